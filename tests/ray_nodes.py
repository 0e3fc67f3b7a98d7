"""Several Ray nodes on one machine, started with the examples' own scripts (examples/ray/start_head.sh and
start_worker.sh, CPU mode: ``NUM_GPUS`` logical GPUs), each in its own session so one node can be killed whole.

Each node gets its own agent and metrics ports (two raylets on one host would otherwise collide on the defaults).
The run and the test's drivers join with :data:`chaos.CLUSTER_ENV` (the cluster's auth token).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from chaos import CLUSTER_ENV, _free_port, new_cluster_token

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    gpus: int
    ip: str

    def kill(self) -> None:
        """The whole node at once (its raylet and every worker process it started), as a machine failing."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def _agent_ports() -> str:
    return (
        f"--dashboard-agent-listen-port={_free_port()} --dashboard-agent-grpc-port={_free_port()} "
        f"--runtime-env-agent-port={_free_port()} --metrics-export-port={_free_port()}"
    )


def _start(script: str, env: dict[str, str], name: str, gpus: int, temp_dir: str) -> Node:
    process = subprocess.Popen(
        ["bash", str(ROOT / "examples" / "ray" / script)],
        env=env,
        cwd=temp_dir,  # the run's actors start here: nothing they write by default lands in the repository
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "Ray runtime started" in line:
            return Node(name, process, gpus, env["NODE_IP"])
    raise RuntimeError(f"{script} failed:\n" + "".join(lines))


class RayNodes:
    """A running cluster of :class:`Node` s: its address, its nodes by name, and a way to add a worker node."""

    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.address = f"{HEAD_IP}:{_free_port()}"
        self.nodes: dict[str, Node] = {}
        self.base = {
            **os.environ,
            **CLUSTER_ENV,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "NODE_IP": HEAD_IP,
            "RAY_BLOCK": "1",
            # Ray's hybrid scheduling places an actor on its creator's node until that node is this full: the run's
            # own actors (created on the head) stay on the head, as a deployment's learner-side services would
            "RAY_scheduler_spread_threshold": "1.0",
        }

    def start_head(self, gpus: int, cpus: int) -> None:
        env = {
            **self.base,
            "NUM_GPUS": str(gpus),
            "RAY_NUM_CPUS": str(cpus),
            "RAY_PORT": self.address.split(":")[1],
            "DASHBOARD_PORT": str(_free_port()),
            "RAY_CLIENT_PORT": str(_free_port()),
            # the learner's node offers LEARNER_RESOURCE: TransferQueue's storage goes only there
            "RAY_EXTRA_ARGS": f"--temp-dir={self.temp_dir} --include-dashboard=false {_agent_ports()} "
            f'--resources={{"{LEARNER_RESOURCE}":1}}',
        }
        self.nodes["head"] = _start("start_head.sh", env, "head", gpus, self.temp_dir)

    def add_worker(self, gpus: int, cpus: int) -> Node:
        index = len(self.nodes) - 1
        name = f"worker{index}"
        env = {
            **self.base,
            "NODE_IP": f"127.0.0.{2 + index}",
            "NUM_GPUS": str(gpus),
            "RAY_NUM_CPUS": str(cpus),
            "RAY_HEAD_ADDRESS": self.address,
            "RAY_EXTRA_ARGS": _agent_ports(),
        }
        self.nodes[name] = _start("start_worker.sh", env, name, gpus, self.temp_dir)
        _wait_for_nodes(self.address, sum(node.process.poll() is None for node in self.nodes.values()))
        return self.nodes[name]

    def stop(self) -> None:
        for node in reversed(list(self.nodes.values())):
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGTERM)
                try:
                    node.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(node.process.pid, signal.SIGKILL)


#: A custom resource only the head (the learner's node) has: ``transfer_queue.backend.SimpleStorage.
#: required_node_resource`` keeps the rollouts' storage there, so losing a sampler node loses no stored rollout.
LEARNER_RESOURCE = "gepo_learner"
#: The head's address; worker nodes take 127.0.0.2, 127.0.0.3, ... (all this machine): a driver that joins with
#: ``ray_init._node_ip_address=HEAD_IP`` attaches to the head (with several nodes on one address Ray picks any), so
#: the run's TaskRunner starts on the learner's node.
HEAD_IP = "127.0.0.1"
#: Logical CPUs of a sampler node: exactly one verl rollout bundle ({"CPU": 3, "GPU": 1}, verl's default
#: max_colocate_count), so that nothing but the sampler is placed there.
SAMPLER_NODE_CPUS = 3


@contextmanager
def ray_nodes(head_gpus: int, worker_gpus: list[int], head_cpus: int = 64) -> Iterator[RayNodes]:
    """A head with ``head_gpus`` logical GPUs and one worker node per entry of ``worker_gpus`` (``worker0``, ...).

    Ray places an actor on its creator's node until that node is full (``RAY_scheduler_spread_threshold=1``), and
    the head has many logical CPUs: the run's own actors (TaskRunner, TransferQueue, reward and agent loops) stay on
    the head, and a worker node holds exactly one sampler bundle, as a deployment whose sampler nodes only sample."""
    temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    new_cluster_token()
    cluster = RayNodes(temp_dir)
    try:
        cluster.start_head(head_gpus, head_cpus)
        for gpus in worker_gpus:
            cluster.add_worker(gpus, SAMPLER_NODE_CPUS * gpus)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


_ACTORS = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR")
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
alive = [a for a in state.state.actor_table(None).values() if a["State"] == "ALIVE"]
print(json.dumps([[a["ActorClassName"], ips.get(a["Address"]["NodeID"], "?")] for a in alive]))
"""


def actors_by_ip(address: str) -> dict[str, list[str]]:
    """The class names of the live actors on each node, by node address (from Ray's GCS, in a driver process)."""
    import json

    done = subprocess.run(
        [sys.executable, "-c", _ACTORS, address], capture_output=True, text=True, env={**os.environ, **CLUSTER_ENV}
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    out: dict[str, list[str]] = {}
    for name, ip in json.loads(done.stdout.strip().splitlines()[-1]):
        out.setdefault(ip, []).append(name)
    return out


def _wait_for_nodes(address: str, count: int, timeout_s: float = 60) -> None:
    script = (
        "import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-c", script, address], capture_output=True, text=True, env={**os.environ, **CLUSTER_ENV}
        )
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1] == str(count):
            return
        time.sleep(1)
    raise RuntimeError(f"the Ray cluster at {address} did not reach {count} nodes")
