"""Simulated network delay on verl's weight path: each sampler group gets a version only when it "arrives".

:class:`DelayedWeightSync` stands in for ``separate_async``'s standalone
``CheckpointEngineManager`` (it has the same ``update_weights(global_steps)`` method the trainer
calls at every step end). It splits verl's standalone rollout replicas into sampler groups, gives
each group its own verl ``CheckpointEngineManager`` (same backend: NCCL, the CPU mailbox, ...), and
follows :class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule` for who installs which
version when.

Exact versions, with verl's own machinery: a group must install the version it started
downloading, not whatever the learner holds when the download lands. The learner keeps a host-memory
snapshot of every version still being downloaded with verl's ``DetachActorWorker.save_model_to_cpu``
(separate_async's own worker; sharded, so each learner rank holds its shard). Installing version
``u`` restores ``u`` into the actor, pushes it to the group with ``global_steps=u`` (so every token
the group generates is tagged ``u``) and restores the current weights. At most one snapshot per
group plus the newest are kept.

When arrivals are installed: at every step end, and while the learner waits for data (the replay buffer
calls :meth:`DelayedWeightSync.poll`). A download that lands while the learner is mid-update is
installed at the step end; its arrival time, not the install time, drives the schedule.

Admission control: a group whose weights are older than ``max_lag - admission_margin`` versions
could only produce groups that break the bound, so it is paused (verl's replica abort gate: its
requests wait, partial rollouts resume later) until newer weights arrive.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

from verl.checkpoint_engine import CheckpointEngineManager

from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.hetero.weight_schedule import Delivery, WeightArrivalSchedule

logger = logging.getLogger(__name__)

PREFIX = "hetero/sampler_group"


def snapshot_key(version: int) -> str:
    """Key of a weight snapshot in ``DetachActorWorker.cpu_saved_models`` (verl's own keys are ints)."""
    return f"gepo_hetero_v{version}"


class DelayedWeightSync:
    def __init__(
        self,
        base: CheckpointEngineManager,
        settings: HeteroSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.actor_wg = base.actor_wg
        self.clock = clock
        sizes = settings.group_sizes(len(base.replicas))
        self.groups: list[CheckpointEngineManager] = []
        start = 0
        for size in sizes:
            self.groups.append(CheckpointEngineManager(base.config, base.actor_wg, base.replicas[start : start + size]))
            start += size
        self.schedule: WeightArrivalSchedule | None = None
        self.snapshots: set[int] = set()
        self.paused: set[int] = set()
        self.deliveries = [0] * len(self.groups)
        #: learner step -> oldest version any group held when the step began (the replay buffer's core reads it).
        self.version_floors: dict[int, int] = {}
        logger.info("hetero: %d sampler group(s) of sizes %s with simulated weight delay", len(sizes), list(sizes))

    # --------------------------------------------------------------- verl's manager interface
    def update_weights(self, global_steps: int | None = None) -> dict:
        """The learner publishes version ``global_steps`` (verl calls this at init and every step end)."""
        version = int(global_steps or 0)
        now = self.clock()
        if self.schedule is None or version <= self.schedule.latest:
            # First sync (start or resume): every group gets the weights at once, as in verl.
            delays = [self.settings.delay_for(g) for g in range(len(self.groups))]
            self.schedule = WeightArrivalSchedule(delays, self.settings.seed, start_version=version, start_time=now)
            self._clear_snapshots()
            for group in self.groups:
                group.update_weights(version)
            self._save(version)
        else:
            due = self.schedule.publish(version, now)
            self._save(version)  # the actor holds `version` now
            self._install(due)
        self._admit(version)
        self.version_floors[version + 1] = self.schedule.oldest_held()
        return self.metrics(version)

    def poll(self) -> None:
        """Install the downloads that have arrived (called while the learner waits for data)."""
        if self.schedule is None:
            return
        due = self.schedule.advance(self.clock())
        if due:
            self._install(due)
            self._admit(self.schedule.latest)

    # Replica controls verl's trainer calls on its standalone manager.
    def abort_replicas(self, reject_request: bool = False) -> None:
        for group in self.groups:
            group.abort_replicas(reject_request=reject_request)

    def resume_generation_replicas(self) -> None:
        for index, group in enumerate(self.groups):
            if index not in self.paused:
                group.resume_generation_replicas()

    @property
    def replicas(self) -> list:
        return [replica for group in self.groups for replica in group.replicas]

    # --------------------------------------------------------------- internals
    def _save(self, version: int) -> None:
        self.actor_wg.save_model_to_cpu(snapshot_key(version))
        self.snapshots.add(version)

    def _install(self, due: list[Delivery]) -> None:
        assert self.schedule is not None
        current = self.schedule.latest
        by_version: dict[int, list[int]] = defaultdict(list)
        for delivery in due:
            by_version[delivery.version].append(delivery.group)
        swapped = False
        for version in sorted(by_version):
            if version != current:
                if version not in self.snapshots:
                    raise RuntimeError(f"hetero: no snapshot of version {version} (have {sorted(self.snapshots)})")
                self.actor_wg.restore_model_from_cpu(snapshot_key(version))
                swapped = True
            for group in dict.fromkeys(by_version[version]):
                self.groups[group].update_weights(version)  # resumes the group's replicas too
                self.paused.discard(group)
                self.deliveries[group] += 1
        if swapped:
            self.actor_wg.restore_model_from_cpu(snapshot_key(current))
        for version in sorted(self.snapshots - self.schedule.needed_versions()):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
            self.snapshots.discard(version)

    def _clear_snapshots(self) -> None:
        for version in sorted(self.snapshots):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
        self.snapshots.clear()

    def _admit(self, learner_version: int) -> None:
        """Pause groups whose weights are too old to produce anything trainable; verl resumes them on install."""
        assert self.schedule is not None
        policy = self.settings.policy
        for index, held in enumerate(self.schedule.held):
            if index not in self.paused and not policy.may_start(learner_version, held):
                self.groups[index].abort_replicas()
                self.paused.add(index)

    def metrics(self, learner_version: int) -> dict[str, float]:
        assert self.schedule is not None
        out = self.schedule.metrics(learner_version, PREFIX)
        for index in range(len(self.groups)):
            out[f"{PREFIX}_{index}/paused"] = float(index in self.paused)
            out[f"{PREFIX}_{index}/installs"] = float(self.deliveries[index])
        out["hetero/weight_snapshots"] = float(len(self.snapshots))
        out["hetero/oldest_sampler_version"] = float(self.schedule.oldest_held())
        return out
