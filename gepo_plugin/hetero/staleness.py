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
* ``wait``: nothing is dropped for staleness. The learner may not advance to ``v+1`` while a
  pending group (queued or in flight) has ``min_version < v + 1 - K``. Those groups must be
  trained at ``v`` first. Samplers stop *starting* rollouts that could not be trained in time
  (admission control, :meth:`StalenessPolicy.may_start`).

``refuse_mixed_versions`` additionally evicts groups whose tokens span several versions
(reason ``mixed_versions``); otherwise they are trained and counted.
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

    @staticmethod
    def lag(learner_version, min_version):
        """``learner_version - min_version`` (works on numbers and numpy arrays)."""
        return np.subtract(learner_version, min_version)

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

    def trainable(self, learner_version: int, min_versions: np.ndarray) -> np.ndarray:
        """Vectorised lag check for many groups: True where lag <= max_lag."""
        if self.max_lag is None:
            return np.ones(np.shape(min_versions), dtype=bool)
        return self.lag(learner_version, np.asarray(min_versions)) <= self.max_lag

    def may_start(self, learner_version: int, sampler_version: int) -> bool:
        """Admission control: start a rollout with ``sampler_version`` weights only if it can still be
        trained within the bound after at least ``admission_margin`` more learner updates."""
        if self.max_lag is None:
            return True
        return (learner_version - sampler_version) + self.admission_margin <= self.max_lag

    def learner_may_advance(self, learner_version: int, pending_min_versions: np.ndarray) -> bool:
        """``wait`` strategy: may the learner move to ``learner_version + 1`` given pending groups?

        True when every pending group (queued or in flight) would still be within the bound at the
        next version. Under ``drop`` the learner never waits.
        """
        if self.max_lag is None or self.strategy == "drop":
            return True
        pending = np.asarray(pending_min_versions)
        return bool(np.all(pending >= learner_version + 1 - self.max_lag)) if pending.size else True

    def must_train_now(self, learner_version: int, min_versions: np.ndarray) -> np.ndarray:
        """Groups that would exceed the bound after this update, so must be in this batch (``wait``)."""
        if self.max_lag is None:
            return np.zeros(np.shape(min_versions), dtype=bool)
        return np.asarray(min_versions) < learner_version + 1 - self.max_lag


class BoundedStalenessQueue:
    """Finished groups waiting for the learner, selected oldest-first under a :class:`StalenessPolicy`.

    The queue owns a :class:`~gepo_plugin.hetero.accounting.RolloutLedger`, so every group it ever
    received is trained, dropped with a reason, or still queued.
    """

    def __init__(self, policy: StalenessPolicy, ledger=None) -> None:
        from gepo_plugin.hetero.accounting import RolloutLedger

        self.policy = policy
        self.ledger = ledger if ledger is not None else RolloutLedger()
        self._max_version: dict[str, int] = {}
        self.mixed_version_groups = 0

    def add(self, group_id: str, min_version: int, max_version: int) -> None:
        if min_version > max_version:
            raise ValueError(f"group {group_id!r}: min_version {min_version} > max_version {max_version}")
        self.ledger.produce(group_id, min_version)
        self._max_version[group_id] = int(max_version)
        if min_version != max_version:
            self.mixed_version_groups += 1

    def select(self, learner_version: int, batch_size: int) -> list[str]:
        """Groups to train at ``learner_version``: evict what the policy refuses, then the oldest first.

        Under ``wait`` every group that would be too old after this update is included, even if
        that makes the batch larger than ``batch_size``: the bound is never exceeded.
        """
        queued = self.ledger.queued_groups()
        stale, mixed, keep = [], [], []
        for group_id, min_version in queued.items():
            verdict = self.policy.verdict(learner_version, min_version, self._max_version[group_id])
            (stale if verdict is Verdict.DROP_STALE else mixed if verdict is Verdict.DROP_MIXED else keep).append(
                group_id
            )
        if stale and self.policy.strategy == "wait":
            raise RuntimeError(
                f"wait strategy violated: {len(stale)} queued group(s) are already older than max_lag; "
                "the learner advanced while they were pending"
            )
        self.ledger.drop(stale, Verdict.DROP_STALE.value)
        self.ledger.drop(mixed, Verdict.DROP_MIXED.value)
        keep.sort(key=lambda gid: queued[gid])
        chosen = keep[:batch_size]
        if self.policy.strategy == "wait":
            urgent = set(np.asarray(keep)[self.policy.must_train_now(learner_version, [queued[g] for g in keep])])
            chosen += [gid for gid in keep[batch_size:] if gid in urgent]
        self.ledger.train(chosen)
        for group_id in [*stale, *mixed, *chosen]:
            self._max_version.pop(group_id, None)
        return chosen
