"""Break a running CPU training run's samplers from outside, as a failing machine would (no hook in the run).

The run joins a Ray cluster the test starts (``ray start --head``), so the test can reach the run's real rollout
server actors by name and kill one (``ray.kill``: its process is gone) or block its event loop (alive, but it
never answers again). Each action runs in a short-lived driver process, so the test process never joins Ray.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from free_ports import free_port

from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides, read_metrics

#: What a driver runs against a server actor, once the server is mid-generation (so the failure hits requests in
#: flight, as a machine failing under load would): ``hang`` blocks its event loop for an hour (the CPU server's loop
#: is reachable through its scheduler task), so it neither answers nor dies; ``kill`` blocks it too, so the requests
#: it is working on cannot be answered in the meantime, then ends its process.
_ACTIONS = {
    "kill": "time.sleep(0.2); ray.kill(handle, no_restart=True)",
    "hang": "pass",
}

_DRIVER = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
names = sorted(
    ((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True) if "_server_" in a["name"]),
    key=lambda entry: int(entry[0].split("_server_")[1].split("_")[0]),
)
print("servers:", [n for n, _ in names])
name, namespace = names[int(sys.argv[2])]
handle = ray.get_actor(name, namespace=namespace)

def freeze_when_busy(server):
    scheduler = server._scheduler
    if not (scheduler.pending or scheduler.running):
        return False
    scheduler.task.get_loop().call_soon_threadsafe(time.sleep, 3600)
    return True

deadline = time.monotonic() + 60
while not ray.get(handle.__ray_call__.remote(freeze_when_busy)):
    if time.monotonic() > deadline:
        sys.exit(f"no request in flight on {{name}} within 60 s")
    time.sleep(0.01)
{action}
print("done", sys.argv[3], name)
"""


#: Environment of every process that joins the test's Ray cluster (set by :func:`ray_cluster`).
CLUSTER_ENV: dict[str, str] = {"RAY_USAGE_STATS_ENABLED": "0"}


def new_cluster_token() -> None:
    """Ray authenticates clients of a cluster started with ``ray start``: the run and the drivers carry its token."""
    CLUSTER_ENV.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})


@contextmanager
def ray_cluster(cpus: int, gpus: int):
    """A local Ray head with ``gpus`` logical GPUs (verl's pools ask for them); yields its address.

    Started with ``--block`` in its own session, so stopping it ends exactly this cluster's processes (``ray stop``
    would end every Ray cluster of the machine). Its temp dir is short: Ray's socket paths must fit 107 bytes."""
    address = f"127.0.0.1:{free_port()}"
    temp_dir = tempfile.mkdtemp(prefix="rg", dir="/tmp")
    new_cluster_token()
    head = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={address.split(':')[1]}",
            f"--num-cpus={cpus}",
            f"--num-gpus={gpus}",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
        ],
        env={**os.environ, **CLUSTER_ENV},
        cwd=temp_dir,  # the run's actors start here: nothing they write by default lands in the repository
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in head.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise RuntimeError("ray start failed:\n" + "".join(lines))
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def act(address: str, sampler: int, action: str) -> str:
    """Kill (``kill``) or hang (``hang``) the rollout server of sampler ``sampler`` (servers in rank order, one
    replica per sampler group) while it is generating; returns the driver's output."""
    script = _DRIVER.format(action=_ACTIONS[action])
    done = subprocess.run(
        [sys.executable, "-c", script, address, str(sampler), action],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CLUSTER_ENV},
    )
    if done.returncode != 0:
        raise RuntimeError(f"chaos driver failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def hetero_overrides(
    tiny: dict[str, str], workdir: Path, steps: int, address: str, samplers: int, loss: str = "gepo"
) -> list[str]:
    """A HeteroRL run with ``samplers`` one-replica sampler groups, joined to the Ray cluster at ``address``."""
    return [
        *cpu_run_overrides(tiny, loss=loss, mode="separate_async", steps=steps, output_dir=str(workdir)),
        "trainer.save_freq=5",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={samplers}",
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        "hetero.max_lag=2",
        "hetero.strategy=wait",
        f"++ray_kwargs.ray_init.address={address}",
        "ray_kwargs.ray_init.num_cpus=null",
        "++ray_kwargs.ray_init.num_gpus=null",
    ]


#: ``hetero.transport`` -> the overrides a run with it needs (``workdir``: the test's folder). Fleet-level end-to-end
#: tests run against every entry: a new transport gets them by adding one line.
WEIGHT_TRANSPORTS: dict[str, Callable[[Path], list[str]]] = {
    "simulated": lambda workdir: ["hetero.transport=simulated"],
    "relay": lambda workdir: ["hetero.transport=relay", f"hetero.relay.url={workdir / 'relay_store'}"],
}


def start_run(overrides: list[str], workdir: Path) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``python -m gepo_plugin.main_ppo`` in the background; returns the process, its metrics and log.

    The run's actors start from the cluster's raylet, not from this process, so verl's file logger learns its
    path through the job's runtime environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, log = workdir / "metrics.jsonl", workdir / "run.log"
    overrides = [*overrides, f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}"]
    env = {**os.environ, **CLUSTER_ENV, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONWARNINGS": "ignore"}
    handle = log.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "gepo_plugin.main_ppo", *overrides],
        cwd=workdir,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, metrics, log


def wait_until(process: subprocess.Popen, metrics: Path, done, what: str, timeout_s: float = 600) -> dict[int, dict]:
    """Block until ``done(metrics by step)`` holds (returns them), or fail if the run ended or took too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logged = read_metrics(metrics)
        if done(logged):
            return logged
        if process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def wait_for_step(process: subprocess.Popen, metrics: Path, step: int, timeout_s: float = 600) -> dict[int, dict]:
    return wait_until(process, metrics, lambda logged: step in logged, f"step {step}", timeout_s)


#: Groups and responses per step (``cpu_run_overrides``' defaults).
PROMPTS, RESPONSES = 4, 4


def failures(count: int):
    """A condition on the logged metrics: ``count`` sampler failures have been counted."""
    return lambda logged: any(m.get("hetero/sampler_failures", 0) >= count for m in logged.values())


def check_every_step(metrics: dict[int, dict], max_lag: int) -> None:
    """At every HeteroRL step the books balance (nothing lost silently), the lag bound holds, and every metric the
    run logged under the plugin's namespaces is declared in the metric table."""
    for step, m in sorted(metrics.items()):
        assert not undeclared(m), (step, undeclared(m))
        if "hetero/produced" in m:
            assert m["hetero/produced"] == m["hetero/trained"] + m["hetero/dropped"] + m["hetero/queued"], (step, m)
            assert m["hetero/lag/max"] <= max_lag, (step, m["hetero/lag/max"])


def check_gepo_hetero_step(step: int, m: dict) -> None:
    """What every step of a HeteroRL run with GEPO must show."""
    assert m["hetero/trained"] == PROMPTS * step, (step, m)  # one batch of groups per step, nothing trained twice
    assert m["actor/gepo/group_term_present"] == 1.0 and math.isfinite(m["actor/pg_loss"])
    # GEPO's weight by lag bucket: finalised shares of the step's sequences
    shares = [v for k, v in m.items() if k.startswith("actor/gepo/iw_by_lag/") and k.endswith("/fraction")]
    assert shares and abs(sum(shares) - 1.0) < 1e-6, m
    assert not any(k.startswith("actor/gepo/iw_by_lag/") and k.endswith(("/sum", "/sumsq", "/count")) for k in m)
    # every trained trajectory is attributed to the server that generated it
    per_group = {k: v for k, v in m.items() if k.endswith("/trained_trajectories")}
    assert sum(per_group.values()) == PROMPTS * RESPONSES, (step, per_group)
    assert "hetero/sampler_group_unknown/trained_trajectories" not in m
