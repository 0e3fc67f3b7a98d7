"""verl's REAL V1 PPO trainer, end to end on CPU, with the plugin (tiny model, real Ray/TransferQueue).

Each run starts Ray, verl's FSDP2 workers over gloo, the transformers rollout and TransferQueue
(about 1.5-2 minutes on 2 cores), so runs are few and each checks several things.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gepo_plugin.tiny import cpu_run_overrides, run_cpu_training, write_all

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return write_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gepo_sync_run(tiny, tmp_path_factory):
    """GEPO, sync mode, 3 steps, checkpoint (with an HF copy of the actor) at the last step."""
    workdir = tmp_path_factory.mktemp("gepo_sync")
    overrides = cpu_run_overrides(tiny, loss="gepo", mode="sync", steps=3, output_dir=str(workdir), save_freq=3)
    overrides.append("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    code, metrics, log = run_cpu_training(overrides, workdir)
    assert code == 0, log[-6000:]
    return {"workdir": workdir, "metrics": metrics, "log": log, "overrides": overrides}


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def test_gepo_sync_trains_with_the_group_term(gepo_sync_run, tiny):
    metrics = gepo_sync_run["metrics"]
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
    assert any(m["actor/grad_norm"] > 0 for m in metrics.values())


def test_gepo_sync_changes_the_actor_weights_and_saves_a_checkpoint(gepo_sync_run, tiny):
    from safetensors.torch import load_file

    step_dir = Path(gepo_sync_run["workdir"]) / "checkpoints" / "global_step_3" / "actor"
    assert step_dir.is_dir(), list((Path(gepo_sync_run["workdir"]) / "checkpoints").glob("*"))
    trained = {}
    for shard in sorted((step_dir / "huggingface").glob("*.safetensors")):
        trained.update(load_file(shard))
    initial = load_file(Path(tiny["model"]) / "model.safetensors")
    common = sorted(set(initial) & set(trained))
    assert common, (list(initial)[:3], list(trained)[:3])
    change = sum(float((trained[k].float() - initial[k].float()).abs().sum()) for k in common)
    assert change > 0, "the actor's weights did not change over 3 steps"


def test_gepo_sync_resumes_from_its_checkpoint_at_the_right_step(gepo_sync_run):
    workdir = gepo_sync_run["workdir"]
    overrides = [o for o in gepo_sync_run["overrides"] if not o.startswith("trainer.total_training_steps")]
    overrides += ["trainer.total_training_steps=4", "trainer.resume_mode=auto"]
    code, metrics, log = run_cpu_training(overrides, Path(workdir) / "resume")
    assert code == 0, log[-6000:]
    assert sorted(metrics) == [4], "the resumed run must train only step 4"
    assert metrics[4]["actor/gepo/group_term_present"] == 1.0
    assert "global_step_3" in log


def test_separate_async_gepo_has_lag_within_the_bound(tiny, tmp_path):
    threshold = 2
    overrides = cpu_run_overrides(tiny, loss="gepo", mode="separate_async", steps=3, output_dir=str(tmp_path))
    overrides += [
        f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    ]
    code, metrics, log = run_cpu_training(overrides, tmp_path)
    assert code == 0, log[-6000:]
    assert sorted(metrics) == [1, 2, 3]
    lags = [m["training/off_policy/trajectory_staleness_worst/max"] for m in metrics.values()]
    assert max(lags) > 0, f"no stale trajectory was trained (lags {lags}): the run was not asynchronous"
    # verl's bound: (learner step) - (prompt's step) + 1 <= threshold, i.e. worst lag <= threshold - 1
    assert max(lags) <= threshold - 1, lags
    for m in metrics.values():
        assert m["actor/gepo/group_term_present"] == 1.0 and _finite(m["actor/pg_loss"])


@pytest.mark.parametrize("loss,loss_mode", [("gspo", "gspo"), ("grpo", "vanilla")])
def test_other_losses_still_train_in_sync_mode(tiny, tmp_path, loss, loss_mode):
    overrides = cpu_run_overrides(tiny, loss=loss, mode="sync", steps=3, output_dir=str(tmp_path))
    code, metrics, log = run_cpu_training(overrides, tmp_path)
    assert code == 0, log[-6000:]
    assert sorted(metrics) == [1, 2, 3]
    for m in metrics.values():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"])
        assert not any(key.startswith("actor/gepo/") for key in m), "a non-GEPO loss must not log GEPO metrics"
    assert f"'loss_mode': '{loss_mode}'" in log
    assert torch.isfinite(torch.tensor([m["actor/grad_norm"] for m in metrics.values()])).all()
