"""The weight relay as a verl checkpoint engine (``checkpoint_engine.backend=relay``, set by ``hetero.transport``).

verl creates one checkpoint engine in every learner rank and in every rollout replica's ``CheckpointEngineWorker``
(on the sampler's node), so the relay lives where each side already is:

- learner: ``send_weights`` (verl's ``actor_wg.update_weights``) publishes the version on rank 0 through a
  :class:`~gepo_sampler.relay.publisher.RelayPublisher` (one host copy; the upload runs in the background);
  the other ranks only drive the collective weight stream;
- sampler: ``follow`` starts a :class:`~gepo_sampler.relay.follower.RelayFollower` that pulls over the
  group's link in the background; ``status`` hands the learner its receipts; ``receive_weights`` yields a staged
  version into verl's rollout weight-update path (``server_adapter.update_weights``) when the learner installs it.

There is no process group to build: ``prepare``/``build_topology``/``init_process_group``/``finalize`` do nothing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from gepo_plugin.names import RELAY_CHECKPOINT_ENGINE
from gepo_plugin.verl_glue import seam
from gepo_sampler.relay.follower import FollowerStatus, RelayFollower
from gepo_sampler.relay.link import Link
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.puller import RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.store import open_store

logger = logging.getLogger(__name__)

BACKEND = RELAY_CHECKPOINT_ENGINE


class RelayCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine protocol over the relay (see the module docstring)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **relay: Any) -> None:
        self.config = RelayConfig.model_validate(relay)
        if not self.config.url or not self.config.run_id:
            raise ValueError("the relay checkpoint engine needs hetero.relay.url and run_id (set by the launcher)")
        self.is_master = is_master
        self.publisher: RelayPublisher | None = None
        self.follower: RelayFollower | None = None

    # ---------------------------------------------------------------- nothing to build
    def prepare(self) -> dict[str, Any] | None:
        return None

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]):
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    # ---------------------------------------------------------------- learner
    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]], global_steps=None
    ) -> dict:
        """Rank 0 publishes version ``global_steps``; the other ranks drive the collective stream."""
        tensors: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # collective: rank 0 needs every rank's shard
            if self.is_master:
                tensors[name] = tensor.detach()
        if not self.is_master:
            return {}
        version = int(global_steps or 0)
        if self.publisher is None:  # the first publication of this learner: a start or a resume at `version`
            self.publisher = RelayPublisher(
                open_store(self.config),
                self.config.run_id,
                self.config,
                self.config.secret(),
                resume_from=version,
                signer=self.config.signer(),
            )
        if self.publisher.latest is not None and version <= self.publisher.latest:
            logger.info("relay: version %d is already published (a resume): not published again", version)
            return self.metrics()
        self.publisher.publish(version, tensors)
        return self.metrics()

    def hold(self, oldest_held: int | None) -> None:
        """The oldest version any live sampler holds: older versions may be deleted from the store."""
        if self.publisher is not None:
            self.publisher.hold(oldest_held)

    def request_keyframe(self, corrupt_shards: list[str] | tuple[str, ...] = ()) -> None:
        """A sampler needs a keyframe; ``corrupt_shards``: the shard addresses samplers found corrupt."""
        if self.publisher is not None:
            self.publisher.request_keyframe(corrupt_shards)

    def check(self) -> dict:
        """Raise if publishing has ended (an outage past hetero.relay.outage_s, a permanent store error); else the
        learner's counters (called while the learner waits for samplers, which a dead publisher would starve)."""
        if self.publisher is not None:
            self.publisher.check()
        return self.metrics()

    def flush(self, timeout_s: float | None = None) -> dict:
        """Wait until everything queued is published (tests, shutdown); the learner's counters."""
        if self.publisher is not None:
            self.publisher.wait(timeout_s)
        return self.metrics()

    def metrics(self) -> dict:
        return self.publisher.counters.metrics() if self.publisher is not None else {}

    # ---------------------------------------------------------------- sampler
    def follow(self, group: int, replica: int) -> None:
        """Start pulling for replica ``replica`` of sampler group ``group`` over the group's link (idempotent)."""
        if self.follower is not None:
            return
        links = self.config.links
        link = Link(links[group]) if links else None
        puller = RelayPuller(
            open_store(self.config), self.config.run_id, self.config.secret(), link, verifier=self.config.verifier()
        )
        self.follower = RelayFollower(puller, group, replica, poll_s=self.config.poll_s, outage_s=self.config.outage_s)
        self.follower.start()

    def probe(self) -> None:
        """Can this sampler read the store? (Read-only: a sampler may hold read-only credentials.)"""
        open_store(self.config).probe(write=False)

    def status(self) -> FollowerStatus:
        if self.follower is None:
            raise RuntimeError("relay: status() before follow()")
        return self.follower.status()

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The staged version ``global_steps``, tensor by tensor (verl's rollout update path installs them)."""
        if self.follower is None:
            raise RuntimeError("relay: receive_weights() before follow()")
        weights = self.follower.take(int(global_steps or 0))
        for name, tensor in weights.to_tensors().items():
            yield name, tensor


def register_relay_engine() -> None:
    """Register ``checkpoint_engine.backend=relay`` with verl in this process (idempotent)."""
    current = seam.resolve("verl.checkpoint_engine.base.CheckpointEngineRegistry._registry").get(BACKEND)
    if current is not None and current is not RelayCheckpointEngine:
        raise ValueError(f"checkpoint engine {BACKEND!r} is already registered to {current}")
    CheckpointEngineRegistry.register(BACKEND)(RelayCheckpointEngine)


# verl imports ``checkpoint_engine.custom_backend_module`` (this module) in every process that builds an engine.
register_relay_engine()
