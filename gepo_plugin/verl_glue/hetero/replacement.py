"""Start a replacement for a lost sampler replica (``hetero.replace_failed=true``).

The replacement is a new replica of verl's own class (``LLMServerManager.rollout_replica_class``), started the way
verl starts standalone replicas (``init_standalone``: its own placement group and rollout workers, then its
servers). It needs an unused ``replica_rank`` (actor names such as ``<rollout>_server_{rank}_0`` and the pool
``rollout_pool_{rank}`` are fixed) and free devices (the lost replica's placement group was released).

Starting takes as long as loading a model (seconds on CPU, minutes for a large model on GPUs), so it runs in a
background thread while the learner trains (:class:`ReplacementStarter`). Once started, the learner's weight sync
admits it at a safe point, by its transport: with simulated delay (:func:`admit`), when the actor holds exactly the
weights the schedule calls the newest (after a step's publish, or while it waits for data), it installs the weights
its sampler group holds from the learner's host snapshots (the learner's current version when the group had no
replica left, and the group rejoins the weight schedule with it; else the group's version, so every replica of a
group samples with the same weights); with the relay, the replica pulls the newest version from the store itself
and is installed once it has arrived. Only then does it join (:func:`enlist`) its group's weight sync, the health
monitor and verl's load balancer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import RayError
from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from gepo_plugin.verl_glue.hetero.replicas import fence, release_resources

logger = logging.getLogger(__name__)

#: How long a replacement waits for the lost replica's devices to come free before it gives up.
DEVICE_WAIT_S = 60.0


@auto_await
async def _start(replica) -> None:
    await replica.init_standalone()


def wait_for_devices(needed: int, timeout_s: float = DEVICE_WAIT_S) -> bool:
    """Wait until the cluster has ``needed`` free accelerators (Ray frees a removed placement group's devices a
    moment later, and verl's pool creation refuses to start short of them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        if free.get("GPU", free.get("NPU", 0)) >= needed:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def next_rank(sync: Any) -> int:
    """A ``replica_rank`` no replica of this run has used (ranks of lost replicas are not reused)."""
    used = [replica.replica_rank for replica in sync.server_manager.rollout_replicas]
    sync.highest_rank = max([sync.highest_rank, *used]) + 1
    return sync.highest_rank


def launch(manager: Any, rank: int, group: int) -> Any | None:
    """Create and start a replica of rank ``rank`` (background thread; touches nothing the learner uses).

    Returns None, with a warning, when the devices did not come free."""
    replica = manager.rollout_replica_class(
        replica_rank=rank,
        config=manager.rollout_config,
        model_config=manager.model_config,
        gpus_per_node=manager.rollout_config.n_gpus_per_node,
    )
    if not wait_for_devices(replica.world_size):
        logger.warning(
            "hetero: no %d free device(s) for a replacement in sampler group %d; going on without",
            replica.world_size,
            group,
        )
        return None
    try:
        _start(replica)
    except BaseException:
        fence(replica)  # whatever of it started: its actors and its devices
        release_resources(replica)
        raise
    return replica


class ReplacementStarter:
    """Replacements being started in a background thread; the learner's thread collects the started ones
    (:meth:`started`) and its weight sync admits each the way its transport installs weights."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gepo-hetero-replacement")
        self._starting: list[tuple[Future, int]] = []

    def start(self, group: int) -> None:
        """Start a replacement for sampler ``group`` (learner's thread; returns at once)."""
        rank = next_rank(self.sync)
        self.sync.roster.begin_replacement(group)
        self._starting.append((self._pool.submit(launch, self.sync.server_manager, rank, group), group))
        logger.warning("hetero: starting a replacement (rank %d) for sampler group %d", rank, group)

    def started(self) -> list[tuple[int, Any]]:
        """(group, replica) of every replacement that has started since the last call (learner's thread, at a safe
        point); one that failed to start is logged and abandoned in the roster."""
        ready, waiting = [], []
        for entry in self._starting:  # one look at each future: one that finishes meanwhile waits for the next call
            (ready if entry[0].done() else waiting).append(entry)
        self._starting = waiting
        out = []
        for future, group in ready:
            try:
                replica = future.result()
            except Exception:
                logger.exception("hetero: a replacement for sampler group %d failed to start", group)
                replica = None
            if replica is None:
                self.sync.roster.abandon_replacement(group)
            else:
                out.append((group, replica))
        return out


def enlist(sync: Any, group: int, replica: Any, version: int) -> int:
    """A replacement that holds ``version`` joins ``group``: the roster, the group's weight sync, the health monitor
    and verl's load balancer and replica lists; returns its roster id. (What every transport shares, after it has
    installed the weights its own way.)"""
    manager = sync.server_manager
    member = sync.roster.join(group)
    sync.members[member] = replica
    sync.groups[group].add_replicas([replica])
    if sync.monitor is not None:
        sync.monitor.watch(member, replica.servers)
    manager.rollout_replicas.append(replica)
    manager.server_handles.append(replica.server_handle)
    manager.server_addresses.append(replica.server_address)
    ray.get(manager.global_load_balancer.add_servers.remote({replica.server_address: replica.server_handle}))
    logger.warning(
        "hetero: replica %d (rank %d) replaces a lost one in sampler group %d with weight version %d",
        member,
        replica.replica_rank,
        group,
        version,
    )
    return member


def abandon(replica: Any) -> None:
    """A started replacement that cannot join: stop it and free its devices."""
    fence(replica)
    release_resources(replica)


def admit(sync: Any, group: int, replica: Any, snapshot_key: Callable[[int], str]) -> int | None:
    """Install sampler ``group``'s weights on a started ``replica`` from the learner's host snapshots and let it
    serve; returns its roster id, or None (the replica stopped and freed) when it was lost before it could take its
    weights.

    ``sync`` is the run's ``DelayedWeightSync`` (its groups, roster, schedule and snapshots, whose keys
    ``snapshot_key`` gives). Call it only while the actor holds the schedule's newest version."""
    schedule = sync.schedule
    rejoining = not sync.roster.alive(group)
    version = schedule.latest if rejoining else schedule.held[group]
    installer = CheckpointEngineManager(sync.config, sync.actor_wg, [replica])
    if version != schedule.latest:
        sync.actor_wg.restore_model_from_cpu(snapshot_key(version))
    try:
        installer.update_weights(version)
    except RayError:
        logger.exception("hetero: a replacement for sampler group %d was lost before it took its weights", group)
        abandon(replica)
        return None
    finally:
        if version != schedule.latest:
            sync.actor_wg.restore_model_from_cpu(snapshot_key(schedule.latest))
    if group in sync.paused:
        installer.abort_replicas()  # its group waits for newer weights (admission control)
    member = enlist(sync, group, replica, version)
    if rejoining:
        schedule.rejoin(group)
    return member
