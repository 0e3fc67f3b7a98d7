"""Start a replacement for a lost sampler replica (``hetero.replace_failed=true``).

The replacement is a new replica of verl's own class (``LLMServerManager.rollout_replica_class``), started the way
verl starts standalone replicas (``init_standalone``: its own placement group and rollout workers, then its
servers). It needs an unused ``replica_rank`` (actor names such as ``<rollout>_server_{rank}_0`` and the pool
``rollout_pool_{rank}`` are fixed) and free devices (the lost replica's placement group was released).

Starting takes as long as loading a model (seconds on CPU, minutes for a large model on GPUs), so it runs in a
background thread while the learner trains (:class:`ReplacementStarter`). Once started, the sampler fleet hands it
to its weight transport at a safe point, which brings it to its group's weights its own way; only then does it join
its group (:meth:`~gepo_plugin.verl_glue.hetero.fleet.SamplerFleet.enlist`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
from verl.utils.ray_utils import auto_await

from gepo_plugin.hetero.roster import SamplerRoster
from gepo_plugin.verl_glue.hetero.replicas import abandon

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
        abandon(replica)  # whatever of it started: its actors and its devices
        raise
    return replica


class ReplacementStarter:
    """Replacements being started in a background thread; the learner's thread collects the started ones
    (:meth:`started`) and the fleet's transport brings each to its group's weights.

    ``next_rank`` gives an unused ``replica_rank``; ``launch(rank, group)`` creates and starts a replica (see
    :func:`launch`); the roster counts what is starting and what failed to."""

    def __init__(
        self, roster: SamplerRoster, next_rank: Callable[[], int], launch: Callable[[int, int], Any | None]
    ) -> None:
        self.roster = roster
        self.next_rank = next_rank
        self.launch = launch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gepo-hetero-replacement")
        self._starting: list[tuple[Future, int]] = []

    def start(self, group: int) -> None:
        """Start a replacement for sampler ``group`` (learner's thread; returns at once)."""
        rank = self.next_rank()
        self.roster.begin_replacement(group)
        self._starting.append((self._pool.submit(self.launch, rank, group), group))
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
                self.roster.abandon_replacement(group)
            else:
                out.append((group, replica))
        return out
