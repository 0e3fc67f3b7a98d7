"""Several Ray nodes on one machine, started with the examples' own scripts (examples/ray/start_head.sh and
start_worker.sh, CPU mode: ``NUM_GPUS`` logical GPUs), each in its own session so one node can be killed whole.

Each node gets its own agent and metrics ports (two raylets on one host would otherwise collide on the defaults).
Ray authenticates the clients of a cluster started with ``ray start``: the run and the test's drivers join with the
cluster's own environment (:attr:`RayNodes.env`, its token). A one-node cluster is also what the end-to-end runs that
need no node of their own share for the whole test session (``conftest.py``'s ``shared_cluster``): each run joins it
instead of starting and stopping a Ray of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from free_ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    gpus: int
    ip: str
    node_id: str = ""  # Ray's id of the node, set once it joined

    def kill(self) -> None:
        """The whole node at once (its raylet and every process it started, wherever their process group), as a
        machine failing."""
        import psutil

        root = psutil.Process(self.process.pid)
        doomed = [root, *root.children(recursive=True)]
        for process in doomed:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(doomed, timeout=30)
        self.process.wait(timeout=30)


def _agent_ports() -> str:
    return (
        f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()} "
        f"--runtime-env-agent-port={free_port()} --metrics-export-port={free_port()}"
    )


def _launch(script: str, env: dict[str, str], temp_dir: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(ROOT / "examples" / "ray" / script)],
        env=env,
        cwd=temp_dir,  # the run's actors start here: nothing they write by default lands in the repository
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _started(process: subprocess.Popen, script: str) -> str | None:
    """Wait until ``ray start`` (kept in the foreground) says the node runs: None, or what it printed instead."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "Ray runtime started" in line:
            return None
    return f"{script} failed:\n" + "".join(lines)


def _start_node(
    script: str,
    env_of_attempt: Callable[[int], dict[str, str]],
    temp_dir: str,
    failed_addresses: set[str] | None = None,
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start a node with ``script``, again (with ``env_of_attempt(attempt)``: new ports, a new address) when ``ray
    start`` timed out: the node that failed is killed whole first (its process group: the raylet and the agents ``ray
    start`` left behind) and its address added to ``failed_addresses`` where given. Its environment is returned with
    it."""
    failures = []
    for attempt in range(START_ATTEMPTS):
        env = env_of_attempt(attempt)
        process = _launch(script, env, temp_dir)
        failure = _started(process, script)
        if failure is None:
            return process, env
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        if failed_addresses is not None:
            failed_addresses.add(env["NODE_IP"])
        failures.append(failure)
        if "timed out during startup" not in failure:
            break  # a mistake, not a slow machine: starting again would only hide it
    raise RuntimeError("\n".join(failures))


def cluster_token_env() -> dict[str, str]:
    """The environment of every process that joins a cluster started with ``ray start``: a new token of its own."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


class RayNodes:
    """A running cluster of :class:`Node` s: its address, its nodes by name, the environment a client joins it with,
    and a way to add a worker node."""

    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.address = f"{HEAD_IP}:{free_port()}"
        self.nodes: dict[str, Node] = {}
        self._workers_started = 0  # worker0, worker1, ...
        self._addresses_used = 0  # each start of a worker node gets its own address, 127.0.0.2, 127.0.0.3, ...
        self.failed_addresses: set[str] = set()  # those of starts that failed (the node killed)
        #: what a run or a driver joining this cluster adds to its environment (the cluster's token)
        self.env = cluster_token_env()
        self.base = {
            **os.environ,
            **self.env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "NODE_IP": HEAD_IP,
            "RAY_BLOCK": "1",
        }

    def start_head(self, gpus: int, cpus: int) -> None:
        def env_of_attempt(attempt: int) -> dict[str, str]:
            if attempt:  # a new port: the GCS that failed may hold the old one a while
                self.address = f"{HEAD_IP}:{free_port()}"
            return {
                **self.base,
                "NUM_GPUS": str(gpus),
                "RAY_NUM_CPUS": str(cpus),
                "RAY_PORT": self.address.split(":")[1],
                "DASHBOARD_PORT": str(free_port()),
                "RAY_CLIENT_PORT": str(free_port()),
                # start_head.sh's default role (learner) offers LEARNER_RESOURCE: HeteroRL keeps verl's services there
                "RAY_EXTRA_ARGS": f"--temp-dir={self.temp_dir} --include-dashboard=false {_agent_ports()}",
            }

        # a failed head's address is not recorded: its GCS, and the cluster with it, died with it
        process, _ = _start_node("start_head.sh", env_of_attempt, self.temp_dir)
        self.nodes["head"] = Node("head", process, gpus, HEAD_IP)

    def join_overrides(self) -> list[str]:
        """What a run's command line adds to join this cluster (its resources are the cluster's, not declared)."""
        return [
            f"++ray_kwargs.ray_init.address={self.address}",
            f"++ray_kwargs.ray_init._node_ip_address={HEAD_IP}",
            "ray_kwargs.ray_init.num_cpus=null",
            "++ray_kwargs.ray_init.num_gpus=null",
        ]

    def add_workers(self, worker_gpus: list[int]) -> None:
        """Sampler nodes (``gpus`` logical GPUs each: room for one rollout bundle per GPU), started one at a time (two
        joining at once can time out here)."""
        for gpus in worker_gpus:
            index = self._workers_started
            self._workers_started += 1

            def env_of_attempt(attempt: int, gpus: int = gpus) -> dict[str, str]:
                self._addresses_used += 1  # a new address: the node that failed may be listed a while yet
                return {
                    **self.base,
                    "NODE_IP": f"127.0.0.{1 + self._addresses_used}",
                    "NUM_GPUS": str(gpus),
                    "RAY_NUM_CPUS": str(SAMPLER_NODE_CPUS * gpus),
                    "RAY_HEAD_ADDRESS": self.address,
                    "RAY_EXTRA_ARGS": _agent_ports(),
                }

            process, env = _start_node("start_worker.sh", env_of_attempt, self.temp_dir, self.failed_addresses)
            self.nodes[f"worker{index}"] = Node(f"worker{index}", process, gpus, env["NODE_IP"])
        running = [node for node in self.nodes.values() if node.process.poll() is None]
        expected = json.dumps(sorted(node.ip for node in running))
        settled = _driver(_SETTLE, self, expected, json.dumps(sorted(self.failed_addresses)))
        for node in running:
            node.node_id = settled["ids"][node.ip]

    def add_worker(self, gpus: int) -> Node:
        """One more sampler node (a machine taking a lost one's place)."""
        self.add_workers([gpus])
        return self.nodes[f"worker{self._workers_started - 1}"]

    def remove(self, name: str) -> None:
        """Stop one node cleanly (``ray stop``'s signal: its raylet leaves the cluster at once)."""
        node = self.nodes.pop(name)
        if node.process.poll() is None:
            os.killpg(node.process.pid, signal.SIGTERM)
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        for name in reversed(list(self.nodes)):
            self.remove(name)


#: The custom resource start_head.sh offers on a learner node (its default role), and hetero.learner_resource's
#: default: HeteroRL keeps verl's own services on the nodes that offer it.
LEARNER_RESOURCE = "gepo_learner"
#: The head's address; worker nodes take 127.0.0.2, 127.0.0.3, ... (all this machine, all loopback): a driver that
#: joins with ``ray_init._node_ip_address=HEAD_IP`` attaches to the head. Not 127.0.0.1: Ray rewrites that address to
#: the machine's own (``resolve_ip_for_localhost``), and a driver on 127.0.0.1 then matches no node and joins any.
HEAD_IP = "127.0.0.100"
#: How many times a node is started before its cluster fails: ``ray start`` gives a raylet 30 s to register with the
#: GCS (``ray/_private/node.py``, a constant); a CI run's worker node took longer on two cores beside the vLLM lane
START_ATTEMPTS = 3
#: Logical CPUs a sampler node offers the run: verl's rollout bundle ({"CPU": 2, "GPU": 1}) and its server's CPU
SAMPLER_NODE_CPUS = 3


@contextmanager
def ray_nodes(head_gpus: int, worker_gpus: list[int], head_cpus: int = 64) -> Iterator[RayNodes]:
    """A head with ``head_gpus`` logical GPUs (a learner node: it offers ``LEARNER_RESOURCE``) and one sampler node per
    entry of ``worker_gpus`` (``worker0``, ...), started with the examples' scripts as a deployment would; nothing
    else is arranged: where verl's own services go is the plugin's business (hetero.learner_resource)."""
    temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cluster = RayNodes(temp_dir)
    try:
        cluster.start_head(head_gpus, head_cpus)
        cluster.add_workers(worker_gpus)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


_ACTORS = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = [a for a in state.state.actor_table(None).values() if a["State"] == "ALIVE"]
print(json.dumps([[a.get("Name") or a["ActorClassName"], a["Address"]["NodeID"]] for a in alive]))
"""
#: Once a node at each address of ``argv[2]`` (a JSON list) is alive, and none at those of ``argv[3]`` (nodes whose
#: start failed and that were killed, in case one had registered): prints every alive node's id by address
_SETTLE = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
expected, failed = set(json.loads(sys.argv[2])), set(json.loads(sys.argv[3]))
alive = lambda: {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
deadline = time.monotonic() + 120
while (not expected <= set(alive()) or failed & set(alive())) and time.monotonic() < deadline:
    time.sleep(0.5)
print(json.dumps({"ids": alive()}))
"""


def _driver(script: str, cluster: RayNodes, *args: str) -> object:
    """Run ``script`` in a short-lived driver joined to the cluster; its last line of output, as JSON."""
    env = {**os.environ, **cluster.env}
    done = subprocess.run(
        [sys.executable, "-c", script, cluster.address, *args], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def actors_by_node(cluster: RayNodes) -> dict[str, list[str]]:
    """The live actors on each node (their names, or class names), by Ray node id, from Ray's GCS actor table (read
    without loading the actors' classes, so in a second or two)."""
    out: dict[str, list[str]] = {}
    for name, node_id in _driver(_ACTORS, cluster):
        out.setdefault(node_id, []).append(name)
    return out
