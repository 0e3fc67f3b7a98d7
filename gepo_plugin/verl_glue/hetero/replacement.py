"""Start a replacement for a lost sampler replica (``hetero.replace_failed=true``).

The replacement is a new replica of verl's own class (``LLMServerManager.rollout_replica_class``), started the way
verl starts standalone replicas (``init_standalone``: its own placement group and rollout workers, then its
servers). It needs an unused ``replica_rank`` (actor names such as ``<rollout>_server_{rank}_0`` and the pool
``rollout_pool_{rank}`` are fixed) and free devices (the lost replica's placement group was released). Before it
takes any request it installs the weights its sampler group holds: the learner's current version when the group
had no replica left (the group rejoins the weight schedule with it), else the group's version, so every replica
of a group samples with the same weights. Then it joins its group's weight sync, the health monitor and verl's
load balancer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

logger = logging.getLogger(__name__)


@auto_await
async def _start(replica) -> None:
    await replica.init_standalone()


def wait_for_devices(needed: int, timeout_s: float = 60.0) -> bool:
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


def replace(sync: Any, group: int, snapshot_key: Callable[[int], str]) -> int | None:
    """Start a replica for sampler ``group``, install its weights and let it serve; returns its roster id.

    ``sync`` is the run's ``DelayedWeightSync`` (its groups, roster, schedule and snapshots, whose keys
    ``snapshot_key`` gives). Returns None, with a warning, when the devices did not come free: training goes on
    with the samplers left."""
    manager, schedule = sync.server_manager, sync.schedule
    replica = manager.rollout_replica_class(
        replica_rank=next_rank(sync),
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
    _start(replica)
    rejoining = not sync.roster.alive(group)
    version = schedule.latest if rejoining else schedule.held[group]
    installer = CheckpointEngineManager(sync.config, sync.actor_wg, [replica])
    if version != schedule.latest:
        sync.actor_wg.restore_model_from_cpu(snapshot_key(version))
    installer.update_weights(version)
    if version != schedule.latest:
        sync.actor_wg.restore_model_from_cpu(snapshot_key(schedule.latest))
    if group in sync.paused:
        installer.abort_replicas()  # its group waits for newer weights (admission control)
    member = sync.roster.join(group)
    sync.members[member] = replica
    sync.groups[group].add_replicas([replica])
    if rejoining:
        schedule.rejoin(group)
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
