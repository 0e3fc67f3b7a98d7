"""The staleness guard and the cost of dropping through verl's real separate_async trainer on CPU.

A harsh learning rate makes a stale batch's sequence ratios p_i/q_i spread out (ESS/N well below 1), while an
on-policy batch has them all equal to 1 (ESS/N = 1): with a threshold between the two and patience 1, the guard
must tighten the bound after a stale batch and relax it after an on-policy one, again and again. The modelled GPU
makes each answer's finish time depend on its length, so what is dropped can differ from what is trained.
"""

from __future__ import annotations

import json
import math

import pytest
from cpu_runs import timed_run

from gepo_plugin.config_keys import HF_ROLLOUT_LATENCY
from gepo_plugin.tiny import cpu_run_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS, MAX_LAG, THRESHOLD, MAX_RESPONSE = 8, 2, 0.99, 8


def test_the_guard_tightens_after_stale_batches_and_relaxes_after_fresh_ones(tiny, tmp_path):
    overrides = cpu_run_overrides(
        tiny, loss="gepo", mode="separate_async", steps=STEPS, learners=1, output_dir=str(tmp_path), save_freq=STEPS
    )
    overrides += [
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "actor_rollout_ref.actor.optim.lr=0.05",
        "hetero.enable=true",
        f"hetero.max_lag={MAX_LAG}",
        "hetero.strategy=drop",
        "hetero.group_delays=[{distribution: none},{distribution: constant, seconds: 3}]",
        "hetero.guard.enable=true",
        f"hetero.guard.min_ess={THRESHOLD}",
        f"hetero.guard.relax_ess={THRESHOLD}",
        "hetero.guard.patience=1",
        "hetero.guard.floor=0",
        f"+{HF_ROLLOUT_LATENCY}={{decode_tokens_per_s: 16, prefill_s: 0.1}}",
    ]
    code, metrics, log = timed_run("hetero with the staleness guard", overrides, tmp_path / "run")
    assert code == 0, log[-6000:]
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, m in metrics.items():
        # every batch respects the bound in force when it was selected, itself within the configured ceiling
        assert m["hetero/lag/max"] <= m["hetero/guard/max_lag"] <= MAX_LAG, (step, m)
        assert 0 < m["actor/gepo/ess_step"] <= 1 + 1e-9
        assert m["hetero/produced"] == m["hetero/trained"] + m["hetero/dropped"] + m["hetero/queued"]
    last = metrics[STEPS]
    assert last["hetero/guard/tightened"] >= 1 and last["hetero/guard/relaxed"] >= 1, last

    # each change saved in hetero.json, triggered by that step's ESS/N on the right side of the threshold
    state = json.loads((tmp_path / "checkpoints" / f"global_step_{STEPS}" / "hetero.json").read_text())
    changes = state["replay_buffer"]["guard"]["changes"]
    assert {change["kind"] for change in changes} == {"tighten", "relax"}
    for change in changes:
        ess = metrics[change["step"]]["actor/gepo/ess_step"]
        assert change["ess"] == pytest.approx(ess, rel=1e-6)
        assert (ess < THRESHOLD) if change["kind"] == "tighten" else (ess >= THRESHOLD), change
        assert f"effective max_lag {'tightened' if change['kind'] == 'tighten' else 'relaxed'}" in log
    # the effective bound a step shows is the one the changes so far left
    effective = MAX_LAG
    for step in range(1, STEPS + 1):
        assert metrics[step]["hetero/guard/max_lag"] == effective, step
        for change in (c for c in changes if c["step"] == step):
            effective = change["to"]

    # what dropping costs: both sides' lengths are real answer lengths; dropped ones reported with their books
    dropped_steps = [m for m in metrics.values() if "hetero/dropped/length_mean" in m]
    assert dropped_steps, "nothing was dropped"
    for m in dropped_steps:
        for side in ("dropped", "trained"):
            assert 1 <= m[f"hetero/{side}/length_mean"] <= MAX_RESPONSE
            assert 0 <= m[f"hetero/{side}/reward_mean"] <= 1 and math.isfinite(m["hetero/drop_bias/length"])
    assert not any(key.startswith("hetero/dropped_step/") for m in metrics.values() for key in m)
    print(f"\n[guard] changes {[(c['step'], c['kind'], c['from'], c['to']) for c in changes]}")
