"""examples/slurm/gepo_hetero.sbatch submitted with ``sbatch`` to a real Slurm on this machine.

``scripts/slurm/setup.sh`` installs and starts Debian's Slurm 22.05 (munge, MariaDB + slurmdbd, slurmctld) and three
``slurmd``, each node in its own network namespace (``n1``..``n3`` at 10.77.0.1-3) with its own ``/tmp/ray``,
one stand-in GPU each; the job's files (the tiny model and data, the store, the output) lie in pytest's folders.
The job is submitted as its header says, from the repository root, with the CPU backend and the tiny model in place
of GPUs and Qwen through the job's own settings: ``SETUP_COMMAND`` activates this virtual environment on every node, the
launch script's environment (``MODEL_PATH``, ``TRAIN_FILE``, sizes) names the tiny model and data, and the overrides
appended to ``sbatch`` put the run on the CPU backend while the layout (learner and sampler nodes, GPUs per node) is
the job's own, read back from Slurm. Nothing in the job is mocked: ``srun`` starts Ray's head and workers on the
allocated nodes, the job waits for every GPU, trains HeteroRL steps from the head node, and ends.

* The remote-samplers launch (``LAUNCH=examples/remote/run_qwen3_1.7b_gepo_math_remote.sh``, which runs the
  relay's launch script, which runs the HeteroRL one; a signed directory store on the shared file system, the
  gateway open for a declared remote sampler that does not dial in): trains every step within the lag bound with
  balanced books, each sampler node's rollouts trained; the gateway answers on the head node's address from outside
  the cluster; the job ends COMPLETED with exit code 0 in ``sacct``.
* The default launch (simulated weight delay): once training is under way, the Ray step of a node hosting a sampler
  (not the learner) is ended with ``scancel``; the run goes on with the other sampler to its last step (a sampler
  may fail), and the job ends FAILED with a message naming the node, as the header promises.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from chaos import check_every_step
from ray_nodes import cluster_token_env

from gepo_plugin.names import CPU_ROLLOUT
from gepo_plugin.tiny import read_metrics, write_all
from gepo_sampler.relay.signing import generate_pair

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[1]
SBATCH = "examples/slurm/gepo_hetero.sbatch"
NODES, MAX_LAG, PROMPTS, RESPONSES = 3, 2, 4, 4
#: the remote-samplers launch script's default gateway port
GATEWAY_PORT = 8471
#: the first node's address (scripts/slurm/setup.sh): the Ray head's
HEAD = "10.77.0.1"


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    """A running Slurm of NODES nodes (scripts/slurm/setup.sh, idempotent); the client environment (SLURM_CONF).
    Stopped afterwards (scripts/slurm/teardown.sh); the database and configuration stay for the next set-up."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root: scripts/slurm/setup.sh starts daemons and network namespaces")
    env = {**os.environ, "GEPO_SLURM_NODES": str(NODES), "GEPO_SLURM_GPUS": "1"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/setup.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode == 3:  # not installed, and no system package manager to install it
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    conf = done.stdout.strip().splitlines()[-1].removeprefix("SLURM_CONF=")
    try:
        yield {"SLURM_CONF": conf}
    finally:
        subprocess.run(["bash", str(ROOT / "scripts/slurm/teardown.sh")], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return write_all(tmp_path_factory.mktemp("tiny_slurm"))  # every node sees this machine's files (all but /tmp/ray)


def cpu_overrides(tiny: dict[str, str], metrics: Path) -> list[str]:
    """Appended to the job's command (they win over the launch script's): the CPU backend and the tiny task in place
    of GPUs, vLLM and math, leaving the job's layout (nodes, GPUs per node, sampler groups) as Slurm gave it."""
    return [
        "trainer.device=cpu",
        f"actor_rollout_ref.rollout.name={CPU_ROLLOUT}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={tiny['reward_path']}",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=False",
        # the job joins the cluster it started (RAY_ADDRESS): no local resources to declare
        "ray_kwargs.ray_init.num_cpus=null",
        "++ray_kwargs.ray_init.num_gpus=null",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}",
    ]


def job_env(slurm: dict[str, str], tiny: dict[str, str], workdir: Path, steps: int, extra: dict[str, str]):
    """The submitting shell's environment (``sbatch`` exports it to the job): the launch script's settings for the
    tiny task, and SETUP_COMMAND, which every node runs first. A new Ray token: the job's cluster carries it."""
    return {
        **os.environ,
        **cluster_token_env(),
        **slurm,
        "SETUP_COMMAND": f"source {Path(sys.executable).parent / 'activate'}",
        "MODEL_PATH": tiny["model"],
        "TRAIN_FILE": tiny["train_files"],
        "VAL_FILE": tiny["val_files"],
        "CKPT_DIR": str(workdir / "checkpoints"),
        "PROMPTS_PER_STEP": str(PROMPTS),
        "GROUP_SIZE": str(RESPONSES),
        "MAX_PROMPT_LENGTH": "16",
        "MAX_RESPONSE_LENGTH": "8",
        "LR": "1e-3",
        "TOTAL_STEPS": str(steps),
        "TEST_FREQ": "-1",
        "SAVE_FREQ": "-1",
        "REWARD_WORKERS": "1",
        "MAX_LAG": str(MAX_LAG),
        "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl"),
        "PYTHONWARNINGS": "ignore",
        "RAY_START_TIMEOUT": "300",
        "RAY_POLL_INTERVAL": "2",
        **extra,
    }


def submit(env: dict[str, str], workdir: Path, overrides: list[str]) -> tuple[str, Path]:
    """``sbatch`` from the repository root, as the job's header says; returns the job id and its output file."""
    output = workdir / "job-%j.out"
    done = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={NODES}", "--gpus-per-node=1", f"--output={output}", SBATCH, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    return job, workdir / f"job-{job}.out"


#: states of a job that has not ended (its accounting record is final only after them)
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")


def job_active(env: dict[str, str], job: str) -> bool:
    """The job has not ended (or Slurm's accounting has no record of it yet)."""
    record = sacct(env, job).get(job)
    return record is None or record[0] in ACTIVE


def sacct(env: dict[str, str], job: str) -> dict[str, tuple[str, str, str]]:
    """Slurm's accounting of the job and its steps: id -> (state, exit code, nodes)."""
    done = subprocess.run(
        ["sacct", "-j", job, "-n", "-P", "-o", "JobID,State,ExitCode,NodeList"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    rows = [line.split("|") for line in done.stdout.strip().splitlines() if line]
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def gateway_answer(env: dict[str, str], job: str, timeout_s: float = 600) -> int:
    """The HTTP status the remote samplers' gateway on the head node gives a hello with a wrong token, asked from
    outside the cluster (this machine's side of the nodes' bridge) while the job runs; 0 if it never answered."""
    url = f"http://{HEAD}:{GATEWAY_PORT}/v1/samplers/far/hello"
    request = urllib.request.Request(url, headers={"Authorization": "Bearer not-the-token-of-far"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job_active(env, job):
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:  # not listening yet
            time.sleep(1)
    return 0


def wait_for_end(env: dict[str, str], job: str, output: Path, timeout_s: float) -> tuple[str, str]:
    """The job's final (state, exit code) once ``sacct`` has its whole record (written a moment after the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not job_active(env, job):
            state, code, _ = sacct(env, job)[job]
            return state, code
        time.sleep(2)
    subprocess.run(["scancel", job], env=env, timeout=30)
    text = output.read_text() if output.exists() else "(no output)"
    raise AssertionError(f"job {job} did not end within {timeout_s} s:\n{text[-6000:]}")


def test_the_remote_samplers_job_trains_on_the_slurm_nodes_and_completes(slurm, tiny, tmp_path):
    """LAUNCH: the remote-samplers launch script, which runs the relay's, which runs the HeteroRL one: weights through
    a signed directory store, the gateway open for a declared remote sampler (none dials in: a remote group starts
    empty and joins when one does, so the in-cluster samplers train alone)."""
    steps = 8
    metrics = tmp_path / "metrics.jsonl"
    private, public = generate_pair()
    settings = {
        "LAUNCH": "examples/remote/run_qwen3_1.7b_gepo_math_remote.sh",
        "RELAY_URL": str(tmp_path / "store"),
        "RELAY_PUBLIC_KEY": public,
        "GEPO_RELAY_SIGNING_KEY": private,
        "REMOTE_SAMPLERS": "far:GEPO_TEST_REMOTE_TOKEN",
        "GEPO_TEST_REMOTE_TOKEN": secrets.token_urlsafe(24),
    }
    env = job_env(slurm, tiny, tmp_path, steps, settings)
    job, output = submit(env, tmp_path, cpu_overrides(tiny, metrics))
    answer = gateway_answer(env, job)
    state, code = wait_for_end(env, job, output, 900)
    text = output.read_text()
    # the gateway listened on the head node, reachable from outside the cluster, and refused a wrong token
    assert answer == 401, answer
    assert (state, code) == ("COMPLETED", "0:0"), text[-6000:]
    # Ray over the allocation: a Ray step on each node (the head's on n1), every GPU waited for, and the run's
    # workers on the sampler nodes' addresses
    steps_by_node = {nodes for step, (_, _, nodes) in sacct(env, job).items() if "." in step and "batch" not in step}
    assert {"n1", "n2", "n3"} <= steps_by_node, steps_by_node
    assert f"Ray cluster at {HEAD}:6379 is ready: {NODES} GPUs" in text, text[-6000:]
    assert all(f"ip=10.77.0.{i})" in text for i in (2, 3)), "no actor ran on a sampler node"
    logged = read_metrics(metrics)
    assert sorted(logged) == list(range(1, steps + 1)), text[-6000:]
    check_every_step(logged, MAX_LAG)
    last = logged[steps]
    assert last["hetero/trained"] == PROMPTS * steps
    for group in (0, 1):  # one sampler group per sampler node, both trained
        assert any(m.get(f"hetero/sampler_group_{group}/trained_trajectories", 0) > 0 for m in logged.values())
    assert last["hetero/relay/versions_published"] >= steps - 1, last
    # the declared remote sampler's group exists and stayed empty: nothing dialled in, nothing of it trained
    assert "hetero/sampler_group_2/relay_bytes" in last and not last.get("hetero/sampler_group_2/trained_trajectories")


def sampler_only_node(output: str) -> str:
    """A node that hosts a rollout server and not the learner, from the run's log: verl 0.9.1 places its learner
    and rollout pools on whichever nodes have GPUs free (the job's learner/sampler labels are informational), so the
    node is chosen by what it hosts, as a test of losing a sampler must."""
    servers = re.search(r"LLMServerManager: \[([^\]]*)\]", output)
    learner = re.search(r"\(WorkerDict pid=\d+(?:, ip=([\d.]+))?\).*Total steps", output)
    assert servers and learner, "the run's log names neither its rollout servers nor its learner"
    learner_ip = learner.group(1) or HEAD  # Ray names no address for actors on the driver's node
    server_ips = {address.strip(" '").rsplit(":", 1)[0] for address in servers.group(1).split(",")}
    candidates = sorted(f"n{ip.rsplit('.', 1)[1]}" for ip in server_ips - {learner_ip, HEAD})
    assert candidates, (server_ips, learner_ip)
    return candidates[0]


def running_step_on(env: dict[str, str], job: str, node: str) -> str:
    """The id (``<job>.<step>``) of the job's running step on ``node``, from Slurm's accounting."""
    for step, (state, _, nodes) in sacct(env, job).items():
        if "." in step and state == "RUNNING" and nodes == node and not step.endswith(".batch"):
            return step
    raise AssertionError(f"no running step of job {job} on {node}: {sacct(env, job)}")


def test_a_node_whose_ray_step_ends_mid_run_fails_the_job_naming_it(slurm, tiny, tmp_path):
    """The header's promise: a Ray step that ends while the job trains fails the job, with a message naming the
    node. The sampler on that node is lost and the run goes on with the other (training ends normally), so only the
    job's own check tells that a node went missing."""
    steps = 12
    metrics = tmp_path / "metrics.jsonl"
    env = job_env(slurm, tiny, tmp_path, steps, {"DELAY_LOW": "0.2", "DELAY_HIGH": "1.0"})
    # the simulated transport's NCCL (the launch script's) becomes the CPU backend's mailbox between Ray nodes
    overrides = [*cpu_overrides(tiny, metrics), "actor_rollout_ref.rollout.checkpoint_engine.backend=ray_mailbox"]
    job, output = submit(env, tmp_path, overrides)
    deadline = time.monotonic() + 600
    while 2 not in read_metrics(metrics):
        assert time.monotonic() < deadline and job_active(env, job), (
            output.read_text()[-6000:] if output.exists() else "no output"
        )
        time.sleep(1)
    node = sampler_only_node(output.read_text())
    doomed = running_step_on(env, job, node)
    subprocess.run(["scancel", doomed], env=env, check=True, timeout=30)  # that node's Ray ends (ray stop's signal)
    state, code = wait_for_end(env, job, output, 900)
    text = output.read_text()
    assert (state, code) == ("FAILED", "1:0"), text[-6000:]
    assert f"gepo_hetero.sbatch: the Ray step on {node} (srun pid" in text, text[-6000:]
    # the run itself went on to its last step without the lost sampler, and the job still failed
    assert "gepo_hetero.sbatch: a Ray step ended during training (training exit code 0)" in text, text[-6000:]
    logged = read_metrics(metrics)
    assert sorted(logged) == list(range(1, steps + 1))
    check_every_step(logged, MAX_LAG)
    assert logged[steps]["hetero/sampler_failures"] >= 1, logged[steps]
