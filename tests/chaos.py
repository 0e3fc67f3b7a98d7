"""Break a running CPU training run's samplers from outside, as a failing machine would (no hook in the run).

The run joins a Ray cluster the test started (``tests/ray_nodes.py``), so the test can reach the run's real rollout
server actors by name and kill one (``ray.kill``: its process is gone) or block its event loop (alive, but it
never answers again). Each action runs in a short-lived driver process, so the test process never joins Ray.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides

if TYPE_CHECKING:
    from ray_nodes import RayNodes

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


def act(cluster: RayNodes, sampler: int, action: str) -> str:
    """Kill (``kill``) or hang (``hang``) the rollout server of sampler ``sampler`` (servers in rank order, one
    replica per sampler group) while it is generating; returns the driver's output."""
    script = _DRIVER.format(action=_ACTIONS[action])
    done = subprocess.run(
        [sys.executable, "-c", script, cluster.address, str(sampler), action],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **cluster.env},
    )
    if done.returncode != 0:
        raise RuntimeError(f"chaos driver failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def hetero_overrides(
    tiny: dict[str, str],
    workdir: Path,
    steps: int,
    samplers: int,
    loss: str = "gepo",
    learners: int = 2,
    max_lag: int = 2,
    strategy: str = "wait",
) -> list[str]:
    """A HeteroRL run on separate_async with ``samplers`` one-replica sampler groups, weights synced every step."""
    return [
        *cpu_run_overrides(
            tiny, loss=loss, mode="separate_async", steps=steps, output_dir=str(workdir), learners=learners
        ),
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={samplers}",
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        f"hetero.max_lag={max_lag}",
        f"hetero.strategy={strategy}",
    ]


#: a weight delay longer than any run: a sampler group with it never receives the learner's weights
NEVER_S = 1e9


def group_delays(*seconds: float | None) -> str:
    """``hetero.group_delays`` with one entry per sampler group: a constant delay in seconds, or None for none."""
    entries = [
        "{distribution: none}" if delay is None else f"{{distribution: constant, seconds: {delay}}}"
        for delay in seconds
    ]
    return f"hetero.group_delays=[{','.join(entries)}]"


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
