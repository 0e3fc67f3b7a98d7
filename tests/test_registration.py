"""The plugin reaches every verl process through the entry point: quietly, cheaply, in any import order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gepo_plugin.names import expected_names

pytestmark = pytest.mark.slow  # every test starts fresh interpreters (each imports verl)

STATUS = """
import json
from gepo_plugin.verl_glue.registration import registration_status
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.v1 import get_trainer_cls
status = registration_status()
get_policy_loss_fn("gepo"); get_trainer_cls("gepo_sync"); get_trainer_cls("hetero_separate_async")
print("STATUS" + json.dumps(status))
"""


def run_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "PYTHONWARNINGS")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "first",
    [
        "import verl",
        "from gepo_plugin.verl_glue.trainers import compute_group_terms",
        "import gepo_plugin.verl_glue.losses",
        "import gepo_plugin.verl_glue.m2po_loss",  # both losses read M2PO's cap: neither may import the other
        "import gepo_plugin.verl_glue.m2_cap",
        "import gepo_plugin.verl_glue.advantages",
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn",
        "from verl.trainer.ppo.v1.trainer_base import PPOTrainer",
        "import gepo_plugin.verl_glue.hetero.replay_buffer",
    ],
)
def test_registration_is_complete_and_silent_in_any_import_order(first):
    """Whatever is imported first, every name ends up registered, verl's lookups find them, and the plugin logs
    nothing (it used to log "failed to register" when a plugin module was imported before verl)."""
    result = run_python(first + "\n" + STATUS)
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(result.stdout.split("STATUS", 1)[1])
    assert status["ok"] is True and status["missing"] == [] and status["errors"] == {}
    assert status["registered"] == expected_names()
    assert "gepo-plugin" not in result.stderr, result.stderr


PLAIN_IMPORT = "import sys, verl; print(sorted(m for m in sys.modules if m.startswith(('gepo_plugin', 'verl.'))))"


def test_import_verl_is_as_quiet_as_without_the_plugin_and_loads_no_trainer_stack():
    """`import verl` prints exactly what it prints with plugins disabled, and imports none of verl's trainer
    stack: the plugin only arranges its registrations (measured in bench/bench_import.py)."""
    with_plugin = run_python(PLAIN_IMPORT)
    without = run_python(PLAIN_IMPORT, {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert with_plugin.returncode == 0 and without.returncode == 0, with_plugin.stderr + without.stderr
    assert with_plugin.stderr == without.stderr
    loaded = eval(with_plugin.stdout.strip().splitlines()[-1])  # a printed list of module names
    baseline = set(eval(without.stdout.strip().splitlines()[-1]))
    extra_verl = sorted(m for m in loaded if m.startswith("verl.") and m not in baseline)
    assert extra_verl == [], extra_verl
    assert "gepo_plugin.entry_point" in loaded
    assert not any(m.startswith(("gepo_plugin.verl_glue.trainers", "gepo_plugin.verl_glue.losses")) for m in loaded)


def test_a_failing_registration_is_logged_with_its_module_and_seen_by_the_doctor():
    code = """
import gepo_plugin.verl_glue.registration as registration
registration.REGISTRATIONS["verl.trainer.ppo.core_algos"] += ("gepo_plugin.no_such_module",)
import verl, verl.trainer.ppo.core_algos
from gepo_plugin.doctor import _problems, probe_process
print("PROBLEMS", _problems(probe_process(), "here"))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not register gepo_plugin.no_such_module with verl" in result.stderr
    problems = result.stdout.split("PROBLEMS", 1)[1]
    assert "gepo_plugin.no_such_module" in problems and "ModuleNotFoundError" in problems


@pytest.mark.ray
def test_a_fresh_ray_actor_has_everything_registered_after_a_plain_import_verl():
    from gepo_plugin.doctor import probe_ray_actor

    report = probe_ray_actor()
    assert report["pid"] != os.getpid()
    assert report["entry_point_loaded"] is True
    assert report["status"]["ok"] is True
    assert report["status"]["registered"] == expected_names()


def _doctor(env_extra, *args):
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "doctor", "--fast", *args], capture_output=True, text=True, env=env
    )


def test_doctor_passes_here_and_fails_when_verl_plugins_are_disabled():
    ok = _doctor({})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "policy losses:        gepo" in ok.stdout
    assert "[1/2]" in ok.stdout and "[2/2]" in ok.stdout  # progress, step by step
    for contact in ("ReplayBufferAsync._select_prompt_uids", "_ROLLOUT_REGISTRY", "PPOTrainer._compute_advantage"):
        assert contact in ok.stdout  # the table of verl internals
    disabled = _doctor({"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert disabled.returncode == 1
    assert "did not load the plugin's entry point" in disabled.stdout


def test_unsupported_verl_versions_are_detected():
    from gepo_plugin.names import verl_version_supported

    assert verl_version_supported("0.9.1") and verl_version_supported("0.9.7")
    assert not verl_version_supported("0.9.0") and not verl_version_supported("0.10.0")


def test_demo_cli_runs_and_checks_group_semantics():
    result = subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "demo", "--prompts", "3", "--micro-batches", "3"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: per-prompt group expectation is preserved" in result.stdout


def test_cli_rejects_bad_demo_options():
    bad = subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "demo", "--responses", "1"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "--responses >= 2" in bad.stderr + bad.stdout
