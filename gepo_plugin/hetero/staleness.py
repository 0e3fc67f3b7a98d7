"""An exact bounded-staleness rule for asynchronous RL, framework-free.

Definitions (the whole contract):

* The learner's **version** ``v`` is the number of optimizer updates applied so far; samplers
  generate with some version ``w <= v``.
* A prompt **group** records the oldest and newest versions that produced any of its tokens
  (``min_version``, ``max_version``; they differ when a partial rollout spans a weight update).
* A group is **trained at** version ``v`` when it is in the batch of the update ``v -> v+1``.
  Its **lag** is ``v - min_version``.
* ``max_lag = K`` guarantees that **no trained group has lag > K**. Not 2K, not K+1: lag K is
  allowed, K+1 never. (The reference code anchored its window to the newest version seen, which
  let lags near 2K through; verl's threshold counts prompt *submission* steps, not the versions
  that actually produced the tokens.)

Strategies:

* ``drop``: a group whose lag would exceed K when trained is evicted (reason ``stale``).
* ``wait``: the learner may not train ``v`` while a group still in flight has ``min_version < v + 1 - K``
  (:meth:`StalenessPolicy.must_train_now`): it waits for it, and such groups are trained first. Samplers stop
  *starting* rollouts that could not be trained in time (admission control, :meth:`StalenessPolicy.may_start`).
  Only if more such groups finish at once than one batch holds does the excess expire (reason
  ``stale_overflow``): the bound is never broken.

``refuse_mixed_versions`` additionally evicts groups whose tokens span several versions
(reason ``mixed_versions``); otherwise they are trained and counted.

This module is the rule; :mod:`gepo_plugin.hetero.core` applies it to a queue for every caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

STRATEGIES = ("drop", "wait")

# The defaults of HeteroRL's staleness settings, written once (``hetero.*`` in the config, the lab and every
# policy built without arguments use them).
DEFAULT_MAX_LAG = 8
DEFAULT_STRATEGY = "wait"
DEFAULT_ADMISSION_MARGIN = 0
DEFAULT_REFUSE_MIXED_VERSIONS = False


class StalenessConfigError(ValueError):
    """An impossible staleness setting; the message says how to fix it."""


class Verdict(str, Enum):
    TRAIN = "train"
    DROP_STALE = "stale"
    DROP_MIXED = "mixed_versions"


@dataclass(frozen=True)
class StalenessPolicy:
    """``max_lag=None`` means unbounded (every group is trained, lags are only recorded)."""

    max_lag: int | None = DEFAULT_MAX_LAG
    strategy: str = DEFAULT_STRATEGY
    refuse_mixed_versions: bool = DEFAULT_REFUSE_MIXED_VERSIONS
    admission_margin: int = DEFAULT_ADMISSION_MARGIN

    def __post_init__(self):
        if self.max_lag is not None and (not isinstance(self.max_lag, int) or self.max_lag < 0):
            raise StalenessConfigError(
                f"max_lag must be an integer >= 0 (0 = on-policy) or null (unbounded), got {self.max_lag!r}"
            )
        if self.strategy not in STRATEGIES:
            raise StalenessConfigError(f"unknown staleness strategy {self.strategy!r}; use one of {STRATEGIES}")
        if self.admission_margin < 0:
            raise StalenessConfigError(f"admission_margin must be >= 0, got {self.admission_margin}")
        if self.max_lag is not None and self.strategy == "wait" and self.admission_margin > self.max_lag:
            raise StalenessConfigError(
                f"admission_margin ({self.admission_margin}) > max_lag ({self.max_lag}) would never let a sampler "
                "start a rollout; lower the margin or raise max_lag"
            )

    def verdict(self, learner_version: int, min_version: int, max_version: int) -> Verdict:
        """What to do with a group if it were trained at ``learner_version``."""
        if min_version > max_version or max_version > learner_version:
            raise ValueError(
                f"impossible versions: min {min_version}, max {max_version}, learner {learner_version} "
                "(a group cannot be newer than the learner, nor its oldest token newer than its newest)"
            )
        if self.refuse_mixed_versions and min_version != max_version:
            return Verdict.DROP_MIXED
        if self.max_lag is not None and learner_version - min_version > self.max_lag:
            return Verdict.DROP_STALE
        return Verdict.TRAIN

    def may_start(self, learner_version: int, sampler_version: int) -> bool:
        """Admission control: start a rollout with ``sampler_version`` weights only if it can still be
        trained within the bound after at least ``admission_margin`` more learner updates."""
        if self.max_lag is None:
            return True
        return (learner_version - sampler_version) + self.admission_margin <= self.max_lag

    def must_train_now(self, learner_version: int, min_versions: np.ndarray) -> np.ndarray:
        """Groups that would exceed the bound after this update: trained at ``learner_version`` or never."""
        if self.max_lag is None:
            return np.zeros(np.shape(min_versions), dtype=bool)
        return np.asarray(min_versions) < learner_version + 1 - self.max_lag
