"""A CPU checkpoint engine for verl: weights travel from the trainer to standalone rollouts via a Ray mailbox.

verl's ``separate_async`` trainer refuses the ``naive`` engine (it only works when rollout and
trainer share a process) and its other engines need NCCL/NIXL/Mooncake hardware. This engine needs
nothing but Ray: trainer rank 0 cuts the weight stream into byte buckets with verl's own
``split_weight_chunks``, ``ray.put``\\ s each bucket (a CPU ``uint8`` array, so the object store
shares it zero-copy with every reader) and posts the reference to a named *mailbox* actor; each
rollout worker fetches the references in order and rebuilds the tensors with verl's
``merge_weight_chunks``. The mailbox keeps at most ``max_inflight_buckets`` unread buckets, so
memory stays bounded by a few buckets whatever the model size.

It follows verl's ``CheckpointEngine`` protocol (``prepare`` -> ``build_topology`` ->
``init_process_group`` -> ``send_weights``/``receive_weights`` -> ``finalize``), driven by
``CheckpointEngineManager`` exactly like the NCCL engine. Select it with
``actor_rollout_ref.rollout.checkpoint_engine.backend=ray_mailbox``; options go under
``checkpoint_engine.engine_kwargs.ray_mailbox`` (``max_inflight_buckets``, ``put_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch.distributed.tensor import DTensor
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

from gepo_plugin.verl_glue import seam

logger = logging.getLogger(__name__)

BACKEND = "ray_mailbox"

MAILBOX_PREFIX = "gepo_ray_mailbox"
#: Byte alignment of tensors inside a bucket.
ALIGNMENT = 16

#: Process-wide handles to named actors this process created or looked up: a named actor that is
#: not detached is reclaimed by Ray once no handle to it is left, so they must outlive any engine.
_NAMED_ACTORS: dict[tuple[str, str], ActorHandle] = {}


def _define_mailbox() -> type:
    """Define the mailbox class inside a function so that Ray ships it *by value*.

    A class importable by name is unpickled by importing its module, and this module imports verl
    (~8 s of CPU and ~0.5 GB per process); the mailbox process then only needs ``asyncio``.
    """

    class Mailbox:
        """The rendezvous (a named async Ray actor): one sender posts numbered buckets, N receivers take them.

        It only holds ``ObjectRef``\\ s, wrapped in a list so that Ray passes them through unresolved:
        the mailbox never deserialises a bucket (nor its metadata, which would import torch and verl
        into this process). A bucket is forgotten once every receiver has taken it; posting
        waits while ``max_inflight`` buckets are still unread (back-pressure); a new sync id evicts
        whatever an older, interrupted sync left behind.
        """

        def __init__(self) -> None:
            self._sync_id: str | None = None
            self._retired: set[str] = set()
            self._slots: dict[int, list[Any]] = {}  # index -> [[ref], reads left]
            self._changed = asyncio.Condition()

        def _check_current(self, sync_id: str, index: int) -> None:
            if sync_id in self._retired:
                raise RuntimeError(f"sync {sync_id} was superseded by a newer one (bucket {index})")

        async def put(self, sync_id: str, index: int, wrapped_ref: list, num_receivers: int, max_inflight: int) -> None:
            """Post bucket ``index`` of sync ``sync_id`` (the sender opens a sync with its first post)."""
            async with self._changed:
                self._check_current(sync_id, index)
                if sync_id != self._sync_id:
                    if self._sync_id is not None:
                        self._retired.add(self._sync_id)
                    self._sync_id = sync_id
                    self._slots.clear()
                    self._changed.notify_all()
                if max_inflight > 0:
                    await self._changed.wait_for(lambda: self._sync_id != sync_id or len(self._slots) < max_inflight)
                    self._check_current(sync_id, index)
                self._slots[index] = [wrapped_ref, num_receivers]
                self._changed.notify_all()

        async def get(self, sync_id: str, index: int) -> list:
            """Take bucket ``index`` of sync ``sync_id``, waiting until the sender has posted it."""
            async with self._changed:
                await self._changed.wait_for(
                    lambda: sync_id in self._retired or (self._sync_id == sync_id and index in self._slots)
                )
                self._check_current(sync_id, index)
                slot = self._slots[index]
                slot[1] -= 1
                if slot[1] <= 0:
                    del self._slots[index]
                    self._changed.notify_all()
                return slot[0]

        async def clear(self, sync_id: str) -> int:
            """Forget what sync ``sync_id`` left (after ``finalize``); returns how many buckets were dropped."""
            async with self._changed:
                if sync_id != self._sync_id:
                    return 0
                dropped = len(self._slots)
                self._slots.clear()
                self._retired.add(sync_id)
                self._sync_id = None
                self._changed.notify_all()
                return dropped

        def pending(self) -> int:
            """Number of buckets posted and not yet taken by every receiver."""
            return len(self._slots)

    return Mailbox


#: The mailbox actor class (see :func:`_define_mailbox`).
Mailbox = _define_mailbox()


def get_or_create_mailbox(name: str, namespace: str | None = None) -> ActorHandle:
    """The named mailbox actor, created on first use; the handle is kept for the process's lifetime.

    It reserves no CPU (it only moves references), so it never blocks Ray's scheduling. It lives on the creator's
    node (the sender's: trainer rank 0): Ray would place an actor that asks for nothing on any node, and on a
    sampler's node its loss would take every group's weight sync with it, where NCCL loses only that group's.
    """
    key = (namespace or "", name)
    if key not in _NAMED_ACTORS:
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        _NAMED_ACTORS[key] = (
            ray.remote(Mailbox)
            .options(
                name=name,
                namespace=namespace,
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=here,
            )
            .remote()
        )
    return _NAMED_ACTORS[key]


def lookup_mailbox(name: str, namespace: str | None = None) -> ActorHandle:
    """Find an existing mailbox by name (and keep the handle process-wide)."""
    key = (namespace or "", name)
    if key not in _NAMED_ACTORS:
        _NAMED_ACTORS[key] = ray.get_actor(name, namespace=namespace)
    return _NAMED_ACTORS[key]


async def _cpu_tensors(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Full (DTensor ``full_tensor``), detached, contiguous CPU tensors, as verl's chunker needs."""
    async for name, tensor in ensure_async_iterator(weights):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().to("cpu").contiguous()


class RayMailboxCheckpointEngine(CheckpointEngine):
    """Checkpoint engine over a Ray mailbox actor (see the module docstring).

    Args:
        bucket_size: bucket size in bytes (``update_weights_bucket_megabytes << 20``).
        is_master: whether this is trainer rank 0, the only sender.
        max_inflight_buckets: unread buckets the mailbox may hold before the sender waits (0: no limit).
        put_timeout_s: how long the sender waits for receivers before failing instead of hanging.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        max_inflight_buckets: int = 4,
        put_timeout_s: float = 600.0,
    ) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.max_inflight_buckets = int(max_inflight_buckets)
        self.put_timeout_s = float(put_timeout_s)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.num_receivers = 0
        self.master_metadata: dict[str, Any] | None = None
        self._mailbox: ActorHandle | None = None
        self._sync_id: str | None = None

    # ---------------------------------------------------------------- topology

    def prepare(self) -> dict[str, Any] | None:
        """Rank 0: make sure the mailbox exists and open a new sync; returns what receivers need."""
        if not self.is_master:
            return None
        context = ray.get_runtime_context()
        name = f"{MAILBOX_PREFIX}_{context.get_job_id()}"
        namespace = context.namespace
        self._mailbox = get_or_create_mailbox(name, namespace)
        self._sync_id = uuid.uuid4().hex
        return {"mailbox": name, "namespace": namespace, "sync_id": self._sync_id, "bucket_size": self.bucket_size}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainer rank 0 sends (rank 0), other trainer ranks only drain (rank -1), rollouts receive (1..N)."""
        master = metadata[0]
        assert isinstance(master, dict) and "mailbox" in master, "trainer rank 0 must be the ray_mailbox master"
        world_size = rollout_world_size + 1
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master_metadata": [master] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """Record this worker's place; senders and receivers look the mailbox up by name."""
        self.rank = rank
        self.world_size = world_size
        self.num_receivers = world_size - 1
        self.master_metadata = master_metadata
        self._sync_id = master_metadata["sync_id"]
        if rank >= 0:
            self._mailbox = lookup_mailbox(master_metadata["mailbox"], master_metadata["namespace"])

    def finalize(self) -> None:
        """Rank 0: drop anything an interrupted sync left in the mailbox (fire and forget)."""
        if self.rank == 0 and self._mailbox is not None and self._sync_id is not None:
            self._mailbox.clear.remote(self._sync_id)
        self.rank = None
        self.world_size = None

    # ---------------------------------------------------------------- transfer

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict:
        """Rank 0 posts the weights bucket by bucket; other trainer ranks only drive the (collective) stream."""
        assert self.rank is not None and self.rank <= 0, "only trainer ranks send weights (call init_process_group)"
        if self.rank < 0:
            async for _, tensor in ensure_async_iterator(weights):
                if isinstance(tensor, DTensor):
                    tensor.full_tensor()  # collective: rank 0 needs every rank's shard
            return {}

        start = time.time()
        buffer = torch.empty(self.bucket_size, dtype=torch.uint8)
        bucket_meta: dict[str, TensorMeta] = {}
        offset = index = total = 0

        async def post(is_last: bool) -> None:
            nonlocal bucket_meta, offset, index
            # one object per bucket: bytes and metadata (ray.put copies the bytes into the object store)
            bucket = {"bucket_meta": bucket_meta, "is_last": is_last, "global_steps": global_steps}
            ref = ray.put({**bucket, "data": buffer[:offset].numpy()})
            await asyncio.wait_for(
                self._mailbox.put.remote(self._sync_id, index, [ref], self.num_receivers, self.max_inflight_buckets),
                timeout=self.put_timeout_s,
            )
            bucket_meta, offset, index = {}, 0, index + 1

        async for tensor_meta, chunk in split_weight_chunks(_cpu_tensors(weights), self.bucket_size):
            # aligned starts, so the receiver can view any dtype in place (torch needs aligned offsets)
            start = -(-offset // ALIGNMENT) * ALIGNMENT
            if start + tensor_meta.chunk_size > self.bucket_size:
                await post(is_last=False)
                start = 0
            tensor_meta.offset = start
            bucket_meta[tensor_meta.name] = tensor_meta
            buffer[start : start + tensor_meta.chunk_size] = chunk
            offset = start + tensor_meta.chunk_size
            total += tensor_meta.chunk_size
        await post(is_last=True)
        logger.info(
            "ray_mailbox: sent %.1f MiB in %d buckets (global_steps %s) in %.2fs",
            total / 2**20,
            index,
            global_steps,
            time.time() - start,
        )
        return {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield ``(name, tensor)`` in the order they were sent (tensors own their CPU memory)."""
        assert self.rank is not None and self.rank > 0, "only rollout workers receive weights"
        bucket_size = int(self.master_metadata.get("bucket_size", self.bucket_size))
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), bucket_size):
            yield name, tensor

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        index = 0
        while True:
            (ref,) = await self._mailbox.get.remote(self._sync_id, index)
            bucket = await ref
            # a private, writable copy: the tensors outlive the object-store buffer they came from
            data = torch.from_numpy(np.array(bucket["data"], dtype=np.uint8, copy=True))
            for tensor_meta in bucket["bucket_meta"].values():
                yield tensor_meta, data[tensor_meta.offset : tensor_meta.offset + tensor_meta.chunk_size]
            if bucket["is_last"]:
                return
            index += 1


def register_ray_mailbox_engine() -> None:
    """Register ``checkpoint_engine.backend=ray_mailbox`` with verl in this process (idempotent).

    Refuses to replace a different engine registered under the same name.
    """
    current = seam.resolve("verl.checkpoint_engine.base.CheckpointEngineRegistry._registry").get(BACKEND)
    if current is not None and current is not RayMailboxCheckpointEngine:
        raise ValueError(f"checkpoint engine {BACKEND!r} is already registered to {current}")
    CheckpointEngineRegistry.register(BACKEND)(RayMailboxCheckpointEngine)


# Importing the module registers the engine, so verl's own hook
# (``checkpoint_engine.custom_backend_module=gepo_plugin.cpu_backend.ray_mailbox_engine``) suffices.
register_ray_mailbox_engine()
