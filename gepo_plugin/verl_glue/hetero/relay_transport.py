"""Weights over the relay: the learner publishes each version once to a store, replicas pull, real arrivals count.

:class:`RelayTransport` is the sampler fleet's transport with ``hetero.transport=relay``. At every step end the
learner publishes the new version through the relay checkpoint engine (verl's ``actor_wg.update_weights``; rank 0
uploads in the background) and keeps no per-group snapshot. Each replica's checkpoint-engine worker follows the store
over its group's link; at safe points (the step end, and while the learner waits for data) the learner collects
their receipts and installs each replica's newly arrived version through verl's rollout weight-update path, tagging
its tokens with that version. Which version a group holds is an :class:`~gepo_sampler.relay.arrivals.ArrivalBook`
of real arrivals.

A replacement (``hetero.replace_failed=true``) follows the store like any replica as soon as it has started: its
first pull is the newest keyframe (and the deltas after it), and at the first safe point after it has arrived the
learner installs it and the replica joins its group.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from verl.checkpoint_engine import CheckpointEngineManager
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

from gepo_plugin import metric_names
from gepo_plugin.names import RELAY_CHECKPOINT_ENGINE
from gepo_plugin.verl_glue.hetero.remote.members import is_remote
from gepo_plugin.verl_glue.hetero.transport import Fleet
from gepo_sampler.relay.arrivals import ArrivalBook
from gepo_sampler.relay.follower import FollowerStatus, Receipt

logger = logging.getLogger(__name__)

#: How long the first sync (start or resume) waits for every replica to pull the learner's version.
FIRST_SYNC_TIMEOUT_S = 1800.0


@dataclass
class Joining:
    """A replacement replica that follows the store and joins its group once its first version has arrived."""

    group: int
    replica: Any
    #: the replacement's checkpoint-engine workers (None for a remote sampler, which installs by itself)
    workers: RayWorkerGroup | None
    manager: CheckpointEngineManager


def checkpoint_workers(replica: Any) -> RayWorkerGroup:
    """The replica's checkpoint-engine workers (where its relay follower runs), as a worker group to call."""
    return RayWorkerGroup(
        worker_handles=list(replica.workers),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker)),
    )


class RelayTransport:
    """The relay transport (see the module docstring)."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float] = time.time) -> None:  # receipts: samplers' wall clock
        self.fleet = fleet
        self.settings = fleet.settings
        self.relay = fleet.settings.relay
        self.actor_wg = fleet.actor_wg
        self.clock = clock
        self.book: ArrivalBook | None = None
        self.worker_groups: dict[int, RayWorkerGroup] = {}
        self.replica_managers: dict[int, CheckpointEngineManager] = {}
        self.receipts: dict[int, dict[int, Receipt]] = {}
        self.sampler_counters: dict[int, dict[str, float]] = {}
        self.publish_metrics: dict[str, float] = {}
        self.joining: list[Joining] = []
        #: roster id -> a remote sampler (it pulls and installs by itself; the learner records what it reports)
        self.remote_members: dict[int, Any] = {}
        #: each live remote sampler's last report, by name (its metrics)
        self.remote_reports: dict[str, dict] = {}
        self.first_version = 0
        for replica, member in fleet.members.items():
            self.worker_groups[replica] = checkpoint_workers(member)
            self.replica_managers[replica] = CheckpointEngineManager(fleet.config, self.actor_wg, [member])
        first = next(iter(self.worker_groups.values()))  # one sampler reads the store before anything else
        ray.get(first.execute_checkpoint_engine(["probe"] * first.world_size))
        follows = []
        for replica, group in self._replica_groups().items():
            workers = self.worker_groups[replica]
            size = workers.world_size
            follows.extend(workers.execute_checkpoint_engine(["follow"] * size, [group] * size, [replica] * size))
        ray.get(follows)
        logger.info("hetero: weights travel through the relay at %s", self.relay.url)

    @property
    def versions(self) -> ArrivalBook | None:
        return self.book

    def _replica_groups(self) -> dict[int, int]:
        return {replica: self.fleet.roster.group_of[replica] for replica in self.fleet.members}

    # --------------------------------------------------------------- the transport protocol
    def start(self, version: int) -> ArrivalBook:
        # results and statuses may name this run's versions, none newer than the learner's: the window opens to a
        # version before it can appear in the store (a host may report it as soon as it sees it)
        if self.fleet.remote is not None:
            self.fleet.remote.set_window(version, version)
        self._publish(version)
        groups = len(self.fleet.roster.groups)
        self.book = ArrivalBook(self._replica_groups(), groups, start_version=version, start_time=self.clock())
        self.first_version = version
        return self.book

    def install_first(self, version: int) -> None:
        """Every live replica installs ``version`` before anything is generated (start or resume)."""
        deadline = time.monotonic() + FIRST_SYNC_TIMEOUT_S
        waiting = set(self.fleet.members)
        for replica in waiting:
            self.book.installed[replica] = version - 1  # held nothing of this run yet
        while waiting:
            for replica in self._collect():
                waiting.discard(replica)
            waiting &= set(self.fleet.members)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"relay: sampler replicas {sorted(waiting)} did not receive weight version {version} from "
                    f"{self.relay.url} within {FIRST_SYNC_TIMEOUT_S:.0f} s"
                )
            time.sleep(self.relay.poll_s)
        self.book.lags_s = [[] for _ in range(self.book.num_groups)]  # the first sync is not a step's
        self.book.pull_s = [[] for _ in range(self.book.num_groups)]

    def publish(self, version: int) -> None:
        if self.fleet.remote is not None:  # (before the version can appear in the store: see start)
            self.fleet.remote.set_window(self.first_version, version)
        self._publish(version)
        self.book.publish(version, self.clock())
        self._collect()

    def collect(self) -> bool:
        self._check_publisher()
        return bool(self._collect())

    def join(self, started: list[tuple[int, Any]]) -> list[int]:
        """Started replacements begin following the store; those whose first version has arrived are installed and
        join their group."""
        if self.book is None:
            return []
        already = {id(joining.replica) for joining in self.joining}
        for group, replica in started:
            if is_remote(replica):  # it follows the store by itself: it joins once it reports a version
                if id(replica) not in already:
                    manager = CheckpointEngineManager(self.fleet.config, self.actor_wg, [replica])
                    self.joining.append(Joining(group, replica, None, manager))
                continue
            workers = checkpoint_workers(replica)
            size = workers.world_size
            try:  # a provisional replica id: receipts are relabelled by the worker group they came from
                ray.get(workers.execute_checkpoint_engine(["follow"] * size, [group] * size, [-1] * size))
            except RayError:
                logger.exception("hetero: a replacement for sampler group %d was lost before it followed", group)
                self.fleet.abandon(group, replica)
                continue
            manager = CheckpointEngineManager(self.fleet.config, self.actor_wg, [replica])
            self.joining.append(Joining(group, replica, workers, manager))
        joining = list(self.joining)
        remote = (
            self.fleet.remote.versions(
                {i: j.replica for i, j in enumerate(joining) if j.workers is None}, self.settings.health.timeout_s
            )
            if self.fleet.remote is not None
            else {}
        )
        members = [
            self._join_remote(j, remote.get(i)) if j.workers is None else self._join(j) for i, j in enumerate(joining)
        ]
        return [member for member in members if member is not None]

    def forget(self, replica: int) -> None:
        if self.book is not None:
            self.book.remove_replica(replica)
        self.worker_groups.pop(replica, None)
        self.remote_members.pop(replica, None)
        self.replica_managers.pop(replica, None)

    def settle(self, oldest: int) -> None:
        """The store keeps what a live group may still need: ``oldest`` and everything newer."""
        size = self.actor_wg.world_size
        ray.get(self.actor_wg.execute_checkpoint_engine(["hold"] * size, [oldest] * size))

    def metrics(self) -> dict[str, float]:
        if self.fleet.remote is not None:
            self._read_remote_reports()
        out = metric_names.under(metric_names.RELAY, self.publish_metrics)
        out.update(metric_names.under(metric_names.RELAY_SAMPLERS, _summed(self.sampler_counters.values())))
        if self.fleet.remote is not None:
            out.update(self.fleet.remote.metrics(self.remote_reports))
        return out

    # --------------------------------------------------------------- the learner's side
    def _publish(self, version: int) -> None:
        self._take_publish_metrics(
            ray.get(self.actor_wg.update_weights(global_steps=version, mode=RELAY_CHECKPOINT_ENGINE))
        )

    def _check_publisher(self) -> None:
        """Stop the run if publishing has ended (outage budget spent, permanent store error): the samplers would
        otherwise starve while the learner waits for their rollouts."""
        size = self.actor_wg.world_size
        self._take_publish_metrics(ray.get(self.actor_wg.execute_checkpoint_engine(["check"] * size)))

    def _take_publish_metrics(self, results: Iterable[Any]) -> None:
        """The publishing rank's metrics (the other ranks return nothing)."""
        for result in results:
            if isinstance(result, Mapping) and result:
                self.publish_metrics = dict(result)

    def _request_keyframe(self, corrupt_shards: list[str]) -> None:
        size = self.actor_wg.world_size
        ray.get(self.actor_wg.execute_checkpoint_engine(["request_keyframe"] * size, [corrupt_shards] * size))

    # --------------------------------------------------------------- the samplers' side
    def _statuses(self) -> dict[int, list[FollowerStatus]]:
        """Each live replica's follower status; a replica whose worker cannot answer is checked like a failed
        install (probed, and reported lost if its servers died or hung) and left out."""
        refs = {
            replica: workers.execute_checkpoint_engine(["status"] * workers.world_size)
            for replica, workers in self.worker_groups.items()
            if replica in self.fleet.members
        }
        out = {}
        for replica, ref in refs.items():
            try:
                out[replica] = ray.get(ref, timeout=self.settings.health.timeout_s)
            except (RayError, GetTimeoutError) as error:
                self.fleet.check_replica(replica, error)
        return out

    def _collect(self) -> list[int]:
        """Install each replica's newly arrived version; returns the replicas that installed one."""
        installed = []
        keyframe = False
        corrupt: set[str] = set()
        self.fleet.retire_lost()
        for replica, statuses in self._statuses().items():
            for status in statuses:
                if status.error is not None:
                    raise RuntimeError(
                        f"relay: sampler replica {replica} cannot pull weights from {self.relay.url}: {status.error}"
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
            if version is None or version <= self.book.installed.get(replica, version):
                continue
            if self._install_replica(replica, version):
                installed.append(replica)
        if keyframe:
            self._request_keyframe(sorted(corrupt))
        return installed + self._collect_remote()

    def _live_remote(self) -> dict[int, Any]:
        return {member: replica for member, replica in self.remote_members.items() if member in self.fleet.members}

    def _collect_remote(self) -> list[int]:
        """Record the versions remote samplers installed by themselves (what they report with every poll): one call
        for their versions, and one resume (or abort) per group for those that installed one."""
        live = self._live_remote()
        if not live:  # (no remote sampler in this run, or none has joined)
            return []
        versions = self.fleet.remote.versions(live, self.settings.health.timeout_s)
        installed: dict[int, list[int]] = {}
        for member, version in versions.items():
            if version is None or version <= self.book.installed.get(member, version):
                continue
            group = self.fleet.roster.group_of[member]
            self.book.install(Receipt(group, member, version, self.clock(), 0, 0.0))
            installed.setdefault(group, []).append(member)
        for group, members in installed.items():
            self.fleet.installed(group, self.fleet.remote.batch([live[m] for m in members]), len(members))
        return [member for members in installed.values() for member in members]

    def _read_remote_reports(self) -> None:
        """The remote samplers' reports for the step's metrics (one call): what each did, its relay counters. A
        retired sampler's totals stay (results, refusals, requests cut by a quarantine: a metric that vanished with
        its sampler would hide them); what described it while alive (silence, version) goes."""
        live = self._live_remote()
        reports = self.fleet.remote.reports(live, self.settings.health.timeout_s)
        current = {live[member].name: report for member, report in reports.items()}
        gone = {name: {"counters": r["counters"], "refused": r["refused"]} for name, r in self.remote_reports.items()}
        self.remote_reports = {**gone, **current}
        for member, report in reports.items():
            status = report.get("status")
            if status is not None:
                self.sampler_counters[member] = {
                    key.removeprefix("relay_"): value
                    for key, value in status["counters"].items()
                    if key.startswith("relay_")
                }

    def _join_remote(self, joining: Joining, version: int | None) -> int | None:
        """A remote sampler joins its group once it has dialled in and reports the ``version`` it installed (None:
        none yet, or it cannot serve)."""
        if version is None:
            return None
        version = int(version)
        self.joining.remove(joining)
        member = self.fleet.enlist(joining.group, joining.replica, version, joining.manager)
        self.remote_members[member] = joining.replica
        self.replica_managers[member] = joining.manager
        self.book.add_replica(member, joining.group, version)
        return member

    def _install_replica(self, replica: int, version: int) -> bool:
        """Install ``version`` on ``replica``; False if the replica was lost meanwhile (it is then reported)."""
        group = self.fleet.roster.group_of[replica]
        manager = self.replica_managers[replica]
        workers = self.worker_groups[replica]
        try:
            manager.abort_replicas()
            manager.release_kv_cache_replicas()
            ray.get(workers.update_weights(global_steps=version))
            manager.resume_kv_cache_replicas()
        except RayError as error:
            self.fleet.check_replica(replica, error)
            return False
        receipt = self.receipts.get(replica, {}).pop(version, None) or Receipt(
            group, replica, version, self.clock(), 0, 0.0
        )
        self.book.install(dataclasses.replace(receipt, group=group, replica=replica))
        self.fleet.installed(group, manager)
        return True

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
            self.fleet.abandon(joining.group, joining.replica)
            return None
        self.joining.remove(joining)
        member = self.fleet.enlist(joining.group, joining.replica, version, joining.manager)
        self.worker_groups[member] = joining.workers
        self.replica_managers[member] = joining.manager
        self.book.add_replica(member, joining.group, version)
        for status in statuses:
            for receipt in status.receipts:  # its pulls count in its group's bytes
                self.book.bytes[joining.group] += receipt.nbytes
        return member


def _summed(counters: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for one in counters:
        for name, value in one.items():
            out[name] = out.get(name, 0.0) + float(value)
    return out
