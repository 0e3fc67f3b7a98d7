"""The rollout replica verl builds for ``rollout.name=hf`` (mirrors ``vLLMReplica``).

HYBRID: the server sits next to the training workers (on the node of the replica's first worker); the workers'
adapter pushes weights. STANDALONE / COLOCATED: verl's ``init_standalone``/``init_colocated`` create
``CheckpointEngineWorker`` actors whose adapters push weights received from a checkpoint engine. Servers reserve no
Ray resources (like vLLM's, whose compute is accounted to the replica's workers), so they never block scheduling.
The replica sets verl's ``_server_handle`` / ``_server_address`` (a seam contact of the ``cpu_backend`` feature).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.utils.net_utils import is_valid_ipv6_address
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from gepo_plugin.cpu_backend.rollout.server import HFGenerationServer


class HFReplica(RolloutReplica):
    """A rollout replica served by one :class:`HFGenerationServer` (mirrors ``vLLMReplica``).

    HYBRID: the server sits next to the training workers (on the node of the replica's first
    worker); the workers' :class:`HFServerAdapter` pushes weights. STANDALONE / COLOCATED: verl's
    ``init_standalone``/``init_colocated`` create ``CheckpointEngineWorker`` actors whose adapters
    push weights received from a checkpoint engine. Servers reserve no Ray resources (like vLLM's,
    whose compute is accounted to the replica's workers), so they never block scheduling.
    """

    def __init__(
        self,
        replica_rank: int,
        config: RolloutConfig,
        model_config: HFModelConfig,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
    ) -> None:
        super().__init__(
            replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model, name_suffix
        )
        self.server_class = ray.remote(HFGenerationServer)

    def _get_server_name_prefix(self) -> str:
        """Actor-name prefix; the adapter derives the same one from ``rollout.name``."""
        return f"{self.config.name}_"

    def _server_name(self) -> str:
        prefix = self._get_server_name_prefix()
        if self.is_reward_model:
            return f"{prefix}server_reward_{self.replica_rank}_0{self.name_suffix}"
        if self.is_teacher_model:
            return f"{prefix}server_teacher_{self.replica_rank}_0{self.name_suffix}"
        return f"{prefix}server_{self.replica_rank}_0{self.name_suffix}"

    async def launch_servers(self) -> None:
        """Start this replica's server on its first worker's node and record handle and address."""
        if self.nnodes != 1:
            raise NotImplementedError(
                f"the transformers rollout serves a replica from one process; world size {self.world_size} spans "
                f"{self.nnodes} nodes (lower tensor/data/pipeline parallel sizes)"
            )
        assert len(self.workers) == self.world_size, (
            f"worker number {len(self.workers)} not equal to world size {self.world_size}"
        )
        options: dict[str, Any] = {"name": self._server_name(), "max_concurrency": self.max_concurrency, "num_cpus": 0}
        node_id = await self._first_worker_node_id()
        if node_id is not None:
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            )
        server = self.server_class.options(**options).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
            node_rank=0,
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server

        address, port = await server.get_server_address.remote()
        self._server_address = f"[{address}]:{port}" if is_valid_ipv6_address(address) else f"{address}:{port}"

    async def _first_worker_node_id(self) -> str | None:
        """Node of the replica's first worker, where the server goes.

        STANDALONE: read from the replica's own placement group (one node, so one group), since the
        workers are still starting up and asking them would serialise their start-up and the
        server's (about 10 s each on a small CPU host). Otherwise the first worker is asked.
        """
        pgs = getattr(self.resource_pool, "pgs", None)
        if self.rollout_mode == RolloutMode.STANDALONE and pgs and len(pgs) == 1:
            bundles = ray.util.placement_group_table(pgs[0]).get("bundles_to_node_id") or {}
            if bundles:
                return bundles[min(bundles)]
        if not self.workers:
            return None
        return await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())

    async def sleep(self) -> None:
        """Let in-flight requests finish, then sleep (as vLLMReplica)."""
        await asyncio.gather(*[server.wait_for_requests_to_drain.remote() for server in self.servers])
        await asyncio.gather(*[server.sleep.remote() for server in self.servers])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Abort every in-flight request (partial rollout); returns the combined counts."""
        results = await asyncio.gather(
            *[server.abort_all_requests.remote(reject_request=reject_request) for server in self.servers]
        )
        return {
            "aborted_count": sum(r.get("aborted_count", 0) for r in results),
            "request_ids": [request_id for r in results for request_id in r.get("request_ids", [])],
            "server_results": results,
        }

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one request wherever it runs."""
        results = await asyncio.gather(*[server.abort_request.remote(request_id) for server in self.servers])
        for result in results:
            if result.get("aborted", False):
                return result
        return {"aborted": False, "request_id": request_id, "error": "Request not found on any server"}

    async def release_kv_cache(self) -> None:
        """Drain, then release (as vLLMReplica)."""
        await asyncio.gather(*[server.wait_for_requests_to_drain.remote() for server in self.servers])
        await asyncio.gather(*[server.release_kv_cache.remote() for server in self.servers])
