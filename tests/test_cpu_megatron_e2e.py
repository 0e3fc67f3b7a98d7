"""GEPO and HeteroRL through verl's REAL V1 trainer with verl's Megatron engine as the actor, on CPU.

megatron-core 0.16.1 and mbridge 0.15.1 (the ``[megatron-cpu]`` extra), one Megatron rank per data-parallel
worker over gloo, the transformers rollout, real Ray and TransferQueue. Marked ``megatron`` (and ``e2e``):
``-m "not megatron"`` skips them. Two scenarios, each run once for every claim of its tests:

* **sync**: GEPO for 3 steps with a checkpoint; its step 1 is compared with the FSDP2 run's
  (``conftest.fsdp_gepo_sync_run``) on the same model, data and deterministic rollouts. A Megatron learner resuming
  from its checkpoint is the relay scenario's (``tests/test_relay_e2e.py``: its resumed run trains on from the
  checkpoint's next step, with its books);
* **HeteroRL**: separate_async with a Megatron learner and two sampler groups, the first's weights 2 s late (it
  installs the learner's Megatron snapshots), the second's never (a control: its reward stays at chance while the
  first group's climbs, and the learner, trained on both, learns).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from chaos import check_every_step
from cpu_runs import MEGATRON, MODELLED_GPU, PROMPTS, RESPONSES, gepo_sync_overrides, megatron_hetero_overrides
from learning import STEPS_TO_LEARN_BESIDE_A_FROZEN_GROUP as HETERO_STEPS
from learning import assert_does_not_learn, assert_learns
from trainer_run import complete_run

pytestmark = [pytest.mark.e2e, pytest.mark.megatron]


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


@pytest.fixture(scope="module")
def megatron_sync_run(tiny, shared_cluster, tmp_path_factory):
    """GEPO, sync, 3 steps on the Megatron actor, checkpoint (with an HF copy) at step 3."""
    workdir = tmp_path_factory.mktemp("megatron_sync")
    # one learner: the run compares with FSDP2's two (the step's statistics are the whole batch's, whatever the split);
    # two Megatron ranks over gloo train in the relay's run (tests/test_relay_e2e.py)
    overrides = [*gepo_sync_overrides(tiny, workdir, 3, [MEGATRON], learners=1), *shared_cluster.join_overrides()]
    first = complete_run("megatron sync", overrides, workdir, env=shared_cluster.env)
    return {"workdir": workdir, "metrics": first.metrics, "log": first.log}


def test_gepo_trains_on_the_megatron_actor_with_the_group_term(megatron_sync_run):
    metrics, log = megatron_sync_run["metrics"], megatron_sync_run["log"]
    assert sorted(metrics) == [1, 2, 3]
    assert "'strategy': 'megatron'" in log
    assert "patches applied: megatron_rng_tracker" in log  # verl's engine ran with the CPU patches, not FSDP
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"]), step
        # every sample of every micro-batch Megatron's own forward_step built carried the trainer's group term:
        # 16 samples per step, micro-batches of 2, so 8 micro-batches
        assert m["actor/gepo/group_term_present"] == 1.0, step
        assert m["gepo/num_groups"] == PROMPTS and m["gepo/group_size_mean"] == RESPONSES, step
        for key in ("iw_mean", "ess", "clipfrac"):
            assert _finite(m[f"actor/gepo/{key}"]), key
        assert 0 < m["actor/gepo/ess"] <= 1 + 1e-6
    assert any(m["actor/grad_norm"] > 0 for m in metrics.values())


def test_the_megatron_actor_weights_change_in_the_hf_checkpoint(megatron_sync_run, tiny):
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


def test_fsdp2_and_megatron_agree_on_step_one(megatron_sync_run, fsdp_gepo_sync_run):
    """The same tiny model, data, seed and (deterministic) rollouts under FSDP2: step 1 compared with Megatron's.

    The group term is computed by the trainer from the rollout's log-probs, and both engines send the rollout the
    same (bf16-exact) weights, so both runs train on the same responses with the same log-probs: the lengths agree
    exactly. The mean score (fractional scores) and the group term's step mean agree to float32 rounding only,
    because one prompt's responses reach the trainer in the order they finished on the server, and a float32 sum
    depends on its order (one ulp, ~1e-7 relative here). The importance weights come from each engine's own forward
    pass (megatron-core's local attention and bf16 parameters vs FSDP2's bf16 mixed precision with SDPA): per-token
    log-probs differ by about bf16's precision (2^-8 relative, on log-probs of a few nats, partly cancelling over a
    response), so the length-normalised log-ratios, and ``iw_mean``/``ess`` (near 1), differ by about 1e-3.
    Tolerance 5e-3 for them, 500 times the group term's: measured 4e-4 (iw_mean) and 7e-4 (ess).
    """
    megatron, reference = megatron_sync_run["metrics"][1], fsdp_gepo_sync_run.metrics[1]
    for key in ("response_length/mean", "gepo/num_groups", "gepo/group_size_mean"):
        assert megatron[key] == reference[key], (key, megatron[key], reference[key])  # the same rollouts
    key = "critic/score/mean"  # a float32 mean of fractional scores, summed in the order responses finished
    assert megatron[key] == pytest.approx(reference[key], rel=1e-6, abs=0), (megatron[key], reference[key])
    key = "gepo/log_group_expectation_mean"
    assert megatron[key] == pytest.approx(reference[key], rel=1e-6, abs=0), (megatron[key], reference[key])
    for key in ("actor/gepo/iw_mean", "actor/gepo/ess"):
        assert megatron[key] == pytest.approx(reference[key], abs=5e-3), (key, megatron[key], reference[key])
        assert megatron[key] != reference[key]  # two engines really computed them
    print({key: (megatron[key], reference[key]) for key in ("actor/gepo/iw_mean", "actor/gepo/ess", "actor/pg_loss")})


#: above the run's length: the frozen group's rollouts stay trainable, so its reward is measured at every step
HETERO_MAX_LAG = HETERO_STEPS + 1
LIVE, FROZEN = "hetero/sampler_group_0/", "hetero/sampler_group_1/"


@pytest.fixture(scope="module")
def hetero_run(tiny, shared_cluster, tmp_path_factory):
    """HeteroRL on separate_async with the Megatron learner (``cpu_runs.megatron_hetero_overrides``): group 0
    receives each version 2 s late, group 1 never; HETERO_STEPS steps, checkpoint at the last."""
    workdir = tmp_path_factory.mktemp("megatron_hetero")
    overrides = [*megatron_hetero_overrides(tiny, workdir, HETERO_STEPS), *shared_cluster.join_overrides()]
    return complete_run("megatron hetero", overrides, workdir / "run", env=shared_cluster.env)


def test_hetero_separate_async_with_a_megatron_learner_keeps_its_books_and_installs_megatron_snapshots(hetero_run):
    metrics, log = hetero_run.metrics, hetero_run.log
    assert sorted(metrics) == list(range(1, HETERO_STEPS + 1))
    assert "'strategy': 'megatron'" in log and "HeteroReplayBuffer" in log
    # the delayed group's weights come from the learner's Megatron snapshots (verl's save_model_to_cpu with the
    # megatron strategy calls copy_megatron_model_to_cpu, which runs through this patch on the CPU)
    assert "megatron_snapshots" in log
    check_every_step(metrics, HETERO_MAX_LAG)
    for step, m in metrics.items():
        assert m["hetero/trained"] == PROMPTS * step
        assert m["hetero/dropped"] == 0, (step, m)  # strategy wait: nothing dropped, the frozen group's groups too
        assert m["actor/gepo/group_term_present"] == 1.0 and _finite(m["actor/pg_loss"])
        assert m[f"{FROZEN}weight_version"] == 0, step  # never installs a version
    versions = {step: m[f"{LIVE}weight_version"] for step, m in metrics.items()}
    assert any(version < step - 1 for step, version in versions.items()), versions  # it lags behind ...
    assert max(versions.values()) >= HETERO_STEPS // 2, versions  # ... and installs delayed snapshots
    assert max(m["hetero/lag/max"] for m in metrics.values()) >= HETERO_STEPS // 2  # the frozen group's lag grew
    state = json.loads(
        (hetero_run.workdir.parent / "checkpoints" / f"global_step_{HETERO_STEPS}" / "hetero.json").read_text()
    )
    assert state["replay_buffer"]["ledger"]["trained"] == metrics[HETERO_STEPS]["hetero/trained"]
    assert state["rollout_latency"] == MODELLED_GPU


def test_the_megatron_learner_learns_from_a_delayed_sampler(hetero_run):
    """The group that receives the weights (2 s late, up to two versions behind) climbs from chance, while half of
    every trained batch comes from the frozen group."""
    assert_learns(hetero_run.metrics, f"{LIVE}reward_mean")


def test_a_sampler_that_never_receives_the_weights_stays_at_chance_while_the_learner_moves(hetero_run):
    """The control: the frozen group generates with the initial weights for the whole run, so its reward does not
    rise, while the learner's loss is that of a model that changes (non-zero gradients, the live group climbing)."""
    metrics = hetero_run.metrics
    assert_does_not_learn(metrics, f"{FROZEN}reward_mean")
    assert all(m["actor/grad_norm"] > 0 for m in metrics.values())
    assert sum(m.get(f"{FROZEN}trained_trajectories", 0) for m in metrics.values()) > 0  # it was trained on
