"""What the end-to-end runs with verl's vLLM rollout share: their overrides, the float32 agreement they check, and the
vLLM processes and /dev/shm they watch. A test helper, not shipped."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest
import torch

from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides

#: Where the rollout's and the learner's float32 log-probs may differ (``tests/test_vllm_e2e.py`` derives it).
FP32_GAP = 1e-4
GAP = "rollout/fresh_logprob_gap/"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_gpus(count: int):
    """On a GPU host, the run needs ``count`` GPUs (one per learner and sampler); on a CPU nothing."""
    short = DEVICE == "cuda" and torch.cuda.device_count() < count
    return pytest.mark.skipif(short, reason=f"needs {count} GPUs")


def vllm_overrides(tiny: dict[str, str], workdir: Path, mode: str, steps: int, **kw) -> list[str]:
    """One learner; the rollout and the learner in float32 (the CPU backend's rollout default; said here for a GPU)."""
    return [
        *cpu_run_overrides(tiny, mode=mode, steps=steps, output_dir=str(workdir), learners=1, **kw),
        f"trainer.device={DEVICE}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        # decoupled mode: the learner recomputes log-probs, so the rollout's can be checked against them
        "algorithm.rollout_correction.bypass_mode=false",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    ]


def vllm_hetero_overrides(tiny: dict[str, str], workdir: Path, steps: int, max_lag: int, **kw) -> list[str]:
    """HeteroRL on separate_async with two one-replica vLLM sampler groups (weights synced every step)."""
    return [
        *vllm_overrides(tiny, workdir, "separate_async", steps=steps, save_freq=steps, **kw),
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        f"hetero.max_lag={max_lag}",
        "hetero.strategy=wait",
    ]


#: the sync vLLM run: 3 prompts of 4 answers a step, trained in mini-batches of 2 prompts (verl pads 12 rows to 16)
SYNC_PROMPTS, SYNC_MINI_BATCH_PROMPTS = 3, 2
#: the HeteroRL vLLM run's bound, and its answers' length: long (the random model rarely stops early), so generation
#: is still under way when a version is installed and vLLM aborts the requests in flight for verl to resume them
HETERO_MAX_LAG, HETERO_RESPONSE_LENGTH = 2, 96


def vllm_sync_learning_overrides(tiny: dict[str, str], workdir: Path, steps: int) -> list[str]:
    """Sync GEPO with vLLM from the random model, checkpoint at the last step, on batches verl pads, beside verl's
    decoupled sequence-level truncated IS: what ``tests/test_vllm_e2e.py`` runs and the learning bench measured."""
    return [
        *vllm_overrides(tiny, workdir, "sync", steps=steps, save_freq=steps, prompts_per_step=SYNC_PROMPTS),
        f"actor_rollout_ref.actor.ppo_mini_batch_size={SYNC_MINI_BATCH_PROMPTS}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "algorithm.rollout_correction.rollout_is=sequence",
    ]


def vllm_hetero_learning_overrides(tiny: dict[str, str], workdir: Path, steps: int) -> list[str]:
    """HeteroRL with two vLLM samplers fed by the relay (a directory store), verl's own gspo loss, long answers: what
    ``tests/test_vllm_e2e.py`` runs and the learning bench measured."""
    return [
        *vllm_hetero_overrides(tiny, workdir, steps, HETERO_MAX_LAG, loss="gspo"),
        f"data.max_response_length={HETERO_RESPONSE_LENGTH}",
        "hetero.transport=relay",
        f"hetero.relay.url={workdir / 'relay_store'}",
        "hetero.relay.poll_s=0.2",
    ]


def check_agreement(metrics: dict[int, dict], steps: list[int]) -> None:
    """At each of ``steps`` the rollout's log-probs of the learner's own version agree with the learner's."""
    for step in steps:
        m = metrics[step]
        assert m[f"{GAP}tokens"] > 0, (step, m)
        assert m[f"{GAP}max"] < FP32_GAP, (step, m[f"{GAP}max"])
        assert not undeclared(m), undeclared(m)


def abandoned_bucket() -> str:
    """A weight bucket named the way verl names one, that no process holds (its creator was killed)."""
    bucket = shared_memory.SharedMemory(name=f"verl_weights_{os.urandom(16).hex()}", create=True, size=1 << 16)
    resource_tracker.unregister(bucket._name, "shared_memory")  # as if killed: nothing unlinks it
    bucket.close()
    return bucket.name


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def vllm_processes(title: bytes) -> list[int]:
    """PIDs of the vLLM processes whose title starts with ``title`` (``VLLM::EngineCore``, ``VLLM::Worker``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(title):
                    pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _ticks(pids: list[int]) -> int:
    """CPU time (utime + stime, in ticks of 10 ms) of ``pids``, together."""
    total = 0
    for pid in pids:
        try:
            total += sum(map(int, _stat(pid)[11:13]))
        except OSError:
            continue
    return total


def kill_engine_while_generating(timeout_s: float = 180) -> int:
    """SIGKILL an engine-core process while it generates (its CPU time, with its worker's, grows); returns the PID.

    On a CPU vLLM's engine core schedules and its worker process (a child) runs the model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = vllm_processes(b"VLLM::Worker")
        for engine in vllm_processes(b"VLLM::EngineCore"):
            try:
                busy = [engine] + [w for w in workers if int(_stat(w)[1]) == engine]
            except OSError:
                continue
            before = _ticks(busy)
            time.sleep(0.05)
            if _ticks(busy) - before >= 2:
                os.kill(engine, signal.SIGKILL)
                return engine
        time.sleep(0.01)
    raise AssertionError("no vLLM engine generating to kill")


def safetensors_in(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}
