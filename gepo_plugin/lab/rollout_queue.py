"""The lab's rollout queue: a thin adapter over HeteroRL's :class:`~gepo_plugin.hetero.core.StalenessCore`.

It plays the role verl's :class:`~gepo_plugin.verl_glue.hetero.replay_buffer.HeteroReplayBuffer` plays over
TransferQueue: it keeps the finished groups' tensors, reports events to the core and carries out its decisions.
Admission, eviction and its reasons, waiting, selection order and the books are the core's, so the lab runs the
same staleness rule as a verl run (``tests/test_hetero_differential.py`` feeds one event trace to both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from gepo_plugin.hetero.core import StalenessCore
from gepo_plugin.hetero.guard import GuardConfig
from gepo_plugin.hetero.staleness import StalenessPolicy


class Group(Protocol):
    """What the queue needs of a finished group."""

    group_id: str
    min_version: int
    max_version: int
    submitted: int


class LabRolloutQueue:
    """Finished groups waiting for the lab's learner."""

    def __init__(
        self,
        policy: StalenessPolicy,
        guard: GuardConfig | None = None,
        on_drop: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.core = StalenessCore(policy, guard)
        self.store: dict[str, Any] = {}
        #: called with each dropped group and its reason, before its tensors are released
        self.on_drop = on_drop

    @property
    def ledger(self):
        return self.core.ledger

    @property
    def policy(self) -> StalenessPolicy:
        return self.core.policy

    def admit(self, groups: list[Group]) -> None:
        """Finished groups enter the queue (and the ledger) with the versions of their oldest and newest token."""
        for group in groups:
            self.store[group.group_id] = group
            self.core.finished(group.group_id, group.min_version, group.max_version, group.submitted)

    def evict(self, learner_version: int) -> dict[str, str]:
        """Drop what may not be trained at ``learner_version`` (with its reason) and release its tensors."""
        reasons = self.core.evictions(learner_version)
        self.core.drop(reasons)
        for uid, reason in reasons.items():
            group = self.store.pop(uid, None)
            if group is not None and self.on_drop is not None:
                self.on_drop(group, reason)
        return reasons

    def ready(self, learner_version: int, batch_size: int, in_flight: Mapping[str, int]) -> bool:
        """May the learner train ``learner_version`` now? Evicts first, then needs a full batch queued and, under
        ``wait``, no in-flight group (``name -> its sampler's version``) that would expire."""
        self.evict(learner_version)
        if len(self.core.queued) < batch_size:
            return False
        return not self.core.urgent(learner_version, in_flight)

    def take(self, learner_version: int, batch_size: int) -> tuple[list[Any], np.ndarray]:
        """The batch the core selects, its groups removed from the queue; returns the groups and their lags."""
        self.evict(learner_version)
        chosen = self.core.select(self.core.queued, batch_size)
        lags = self.core.train(chosen, learner_version)
        return [self.store.pop(uid) for uid in chosen], lags

    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], groups: Mapping[str, Any]) -> list[str]:
        """Restore the books and the groups a checkpoint still holds; queued groups it lost are counted as
        ``missing_after_resume`` (returned)."""
        self.core.load_state_dict(state)
        self.store = {uid: group for uid, group in groups.items() if uid in self.core.queued}
        return self.core.reconcile(self.store)
