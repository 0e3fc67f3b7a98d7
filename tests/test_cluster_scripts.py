"""examples/ray/start_{head,worker}.sh and examples/slurm/gepo_hetero.sbatch without a cluster.

The scripts run for real under bash; what they would call on a cluster (nvidia-smi, srun, scontrol, ray, the
Python readiness check) are small bash stand-ins in a temporary ``bin`` directory that is the whole PATH, next
to links to the few coreutils the scripts use. The sbatch's waiting logic is sourced (its functions) and also
exercised through a whole job run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_SCRIPTS = {"head": ROOT / "examples/ray/start_head.sh", "worker": ROOT / "examples/ray/start_worker.sh"}
SBATCH = ROOT / "examples/slurm/gepo_hetero.sbatch"
BASH = shutil.which("bash")
# the commands the scripts run besides bash builtins and the fakes
TOOLS = ("awk", "cat", "dirname", "grep", "head", "hostname", "mktemp", "rm", "sed", "sleep", "tail", "timeout")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def fake_bin(tmp_path: Path, fakes: dict[str, str] | None = None) -> Path:
    """A directory to be the whole PATH: links to TOOLS and bash, plus ``fakes`` (name -> bash script body)."""
    directory = tmp_path / "bin"
    directory.mkdir(exist_ok=True)
    for tool in (*TOOLS, "bash", "env", "touch"):  # (touch: for the fakes)
        found = shutil.which(tool)
        if found and not (directory / tool).exists():
            (directory / tool).symlink_to(found)
    for name, body in (fakes or {}).items():
        path = directory / name
        path.write_text(f"#!{BASH}\n{body}\n")
        path.chmod(0o755)
    return directory


def run_bash(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, *args], env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- start_head.sh / start_worker.sh


def ray_script_env(tmp_path: Path, role: str, extra: dict[str, str]) -> dict[str, str]:
    env = {"PATH": str(fake_bin(tmp_path)), "HOME": str(tmp_path), "PRINT_ONLY": "1", "NODE_IP": "10.0.0.1"}
    if role == "worker":
        env["RAY_HEAD_ADDRESS"] = "10.0.0.1:6379"
    return {**env, **extra}


@pytest.mark.parametrize("role", RAY_SCRIPTS)
def test_ray_scripts_refuse_to_guess_zero_gpus_without_nvidia_smi(tmp_path, role):
    result = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {}))
    assert result.returncode != 0
    assert "NUM_GPUS" in result.stderr and "nvidia-smi" in result.stderr
    assert "ray start" not in result.stdout


@pytest.mark.parametrize("role", RAY_SCRIPTS)
def test_ray_scripts_accept_an_explicit_zero(tmp_path, role):
    result = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {"NUM_GPUS": "0"}))
    assert result.returncode == 0, result.stderr
    assert "--num-gpus=0" in shlex.split(result.stdout)


@pytest.mark.parametrize("role", RAY_SCRIPTS)
def test_ray_scripts_count_the_gpus_nvidia_smi_lists(tmp_path, role):
    listing = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}000)\\n" for i in range(4))
    fake_bin(tmp_path, {"nvidia-smi": f'[ "$1" = -L ] || exit 64\nprintf "{listing}"'})
    result = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {}))
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[:2] == ["ray", "start"] and "--num-gpus=4" in words
    assert "detected 4 GPUs" in result.stderr


@pytest.mark.parametrize("role", RAY_SCRIPTS)
def test_ray_scripts_stop_when_nvidia_smi_fails_or_lists_none(tmp_path, role):
    fake_bin(tmp_path, {"nvidia-smi": 'echo "NVIDIA-SMI has failed because it could not communicate"; exit 9'})
    failed = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {}))
    assert failed.returncode != 0
    assert "NUM_GPUS" in failed.stderr and "could not communicate" in failed.stderr

    fake_bin(tmp_path, {"nvidia-smi": "exit 0"})
    empty = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {}))
    assert empty.returncode != 0 and "NUM_GPUS" in empty.stderr

    garbage = run_bash([str(RAY_SCRIPTS[role])], ray_script_env(tmp_path, role, {"NUM_GPUS": "eight"}))
    assert garbage.returncode != 0 and "NUM_GPUS" in garbage.stderr


# ---------------------------------------------------------------- gepo_hetero.sbatch: its functions

# the fake readiness check: answers in turn with the lines of $FAKE/answers ("exit CODE" or a GPU count), the
# last line forever; counts its calls in $FAKE/calls
FAKE_PROBE = """
echo x >> "$FAKE/calls"
calls=$(grep -c x "$FAKE/calls")
total=$(grep -c '' "$FAKE/answers")
answer=$(sed -n "$(( calls < total ? calls : total ))p" "$FAKE/answers")
case "$answer" in
  exit*) echo "probe stderr: answer $calls: $answer" >&2; exit "${answer#exit }" ;;
  *) echo "$answer" ;;
esac
"""


def sourced(tmp_path: Path, script: str, answers: list[str], env: dict[str, str] | None = None, timeout: float = 30):
    """Runs ``script`` in bash after sourcing the sbatch (functions only), with the fake readiness check."""
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "answers").write_text("\n".join(answers) + "\n")
    bin_dir = fake_bin(tmp_path, {"fake-python": FAKE_PROBE})
    full_env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "FAKE": str(fake),
        "PYTHON": str(bin_dir / "fake-python"),
        "RAY_POLL_INTERVAL": "0.05",
        **(env or {}),
    }
    start = time.monotonic()
    # ($0 is "bash", not the sbatch: sourced, the sbatch defines its functions and returns)
    result = run_bash(["-c", f'source "$1"\n{script}', "bash", str(SBATCH)], full_env, timeout=timeout)
    calls = (fake / "calls").read_text().count("x") if (fake / "calls").exists() else 0
    return result, calls, time.monotonic() - start


def test_sourcing_the_sbatch_defines_functions_and_starts_nothing(tmp_path):
    result, calls, _ = sourced(tmp_path, "declare -F wait_for_ray check_steps start_step gpus_per_node", ["8"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["wait_for_ray", "check_steps", "start_step", "gpus_per_node"]
    assert calls == 0


def test_gpus_per_node_is_one_setting_read_from_slurm_or_the_sbatch_line(tmp_path):
    assert 'GPUS_PER_NODE="${GPUS_PER_NODE:-' not in SBATCH.read_text()  # no second default
    header = next(line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH --gpus-per-node="))
    script = 'gpus_per_node "$1"'
    from_header, _, _ = sourced(tmp_path, script, ["8"])
    assert from_header.stdout.strip() == header.split("=")[1]
    typed, _, _ = sourced(tmp_path, script, ["8"], {"SLURM_GPUS_PER_NODE": "h100:4"})
    assert typed.stdout.strip() == "4"
    bad, _, _ = sourced(tmp_path, script, ["8"], {"SLURM_GPUS_PER_NODE": "lots"})
    assert bad.returncode != 0 and "--gpus-per-node" in bad.stderr


def test_wait_for_ray_polls_until_every_gpu_has_joined(tmp_path):
    result, calls, _ = sourced(tmp_path, "wait_for_ray 10.0.0.1:6379 16 60", ["exit 4", "8", "16"])
    assert result.returncode == 0, result.stderr
    assert calls == 3
    assert "8 of 16 GPUs have joined" in result.stdout and "ready: 16 GPUs" in result.stdout


def test_wait_for_ray_fails_fast_and_loudly_when_the_check_cannot_run(tmp_path):
    # the real readiness check, run by a real Python that cannot import ray (isolated mode, no site-packages)
    fake_bin(tmp_path, {"python-without-ray": f'exec {shlex.quote(sys.executable)} -S -I "$@"'})
    env = {"PYTHON": str(tmp_path / "bin" / "python-without-ray")}
    result, _, elapsed = sourced(tmp_path, "wait_for_ray 10.0.0.1:6379 16 600", ["8"], env)
    assert result.returncode != 0
    assert "cannot import ray" in result.stderr and "exit code 3" in result.stderr
    assert elapsed < 60  # not the 600 s deadline

    missing, _, _ = sourced(tmp_path, "wait_for_ray 10.0.0.1:6379 16 600", ["8"], {"PYTHON": "/nonexistent/python"})
    assert missing.returncode != 0 and "/nonexistent/python" in missing.stderr

    garbage, _, _ = sourced(tmp_path, "wait_for_ray 10.0.0.1:6379 16 600", ["Traceback"])
    assert garbage.returncode != 0 and "instead of a GPU count" in garbage.stderr


def test_wait_for_ray_gives_up_at_its_deadline_with_the_last_count(tmp_path):
    result, calls, elapsed = sourced(tmp_path, "wait_for_ray 10.0.0.1:6379 16 1", ["8"])
    assert result.returncode != 0
    assert "8 of 16 GPUs after 1s" in result.stderr
    assert calls >= 1 and elapsed < 30


def test_a_dead_step_stops_the_wait_at_once_with_its_node_and_code(tmp_path):
    script = 'start_step node-7 bash -c "exit 5"\nsleep 0.2\nwait_for_ray 10.0.0.1:6379 16 600'
    result, _, elapsed = sourced(tmp_path, script, ["exit 4"])
    assert result.returncode != 0
    assert "node-7" in result.stderr and "exit code 5" in result.stderr
    assert elapsed < 60  # well before the deadline


def test_check_steps_passes_while_steps_run_and_fails_once_one_ends(tmp_path):
    script = (
        "start_step node-1 sleep 30\n"
        "start_step node-2 bash -c 'while [ ! -e \"$FAKE/go\" ]; do sleep 0.05; done'\n"
        "check_steps && echo running\n"
        'touch "$FAKE/go"\n'
        'while kill -0 "${STEP_PIDS[1]}" 2>/dev/null; do sleep 0.05; done\n'
        "check_steps || echo ended\n"
        "stop_steps"
    )
    result, _, elapsed = sourced(tmp_path, script, ["8"])
    assert result.stdout.split() == ["running", "ended"], result.stderr
    assert "node-2" in result.stderr and "exit code 0" in result.stderr and "node-1" not in result.stderr
    assert elapsed < 25  # stop_steps ended the 30 s step


# ---------------------------------------------------------------- gepo_hetero.sbatch: a whole job with fakes

FAKE_SRUN = """
echo "$*" >> "$FAKE/srun.log"
node=""
while [ $# -gt 0 ]; do
  case "$1" in -w) node="$2"; shift 2 ;; hostname) echo "10.0.0.7 172.17.0.1"; exit 0 ;; *) shift ;; esac
done
if [ "$node" = "${FAKE_DEAD_NODE:-}" ]; then
  sleep 0.1
  echo "srun: error: $node: task 0: Exited with exit code 5" >&2
  exit 5
fi
# a Ray step: runs until `ray stop` (the fake ray touches $FAKE/stopped) or until told to die
while [ ! -e "$FAKE/stopped" ]; do
  [ -e "$FAKE/kill-$node" ] && { touch "$FAKE/dead-$node"; exit 6; }
  sleep 0.05
done
"""
FAKE_LAUNCH = """#!/usr/bin/env bash
echo "LAUNCH RAY_ADDRESS=$RAY_ADDRESS LEARNER_GPUS_PER_NODE=$LEARNER_GPUS_PER_NODE SAMPLER_NODES=$SAMPLER_NODES ARGS=$*"
if [ -n "${KILL_DURING_TRAINING:-}" ]; then
  touch "$FAKE/kill-$KILL_DURING_TRAINING"
  while [ ! -e "$FAKE/dead-$KILL_DURING_TRAINING" ]; do sleep 0.05; done
  sleep 0.5
fi
"""


def run_job(tmp_path: Path, gpus_answers: list[str], extra: dict[str, str] | None = None):
    """The sbatch as Slurm would run it on n1 of n1,n2,n3 (8 GPUs each), with fakes for the cluster tools."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "answers").write_text("\n".join(gpus_answers) + "\n")
    repo = tmp_path / "repo"
    launch = repo / "examples/hetero/run_qwen3_1.7b_gepo_math.sh"
    launch.parent.mkdir(parents=True)
    launch.write_text(FAKE_LAUNCH)
    (repo / "examples/common.sh").write_text((ROOT / "examples/common.sh").read_text())  # the job sources it
    bin_dir = fake_bin(
        tmp_path,
        {
            "srun": FAKE_SRUN,
            "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "n1\\nn2\\nn3\\n"',
            "ray": 'touch "$FAKE/stopped"',
            "fake-python": FAKE_PROBE,
        },
    )
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "FAKE": str(fake),
        "PYTHON": str(bin_dir / "fake-python"),
        "REPO_DIR": str(repo),
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_GPUS_PER_NODE": "8",
        "RAY_POLL_INTERVAL": "0.05",
        "RAY_START_TIMEOUT": "120",
        **(extra or {}),
    }
    start = time.monotonic()
    result = run_bash([str(SBATCH), "hetero.max_lag=8"], env, timeout=180)
    srun_log = (fake / "srun.log").read_text() if (fake / "srun.log").exists() else ""
    return result, srun_log, time.monotonic() - start


def test_the_job_starts_ray_everywhere_waits_then_trains(tmp_path):
    result, srun_log, _ = run_job(tmp_path, ["exit 4", "8", "24"])
    assert result.returncode == 0, result.stderr
    # the head IP came from `hostname -I` on the head node; every node got the one GPUs-per-node setting
    assert "LAUNCH RAY_ADDRESS=10.0.0.7:6379 LEARNER_GPUS_PER_NODE=8 SAMPLER_NODES=2 ARGS=hetero.max_lag=8" in (
        result.stdout
    )
    steps = [line for line in srun_log.splitlines() if "ray/start_" in line]
    assert len(steps) == 3 and all("NUM_GPUS=8" in line for line in steps)
    assert "-w n1" in steps[0] and "start_head.sh" in steps[0] and "NODE_IP=10.0.0.7" in steps[0]
    # the worker steps start in the background, so they reach the log in either order
    assert sorted(line.split("-w ")[1].split()[0] for line in steps[1:]) == ["n2", "n3"]
    assert all("RAY_HEAD_ADDRESS=10.0.0.7:6379" in line for line in steps[1:])
    assert "ready: 24 GPUs" in result.stdout


def test_head_ip_overrides_hostname(tmp_path):
    result, srun_log, _ = run_job(tmp_path, ["24"], {"HEAD_IP": "192.168.5.5"})
    assert result.returncode == 0, result.stderr
    assert "RAY_ADDRESS=192.168.5.5:6379" in result.stdout
    assert "hostname" not in srun_log and "NODE_IP=192.168.5.5" in srun_log


def test_a_worker_step_that_dies_fails_the_job_before_the_deadline(tmp_path):
    result, _, elapsed = run_job(tmp_path, ["8", "16"], {"FAKE_DEAD_NODE": "n3", "RAY_START_TIMEOUT": "600"})
    assert result.returncode != 0
    assert "the Ray step on n3" in result.stderr and "exit code 5" in result.stderr
    assert "LAUNCH" not in result.stdout
    assert elapsed < 60  # well before the deadline


def test_a_step_that_dies_during_training_fails_the_job(tmp_path):
    result, _, _ = run_job(tmp_path, ["24"], {"KILL_DURING_TRAINING": "n2"})
    assert "LAUNCH" in result.stdout  # training ran (and exited 0) ...
    assert result.returncode != 0  # ... but a sampler node's Ray went away under it
    assert "the Ray step on n2" in result.stderr and "exit code 6" in result.stderr
    assert "during training" in result.stderr


def test_a_broken_environment_fails_the_job_at_once(tmp_path):
    result, _, elapsed = run_job(tmp_path, ["exit 3"], {"RAY_START_TIMEOUT": "600"})
    assert result.returncode != 0
    assert "probe stderr: answer 1: exit 3" in result.stderr and "exit code 3" in result.stderr
    assert "LAUNCH" not in result.stdout and elapsed < 60


def test_gpus_per_node_set_elsewhere_must_agree_with_the_allocation(tmp_path):
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PRINT_ONLY": "1",
        "DATA_DIR": str(tmp_path),
        "SLURM_JOB_NUM_NODES": "3",
    }
    printed = run_bash([str(SBATCH)], {**env, "SLURM_GPUS_PER_NODE": "4"})
    assert printed.returncode == 0, printed.stderr
    assert "GPUs per node: 4" in printed.stdout
    words = shlex.split(printed.stdout.strip().splitlines()[-1])
    assert "trainer.n_gpus_per_node=4" in words, words
    clash = run_bash([str(SBATCH)], {**env, "SLURM_GPUS_PER_NODE": "4", "SAMPLER_GPUS_PER_NODE": "8"})
    assert clash.returncode != 0 and "--gpus-per-node" in clash.stderr
