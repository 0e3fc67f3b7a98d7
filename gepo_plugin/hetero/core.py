"""Every staleness decision of HeteroRL, made in one framework-free place for every caller.

verl's replay buffer (:class:`gepo_plugin.verl_glue.hetero.replay_buffer.HeteroReplayBuffer`, over TransferQueue)
and the CPU lab's simulator (:mod:`gepo_plugin.lab.stability_sim`) are thin adapters: they report events (a group
finished with the versions of its oldest and newest token, a group failed, the learner is about to train version
``v``) and carry out what :class:`StalenessCore` decides:

* **admission**: may a sampler holding version ``w`` start a rollout? (:meth:`StalenessCore.may_start`);
* **eviction**, with a reason: ``failed``, ``stale`` (``drop``: lag would exceed ``max_lag``), ``stale_overflow``
  (``wait``: more urgent groups finished than one batch holds, so the excess expired), ``mixed_versions``
  (``refuse_mixed_versions``), ``missing_after_resume`` (:meth:`StalenessCore.evictions`,
  :meth:`StalenessCore.reconcile`);
* **waiting**: under ``wait`` the learner does not train version ``v`` while a group still in flight could
  expire (:meth:`StalenessCore.urgent`);
* **selection order**: oldest weight version first, then the step the prompt was submitted at, then the id
  (:meth:`StalenessCore.select`);
* **the books**: every group ever reported is trained, dropped with a reason, or still queued
  (:class:`~gepo_plugin.hetero.accounting.RolloutLedger`), checked on every transition, saved and restored.

The batch never grows beyond the batch size (verl's trainer expects exactly one batch), so under ``wait`` the
bound is kept by selecting urgent groups first and evicting what could not fit, never by training it late.
The definitions of lag and of the bound are :mod:`gepo_plugin.hetero.staleness`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gepo_plugin.hetero.accounting import RolloutLedger
from gepo_plugin.hetero.guard import GuardConfig, StalenessGuard
from gepo_plugin.hetero.staleness import StalenessPolicy, Verdict

#: Eviction reasons (the ledger's ``dropped/<reason>`` counters).
FAILED = "failed"
STALE = Verdict.DROP_STALE.value
OVERFLOW = "stale_overflow"
MIXED = Verdict.DROP_MIXED.value
MISSING = "missing_after_resume"
#: Groups with a trajectory of a sampler the audit quarantined (queued or failed when it was): never trained.
QUARANTINED = "quarantined"
REASONS: tuple[str, ...] = (STALE, OVERFLOW, MIXED, FAILED, MISSING, QUARANTINED)
#: Evictions for staleness, whose trajectories exist: what "the cost of dropping" measures.
STALENESS_REASONS: tuple[str, ...] = (STALE, OVERFLOW, MIXED)


class BoundViolation(AssertionError):
    """A group would be trained with a lag above ``max_lag`` (a bug in an adapter; never silently allowed)."""


@dataclass(frozen=True)
class GroupVersions:
    """Weight versions of a queued group: its oldest and newest token, and the step its prompt was submitted at."""

    min: int
    max: int
    submitted: int


class StalenessCore:
    """The decisions and the books of one learner's rollout queue (see the module docstring)."""

    def __init__(self, policy: StalenessPolicy, guard: GuardConfig | None = None) -> None:
        #: the bound every decision uses: the configured one, or the guard's tighter one
        self.policy = policy
        self.configured_policy = policy
        self.guard: StalenessGuard | None = None
        if guard is not None and guard.enable:
            self.guard = StalenessGuard.for_policy(guard, policy)
        self.ledger = RolloutLedger()
        self._groups: dict[str, GroupVersions] = {}
        self._failed: dict[str, GroupVersions] = {}
        #: reported groups a quarantined sampler took part in: evicted as ``quarantined`` (see :meth:`quarantine`)
        self._quarantined: set[str] = set()
        self.mixed_version_trained = 0
        #: learner step -> the oldest weight version any sampler held when the step began (the weight path records
        #: it with :meth:`record_floor`: verl's sampler fleet, the lab's driver). A step without an entry means every
        #: sampler got the learner's weights at once, so its floor is ``step - 1``.
        self._floors: dict[int, int] = {}

    # ------------------------------------------------------------------ events
    @property
    def failed_ids(self) -> frozenset[str]:
        """The reported groups that failed (verl clears those differently from finished ones)."""
        return frozenset(self._failed)

    def known(self, uid: str) -> bool:
        """Has ``uid`` been reported (and not yet trained or dropped)?"""
        return uid in self._groups or uid in self._failed

    def finished(self, uid: str, min_version: int, max_version: int, submitted: int = 0) -> None:
        """A group finished; its tokens came from weight versions ``min_version .. max_version``."""
        if min_version > max_version:
            raise ValueError(f"group {uid!r}: min_version {min_version} > max_version {max_version}")
        self.ledger.produce(uid, int(min_version))
        self._groups[uid] = GroupVersions(int(min_version), int(max_version), int(submitted))

    def failed(self, uid: str, submitted: int) -> None:
        """A group failed (no usable trajectory); it is counted as produced and evicted as ``failed``."""
        bound = self.lower_bound(submitted)
        self.ledger.produce(uid, bound)
        self._failed[uid] = GroupVersions(bound, bound, int(submitted))

    def quarantine(self, uids: Iterable[str]) -> None:
        """Groups a quarantined sampler generated a trajectory of (the adapter knows which): whatever else they hold,
        they are evicted as ``quarantined`` and never trained. Unknown ids (trained or dropped already) are ignored."""
        self._quarantined.update(uid for uid in uids if self.known(uid))

    def record_floor(self, step: int, floor: int) -> None:
        """When learner step ``step`` begins, the oldest weight version any live sampler holds is ``floor``."""
        self._floors[int(step)] = int(floor)

    @property
    def version_floors(self) -> dict[int, int]:
        """The floors recorded so far (a copy: record one with :meth:`record_floor`)."""
        return dict(self._floors)

    def lower_bound(self, submitted: int) -> int:
        """A version no newer than the oldest token of a group whose prompt was submitted at learner step
        ``submitted``: the oldest version any sampler held when that step began. Which sampler serves a prompt is
        not known when it is submitted, so the bound is the floor over all of them."""
        return int(self._floors.get(int(submitted), int(submitted) - 1))

    # ------------------------------------------------------------------ decisions
    def may_start(self, learner_version: int, sampler_version: int) -> bool:
        """Admission control: may a sampler holding ``sampler_version`` start a rollout now?"""
        return self.policy.may_start(learner_version, sampler_version)

    def evictions(self, learner_version: int) -> dict[str, str]:
        """Queued groups that may not be trained at ``learner_version``, with their reason (not yet dropped)."""
        out = dict.fromkeys(self._failed, FAILED)
        out.update(dict.fromkeys(self._quarantined, QUARANTINED))
        wait = self.policy.strategy == "wait"
        for uid, versions in self._groups.items():
            if uid in self._quarantined:
                continue
            verdict = self.policy.verdict(learner_version, versions.min, min(versions.max, learner_version))
            if verdict is Verdict.DROP_STALE:
                out[uid] = OVERFLOW if wait else STALE
            elif verdict is Verdict.DROP_MIXED:
                out[uid] = MIXED
        return out

    def drop(self, reasons: Mapping[str, str]) -> None:
        """Evict groups (``uid -> reason``), counting each under its reason."""
        by_reason: dict[str, list[str]] = {}
        for uid, reason in reasons.items():
            by_reason.setdefault(reason, []).append(uid)
        for reason, uids in by_reason.items():
            self.ledger.drop(uids, reason)
            for uid in uids:
                self._groups.pop(uid, None)
                self._failed.pop(uid, None)
                self._quarantined.discard(uid)

    def urgent(self, learner_version: int, in_flight: Mapping[str, int]) -> list[str]:
        """In-flight groups (``uid -> the learner step its prompt was submitted at``) that could exceed the bound
        if the learner trained ``learner_version`` now; under ``wait`` the learner must wait for them."""
        if self.policy.strategy != "wait" or not in_flight:
            return []
        uids = list(in_flight)
        bounds = np.array([self.lower_bound(in_flight[uid]) for uid in uids])
        expiring = self.policy.must_train_now(learner_version, bounds)
        return [uid for uid, expires in zip(uids, expiring, strict=True) if expires]

    def select(self, candidates: Iterable[str], batch_size: int) -> list[str]:
        """The groups to train: oldest weight version first, then the earliest submission, then the id."""
        groups = self._groups
        candidates = [uid for uid in candidates if uid not in self._quarantined]
        ordered = sorted(candidates, key=lambda uid: (groups[uid].min, groups[uid].submitted, uid))
        return ordered[:batch_size]

    def train(self, uids: Iterable[str], learner_version: int) -> np.ndarray:
        """Record that ``uids`` are trained at ``learner_version``; returns their lags (refuses one above the bound)."""
        uids = list(uids)
        if self._quarantined.intersection(uids):
            raise BoundViolation(f"groups of a quarantined sampler selected: {sorted(self._quarantined & set(uids))}")
        versions = [self._groups[uid] for uid in uids]
        lags = np.array([learner_version - v.min for v in versions], dtype=np.int64)
        if self.policy.max_lag is not None and lags.size and int(lags.max()) > self.policy.max_lag:
            raise BoundViolation(f"selected lag {int(lags.max())} > max_lag {self.policy.max_lag}")
        if lags.size and int(lags.min()) < 0:
            raise BoundViolation(f"a group is newer than the learner (lag {int(lags.min())})")
        self.ledger.train(uids)
        self.mixed_version_trained += sum(v.min != v.max for v in versions)
        for uid in uids:
            del self._groups[uid]
        return lags

    def observe_ess(self, step: int, ess: float) -> str | None:
        """The batch trained into version ``step`` had importance weights with ``ESS/N = ess``: the guard may move
        the effective bound (every later decision uses it). Returns a one-line note when it moved."""
        if self.guard is None:
            return None
        moved = self.guard.observe(step, ess)
        if moved is None:
            return None
        self._apply_guard()
        old, new = moved
        verb = "tightened" if new < old else "relaxed"
        return (
            f"hetero.guard: ESS/N {ess:.3f} at step {step}: effective max_lag {verb} {old} -> {new} "
            f"(ceiling {self.configured_policy.max_lag})"
        )

    def _apply_guard(self) -> None:
        self.policy = dataclasses.replace(self.configured_policy, max_lag=self.guard.effective)

    def reconcile(self, present: Iterable[str]) -> list[str]:
        """After a resume: queued groups the restored queue no longer holds are dropped (``missing_after_resume``)."""
        present = set(present)
        missing = [uid for uid in self._groups if uid not in present]
        self.drop(dict.fromkeys(missing, MISSING))
        return missing

    # ------------------------------------------------------------------ books
    @property
    def queued(self) -> dict[str, GroupVersions]:
        return dict(self._groups)

    def mixed(self, uids: Iterable[str]) -> int:
        """How many of the queued ``uids`` span several weight versions."""
        return sum(self._groups[uid].min != self._groups[uid].max for uid in uids)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger.state_dict(),
            "groups": {uid: [v.min, v.max, v.submitted] for uid, v in self._groups.items()},
            "failed": {uid: [v.min, v.max, v.submitted] for uid, v in self._failed.items()},
            "quarantined": sorted(self._quarantined),
            "mixed_version_trained": self.mixed_version_trained,
            "version_floors": {str(step): floor for step, floor in self._floors.items()},
            "guard": self.guard.state_dict() if self.guard is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ledger = RolloutLedger.from_state_dict(state["ledger"])
        self._groups = {uid: GroupVersions(*map(int, v)) for uid, v in state["groups"].items()}
        self._failed = {uid: GroupVersions(*map(int, v)) for uid, v in state.get("failed", {}).items()}
        self._quarantined = set(state.get("quarantined", []))
        self.mixed_version_trained = int(state.get("mixed_version_trained", 0))
        self._floors = {int(step): int(floor) for step, floor in state.get("version_floors", {}).items()}
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])
            self._apply_guard()
        queued = set(self.ledger.queued_groups())
        if queued != set(self._groups) | set(self._failed):
            raise ValueError("hetero state: the ledger's queued groups differ from the recorded versions")

    def metrics(self) -> dict[str, float]:
        """The books (checked), every reason's counter (0 when unused) and the mixed-version total."""
        out = self.ledger.metrics()
        for reason in REASONS:
            out.setdefault(f"dropped/{reason}", 0.0)
        out["mixed_version_groups_total"] = float(self.mixed_version_trained)
        if self.guard is not None:
            out.update(self.guard.metrics())
        return out
