"""HeteroRL's weight sync over the relay: the learner publishes once, replicas pull, their real arrivals count.

:class:`RelayWeightSync` takes the place of :class:`~gepo_plugin.verl_glue.hetero.weight_sync.DelayedWeightSync` when
``hetero.transport=relay`` (it keeps its sampler groups, health monitor, retirement and admission control). At every
step end the learner publishes the new version through the relay checkpoint engine (verl's
``actor_wg.update_weights``, rank 0 uploads in the background) and keeps no per-group snapshot. Each replica's
checkpoint-engine worker follows the store over its group's link; at safe points (the step end, and while the
learner waits for data) the learner collects their receipts and installs each replica's newly arrived version
through verl's rollout weight-update path, tagging its tokens with that version. Which version a group holds is then
an :class:`~gepo_plugin.hetero.relay.arrivals.ArrivalBook` of real arrivals, and the staleness core's bound, waits
and admission read it as they read the simulated schedule.

A replacement (``hetero.replace_failed=true``) follows the store like any replica as soon as it has started: its
first pull is the newest keyframe (and the deltas after it), and at the first safe point after it has arrived the
learner installs it and the replica joins its group (:func:`~gepo_plugin.verl_glue.hetero.replacement.enlist`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from verl.checkpoint_engine import CheckpointEngineManager
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

from gepo_plugin.hetero.relay.arrivals import ArrivalBook
from gepo_plugin.hetero.relay.follower import FollowerStatus, Receipt
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue.hetero.health import probe
from gepo_plugin.verl_glue.hetero.relay_engine import BACKEND
from gepo_plugin.verl_glue.hetero.replacement import abandon, enlist
from gepo_plugin.verl_glue.hetero.weight_sync import DelayedWeightSync

logger = logging.getLogger(__name__)
RELAY_PREFIX = "hetero/relay/"
#: How long the first sync (start or resume) waits for every replica to pull the learner's version.
FIRST_SYNC_TIMEOUT_S = 1800.0


@dataclass
class Joining:
    """A replacement replica that follows the store and joins its group once its first version has arrived."""

    group: int
    replica: Any
    workers: RayWorkerGroup
    manager: CheckpointEngineManager


def checkpoint_workers(replica: Any) -> RayWorkerGroup:
    """The replica's checkpoint-engine workers (where its relay follower runs), as a worker group to call."""
    return RayWorkerGroup(
        worker_handles=list(replica.workers),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker)),
    )


class RelayWeightSync(DelayedWeightSync):
    """The relay transport for HeteroRL (see the module docstring)."""

    def __init__(
        self,
        base: CheckpointEngineManager,
        settings: HeteroSettings,
        clock: Callable[[], float] = time.time,  # receipts carry the samplers' wall clock
        server_manager: Any = None,
    ) -> None:
        super().__init__(base, settings, clock, server_manager)
        self.worker_groups: dict[int, RayWorkerGroup] = {}
        self.replica_managers: dict[int, CheckpointEngineManager] = {}
        self.receipts: dict[int, dict[int, Receipt]] = {}
        self.sampler_counters: dict[int, dict[str, float]] = {}
        self.publish_metrics: dict[str, float] = {}
        self.joining: list[Joining] = []
        for replica, member in self.members.items():
            self.worker_groups[replica] = checkpoint_workers(member)
            self.replica_managers[replica] = CheckpointEngineManager(base.config, base.actor_wg, [member])
        first = next(iter(self.worker_groups.values()))  # one sampler reads the store before anything else
        ray.get(first.execute_checkpoint_engine(["probe"] * first.world_size))
        follows = []
        for replica, group in self._replica_groups().items():
            workers = self.worker_groups[replica]
            size = workers.world_size
            follows.extend(workers.execute_checkpoint_engine(["follow"] * size, [group] * size, [replica] * size))
        ray.get(follows)
        logger.info("hetero: weights travel through the relay at %s", settings.relay.url)

    def _replica_groups(self) -> dict[int, int]:
        return {replica: self.roster.group_of[replica] for replica in self.members}

    # --------------------------------------------------------------- verl's manager interface
    def update_weights(self, global_steps: int | None = None) -> dict:
        """Publish version ``global_steps``; install what has arrived (verl calls this at init and every step end)."""
        version = int(global_steps or 0)
        self.retire_lost()
        self._publish(version)
        now = self.clock()
        if self.schedule is None or version <= self.schedule.latest:
            self.schedule = ArrivalBook(self._replica_groups(), len(self.groups), start_version=version, start_time=now)
            for group in range(self.schedule.num_groups):
                if not self.roster.alive(group):
                    self.schedule.retire(group)
            self._first_sync(version)
        else:
            self.schedule.publish(version, now)
            self._collect()
        self._admit_replacements()
        self._admit(version)
        self.version_floors[version + 1] = self.schedule.oldest_held()
        self._hold(self.schedule.oldest_held())
        return self.metrics(version)

    def poll(self) -> None:
        """Install the versions that have arrived (called while the learner waits for data)."""
        if self.schedule is None:
            return
        self.retire_lost()
        self._check_publisher()
        if self._collect() or self._admit_replacements():
            self._admit(self.schedule.latest)

    def retire_lost(self) -> None:
        super().retire_lost()
        if self.schedule is not None:
            for replica in [r for r in self.schedule.installed if r not in self.members]:
                self.schedule.remove_replica(replica)
                self.worker_groups.pop(replica, None)
                self.replica_managers.pop(replica, None)

    # --------------------------------------------------------------- replacements
    def _admit_replacements(self) -> list[int]:
        """Started replacements begin following the store; those whose first version has arrived are installed and
        join their group. Returns the roster ids that joined."""
        if self.replacements is None or self.schedule is None:
            return []
        for group, replica in self.replacements.started():
            workers = checkpoint_workers(replica)
            size = workers.world_size
            try:  # a provisional replica id: receipts are relabelled by the worker group they came from
                ray.get(workers.execute_checkpoint_engine(["follow"] * size, [group] * size, [-1] * size))
            except RayError:
                logger.exception("hetero: a replacement for sampler group %d was lost before it followed", group)
                abandon(replica)
                self.roster.abandon_replacement(group)
                continue
            manager = CheckpointEngineManager(self.config, self.actor_wg, [replica])
            self.joining.append(Joining(group, replica, workers, manager))
        joined = [member for member in map(self._join, list(self.joining)) if member is not None]
        self.roster.require_any()
        return joined

    def _join(self, joining: Joining) -> int | None:
        """Install ``joining``'s first arrived version and enlist it; None while it has not arrived (or it failed)."""
        size = joining.workers.world_size
        try:
            statuses = ray.get(
                joining.workers.execute_checkpoint_engine(["status"] * size), timeout=self.settings.health.timeout_s
            )
            staged = {status.staged for status in statuses}
            if len(staged) != 1 or None in staged:
                errors = [status.error for status in statuses if status.error is not None]
                if errors:
                    raise RuntimeError(f"its relay follower stopped: {errors[0]}")
                return None
            version = staged.pop()
            joining.manager.abort_replicas()
            joining.manager.release_kv_cache_replicas()
            ray.get(joining.workers.update_weights(global_steps=version))
            joining.manager.resume_kv_cache_replicas()
        except (RayError, GetTimeoutError, RuntimeError):
            logger.exception("hetero: a replacement for sampler group %d failed before it joined", joining.group)
            self.joining.remove(joining)
            abandon(joining.replica)
            self.roster.abandon_replacement(joining.group)
            return None
        self.joining.remove(joining)
        rejoining = not self.roster.alive(joining.group)
        member = enlist(self, joining.group, joining.replica, version)
        self.worker_groups[member] = joining.workers
        self.replica_managers[member] = joining.manager
        self.schedule.add_replica(member, joining.group, version)
        for status in statuses:
            for receipt in status.receipts:  # its pulls count in its group's bytes
                self.schedule.bytes[joining.group] += receipt.nbytes
        if joining.group in self.paused and not rejoining:
            joining.manager.abort_replicas()  # its group waits for newer weights (admission control)
        else:
            self.paused.discard(joining.group)
            joining.manager.resume_generation_replicas()
        return member

    # --------------------------------------------------------------- the learner's side
    def _publish(self, version: int) -> None:
        results = ray.get(self.actor_wg.update_weights(global_steps=version, mode=BACKEND))
        for result in results:
            if isinstance(result, dict) and result:
                self.publish_metrics = {RELAY_PREFIX + k.removeprefix(RELAY_PREFIX): v for k, v in result.items()}

    def _hold(self, oldest: int) -> None:
        size = self.actor_wg.world_size
        ray.get(self.actor_wg.execute_checkpoint_engine(["hold"] * size, [oldest] * size))

    def _request_keyframe(self, corrupt_shards: list[str]) -> None:
        size = self.actor_wg.world_size
        ray.get(self.actor_wg.execute_checkpoint_engine(["request_keyframe"] * size, [corrupt_shards] * size))

    def _check_publisher(self) -> None:
        """Stop the run if publishing has ended (outage budget spent, permanent store error): the samplers would
        otherwise starve while the learner waits for their rollouts."""
        size = self.actor_wg.world_size
        for result in ray.get(self.actor_wg.execute_checkpoint_engine(["check"] * size)):
            if isinstance(result, dict) and result:
                self.publish_metrics = {RELAY_PREFIX + k.removeprefix(RELAY_PREFIX): v for k, v in result.items()}

    # --------------------------------------------------------------- the samplers' side
    def _statuses(self) -> dict[int, list[FollowerStatus]]:
        """Each live replica's follower status; a replica whose worker cannot answer is checked like a failed
        install (probed, and retired if its servers died or hung) and left out."""
        refs = {
            replica: workers.execute_checkpoint_engine(["status"] * workers.world_size)
            for replica, workers in self.worker_groups.items()
            if replica in self.members
        }
        out = {}
        for replica, ref in refs.items():
            try:
                out[replica] = ray.get(ref, timeout=self.settings.health.timeout_s)
            except (RayError, GetTimeoutError) as error:
                self._check_replica(replica, error)
        return out

    def _check_replica(self, replica: int, error: Exception) -> None:
        """A call to ``replica`` failed: retire it if its servers are lost, else re-raise (a real error)."""
        if self.monitor is None:  # hetero.health.enable=false: a lost sampler stops the run
            raise error
        lost = probe({replica: self.members[replica].servers}, self.settings.health.timeout_s)
        if not lost:
            raise error
        for lost_replica, kind in lost.items():
            self.report_lost(lost_replica, kind, self.monitor.since_answer(lost_replica))

    def _collect(self) -> list[int]:
        """Install each replica's newly arrived version; returns the replicas that installed one."""
        installed = []
        keyframe = False
        corrupt: set[str] = set()
        self.retire_lost()
        for replica, statuses in self._statuses().items():
            for status in statuses:
                if status.error is not None:
                    raise RuntimeError(
                        f"relay: sampler replica {replica} cannot pull weights from {self.settings.relay.url}: "
                        f"{status.error}"
                    )
                keyframe |= status.keyframe_needed is not None
                corrupt.update(status.corrupt_shards)
                for receipt in status.receipts:
                    self.receipts.setdefault(replica, {})[receipt.version] = receipt
            self.sampler_counters[replica] = _summed(status.counters for status in statuses)
            staged = {status.staged for status in statuses}
            if len(staged) != 1:
                continue  # the replica's workers disagree for a moment: install when they agree
            version = staged.pop()
            if version is None or version <= self.schedule.installed.get(replica, version):
                continue
            if self._install_replica(replica, version):
                installed.append(replica)
        if keyframe:
            self._request_keyframe(sorted(corrupt))
        return installed

    def _install_replica(self, replica: int, version: int) -> bool:
        """Install ``version`` on ``replica``; False if the replica was lost meanwhile (it is then retired)."""
        group = self.roster.group_of[replica]
        manager = self.replica_managers[replica]
        workers = self.worker_groups[replica]
        try:
            manager.abort_replicas()
            manager.release_kv_cache_replicas()
            ray.get(workers.update_weights(global_steps=version))
            manager.resume_kv_cache_replicas()
        except RayError as error:
            self._check_replica(replica, error)
            return False
        receipt = self.receipts.get(replica, {}).pop(version, None) or Receipt(
            group, replica, version, self.clock(), 0, 0.0
        )
        self.schedule.install(dataclasses.replace(receipt, group=group, replica=replica))
        self.deliveries[group] += 1
        if group in self.paused and self.settings.policy.may_start(self.schedule.latest, self.schedule.held[group]):
            self.paused.discard(group)
            self._on_group(group, lambda manager: manager.resume_generation_replicas())
        elif group not in self.paused:
            manager.resume_generation_replicas()
        return True

    def _first_sync(self, version: int) -> None:
        """Every live replica installs ``version`` before anything is generated (start or resume)."""
        deadline = time.monotonic() + FIRST_SYNC_TIMEOUT_S
        waiting = set(self.members)
        for replica in waiting:
            self.schedule.installed[replica] = version - 1  # held nothing of this run yet
        while waiting:
            for replica in self._collect():
                waiting.discard(replica)
            waiting &= set(self.members)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"relay: sampler replicas {sorted(waiting)} did not receive weight version {version} from "
                    f"{self.settings.relay.url} within {FIRST_SYNC_TIMEOUT_S:.0f} s"
                )
            time.sleep(self.settings.relay.poll_s)
        self.schedule.lags_s = [[] for _ in range(self.schedule.num_groups)]  # the first sync is not a step's
        self.schedule.pull_s = [[] for _ in range(self.schedule.num_groups)]

    def metrics(self, learner_version: int) -> dict[str, float]:
        out = super().metrics(learner_version)  # the groups' books (no snapshots: the store holds the versions)
        out.update(self.publish_metrics)
        for name, value in _summed(self.sampler_counters.values()).items():
            out[f"{RELAY_PREFIX}samplers/{name}"] = value
        return out


def _summed(counters) -> dict[str, float]:
    out: dict[str, float] = {}
    for one in counters:
        for name, value in one.items():
            out[name] = out.get(name, 0.0) + float(value)
    return out
