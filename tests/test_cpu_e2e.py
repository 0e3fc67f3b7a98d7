"""verl's REAL V1 PPO trainer, end to end on CPU, with the plugin (tiny model, real Ray/TransferQueue).

One run (``conftest.fsdp_gepo_sync_run``: GEPO in sync mode, 3 steps, two FSDP2 learners over gloo, the transformers
rollout, deterministic rollouts, M2PO's mask at a budget of 0, a checkpoint at step 3) checks every claim below; its
step 1 is also the reference of the Megatron run (``tests/test_cpu_megatron_e2e.py``). A run costs about 45 s of
start-up on 2 cores and half a second a step, so claims share runs.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gepo_plugin.metric_names import undeclared

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gepo_sync_run(fsdp_gepo_sync_run):
    """GEPO, sync, 3 steps, checkpoint (with an HF copy of the actor) at the last step (shared with the Megatron
    tests, which compare their step 1 with it)."""
    return fsdp_gepo_sync_run


@pytest.fixture(scope="module")
def metrics(gepo_sync_run) -> dict[int, dict]:
    return gepo_sync_run.metrics


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def test_gepo_sync_trains_with_the_group_term(metrics):
    assert sorted(metrics) == [1, 2, 3]
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"]), step
        # the trainer-side term reached the loss for every sample of every micro-batch
        assert m["actor/gepo/group_term_present"] == 1.0
        assert m["gepo/num_groups"] == 4 and m["gepo/group_size_mean"] == 4
        for key in ("iw_mean", "iw_std", "iw_max", "iw_min", "ess", "clipfrac", "sampler_kl"):
            assert _finite(m[f"actor/gepo/{key}"]), key
        assert 0 < m["actor/gepo/ess"] <= 1 + 1e-6
        assert m["actor/gepo/iw_min"] <= m["actor/gepo/iw_mean"] <= m["actor/gepo/iw_max"]
        assert not undeclared(m), undeclared(m)  # every plugin metric is in the metric table
    assert any(m["actor/grad_norm"] > 0 for m in metrics.values())


def test_gepo_sync_changes_the_actor_weights_and_saves_a_checkpoint(gepo_sync_run, tiny):
    from safetensors.torch import load_file

    step_dir = gepo_sync_run.workdir / "checkpoints" / "global_step_3" / "actor"
    assert step_dir.is_dir(), list((gepo_sync_run.workdir / "checkpoints").glob("*"))
    trained = {}
    for shard in sorted((step_dir / "huggingface").glob("*.safetensors")):
        trained.update(load_file(shard))
    initial = load_file(Path(tiny["model"]) / "model.safetensors")
    common = sorted(set(initial) & set(trained))
    assert common, (list(initial)[:3], list(trained)[:3])
    change = sum(float((trained[k].float() - initial[k].float()).abs().sum()) for k in common)
    assert change > 0, "the actor's weights did not change over 3 steps"


def _task_runner_config(log: str) -> dict:
    """The config verl's TaskRunner printed (``pprint`` of the resolved config) in a run's console output.

    Ray's log monitor forwards what it finds in the actor's output file, so on a busy machine it can read a line
    half-written and forward it as two: every forwarded piece is joined back without a newline (pprint's own
    newlines are followed by indentation, so the pieces of the print still parse as one literal)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # Ray colours the actor prefix
    prefix = re.compile(r"^.*?\(TaskRunnerV1 pid=\d+[^)]*\) ")  # Ray writes "<prefix> <piece>"
    pieces = [prefix.sub("", line) for line in plain.splitlines() if "TaskRunnerV1" in line]
    start = next(i for i, piece in enumerate(pieces) if piece.startswith("{'"))
    text = ""
    for piece in pieces[start:]:
        text += piece
        if text.rstrip().endswith("}"):
            try:
                return ast.literal_eval(text)
            except (SyntaxError, ValueError):
                continue
    raise AssertionError("no config printed by the TaskRunner")


def test_cfg_job_prints_exactly_the_config_verls_trainer_received(gepo_sync_run):
    """What ``--cfg job --resolve`` prints for a command line is what verl's TaskRunner received when the same
    command line ran (the TaskRunner only switches TransferQueue on, as it does for every run)."""
    printed = subprocess.run(
        [sys.executable, "-m", "gepo_plugin.main_ppo", *gepo_sync_run.overrides, "--cfg", "job", "--resolve"],
        cwd=gepo_sync_run.workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert printed.returncode == 0, printed.stderr[-3000:]
    shown = yaml.safe_load(printed.stdout)
    received = _task_runner_config(gepo_sync_run.log)
    shown["transfer_queue"]["enable"] = True
    assert shown == received
    assert received["trainer"]["v1"]["trainer_mode"] == "gepo_sync"  # the preset's part, not only the user's
    assert received["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "gepo"


def test_gepo_with_m2pos_mask_reads_the_cap_measured_over_each_mini_batch(metrics):
    """GEPO with ``policy_loss.m2_mask=true``: without the launcher's switch or the patch in the learner processes the
    loss would stop at its first micro-batch (the cap missing); the cap is measured over each whole mini-batch, which
    verl then splits over two learners and two-row micro-batches, and at a budget of 0 every harmful token is masked."""
    for step, m in metrics.items():
        for key in ("m2", "m2_after", "cap_binds", "harmful_tokens", "masked_frac"):
            assert _finite(m[f"actor/m2po/{key}"]), (step, key)
        # the mini-batch's count, the same in every micro-batch of both learners (a micro-batch's own is smaller)
        assert m["actor/m2po/harmful_tokens"] == int(m["actor/m2po/harmful_tokens"]) > 0, step
        assert m["actor/m2po/cap_binds"] == 1.0 and m["actor/m2po/masked_frac"] > 0, step


def test_verls_buffer_no_longer_waits_two_seconds_for_each_generation(metrics):
    """The launcher switches the paced polls on (``patches/replay_buffer_poll.py``): verl's sync buffer slept 2 s
    whenever a batch was not finished, so every step's generation ended on a multiple of 2 s; the tiny model generates
    in well under a second, and after the first step (which starts verl's agent loop) so does the wait for it."""
    waits = [m["timing_s/gen"] for step, m in sorted(metrics.items()) if step > 1]
    assert waits and max(waits) < 1.5, waits
