"""verl's REAL trainer on CPU with the answers to stale rollouts beside GEPO: M2PO over whole mini-batches, and GEPO
with verl's decoupled rollout correction (tiny model, two data-parallel learners, real Ray and TransferQueue)."""

from __future__ import annotations

import math

import pytest
from cpu_runs import timed_run

from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides

pytestmark = pytest.mark.e2e

STEPS = 2


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


@pytest.mark.parametrize(
    "loss",
    [
        "m2po",
        # the same pre-pass, switch and cap fields, read by GEPO's loss: a path CI runs with m2po
        pytest.param("gepo_m2_mask", marks=pytest.mark.extended),
    ],
)
def test_m2po_measures_each_mini_batch_in_the_learners_and_trains(tiny, tmp_path, loss):
    """Without the launcher's switch or the patch in the learner processes the loss would stop at its first
    micro-batch (the cap missing): the run trains, with the cap measured over each whole mini-batch, which verl
    then splits over two learners and two-row micro-batches. The budget 0 clips every harmful token (M2PO), or
    masks it (GEPO with ``m2_mask=true``)."""
    overrides = cpu_run_overrides(tiny, loss=loss.removesuffix("_m2_mask"), steps=STEPS, output_dir=str(tmp_path))
    overrides.append("actor_rollout_ref.actor.policy_loss.m2_budget=0")
    if loss == "gepo_m2_mask":
        overrides.append("actor_rollout_ref.actor.policy_loss.m2_mask=true")
    code, metrics, log = timed_run(f"{loss}, sync, 2 steps", overrides, tmp_path)
    assert code == 0, log[-6000:]
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"]), step
        for key in ("m2", "m2_after", "cap_binds", "harmful_tokens"):
            assert _finite(m[f"actor/m2po/{key}"]), key
        # the mini-batch's count, the same in every micro-batch of both learners (a micro-batch's own is smaller)
        assert m["actor/m2po/harmful_tokens"] == int(m["actor/m2po/harmful_tokens"]) > 0, step
        assert m["actor/m2po/cap_binds"] == 1.0, step
        assert m["actor/pg_clipfrac" if loss == "m2po" else "actor/m2po/masked_frac"] > 0, step
        assert not undeclared(m), undeclared(m)


def test_gepo_with_verls_decoupled_sequence_truncated_is_trains(tiny, tmp_path):
    """algorithm.loss=gepo with bypass_mode=false and rollout_is=sequence: verl recomputes the old log-probs,
    computes its weights and hands them to the gepo loss; its rollout_corr metrics are logged."""
    overrides = cpu_run_overrides(tiny, loss="gepo", steps=STEPS, output_dir=str(tmp_path))
    overrides += ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=sequence"]
    code, metrics, log = timed_run("gepo + decoupled seq IS, sync, 2 steps", overrides, tmp_path)
    assert code == 0, log[-6000:]
    assert "q is the recomputed old policy" in log  # the launcher said what GEPO's q becomes
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and m["actor/gepo/group_term_present"] == 1.0, step
        # verl computes these only in decoupled mode, from the recomputed old log-probs and the rollout's
        assert 0 < m["rollout_corr/rollout_is_mean"] <= m["rollout_corr/rollout_is_max"] <= 2.0, step
        assert not undeclared(m), undeclared(m)
