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

Without a configured delay every delay is 0: each version reaches every group at once, as in verl, and no
snapshot is taken.

Elastic samplers (README "When a sampler fails"): a :class:`~gepo_plugin.verl_glue.hetero.health.HealthMonitor`
reports replicas that died or hung. At once (from its thread) the replica is fenced (its Ray actors are killed, so
requests pinned to a hung server fail instead of waiting forever) and leaves verl's load balancer, so no new
request reaches it; its groups in flight fail and the replay buffer counts them as ``failed``. At the next safe
point of the learner's thread (the step end, or while it waits for data) it leaves its group's weight sync, a
group without replicas leaves the weight schedule, and with ``hetero.replace_failed`` a replacement replica starts
in the background (:mod:`~gepo_plugin.verl_glue.hetero.replacement`). It is admitted at a later safe point (after
the step's publish, or while the learner waits for data: the actor then holds the newest version). With no sampler
left and none starting, the run stops with :class:`~gepo_plugin.hetero.roster.NoSamplerLeft`. A weight install
that fails because a replica was lost is retried on the replicas left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError
from verl.checkpoint_engine import CheckpointEngineManager

from gepo_plugin.hetero.roster import SamplerRoster
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.hetero.weight_schedule import Delivery, WeightArrivalSchedule
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.hetero.health import HealthMonitor, probe
from gepo_plugin.verl_glue.hetero.replacement import ReplacementStarter, admit
from gepo_plugin.verl_glue.hetero.replicas import fence, forget_replica, release_resources

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
        server_manager: Any = None,
    ) -> None:
        self.settings = settings
        self.config = base.config
        self.actor_wg = base.actor_wg
        self.clock = clock
        #: verl's standalone ``LLMServerManager``: its load balancer and replica lists follow the live samplers.
        self.server_manager = server_manager
        sizes = settings.group_sizes(len(base.replicas))
        self.roster = SamplerRoster(sizes)
        self.members: dict[int, Any] = dict(enumerate(base.replicas))  # roster id -> verl RolloutReplica
        #: the highest ``replica_rank`` used in this run (a replacement takes a new one: actor names contain it)
        self.highest_rank = max((replica.replica_rank for replica in base.replicas), default=-1)
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
        self._lost: list[tuple[int, str, float]] = []
        self._lost_lock = threading.Lock()
        self.monitor: HealthMonitor | None = None
        if settings.health.enable:
            seam.require("elastic_samplers")
            self.monitor = HealthMonitor(settings.health, self.report_lost, clock)
            for replica, member in self.members.items():
                self.monitor.watch(replica, member.servers)
            self.monitor.start()
        self.replacements: ReplacementStarter | None = None
        if settings.config.replace_failed and server_manager is not None:
            self.replacements = ReplacementStarter(self)
        kind = "simulated weight delay" if settings.simulates_delay else "no weight delay"
        logger.info("hetero: %d sampler group(s) of sizes %s with %s", len(sizes), list(sizes), kind)

    # --------------------------------------------------------------- verl's manager interface
    def update_weights(self, global_steps: int | None = None) -> dict:
        """The learner publishes version ``global_steps`` (verl calls this at init and every step end)."""
        version = int(global_steps or 0)
        self.retire_lost()
        now = self.clock()
        if self.schedule is None or version <= self.schedule.latest:
            # First sync (start or resume): every group gets the weights at once, as in verl.
            delays = [self.settings.delay_for(g) for g in range(len(self.groups))]
            self.schedule = WeightArrivalSchedule(delays, self.settings.seed, start_version=version, start_time=now)
            for group in range(len(self.groups)):
                if not self.roster.alive(group):
                    self.schedule.retire(group)
            self._clear_snapshots()
            for group in self.roster.live_groups():
                self._push(group, version)
            self._save(version)
        else:
            due = self.schedule.publish(version, now)
            self._save(version)  # the actor holds `version` now
            self._install(due)
        self._admit_replacements()
        self._admit(version)
        self.version_floors[version + 1] = self.schedule.oldest_held()
        return self.metrics(version)

    def poll(self) -> None:
        """Install the downloads that have arrived (called while the learner waits for data)."""
        if self.schedule is None:
            return
        self.retire_lost()
        due = self.schedule.advance(self.clock())
        if due:
            self._install(due)
        if due or self._admit_replacements():
            self._admit(self.schedule.latest)

    def _admit_replacements(self) -> list[int]:
        """Let the replacements that have started serve (only while the actor holds the newest version); stop the
        run when the last one failed to start and no sampler is left."""
        if self.replacements is None:
            return []
        joined = []
        for group, replica in self.replacements.started():
            member = admit(self, group, replica, snapshot_key)
            if member is None:
                self.roster.abandon_replacement(group)
            else:
                joined.append(member)
        self.roster.require_any()
        return joined

    # --------------------------------------------------------------- lost samplers
    def report_lost(self, replica: int, kind: str, detect_s: float) -> None:
        """A replica died or hung (the monitor's thread, or a failed call): fence it, stop routing to it, and
        queue it for retirement on the learner's thread."""
        with self._lost_lock:
            if replica not in self.members or any(entry[0] == replica for entry in self._lost):
                return
            self._lost.append((replica, kind, detect_s))
        member = self.members[replica]
        fence(member)
        if self.server_manager is not None:
            ray.get(self.server_manager.global_load_balancer.remove_servers.remote([member.server_address]))

    def retire_lost(self) -> None:
        """Retire the replicas reported lost (learner's thread); stop the run if no sampler is left."""
        with self._lost_lock:
            lost, self._lost = self._lost, []
        learner_version = self.schedule.latest if self.schedule is not None else 0
        emptied: list[int] = []
        for replica, kind, detect_s in lost:
            member = self.members.pop(replica)
            if self.monitor is not None:
                self.monitor.forget(replica)
            group = self.roster.group_of[replica]
            if self.roster.retire(replica, kind, learner_version, detect_s):
                emptied.append(group)
            self.groups[group].remove_replicas([member])
            if self.server_manager is not None:
                forget_replica(self.server_manager, member)
            release_resources(member)
            logger.warning(
                "hetero: retired sampler replica %d of group %d (%s, detected after %.1f s)%s",
                replica,
                group,
                kind,
                detect_s,
                "; the group has no replica left" if group in emptied else "",
            )
        for group in emptied:
            self.paused.discard(group)
            if self.schedule is not None:
                self.schedule.retire(group)
        if self.replacements is not None:
            for replica, _, _ in lost:
                self.replacements.start(self.roster.group_of[replica])
        self.roster.require_any()

    def _push(self, group: int, version: int) -> None:
        """Install ``version`` on ``group``'s replicas (resuming them too)."""
        self._on_group(group, lambda manager: manager.update_weights(version))

    def _on_group(self, group: int, call: Callable[[CheckpointEngineManager], object]) -> None:
        """Run ``call`` on ``group``'s weight-sync manager. A replica lost before or during the call (the health
        monitor may have fenced it since the last safe point) is retired and the call retried on the others; an
        error with every replica answering is re-raised."""
        while self.roster.alive(group):
            try:
                call(self.groups[group])
                return
            except RayError:
                if self.monitor is None:  # hetero.health.enable=false: a lost sampler stops the run
                    raise
                servers = {r: self.members[r].servers for r in self.roster.groups[group] if r in self.members}
                lost = probe(servers, self.settings.health.timeout_s)
                if not lost:
                    raise
                for replica, kind in lost.items():
                    self.report_lost(replica, kind, self.monitor.since_answer(replica))
                self.retire_lost()

    # Replica controls verl's trainer calls on its standalone manager.
    def abort_replicas(self, reject_request: bool = False) -> None:
        for index in self.roster.live_groups():
            self._on_group(index, lambda manager: manager.abort_replicas(reject_request=reject_request))

    def resume_generation_replicas(self) -> None:
        for index in self.roster.live_groups():
            if index not in self.paused:
                self._on_group(index, lambda manager: manager.resume_generation_replicas())

    @property
    def replicas(self) -> list:
        return [replica for group in self.groups for replica in group.replicas]

    # --------------------------------------------------------------- internals
    def _save(self, version: int) -> None:
        if not self.settings.simulates_delay:
            return  # every group installs the newest version: no older one is ever restored
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
                self._push(group, version)
                self.paused.discard(group)
                self.deliveries[group] += 1
        if swapped:
            self.actor_wg.restore_model_from_cpu(snapshot_key(current))
        for version in sorted(self.snapshots - self._kept_versions()):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
            self.snapshots.discard(version)

    def _kept_versions(self) -> set[int]:
        """Snapshots to keep: versions being downloaded and the newest; with replacements on, also every live
        group's version (a replacement installs it)."""
        kept = self.schedule.needed_versions()
        if self.settings.config.replace_failed:
            kept |= {held for held, live in zip(self.schedule.held, self.schedule.live, strict=True) if live}
        return kept

    def _clear_snapshots(self) -> None:
        for version in sorted(self.snapshots):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
        self.snapshots.clear()

    def _admit(self, learner_version: int) -> None:
        """Pause groups whose weights are too old to produce anything trainable; verl resumes them on install."""
        assert self.schedule is not None
        policy = self.settings.policy
        for index, held in enumerate(self.schedule.held):
            if not self.schedule.live[index]:
                continue
            if index not in self.paused and not policy.may_start(learner_version, held):
                self._on_group(index, lambda manager: manager.abort_replicas())
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
