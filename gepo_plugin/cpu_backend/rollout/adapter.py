"""The server's client inside verl's training and checkpoint-engine workers (like vLLM's ``ServerAdapter``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterable, Iterable
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.utils import ensure_async_iterator

from gepo_plugin.cpu_backend.rollout.server import ENGINE_KWARGS_KEY
from gepo_plugin.cpu_backend.rollout.weights import full_tensor

logger = logging.getLogger(__name__)


class HFServerAdapter(BaseRollout):
    """Client of the replica's :class:`HFGenerationServer` inside a worker process (like vLLM's ``ServerAdapter``).

    Built by verl's ``ActorRolloutRefWorker`` (HYBRID; ``replica_rank`` derived from ``RANK``) and by
    ``CheckpointEngineWorker`` (STANDALONE/COLOCATED; ``replica_rank`` passed in). Only the replica's
    rollout rank 0 (the leader) talks to the server; every rank still consumes the weight stream,
    because producing it (FSDP2 ``full_tensor``) is collective over the training ranks.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        device_mesh: Any = None,
        replica_rank: int = -1,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        self.server_handle: ActorHandle | None = None
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20

    @property
    def is_leader_rank(self) -> bool:
        """Whether this rank drives the server (read by ``CheckpointEngineWorker.is_leader_rank``)."""
        return self.rollout_rank == 0

    def _server_name(self) -> str:
        return f"{self.config.get('name', ENGINE_KWARGS_KEY)}_server_{self.replica_rank}_0"

    def _ensure_server_handle(self) -> bool:
        """Look the server up lazily (in HYBRID mode it starts after the workers); False off the leader."""
        if not self.is_leader_rank:
            return False
        if self.server_handle is None:
            self.server_handle = ray.get_actor(self._server_name())
        return True

    async def resume(self, tags: list[str]) -> None:
        """Wake the server up (``tags``: weights and/or kv_cache)."""
        if self.config.free_cache_engine and self._ensure_server_handle():
            await self.server_handle.wake_up.remote(tags=tags)

    async def release(self) -> None:
        """Put the server to sleep."""
        if self.config.free_cache_engine and self._ensure_server_handle():
            await self.server_handle.sleep.remote()

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        base_sync_done: bool = True,
        **kwargs: Any,
    ) -> None:
        """Stream ``(name, tensor)`` pairs to the server in buckets, then record ``global_steps``.

        Tensors are materialised (DTensor ``full_tensor``) on every rank, compacted into their own CPU
        storage (Ray would otherwise pickle a view's whole underlying buffer) and sent in buckets of
        ``checkpoint_engine.update_weights_bucket_megabytes``.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"transformers rollout takes wire_format='named_tensors', got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("the transformers rollout takes no unmerged LoRA adapters; set lora.merge=True")
        start = time.time()
        leader = self._ensure_server_handle()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = count = 0
        async for name, tensor in ensure_async_iterator(weights):
            tensor = full_tensor(tensor)
            if not leader:
                continue
            tensor = tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            bucket.append((name, tensor))
            size += tensor.nbytes
            count += 1
            if size >= self.bucket_bytes:
                await self.server_handle.update_weights.remote(bucket)
                bucket, size = [], 0
        if not leader:
            return
        if bucket:
            await self.server_handle.update_weights.remote(bucket)
        await self.server_handle.clear_kv_cache.remote()
        if global_steps is not None:
            await self.server_handle.set_global_steps.remote(global_steps)
        logger.info(
            "replica %d: updated %d tensors (global_steps %s) in %.2fs",
            self.replica_rank,
            count,
            global_steps,
            time.time() - start,
        )

    def generate_sequences(self, prompts: Any) -> Any:
        """Synchronous batch generation is not offered (verl's V1 path generates through the server)."""
        raise NotImplementedError("use the rollout server (HFReplica / LLMServerClient) to generate")
