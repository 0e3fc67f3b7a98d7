"""bench/gpu_check.py, the torch-only check run on a lent GPU machine: its quick CPU run passes and its JSON holds every
figure it promises; it imports none of verl, Ray, Hydra, OmegaConf, transformers or vLLM, and still runs where those,
pydantic, zstandard and xxhash cannot be imported at all (as on that machine); its GSPO baseline is verl's own."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # each test starts an interpreter (torch's import, then a run of seconds)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
FORBIDDEN = ("verl", "ray", "hydra", "omegaconf", "transformers", "vllm")
#: what the device machine lacks among the plugin's module-level imports, and must be stood in for
MISSING_THERE = ("pydantic", "zstandard", "xxhash")


def run_check(tmp_path: Path, *args: str, unimportable: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """Run the script with the venv's python (cwd elsewhere, as the script must find the checkout itself); each
    package in ``unimportable`` is made to fail its import (None in sys.modules). Returns its JSON and its output."""
    out = tmp_path / "gpu_check.json"
    argv = [str(SCRIPT), *args, "--json", str(out), "--no-progress"]
    code = (
        "import runpy, sys\n"
        f"for name in {list(unimportable)!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = {argv!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return json.loads(out.read_text()), output


def assert_correctness_passed(result: dict[str, Any]) -> None:
    correctness = result["correctness"]
    assert correctness["passed"]
    for dtype in ("float32", "bfloat16"):
        checks = [c for c in correctness["checks"] if c["dtype"] == dtype]
        assert {c["loss"] for c in checks} == {"gepo", "gepo_plus_hard", "gepo_plus_soft"}
        tolerance = correctness["tolerances"][dtype]
        for check in checks:
            assert check["passed"], check
            assert check["tolerance"] == tolerance
            assert 0 <= check["loss_rel_err"] < tolerance, check
            assert 0 <= check["grad_rel_err"] < tolerance, check
    assert correctness["tolerances"]["float32"] < correctness["tolerances"]["bfloat16"]


def assert_no_framework(result: dict[str, Any]) -> None:
    imports = result["imports"]
    assert imports["forbidden_imported"] == []
    assert not set(FORBIDDEN) & set(imports["third_party_top_level"]), imports["third_party_top_level"]
    assert "torch" in imports["third_party_top_level"]


def test_quick_cpu_run(tmp_path):
    result, output = run_check(tmp_path, "--device", "cpu", "--quick")
    assert result["passed"]
    assert result["device"]["device"] == "cpu"
    assert result["args"]["rows"] == 16 and result["args"]["tokens"] == 256 and result["args"]["relay_mb"] == 8
    assert_correctness_passed(result)
    # GEPO against GSPO: finite positive times and ratios; no peak memory off CUDA
    perf = result["performance"]
    ratio = perf["gepo_over_gspo_time"]
    assert math.isfinite(ratio) and ratio > 0
    for name, entry in perf["losses"].items():
        assert math.isfinite(entry["median_ms"]) and entry["median_ms"] > 0, name
        assert math.isfinite(entry["time_vs_gspo"]) and entry["time_vs_gspo"] > 0, name
        assert entry["peak_mib"] is None
    assert set(perf["losses"]) >= {"gspo", "gepo", "gepo_plus_hard"}
    # the relay codec: every figure positive, the delta applied bit for bit, digests equal (xxhash is installed here)
    relay = result["relay"]
    assert relay["apply_exact"] is True and relay["digest_match"] is True and relay["passed"]
    assert relay["state_mib"] > 7 and 0 < relay["changed_fraction"] < 1 and relay["delta_mib"] > 0
    assert set(relay["ops"]) == {"snapshot", "encode delta", "apply delta", "digest"}
    for op, entry in relay["ops"].items():
        assert entry["with_copy_gb_per_s"] > 0, op
        if op != "snapshot":
            assert entry["host_gb_per_s"] > 0, op
    assert_no_framework(result)
    assert result["imports"]["stand_ins"] == {}  # pydantic, zstandard and xxhash are installed here: the real ones ran
    assert "GEPO/GSPO: time" in output and "overall: PASS" in output


def test_runs_where_the_device_machine_lacks_packages(tmp_path):
    """verl & co. and pydantic, zstandard, xxhash unimportable: stand-ins for the last three, the digest skipped."""
    blocked = (*FORBIDDEN, *MISSING_THERE, "pandas", "fsspec", "tqdm")
    result, output = run_check(
        tmp_path, "--device", "cpu", "--quick", "--rows", "8", "--tokens", "64", "--group-size", "4",
        "--relay-mb", "1", "--repeats", "2", unimportable=blocked,
    )  # fmt: skip
    assert result["passed"]
    assert_correctness_passed(result)
    assert_no_framework(result)
    assert set(result["imports"]["stand_ins"]) == set(MISSING_THERE)
    relay = result["relay"]
    assert relay["apply_exact"] is True and relay["digest_match"] is None
    assert "xxhash" in relay["ops"]["digest"]["skipped"]
    assert relay["ops"]["encode delta"]["with_copy_gb_per_s"] > 0
    assert "stand-ins for missing packages: pydantic" in output


def test_help_names_every_option():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for option in (
        "--device", "--quick", "--rows", "--tokens", "--group-size", "--dtype", "--repeats", "--warmup",
        "--relay-mb", "--relay-repeats", "--seed", "--skip", "--json", "--progress",
    ):  # fmt: skip
        assert option in proc.stdout, option
    assert "run(command=" in proc.stdout  # the docstring: how to run it on the device machine


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_gspo_baseline_is_verls():
    """The script's GSPO (copied, since verl cannot be imported there) against verl's compute_policy_loss_gspo."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo

    from gepo_plugin.verl_glue.loss_batch import compose_actor_config

    script = load_script()
    config = compose_actor_config(
        [
            "strategy=fsdp2",
            "ppo_micro_batch_size_per_gpu=1",
            "policy_loss.loss_mode=gspo",
            "loss_agg_mode=seq-mean-token-mean",
            f"clip_ratio_low={script.CLIP}",
            f"clip_ratio_high={script.CLIP}",
        ]
    )
    config.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    batch = script.make_batch(rows=64, tokens=48, group_size=4, seed=3).to("cpu", torch.float32)

    def loss_and_grad(fn, **kwargs):
        leaf = batch.log_prob.detach().clone().requires_grad_()
        loss, metrics = fn(
            log_prob=leaf,
            old_log_prob=batch.old_log_prob,
            advantages=batch.advantages,
            response_mask=batch.mask,
            **kwargs,
        )
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss, grad, metrics

    ours = loss_and_grad(script.gspo_loss)
    verls = loss_and_grad(
        compute_policy_loss_gspo, loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=None
    )
    torch.testing.assert_close(ours[0], verls[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[1], verls[1], rtol=1e-6, atol=1e-12)
    assert ours[2] == pytest.approx(verls[2], rel=1e-6)
    assert float(verls[2]["actor/pg_clipfrac"]) > 0  # the clipped branch was exercised
