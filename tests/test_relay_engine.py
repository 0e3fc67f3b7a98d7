"""The relay's verl checkpoint engine without a cluster: the learner's rank 0 publishes what verl's weight stream
yields, the other ranks publish nothing, and a sampler's engine follows and yields exactly the published weights."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from relay_fixtures import Learner

from gepo_plugin.names import RELAY_CHECKPOINT_ENGINE
from gepo_plugin.verl_glue.hetero.relay_engine import RelayCheckpointEngine


async def _collect(stream) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() async for name, tensor in stream}


def test_the_relay_engine_is_registered_with_verl_and_carries_exact_weights(tmp_path: Path) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get(RELAY_CHECKPOINT_ENGINE) is RelayCheckpointEngine
    relay = {"url": str(tmp_path), "run_id": "proj/exp", "poll_s": 0.01}
    learner = RelayCheckpointEngine(bucket_size=1 << 20, is_master=True, **relay)
    other_rank = RelayCheckpointEngine(bucket_size=1 << 20, is_master=False, **relay)
    sampler = RelayCheckpointEngine(bucket_size=1 << 20, **relay)
    model = Learner()
    for version in range(3):
        model.step()
        weights = model.weights()
        asyncio.run(learner.send_weights(iter(weights.items()), global_steps=version))
        assert asyncio.run(other_rank.send_weights(iter(weights.items()), global_steps=version)) == {}
        metrics = learner.flush(timeout_s=30)
        assert metrics["versions_published"] == version + 1  # named hetero/relay/... by the transport
        if version == 0:
            sampler.follow(group=0, replica=0)
        deadline = time.monotonic() + 20
        while sampler.status().staged != version:
            assert time.monotonic() < deadline, "the sampler never staged the version"
            time.sleep(0.01)
        received = asyncio.run(_collect(sampler.receive_weights(global_steps=version)))
        assert received.keys() == weights.keys()
        for name, tensor in weights.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert len(list((tmp_path / "proj" / "exp" / "manifests").iterdir())) == 3  # published once each, by rank 0
    sampler.follower.stop()
    learner.publisher.close()
