"""What the plugin does to a lost or new verl ``RolloutReplica``: stop it, take it out of verl's lists, free its
devices (public attributes and Ray calls only)."""

from __future__ import annotations

import logging
from typing import Any

import ray

from gepo_plugin.verl_glue.hetero.remote.pool import PooledProxy

logger = logging.getLogger(__name__)


def fence(replica: Any) -> None:
    """Kill a lost replica's Ray actors (servers and rollout workers): calls pinned to it fail at once."""
    kill_actors([*replica.servers, *replica.workers], "a lost replica's actor")


def kill_actors(handles: list[Any], what: str) -> None:
    """Kill each actor for good (no restart); one already gone is skipped (``what`` names them in the debug log). A
    remote sampler's pooled proxy is removed from its pool instead (its process serves other samplers)."""
    for handle in handles:
        if isinstance(handle, PooledProxy):
            handle.retire()
            continue
        try:
            ray.kill(handle, no_restart=True)
        except Exception as error:  # already gone
            logger.debug("gepo-plugin: kill of %s: %r", what, error)


def forget_replica(manager: Any, replica: Any) -> None:
    """Take a retired replica out of verl's standalone ``LLMServerManager`` lists (public attributes)."""
    if replica in manager.rollout_replicas:
        index = manager.rollout_replicas.index(replica)
        del manager.rollout_replicas[index]
        if index < len(manager.server_handles):
            del manager.server_handles[index]
        if index < len(manager.server_addresses):
            del manager.server_addresses[index]


def release_resources(replica: Any) -> None:
    """Free a retired replica's placement groups, so a replacement (or anything else) can use its devices."""
    pool = getattr(replica, "resource_pool", None)
    for group in getattr(pool, "pgs", None) or []:
        try:
            ray.util.remove_placement_group(group)
        except Exception as error:
            logger.debug("hetero: removing a lost replica's placement group: %r", error)


def abandon(replica: Any) -> None:
    """A replica that cannot serve (a replacement that failed to start or to join): stop it and free its devices."""
    fence(replica)
    release_resources(replica)
