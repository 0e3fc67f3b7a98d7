"""verl's standalone rollout replicas as HeteroRL's sampler fleet, whatever transport carries the weights.

:class:`SamplerFleet` takes the place of ``separate_async``'s standalone ``CheckpointEngineManager`` (the trainer
calls the same ``update_weights(global_steps)`` at every step end, and its replica controls). It owns what every
transport shares:

- **groups and replicas**: verl's replicas split into sampler groups (``hetero.sampler_groups``), each group with
  its own verl ``CheckpointEngineManager``, and the :class:`~gepo_plugin.hetero.roster.SamplerRoster`;
- **health and retirement** (README "When a sampler fails"): a
  :class:`~gepo_plugin.verl_glue.hetero.health.HealthMonitor` reports replicas that died or hung; at once (from its
  thread) the replica is fenced (its Ray actors are killed, so requests pinned to a hung server fail instead of
  waiting for ever) and leaves verl's load balancer; at the next safe point of the learner's thread (the step end,
  or while it waits for data) it is retired, and a group without replicas leaves the transport's view. With no
  sampler left and none starting the run stops (:class:`~gepo_plugin.hetero.roster.NoSamplerLeft`). A call that
  fails because a replica was lost is retried on the replicas left;
- **replacement** (``hetero.replace_failed``): started in the background
  (:class:`~gepo_plugin.verl_glue.hetero.replacement.ReplacementStarter`), brought to its group's weights by the
  transport, then enlisted here (roster, group manager, health monitor, verl's load balancer and replica lists);
- **admission**: a group whose weights are too old to produce anything trainable (the staleness core's
  ``may_start``, with the guard's bound when it is on) is paused (verl's replica abort gate: requests wait, partial
  rollouts resume later) until newer weights arrive;
- **version floors**: at every step end the oldest version any live group holds is recorded in the staleness core
  (``record_floor``), which bounds the rollouts still in flight;
- **per-group metrics**, from the transport's :class:`~gepo_plugin.hetero.sampler_versions.SamplerVersions`.

How versions travel is the :class:`~gepo_plugin.verl_glue.hetero.transport.WeightTransport`'s alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import ray
from ray.exceptions import RayError
from verl.checkpoint_engine import CheckpointEngineManager

from gepo_plugin import metric_names
from gepo_plugin.hetero.roster import SamplerRoster
from gepo_plugin.hetero.sampler_versions import SamplerVersions
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.hetero.health import HealthMonitor, probe
from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers, is_remote
from gepo_plugin.verl_glue.hetero.replacement import ReplacementStarter, launch
from gepo_plugin.verl_glue.hetero.replicas import abandon, fence, forget_replica, release_resources
from gepo_plugin.verl_glue.hetero.transport import WeightTransport

logger = logging.getLogger(__name__)

#: verl's replica abort, whose ``reject_request`` only some verl versions take (a seam contact).
ABORT_REPLICAS = "verl.checkpoint_engine.base.CheckpointEngineManager.abort_replicas"


class Staleness(Protocol):
    """What the fleet asks of the staleness core (:class:`~gepo_plugin.hetero.core.StalenessCore`)."""

    def may_start(self, learner_version: int, sampler_version: int) -> bool: ...

    def record_floor(self, step: int, floor: int) -> None: ...


class SamplerFleet:
    """HeteroRL's samplers behind verl's checkpoint-manager interface (see the module docstring)."""

    def __init__(
        self,
        base: CheckpointEngineManager,
        settings: HeteroSettings,
        staleness: Staleness,
        transport: Callable[[SamplerFleet], WeightTransport],
        server_manager: Any = None,
        remote: RemoteSamplers | None = None,
    ) -> None:
        self.settings = settings
        self.staleness = staleness
        self.config = base.config
        self.actor_wg = base.actor_wg
        #: verl's standalone ``LLMServerManager``: its load balancer and replica lists follow the live samplers.
        self.server_manager = server_manager
        sizes = settings.group_sizes(len(base.replicas))
        #: samplers outside the cluster: their groups follow the in-cluster ones and start empty; each sampler joins
        #: (like a replacement) once it has dialled in and holds a version
        self.remote = remote
        #: server addresses of samplers the audit quarantined (shared with the replay buffer)
        self.quarantined_servers: set[str] = set()
        remote_groups = remote.num_groups if remote is not None else 0
        self.roster = SamplerRoster([*sizes, *[0] * remote_groups])
        self.members: dict[int, Any] = dict(enumerate(base.replicas))  # roster id -> verl RolloutReplica
        #: the highest ``replica_rank`` used in this run (a replacement takes a new one: actor names contain it)
        self.highest_rank = max((replica.replica_rank for replica in base.replicas), default=-1)
        self.groups: list[CheckpointEngineManager] = []
        start = 0
        for size in sizes:
            self.groups.append(CheckpointEngineManager(base.config, base.actor_wg, base.replicas[start : start + size]))
            start += size
        for _ in range(remote_groups):
            self.groups.append(CheckpointEngineManager(base.config, base.actor_wg, []))
        if remote is not None:
            for name in remote.samplers:
                self.roster.begin_replacement(remote.group_of[name])
        self.paused: set[int] = set()
        self.installs = [0] * len(self.groups)
        #: seconds of the fleet's work on the learner's thread since the last step's metrics
        self.bookkeeping_s = 0.0
        self._lost: list[tuple[int, str, float]] = []
        self._lost_lock = threading.Lock()
        self.monitor: HealthMonitor | None = None
        if settings.health.enable:
            seam.require("elastic_samplers")
            self.monitor = HealthMonitor(settings.health, self.report_lost, time.monotonic)
            for replica, member in self.members.items():
                self.monitor.watch(replica, member.servers)
            self.monitor.start()
        self.replacements: ReplacementStarter | None = None
        if settings.config.replace_failed and server_manager is not None:
            self.replacements = ReplacementStarter(
                self.roster, self._next_rank, lambda rank, group: launch(server_manager, rank, group)
            )
        self.transport = transport(self)
        kind = type(self.transport).__name__
        logger.info("hetero: %d sampler group(s) of sizes %s; weights by %s", len(sizes), list(sizes), kind)

    @property
    def versions(self) -> SamplerVersions | None:
        return self.transport.versions

    # --------------------------------------------------------------- verl's manager interface
    def update_weights(self, global_steps: int | None = None) -> dict:
        """The learner holds version ``global_steps`` (verl calls this at init and at every step end)."""
        started = time.perf_counter()
        version = int(global_steps or 0)
        self._update_weights(version)
        self.bookkeeping_s += time.perf_counter() - started
        return self.metrics(version)

    def _update_weights(self, version: int) -> None:
        self.retire_lost()
        versions = self.transport.versions
        if versions is None or version <= versions.latest:
            # the first sync (start or resume): every group gets the weights before generating, as in verl
            versions = self.transport.start(version)
            for group in range(versions.num_groups):
                if not self.roster.alive(group):
                    versions.retire(group)
            self.transport.install_first(version)
        else:
            self.transport.publish(version)
        self._admit_replacements()
        self._pause_stale(version)
        self.staleness.record_floor(version + 1, versions.oldest_held())
        self.transport.settle(versions.oldest_held())

    def poll(self) -> None:
        """Install what has arrived and admit replacements (called while the learner waits for data)."""
        started = time.perf_counter()
        try:
            self._poll()
        finally:
            self.bookkeeping_s += time.perf_counter() - started

    def _poll(self) -> None:
        versions = self.transport.versions
        if versions is None:
            return
        self.retire_lost()
        installed = self.transport.collect()
        joined = self._admit_replacements()
        if installed or joined:
            self._pause_stale(versions.latest)

    def abort_replicas(self, reject_request: bool = False) -> None:
        # a verl without the parameter parks the requests behind the closed gate instead of failing them
        accepted = seam.accepted_kwargs(ABORT_REPLICAS, reject_request=reject_request)
        for group in self.roster.live_groups():
            self.on_group(group, lambda manager: manager.abort_replicas(**accepted))

    def resume_generation_replicas(self) -> None:
        for group in self.roster.live_groups():
            if group not in self.paused:
                self.on_group(group, lambda manager: manager.resume_generation_replicas())

    @property
    def replicas(self) -> list:
        return [replica for group in self.groups for replica in group.replicas]

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
        versions = self.transport.versions
        learner_version = versions.latest if versions is not None else 0
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
            if is_remote(member):
                self.remote.retired(member, quarantined=kind == "quarantined")
                if kind == "quarantined":  # the replay buffer drops every queued group it took part in
                    self.quarantined_servers.add(member.server_address)
            self.transport.forget(replica)
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
            if versions is not None:
                versions.retire(group)
        if lost and versions is not None:
            self._resume_ready()
        if self.replacements is not None:
            for replica, _, _ in lost:
                group = self.roster.group_of[replica]
                if self.remote is None or group < len(self.groups) - self.remote.num_groups:
                    self.replacements.start(group)  # (a remote sampler comes back by dialling in again)
        self.roster.require_any()

    def on_group(self, group: int, call: Callable[[CheckpointEngineManager], object]) -> None:
        """Run ``call`` on ``group``'s weight-sync manager. A replica lost before or during the call (the health
        monitor may have fenced it since the last safe point) is retired and the call retried on the others; an
        error with every replica answering is re-raised."""
        while self.roster.alive(group):
            try:
                call(self.groups[group])
                return
            except RayError as error:
                self._report_if_lost([r for r in self.roster.groups[group] if r in self.members], error)
                self.retire_lost()

    def check_replica(self, replica: int, error: Exception) -> None:
        """A call to ``replica`` failed: report it lost (retired at the next :meth:`retire_lost`) if its servers
        died or hung, else re-raise ``error``."""
        self._report_if_lost([replica], error)

    def _report_if_lost(self, replicas: list[int], error: Exception) -> None:
        """Probe ``replicas`` after ``error`` and report the lost ones; re-raise when none was lost (a real error)
        or without health checks (``hetero.health.enable=false``: a lost sampler stops the run)."""
        if self.monitor is None:
            raise error
        lost = probe({r: self.members[r].servers for r in replicas}, self.settings.health.timeout_s)
        if not lost:
            raise error
        for replica, kind in lost.items():
            self.report_lost(replica, kind, self.monitor.since_answer(replica))

    # --------------------------------------------------------------- what transports report
    def installed(self, group: int, replicas: CheckpointEngineManager, count: int = 1) -> None:
        """``replicas`` of ``group`` installed a version: count it (``count`` installs: remote samplers come in one
        batch); they serve unless their group must stay paused (a paused group resumes once what it holds may start
        rollouts again)."""
        self.installs[group] += count
        versions = self.transport.versions
        if group not in self.paused:
            replicas.resume_generation_replicas()
        elif versions is not None and self._may_resume(group, versions):
            self.paused.discard(group)
            self.on_group(group, lambda manager: manager.resume_generation_replicas())
        else:
            replicas.abort_replicas()

    def _may_resume(self, group: int, versions: SamplerVersions) -> bool:
        """A paused group may generate again: the oldest version its replicas hold may start rollouts."""
        return self.staleness.may_start(versions.latest, versions.held[group])

    def _resume_ready(self) -> None:
        """Resume the paused groups that may start again without an install: the replica that held one back (the
        oldest version of a group is its oldest replica's) was retired."""
        versions = self.transport.versions
        for group in sorted(self.paused):
            if versions.live[group] and self.roster.alive(group) and self._may_resume(group, versions):
                self.paused.discard(group)
                self.on_group(group, lambda manager: manager.resume_generation_replicas())

    def enlist(self, group: int, replica: Any, version: int, replicas: CheckpointEngineManager) -> int:
        """A replacement that holds ``version`` joins ``group``: the roster, the group's weight sync, the health
        monitor and verl's load balancer and replica lists; returns its roster id. It serves at once unless its group
        is paused (admission control)."""
        rejoining = not self.roster.alive(group)
        manager = self.server_manager
        member = self.roster.join(group)
        self.members[member] = replica
        self.groups[group].add_replicas([replica])
        if self.monitor is not None:
            self.monitor.watch(member, replica.servers)
        if not is_remote(replica):  # verl's own replica lists hold the replicas it can start and stop
            manager.rollout_replicas.append(replica)
            manager.server_handles.append(replica.server_handle)
            manager.server_addresses.append(replica.server_address)
        ray.get(manager.global_load_balancer.add_servers.remote({replica.server_address: replica.server_handle}))
        if group in self.paused and not rejoining:
            replicas.abort_replicas()  # its group waits for newer weights
        else:
            self.paused.discard(group)
            replicas.resume_generation_replicas()
        if is_remote(replica):
            logger.warning(
                "hetero: replica %d (remote sampler %r) joins sampler group %d with weight version %d",
                member,
                replica.name,
                group,
                version,
            )
        else:
            logger.warning(
                "hetero: replica %d (rank %d) replaces a lost one in sampler group %d with weight version %d",
                member,
                replica.replica_rank,
                group,
                version,
            )
        return member

    def abandon(self, group: int, replica: Any) -> None:
        """A started replacement that cannot join: stop it, free its devices, and count it as failed to start."""
        abandon(replica)
        self.roster.abandon_replacement(group)

    # --------------------------------------------------------------- internals
    def _next_rank(self) -> int:
        """A ``replica_rank`` no replica of this run has used (ranks of lost replicas are not reused)."""
        used = [replica.replica_rank for replica in self.server_manager.rollout_replicas]
        self.highest_rank = max([self.highest_rank, *used]) + 1
        return self.highest_rank

    def _admit_replacements(self) -> list[int]:
        """The transport brings the replacements that have started, and the remote samplers that dialled in, to
        their group's weights; stop the run when the last one failed to start and no sampler is left. Returns the
        roster ids that joined."""
        started = self.replacements.started() if self.replacements is not None else []
        if self.remote is not None:
            for name in self.remote.rejoin():
                self.roster.begin_replacement(self.remote.group_of[name])
            started += self.remote.candidates(list(self.members.values()))
        if not started and self.replacements is None:
            return []
        joined = self.transport.join(started)
        self.roster.require_any()
        return joined

    def _pause_stale(self, learner_version: int) -> None:
        """Pause groups whose weights are too old to produce anything trainable; an install resumes them."""
        versions = self.transport.versions
        for group, held in enumerate(versions.held):
            if not versions.live[group]:
                continue
            if group not in self.paused and not self.staleness.may_start(learner_version, held):
                self.on_group(group, lambda manager: manager.abort_replicas())
                self.paused.add(group)

    def metrics(self, learner_version: int) -> dict[str, float]:
        """Per group: the version it holds and its age, the transport's own measures, paused, installs; and the
        seconds the fleet's work took on the learner's thread since the last step's metrics (``fleet_s``)."""
        started = time.perf_counter()
        versions = self.transport.versions
        out = metric_names.by_group(versions.metrics(learner_version))
        for group in range(len(self.groups)):
            out[metric_names.sampler_group(group, "paused")] = float(group in self.paused)
            out[metric_names.sampler_group(group, "installs")] = float(self.installs[group])
        out[metric_names.HETERO + "oldest_sampler_version"] = float(versions.oldest_held())
        out.update(self.transport.metrics())
        # this step's bookkeeping so far (the metrics themselves included), then counted afresh for the next step
        out[metric_names.HETERO + "fleet_s"] = self.bookkeeping_s + time.perf_counter() - started
        self.bookkeeping_s = 0.0
        return out
