"""One measured run: verl's real trainer (HeteroRL ``separate_async``, the relay, the tiny model on CPU) with a
synthetic fleet of remote samplers beside it, and what the learner's node paid for it.

:func:`run_fleet` writes the tiny model, starts ``python -m gepo_plugin.main_ppo`` with one in-cluster sampler group
and ``samplers`` remote samplers in ``groups`` groups (each with its own token, derived from a secret the fleet's
processes share), starts the fleet's processes (``python -m gepo_plugin.fleet_sim``) once the gateway listens,
samples the learner node's memory (the proportional set size of the launcher and every process under it: Ray's and
verl's) while the run trains, and returns the run's metrics, the fleet's statistics and a summary.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from pydantic import BaseModel, ConfigDict, Field

from gepo_plugin.fleet_sim.__main__ import SECRET_ENV
from gepo_plugin.fleet_sim.profile import FleetProfile, sampler_name, sampler_token, token_env
from gepo_plugin.tiny import cpu_run_overrides, read_metrics, write_all
from gepo_sampler import __version__ as VERSION
from gepo_sampler.relay.signing import generate_pair
from gepo_sampler.remote.protocol import PACKAGE_HEADER, PROTOCOL_HEADER, PROTOCOL_VERSION

RUN_ID = "fleet"
KEY_ENV = "GEPO_FLEET_SIGNING_KEY"


class FleetRun(BaseModel):
    """One run's size and shape (``bench/bench_fleet.py --help`` lists each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samplers: int = Field(64, ge=1, description="remote samplers")
    groups: int = Field(4, ge=1, description="sampler groups they form")
    fleet_processes: int = Field(0, ge=0, description="processes the synthetic fleet runs in (0: one per 512)")
    steps: int = Field(16, ge=2, description="training steps")
    learners: int = Field(2, ge=1, description="data-parallel training processes (trainer.n_gpus_per_node)")
    prompts_per_step: int = Field(8, ge=1, description="prompts a step (each answered 4 times)")
    max_lag: int = Field(2, ge=0, description="hetero.max_lag")
    sampler_timeout_s: float = Field(15.0, gt=0, description="hetero.gateway.sampler_timeout_s")
    timeout_s: float = Field(1800.0, gt=0, description="the longest the run may take")
    audit: float = Field(
        0.0, ge=0, le=1, description="hetero.audit.fraction (0: no audit); the samplers then sample from the model"
    )
    profile: FleetProfile = FleetProfile()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def trainer_overrides(run: FleetRun, paths: dict[str, str], workdir: Path, port: int, public: str) -> list[str]:
    entries = ",".join(
        f"{{name:{sampler_name(i)},token_env:{token_env(i)},group:g{i % run.groups}}}" for i in range(run.samplers)
    )
    return [
        *cpu_run_overrides(
            paths,
            mode="separate_async",
            steps=run.steps,
            prompts_per_step=run.prompts_per_step,
            output_dir=str(workdir),
            learners=run.learners,
        ),
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        f"hetero.max_lag={run.max_lag}",
        "hetero.strategy=wait",
        "hetero.transport=relay",
        f"hetero.relay.url={workdir / 'store'}",
        f"hetero.relay.run_id={RUN_ID}",
        "hetero.relay.poll_s=0.2",
        f"hetero.relay.signing_key_env={KEY_ENV}",
        f"hetero.relay.public_key={public}",
        f"hetero.remote_samplers=[{entries}]",
        "hetero.gateway.host=127.0.0.1",
        f"hetero.gateway.port={port}",
        f"hetero.gateway.sampler_timeout_s={run.sampler_timeout_s}",
        *(["hetero.audit.enable=true", f"hetero.audit.fraction={run.audit}"] if run.audit else []),
    ]


def sample(root: psutil.Process) -> dict[str, float]:
    """The learner node now: the memory the process tree under ``root`` holds (proportional set size: shared pages
    split) and its number of processes."""
    out = {"pss": 0.0, "processes": 0}
    for process in [root, *root.children(recursive=True)]:
        try:
            out["pss"] += process.memory_full_info().pss
            out["processes"] += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def wait_for_gateway(port: int, token: str, trainer: subprocess.Popen, timeout_s: float) -> None:
    """Until this run's gateway answers a hello with the first sampler's token (something else on the port, which
    the tests' other lane may have taken meanwhile, would not)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/samplers/{sampler_name(0)}/hello",
        headers={"Authorization": f"Bearer {token}", PROTOCOL_HEADER: str(PROTOCOL_VERSION), PACKAGE_HEADER: VERSION},
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited ({trainer.returncode}) before its gateway answered")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the run's gateway did not answer on port {port} within {timeout_s:.0f} s")


def run_fleet(run: FleetRun, workdir: str | Path, progress: Any = None, source: Path | None = None) -> dict[str, Any]:
    """Train with a synthetic fleet; returns ``{"run", "metrics", "fleet", "samples", "summary"}`` (``progress``: a
    tqdm-like object updated per step; ``source``: another checkout whose packages the trainer and its Ray workers
    import ahead of the installed ones, to measure an older revision of the learner's side beside the same fleet)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = write_all(workdir / "tiny")
    vocab = json.loads(Path(paths["model"], "config.json").read_text())["vocab_size"]
    private, public = generate_pair()
    secret, port = secrets.token_hex(16), free_port()
    metrics_path = workdir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    tokens = {token_env(i): sampler_token(secret, sampler_name(i)) for i in range(run.samplers)}
    env = {**os.environ, **tokens, KEY_ENV: private, "VERL_FILE_LOGGER_PATH": str(metrics_path)}
    env |= {"PYTHONWARNINGS": "ignore"}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(source), str(source / "sampler"), *filter(None, [env.get("PYTHONPATH")])]
        )
    overrides = trainer_overrides(run, paths, workdir, port, public)
    overrides.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}")
    log = (workdir / "trainer.log").open("w")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "gepo_plugin.main_ppo", *overrides],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    fleet: list[tuple[subprocess.Popen, Path]] = []
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    try:
        wait_for_gateway(port, tokens[token_env(0)], trainer, run.timeout_s)
        processes = run.fleet_processes or math.ceil(run.samplers / 512)
        bounds = np.linspace(0, run.samplers, processes + 1).astype(int)
        fleet_env = {**os.environ, SECRET_ENV: secret, "PYTHONWARNINGS": "ignore"}
        profile = [f"--{k.replace('_', '-')}={v}" for k, v in run.profile.model_dump().items()]
        for index, (first, end) in enumerate(itertools.pairwise(bounds)):
            stats = workdir / f"fleet_{index}.json"
            command = [
                sys.executable,
                "-m",
                "gepo_plugin.fleet_sim",
                f"--gateway=http://127.0.0.1:{port}",
                f"--first={first}",
                f"--count={end - first}",
                f"--store={workdir / 'store' / RUN_ID}",
                f"--run-id={RUN_ID}",
                f"--public-key={public}",
                f"--vocab-size={vocab}",
                f"--stats={stats}",
                *([f"--model={paths['model']}"] if run.audit else []),
                *profile,
            ]
            out = (workdir / f"fleet_{index}.log").open("w")
            fleet.append((subprocess.Popen(command, env=fleet_env, stdout=out, stderr=subprocess.STDOUT), stats))
        root, seen = psutil.Process(trainer.pid), 0
        while trainer.poll() is None:
            if time.monotonic() - started > run.timeout_s:
                raise TimeoutError(f"the run took longer than {run.timeout_s:.0f} s")
            steps = len(read_metrics(metrics_path))
            samples.append({"t": time.monotonic() - started, "steps": steps, **sample(root)})
            if progress is not None and steps > seen:
                progress.update(steps - seen)
                seen = steps
            time.sleep(2.0)
    finally:
        for process, _ in fleet:
            process.terminate()
        for process, _ in fleet:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        if trainer.poll() is None:
            os.killpg(trainer.pid, 9)
            trainer.wait()
        log.close()
    if trainer.returncode != 0:
        tail = (workdir / "trainer.log").read_text()[-4000:]
        raise RuntimeError(f"the trainer failed (exit {trainer.returncode}):\n{tail}")
    metrics = read_metrics(metrics_path)
    stats = [json.loads(path.read_text()) for _, path in fleet if path.exists()]
    if not any(record["calls"].get("hello") for record in stats):
        logs = "".join((workdir / f"fleet_{index}.log").read_text()[-2000:] for index in range(len(fleet)))
        raise RuntimeError(f"no synthetic sampler got through its hello to the gateway:\n{logs}")
    return {
        "run": run.model_dump(),
        "metrics": metrics,
        "fleet": stats,
        "samples": samples,
        "summary": summarise(run, metrics, stats, samples),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": math.nan, "p99_ms": math.nan}
    p50, p99 = np.percentile(np.asarray(values) * 1e3, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99)}


def _gateway_side(steps: list[dict]) -> dict[str, dict[str, float]]:
    """The gateway's own timing of each route (its per-step metrics): calls, the median p50, the largest p99."""
    out: dict[str, dict[str, float]] = {}
    loop = [m for m in steps if "hetero/remote/gateway/loop_busy" in m]
    if loop:  # the wait before a handler starts: the median step's, the worst step's, and why
        out["loop"] = {
            "late_p50_ms": statistics.median(m["hetero/remote/gateway/loop_late_p50_ms"] for m in loop),
            "late_p99_ms": max(m["hetero/remote/gateway/loop_late_p99_ms"] for m in loop),
            "busy": statistics.median(m["hetero/remote/gateway/loop_busy"] for m in loop),
        }
        key = "hetero/remote/gateway/loop_busy_when_late"
        if late := [m[key] for m in loop if key in m]:
            out["loop"]["busy_when_late"] = statistics.median(late)
    for route in ("hello", "status", "results"):
        prefix = f"hetero/remote/gateway/{route}/"
        rows = [m for m in steps if prefix + "calls" in m]
        if rows:
            out[route] = {
                "calls": sum(m[prefix + "calls"] for m in rows),
                "p50_ms": statistics.median(m[prefix + "p50_ms"] for m in rows),
                "p99_ms": max(m[prefix + "p99_ms"] for m in rows),
            }
    return out


def summarise(run: FleetRun, metrics: dict[int, dict], stats: list[dict], samples: list) -> dict[str, Any]:
    """The growth table's row: memory, step time, the fleet's bookkeeping, the gateway, the store, the ledger."""
    steps = [m for _, m in sorted(metrics.items()) if "timing_s/step" in m]
    measured = steps[2:] or steps  # the first steps compile and wait for the fleet to join
    last = steps[-1] if steps else {}
    latencies: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    counters: dict[str, float] = {}
    arrivals: dict[int, tuple[float, list[float]]] = {}
    for record in stats:
        for kind, values in record["latencies"].items():
            latencies.setdefault(kind, []).extend(values)
        for kind, n in record["calls"].items():
            calls[kind] = calls.get(kind, 0) + n
        for key, value in record["counters"].items():
            counters[key] = counters.get(key, 0) + value
        for version, (published, times) in record["arrivals"].items():
            arrivals.setdefault(int(version), (published, []))[1].extend(times)
    live = run.samplers - counters.get("vanished", 0)
    versions = sorted(v for v, (_, times) in arrivals.items() if v > 0 and len(times) >= live)
    spread = [max(arrivals[v][1]) - arrivals[v][0] for v in versions]
    fetched = len([v for v in arrivals if v > 0]) or 1
    seconds = max((s["t"] for s in samples), default=0.0)
    steady = [s["pss"] for s in samples if s["t"] >= seconds / 2] or [0.0]
    return {
        "samplers": run.samplers,
        "steps": len(steps),
        "memory_gib": max(s["pss"] for s in samples) / 2**30 if samples else math.nan,
        "memory_steady_gib": statistics.median(steady) / 2**30,
        "processes": max((s["processes"] for s in samples), default=0),
        "gateway_side": _gateway_side(measured),
        "step_s": statistics.median(m["timing_s/step"] for m in measured) if measured else math.nan,
        "fleet_s": statistics.median(m.get("hetero/fleet_s", math.nan) for m in measured) if measured else math.nan,
        "gateway": {kind: {"calls": calls.get(kind, 0), **_percentiles(values)} for kind, values in latencies.items()},
        "gateway_calls_per_s": sum(calls.values()) / seconds if seconds else math.nan,
        "fleet_cores": sum(record.get("cores", 0.0) for record in stats),
        "store_reads_per_version_per_sampler": counters.get("store_reads", 0) / fetched / run.samplers,
        "store_lists_per_version_per_sampler": counters.get("store_lists", 0) / fetched / run.samplers,
        "publish_to_all_s": {"median": statistics.median(spread), "max": max(spread)} if spread else None,
        "results": counters.get("results", 0),
        "vanished": counters.get("vanished", 0),
        "ledger": {k: last.get(f"hetero/{k}", math.nan) for k in ("produced", "trained", "dropped", "queued")},
        "lag_max": max((m.get("hetero/lag/max", 0.0) for m in steps), default=math.nan),
        "quarantined": sorted(
            k.split("/")[2]
            for k, v in last.items()
            if k.startswith("hetero/remote/") and k.endswith("/quarantined") and v
        ),
        "audits": sum(v for k, v in last.items() if k.startswith("hetero/remote/") and k.endswith("/audits")),
        "audit_seconds": last.get("hetero/remote/audit_seconds", 0.0),
        "remote_trained": sum(
            v
            for k, v in last.items()
            if k.startswith("hetero/sampler_group_")
            and k.endswith("/trained_trajectories")
            and not k.startswith("hetero/sampler_group_0/")
        ),
    }
