"""GEPO and HeteroRL through verl's REAL V1 trainer with verl's Megatron engine as the actor, on CPU.

megatron-core 0.16.1 and mbridge 0.15.1 (the ``[megatron-cpu]`` extra), one Megatron rank per data-parallel
worker over gloo, the transformers rollout, real Ray and TransferQueue. Marked ``megatron`` (and ``e2e``):
``-m "not megatron"`` skips them. Their durations on the 2-core machine are in the README's Tests section.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from cpu_runs import PROMPTS, RESPONSES, gepo_sync_overrides, timed_run

from gepo_plugin.config_keys import HF_ROLLOUT_LATENCY
from gepo_plugin.tiny import cpu_run_overrides, run_cpu_training

pytestmark = [pytest.mark.e2e, pytest.mark.megatron]

MEGATRON = "model_engine=megatron"


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


@pytest.fixture(scope="module")
def megatron_sync_run(tiny, tmp_path_factory):
    """GEPO, sync, 3 steps on the Megatron actor, checkpoint (with an HF copy) at step 3."""
    workdir = tmp_path_factory.mktemp("megatron_sync")
    overrides = gepo_sync_overrides(tiny, workdir, 3, [MEGATRON])
    code, metrics, log = timed_run("megatron sync, 3 steps", overrides, workdir)
    assert code == 0, log[-6000:]
    return {"workdir": workdir, "metrics": metrics, "log": log, "overrides": overrides}


def test_gepo_trains_on_the_megatron_actor_with_the_group_term(megatron_sync_run):
    metrics, log = megatron_sync_run["metrics"], megatron_sync_run["log"]
    assert sorted(metrics) == [1, 2, 3]
    assert "'strategy': 'megatron'" in log
    assert "patches applied: megatron_rng_tracker" in log  # verl's engine ran with the CPU patches, not FSDP
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"]), step
        # every sample of every micro-batch Megatron's own forward_step built carried the trainer's group term:
        # 16 samples per step over 2 learners, micro-batches of 2, so 4 micro-batches per learner
        assert m["actor/gepo/group_term_present"] == 1.0, step
        assert m["gepo/num_groups"] == PROMPTS and m["gepo/group_size_mean"] == RESPONSES, step
        for key in ("iw_mean", "ess", "clipfrac"):
            assert _finite(m[f"actor/gepo/{key}"]), key
        assert 0 < m["actor/gepo/ess"] <= 1 + 1e-6
    assert any(m["actor/grad_norm"] > 0 for m in metrics.values())


def test_the_megatron_actor_weights_change_and_the_checkpoint_resumes_at_the_next_step(megatron_sync_run, tiny):
    from safetensors.torch import load_file

    workdir = Path(megatron_sync_run["workdir"])
    step_dir = workdir / "checkpoints" / "global_step_3" / "actor"
    shards = sorted(step_dir.rglob("*.safetensors"))
    assert shards, sorted(p.relative_to(workdir) for p in step_dir.rglob("*"))[:20]
    trained: dict[str, torch.Tensor] = {}
    for shard in shards:
        trained.update(load_file(shard))
    initial = load_file(Path(tiny["model"]) / "model.safetensors")
    common = sorted(set(initial) & set(trained))
    assert len(common) >= len(initial) - 1, (sorted(initial)[:4], sorted(trained)[:4])  # HF names, via mbridge
    change = sum(float((trained[k].float() - initial[k].float()).abs().sum()) for k in common)
    assert change > 0, "the Megatron actor's weights did not change over 3 steps"

    overrides = [o for o in megatron_sync_run["overrides"] if not o.startswith("trainer.total_training_steps")]
    code, metrics, log = run_cpu_training(
        [*overrides, "trainer.total_training_steps=4", "trainer.resume_mode=auto"], workdir / "resume"
    )
    assert code == 0, log[-6000:]
    assert sorted(metrics) == [4], "the resumed run must train exactly step 4"
    assert metrics[4]["actor/gepo/group_term_present"] == 1.0 and _finite(metrics[4]["actor/pg_loss"])
    assert "global_step_3" in log


def test_fsdp2_and_megatron_agree_on_step_one(megatron_sync_run, fsdp_gepo_sync_run):
    """The same tiny model, data, seed and (deterministic) rollouts under FSDP2: step 1 compared with Megatron's.

    The group term is computed by the trainer from the rollout's log-probs, and both engines send the rollout the
    same (bf16-exact) weights, so both runs train on the same responses with the same log-probs: the reward and
    the lengths agree exactly. The group term's step mean agrees to float32 rounding only, because one prompt's
    responses reach the trainer in the order they finished on the server, and a float32 sum depends on its order
    (one ulp, ~2e-7 here). The importance weights come from each engine's own forward pass (megatron-core's local
    attention and bf16 parameters vs FSDP2's bf16 mixed precision with SDPA): per-token log-probs differ by about
    bf16's precision (2^-8 relative, on log-probs of a few nats, partly cancelling over a response), so the
    length-normalised log-ratios, and ``iw_mean``/``ess`` (near 1), differ by about 1e-3. Tolerance 5e-3 for them,
    500 times the group term's: measured 4e-4 (iw_mean) and 7e-4 (ess).
    """
    megatron, reference = megatron_sync_run["metrics"][1], fsdp_gepo_sync_run["metrics"][1]
    for key in ("critic/score/mean", "response_length/mean", "gepo/num_groups", "gepo/group_size_mean"):
        assert megatron[key] == reference[key], (key, megatron[key], reference[key])  # the same rollouts
    key = "gepo/log_group_expectation_mean"
    assert megatron[key] == pytest.approx(reference[key], rel=1e-6, abs=0), (megatron[key], reference[key])
    for key in ("actor/gepo/iw_mean", "actor/gepo/ess"):
        assert megatron[key] == pytest.approx(reference[key], abs=5e-3), (key, megatron[key], reference[key])
        assert megatron[key] != reference[key]  # two engines really computed them
    print({key: (megatron[key], reference[key]) for key in ("actor/gepo/iw_mean", "actor/gepo/ess", "actor/pg_loss")})


HETERO_MAX_LAG = 2


def test_hetero_separate_async_with_a_megatron_learner_and_a_delayed_sampler(tiny, tmp_path):
    """Two samplers (group 1's weights 8 s late) and a Megatron learner in verl's separate_async trainer."""
    overrides = cpu_run_overrides(
        tiny, loss="gepo", mode="separate_async", steps=4, output_dir=str(tmp_path), save_freq=4
    )
    overrides += [
        MEGATRON,
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "hetero.enable=true",
        f"hetero.max_lag={HETERO_MAX_LAG}",
        "hetero.strategy=wait",
        "hetero.group_delays=[{distribution: none},{distribution: constant, seconds: 8}]",
        # a modelled GPU for the CPU rollout (fast enough not to slow the test): hetero.json must record it
        f"+{HF_ROLLOUT_LATENCY}={{decode_tokens_per_s: 4000, prefill_s: 0.01}}",
    ]
    code, metrics, log = timed_run("megatron hetero separate_async, 4 steps", overrides, tmp_path / "run")
    assert code == 0, log[-6000:]
    assert sorted(metrics) == [1, 2, 3, 4]
    assert "'strategy': 'megatron'" in log and "HeteroReplayBuffer" in log
    # the delayed group's weights come from the learner's Megatron snapshots (verl's save_model_to_cpu with the
    # megatron strategy calls copy_megatron_model_to_cpu, which runs through this patch on the CPU)
    assert "megatron_snapshots" in log
    for step, m in metrics.items():
        assert m["hetero/lag/max"] <= HETERO_MAX_LAG, (step, m["hetero/lag/max"])
        assert m["hetero/produced"] == m["hetero/trained"] + m["hetero/dropped"] + m["hetero/queued"], m
        assert m["hetero/trained"] == PROMPTS * step
        assert m["actor/gepo/group_term_present"] == 1.0 and _finite(m["actor/pg_loss"])
        assert m["hetero/sampler_group_0/weight_version"] == step
    versions = {step: m["hetero/sampler_group_1/weight_version"] for step, m in metrics.items()}
    assert any(version < step for step, version in versions.items()), versions  # it lags ...
    assert max(versions.values()) >= 1, versions  # ... and installs delayed snapshots
    assert sum(m.get("hetero/sampler_group_1/trained_trajectories", 0) for m in metrics.values()) > 0
    state = json.loads((tmp_path / "checkpoints" / "global_step_4" / "hetero.json").read_text())
    assert state["replay_buffer"]["ledger"]["trained"] == metrics[4]["hetero/trained"]
    assert state["rollout_latency"] == {"decode_tokens_per_s": 4000, "prefill_s": 0.01}
