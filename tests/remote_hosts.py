"""Sampler hosts for the remote-sampler tests: ``python -m gepo_sampler`` as an ordinary process outside Ray,
started through ``examples/remote/sampler_host.sh`` as an operator would.

Each host runs from its own environment, ``.venv-host`` (``scripts/bootstrap_host.sh``: vLLM's newest CPU build and
gepo-sampler, nothing of the learner's stack; ``import ray`` fails there), in its own process group with nothing of a
Ray cluster in its environment (no ``RAY_*`` variable), exactly as an operator starts one on another machine; the
tests talk to it only through the learner's gateway (it dials out) and the store. A test helper, not shipped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

from free_ports import free_port

ROOT = Path(__file__).resolve().parents[1]
#: what a remote machine runs to start a host (an honest one)
SAMPLER_HOST_SCRIPT = ROOT / "examples" / "remote" / "sampler_host.sh"
#: the sampler host's own environment, and the script that sets it up (idempotent)
HOST_VENV, HOST_BOOTSTRAP = ROOT / ".venv-host", ROOT / "scripts" / "bootstrap_host.sh"


@functools.cache
def host_python() -> Path:
    """The host environment's interpreter, set up first where it is missing or stale (test.sh sets it up before the
    end-to-end runs; a test run on its own pays the install once)."""
    done = subprocess.run(["bash", str(HOST_BOOTSTRAP)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{HOST_BOOTSTRAP} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return HOST_VENV / "bin" / "python"


#: vLLM's CPU build, one engine per host: no thread pinning (two engines would share a core), and no KV-cache size
#: from the environment (VLLM_CPU_KVCACHE_SPACE takes whole GiB and wins over the command line): see KV_CACHE_BYTES.
CPU_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: The KV cache of a host's vLLM: 64 MB hold 64k tokens of the tiny model (1 kB a token), hundreds of its 64-token
#: requests; a 1 GiB cache made each host's engine 3.4 GB instead of 2.4 (measured), and four engines beside the
#: learner came near this machine's 24 GiB.
KV_CACHE_BYTES = 64 << 20


def start_host(
    gateway: str,
    name: str,
    token: str,
    public_key: str,
    model: str,
    relay_url: str,
    storage_options: dict,
    workdir: Path,
    max_model_len: int = 64,
    extra: list[str] = (),
    vllm_port: int | None = None,
    lie: str | None = None,
    vllm_url: str | None = None,
) -> tuple[subprocess.Popen, Path]:
    """Start a sampler host (its vLLM on ``vllm_port``, default a free one; ``vllm_url``: attached to that running
    server instead; ``lie``: a lying host of ``tests/lying_host.py``); returns the process and its log. An honest host
    is started as a remote machine starts one: ``examples/remote/sampler_host.sh``, its settings in the script's
    environment variables (the script execs the host, so the process is the host's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"host-{name}.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "VLLM_CPU_KVCACHE"))}
    env.update(CPU_ENGINE_ENV, GEPO_SAMPLER_TOKEN=token, PYTHONWARNINGS="ignore")
    if vllm_url is None:  # the vLLM server the host starts
        starts = [
            *("--port", str(vllm_port or free_port()), "--vllm-log", str(workdir / f"vllm-{name}.log")),
            "--vllm-arg=--enforce-eager",
            f"--vllm-arg=--kv-cache-memory-bytes={KV_CACHE_BYTES}",
        ]
    else:  # the one it attaches to (the script's VLLM_URL)
        assert lie is None, "an attaching host is an honest one"
        starts, env["VLLM_URL"] = [], vllm_url
    engine = [*starts, "--poll-s", "0.2", *extra]
    if lie is None:
        env.update(
            PYTHON=str(host_python()),
            GATEWAY_URL=gateway,
            SAMPLER_NAME=name,
            RELAY_PUBLIC_KEY=public_key,
            MODEL_PATH=model,
            MAX_MODEL_LEN=str(max_model_len),
            DTYPE="float32",
            RELAY_URL=relay_url,
            STORAGE_OPTIONS=json.dumps(storage_options),
        )
        command = ["bash", str(SAMPLER_HOST_SCRIPT), *engine]
    else:
        command = [
            str(host_python()),
            str(Path(__file__).with_name("lying_host.py")),
            lie,
            *("--gateway", gateway, "--name", name, "--public-key", public_key, "--model", model),
            *("--max-model-len", str(max_model_len), "--dtype", "float32", "--relay-url", relay_url),
            *("--storage-options", json.dumps(storage_options), *engine),
        ]
    process = subprocess.Popen(
        command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir
    )
    return process, log


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """Stop a host and its vLLM (its process group, and any descendant; SIGKILL if it does not end in time)."""
    descendants = children(process.pid)
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        except ProcessLookupError:
            pass
    for pid in descendants:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def children(root: int) -> list[int]:
    """Every descendant of ``root`` still alive (by /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent_of[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [root]
    while frontier:
        current = frontier.pop()
        kids = [pid for pid, parent in parent_of.items() if parent == current]
        out.extend(kids)
        frontier.extend(kids)
    return out


def wait_for(predicate, what: str, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(every_s)


@contextlib.contextmanager
def ray_with_token(variable: str, num_cpus: int):
    """A local Ray whose workers see a fresh sampler token in ``variable`` (as on the learner's node, where it is set
    before Ray starts); yields the token."""
    import ray

    token = secrets.token_urlsafe(24)
    saved = os.environ.get(variable)
    os.environ[variable] = token
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield token
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved
