"""The transformers rollout backend and the Ray-mailbox checkpoint engine, against real verl and a real Ray.

One small Ray cluster (4 logical CPUs, 1 fake GPU) per module: a STANDALONE ``HFReplica`` built by
verl's own ``init_standalone`` (resource pool, ``CheckpointEngineWorker`` with our adapter, our
server), and a two-rank stand-in for the trainer (a verl ``Worker`` group holding another model).
Expected values come from plain transformers in the test process: greedy ``generate`` and a
forward pass over the returned tokens.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402

from gepo_plugin.cpu_backend.ray_mailbox_engine import RayMailboxCheckpointEngine, lookup_mailbox  # noqa: E402
from gepo_plugin.cpu_backend.rollout.replica import HFReplica  # noqa: E402
from gepo_plugin.cpu_backend.rollout.sampling import (  # noqa: E402
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
)
from gepo_plugin.tiny import write_tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8]
RESPONSE_LENGTH = 24


class _Trainer(Worker):
    """Stand-in for verl's actor worker: a model and a checkpoint engine, with the methods verl calls."""

    def __init__(self, model_path: str, bucket_size: int = 1 << 20) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.checkpoint_engine = RayMailboxCheckpointEngine(bucket_size=bucket_size, is_master=self.rank == 0)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(iter(self.model.state_dict().items()), global_steps)

    def use_engine(self, bucket_size: int, is_master: bool) -> None:
        self.checkpoint_engine = RayMailboxCheckpointEngine(bucket_size=bucket_size, is_master=is_master)

    async def send(self, tensors: dict) -> None:
        await self.checkpoint_engine.send_weights(iter(tensors.items()), global_steps=3)

    async def receive(self) -> list:
        return [(name, tensor.clone()) async for name, tensor in self.checkpoint_engine.receive_weights()]


def _write_model(path: Path, seed: int) -> Path:
    """The tiny random model, with an output layer of its own, that ends ``PROMPT`` with EOS.

    Tied random embeddings make greedy decoding repeat the last token, which would let a broken
    sampler pass; an independent random ``lm_head`` gives varied continuations. Its EOS row is then
    pointed at the hidden state after ``PROMPT``, so greedy decoding of ``PROMPT`` emits EOS first.
    """
    from transformers import AutoModelForCausalLM

    write_tiny_model(path, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    generator = torch.Generator().manual_seed(100 + seed)
    weight = torch.randn(model.lm_head.weight.shape, generator=generator)
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
        margin = (weight @ hidden).max() + 5.0
        weight[model.generation_config.eos_token_id] = hidden * margin / hidden.norm() ** 2
    model.lm_head.weight = torch.nn.Parameter(weight)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"old": _write_model(root / "old", seed=0), "new": _write_model(root / "new", seed=1)}


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path]):
    # classes defined here must reach the workers by value (this module is not importable there)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=1,  # fake: verl's standalone pool asks for a GPU resource; nothing uses CUDA
        include_dashboard=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def replica(cluster, trainer, models: dict[str, Path]) -> HFReplica:
    # (after ``trainer``: its actors start up while this replica is being built; 2 cores go further)
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    config = RolloutConfig(
        name="hf",
        nnodes=1,
        n_gpus_per_node=1,
        tensor_model_parallel_size=1,
        prompt_length=16,
        response_length=RESPONSE_LENGTH,
        checkpoint_engine=CheckpointEngineConfig(
            backend="ray_mailbox",
            update_weights_bucket_megabytes=1,
            custom_backend_module="gepo_plugin.cpu_backend.rollout.registration",
        ),
    )
    replica = HFReplica(
        replica_rank=0, config=config, model_config=HFModelConfig(path=str(models["old"])), gpus_per_node=1
    )
    asyncio.run(replica.init_standalone())
    return replica


@pytest.fixture(scope="module")
def trainer(cluster, models: dict[str, Path]):
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(_Trainer), model_path=str(models["new"])),
        use_gpu=False,
        device_name="cpu",
    )


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _generate(replica: HFReplica, prompt: list[int], request_id: str = "r", **params):
    return ray.get(
        replica.server_handle.generate.remote(prompt_ids=prompt, sampling_params=params, request_id=request_id)
    )


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    prompt_ids = torch.tensor([prompt])
    out = model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(prompt) :].tolist()


def _wait_until_running(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.get(server.get_status.remote())["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)


@torch.no_grad()
def _step_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits that predicted each generated token (one forward pass over prompt + response)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def test_sampling_masks_match_their_definitions():
    """top-k, top-p (nucleus), min-p and repetition penalty, row by row, against direct definitions (no Ray)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    top_k, top_p = torch.tensor([50, 5, 50, 3]), torch.tensor([1.0, 1.0, 0.8, 0.5])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(4):
        order = logits[row].argsort(descending=True)
        probs = logits[row, order].softmax(-1)
        if top_k[row] < 50:
            probs = torch.where(torch.arange(50) < top_k[row], probs, 0.0)
            probs = probs / probs.sum()
        mass_above = probs.cumsum(0) - probs  # nucleus: keep a token while the tokens above it hold < p
        keep = (torch.arange(50) < top_k[row]) & (mass_above < top_p[row])
        assert torch.equal(torch.isfinite(masked[row, order]), keep), row
        assert torch.equal(masked[row, order][keep], logits[row, order][keep])
    assert torch.equal(apply_top_k_top_p(logits, None, None), logits)

    min_p = apply_min_p(logits, torch.tensor([0.0, 0.1, 0.5, 1.0]))
    probs = logits.softmax(-1)
    for row, threshold in enumerate([0.0, 0.1, 0.5, 1.0]):
        expected = probs[row] >= threshold * probs[row].max()
        assert torch.equal(torch.isfinite(min_p[row]), expected)

    seen = torch.zeros(4, 50, dtype=torch.bool)
    seen[:, :10] = True
    penalized = apply_repetition_penalty(logits, seen, torch.tensor([1.0, 2.0, 2.0, 0.5]))
    assert torch.equal(penalized[0], logits[0]) and torch.equal(penalized[:, 10:], logits[:, 10:])
    old = logits[1, :10]
    assert torch.allclose(penalized[1, :10], torch.where(old > 0, old / 2, old * 2))


@pytest.mark.ray
def test_greedy_matches_transformers_and_log_probs_match_a_forward_pass(replica, models):
    model = _hf_model(models["old"])
    eos = model.generation_config.eos_token_id
    for prompt in (PROMPT, [12, 13, 14], [9, 10]):
        out = _generate(replica, prompt, temperature=0.0, max_tokens=12, logprobs=True)
        assert out.stop_reason == "completed" and out.extra_fields["global_steps"] is None
        assert len(out.log_probs) == len(out.token_ids) and all(0 <= t < model.config.vocab_size for t in out.token_ids)
        assert out.token_ids == _hf_greedy(model, prompt, 12)  # transformers stops at EOS too
        logits = _step_logits(model, prompt, out.token_ids)
        expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
    # generation stops at EOS (included), unless told to ignore it; and at any requested stop token
    assert _generate(replica, PROMPT, temperature=0.0, max_tokens=12).token_ids == [eos]
    full = _generate(replica, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True).token_ids
    assert len(full) == 12 and full[0] == eos
    stop = full[3]
    stopped = _generate(replica, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    assert stopped.token_ids == full[: full.index(stop) + 1] and stopped.stop_reason == "completed"
    # deterministic, and unchanged when it shares a batch with other (sampled, longer) requests
    reference = _generate(replica, [9, 10], temperature=0.0, max_tokens=12, logprobs=True)
    batch = ray.get(
        [
            replica.server_handle.generate.remote(
                prompt_ids=[9, 10] if i == 0 else [9 + i] * (i + 1),
                sampling_params={"temperature": 0.0 if i == 0 else 1.0, "max_tokens": 12 + i, "logprobs": True},
                request_id=f"b{i}",
            )
            for i in range(6)
        ]
    )
    assert ray.get(replica.server_handle.get_status.remote())["largest_batch"] >= 2  # really shared a batch
    assert batch[0].token_ids == reference.token_ids
    assert torch.allclose(torch.tensor(batch[0].log_probs), torch.tensor(reference.log_probs), atol=1e-5)
    # no logprobs requested: none returned (what vLLM does, so verl adds no rollout_log_probs)
    assert _generate(replica, PROMPT, temperature=0.0, max_tokens=3).log_probs is None


@pytest.mark.ray
def test_sampling_honours_temperature_top_k_and_max_tokens(replica, models):
    model = _hf_model(models["old"])
    prompt = [12, 13, 14]
    # ignore_eos: exactly max_tokens tokens; log-probs under the temperature-scaled distribution
    out = _generate(
        replica, prompt, temperature=0.7, top_k=-1, top_p=1.0, max_tokens=20, ignore_eos=True, logprobs=True
    )
    assert len(out.token_ids) == 20 == len(out.log_probs) and out.stop_reason == "completed"
    scaled = _step_logits(model, prompt, out.token_ids) / 0.7
    expected = scaled.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
    # the default budget is the configured response length
    assert len(_generate(replica, prompt, temperature=1.0, ignore_eos=True).token_ids) == RESPONSE_LENGTH
    # top-k: every token among the 3 most likely; log-prob renormalised over them (vLLM's processed_logprobs)
    out = _generate(replica, prompt, temperature=1.0, top_k=3, max_tokens=20, ignore_eos=True, logprobs=True, seed=1)
    logits = _step_logits(model, prompt, out.token_ids)
    top3 = logits.topk(3, dim=-1)
    assert all(t in row for t, row in zip(out.token_ids, top3.indices.tolist(), strict=True))
    masked = torch.full_like(logits, float("-inf")).scatter(1, top3.indices, top3.values)
    expected = masked.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
    # a per-request seed reproduces the sample
    again = _generate(replica, prompt, temperature=1.0, top_k=3, max_tokens=20, ignore_eos=True, logprobs=True, seed=1)
    assert again.token_ids == out.token_ids
    with pytest.raises(ray.exceptions.RayTaskError, match="presence_penalty"):
        _generate(replica, prompt, presence_penalty=0.5)


@pytest.mark.ray
def test_abort_returns_partial_output_and_the_gate_parks_or_rejects(replica):
    server = replica.server_handle
    full = _generate(replica, PROMPT, temperature=0.0, max_tokens=400, ignore_eos=True)
    assert len(full.token_ids) == 400

    pending = server.generate.remote(
        prompt_ids=PROMPT, sampling_params={"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}, request_id="a"
    )
    _wait_until_running(server)
    result = asyncio.run(replica.abort_all_requests())
    out = ray.get(pending)
    assert result["aborted_count"] == 1 and result["request_ids"] == ["a"]
    assert out.stop_reason == "aborted" and len(out.token_ids) < 400
    assert out.token_ids == full.token_ids[: len(out.token_ids)]  # partial output is real generation

    parked = server.generate.remote(prompt_ids=PROMPT, sampling_params={"max_tokens": 2}, request_id="p")
    ready, _ = ray.wait([parked], timeout=0.3)
    assert not ready  # the gate is closed: the request waits for resume_generation
    asyncio.run(replica.resume_generation())
    assert ray.get(parked).stop_reason == "completed"

    asyncio.run(replica.abort_all_requests(reject_request=True))
    rejected = _generate(replica, PROMPT, max_tokens=2)
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    asyncio.run(replica.resume_generation())

    one = server.generate.remote(
        prompt_ids=PROMPT, sampling_params={"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}, request_id="one"
    )
    _wait_until_running(server)
    assert asyncio.run(replica.abort_request("one"))["aborted"]
    assert ray.get(one).stop_reason == "aborted"
    assert not asyncio.run(replica.abort_request("missing"))["aborted"]


@pytest.mark.ray
def test_mailbox_round_trips_tensors_bit_exactly(trainer):
    sender, receiver = trainer.workers
    bucket_size = 4096
    ray.get([sender.use_engine.remote(bucket_size, True), receiver.use_engine.remote(bucket_size, False)])
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(3000, generator=generator),  # 12 kB: split over buckets
        "bf16": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "odd_bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=generator),  # misaligns what follows
        "transposed": torch.randn(6, 4, generator=generator).t(),
        "ints": torch.randint(-(2**40), 2**40, (9,), generator=generator),
        "mask": torch.rand(11, generator=generator) > 0.5,
        "scalar": torch.tensor(3.5),
    }
    metadata = ray.get(
        [sender.execute_checkpoint_engine.remote("prepare"), receiver.execute_checkpoint_engine.remote("prepare")]
    )
    send_kwargs, receive_kwargs = RayMailboxCheckpointEngine.build_topology(1, 1, metadata)
    ray.get(
        [
            sender.execute_checkpoint_engine.remote("init_process_group", **{k: v[0] for k, v in send_kwargs.items()}),
            receiver.execute_checkpoint_engine.remote(
                "init_process_group", **{k: v[0] for k, v in receive_kwargs.items()}
            ),
        ]
    )
    _, received = ray.get([sender.send.remote(tensors), receiver.receive.remote()])
    ray.get(
        [sender.execute_checkpoint_engine.remote("finalize"), receiver.execute_checkpoint_engine.remote("finalize")]
    )

    assert [name for name, _ in received] == list(tensors)
    for name, tensor in received:
        sent = tensors[name].contiguous()
        assert tensor.dtype == sent.dtype and tensor.shape == sent.shape, name
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), name
    mailbox = lookup_mailbox(metadata[0]["mailbox"], metadata[0]["namespace"])
    assert ray.get(mailbox.pending.remote()) == 0  # every bucket was taken and forgotten


@pytest.mark.ray
def test_update_weights_through_verl_checkpoint_manager_changes_outputs(replica, trainer, models):
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    ray.get([w.use_engine.remote(1 << 20, i == 0) for i, w in enumerate(trainer.workers)])
    prompt = [9, 10]
    old, new = _hf_model(models["old"]), _hf_model(models["new"])
    expected_old, expected_new = _hf_greedy(old, prompt, 12), _hf_greedy(new, prompt, 12)
    assert expected_old != expected_new
    assert _generate(replica, prompt, temperature=0.0, max_tokens=12).token_ids == expected_old

    manager = CheckpointEngineManager(
        config=CheckpointEngineConfig(backend="ray_mailbox", update_weights_bucket_megabytes=1),
        actor_wg=trainer,
        replicas=[replica],
    )
    manager.update_weights(global_steps=7)  # abort, sync (trainer rank 0 sends, rank 1 drains), resume

    out = _generate(replica, prompt, temperature=0.0, max_tokens=12, logprobs=True)
    assert out.token_ids == expected_new
    assert out.extra_fields["global_steps"] == 7
    logits = _step_logits(new, prompt, out.token_ids)
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)


def test_deterministic_seeds_tell_identical_requests_apart_and_repeat():
    """Under full_determinism verl's V1 path names every request ``det-0``: one prompt's n responses differ only by
    their occurrence, which must give them different seeds, and the same occurrence the same seed in every run."""
    from gepo_plugin.cpu_backend.rollout.server import deterministic_seed

    group = [deterministic_seed(7, "det-0", PROMPT, occurrence) for occurrence in range(8)]
    assert len(set(group)) == 8
    assert group == [deterministic_seed(7, "det-0", PROMPT, occurrence) for occurrence in range(8)]
    assert deterministic_seed(7, "det-0", [*PROMPT, 9], 0) != group[0]  # another prompt
    assert deterministic_seed(8, "det-0", PROMPT, 0) != group[0]  # another rollout seed
    assert all(0 <= seed < 2**63 for seed in group)
