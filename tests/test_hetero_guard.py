"""The staleness guard: its rule, ESS/N in log space, the core deciding with the tightened bound, and its books."""

from __future__ import annotations

import math

import pytest
import torch

from gepo_plugin.hetero.core import BoundViolation, StalenessCore
from gepo_plugin.hetero.guard import GuardConfig, StalenessGuard, check_guard, ess_fraction, ess_fraction_from_sums
from gepo_plugin.hetero.lag_buckets import finalize_lag_metrics, weight_sums_by_lag
from gepo_plugin.hetero.settings import HeteroConfigError, parse_hetero
from gepo_plugin.hetero.staleness import StalenessPolicy


def test_ess_fraction_is_the_textbook_formula_and_stays_finite_in_log_space():
    w = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    assert ess_fraction(w.log()) == pytest.approx(float(w.sum() ** 2 / (4 * (w**2).sum())), rel=1e-12)
    assert ess_fraction(torch.zeros(7)) == pytest.approx(1.0)
    # one weight e^800 times larger than the rest: exp would overflow float64; the log-space form gives 1/N
    assert ess_fraction(torch.tensor([800.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert ess_fraction_from_sums(4, float(w.sum()), float((w**2).sum())) == pytest.approx(ess_fraction(w.log()))
    assert math.isnan(ess_fraction_from_sums(0, 0.0, 0.0))


def test_the_step_ess_from_per_bucket_totals_equals_the_whole_batch_formula():
    """Two micro-batches' by-lag totals, added as verl adds them, give the whole step's ESS/N, overall and per
    bucket."""
    log_w = torch.tensor([0.1, -0.3, 0.8, 0.0, -1.2, 0.5], dtype=torch.float64)
    lags = torch.tensor([0, 0, 2, 5, 5, 40])
    halves = [weight_sums_by_lag(log_w[rows], lags[rows]) for rows in (slice(0, 3), slice(3, 6))]
    metrics = {}
    for sums in halves:
        for label, entry in sums.items():
            for name, value in entry.items():
                key = f"actor/gepo/seq_is_by_lag/{label}/{name}"
                metrics[key] = metrics.get(key, 0.0) + value
    finalize_lag_metrics(metrics)
    assert metrics["actor/gepo/ess_step"] == pytest.approx(ess_fraction(log_w), rel=1e-12)
    assert metrics["actor/gepo/seq_is_by_lag/3-8/ess"] == pytest.approx(ess_fraction(log_w[3:5]), rel=1e-12)
    assert metrics["actor/gepo/seq_is_by_lag/33+/ess"] == pytest.approx(1.0)


def test_the_rule_tightens_after_patience_low_steps_and_relaxes_after_patience_high_ones():
    guard = StalenessGuard(GuardConfig(enable=True, min_ess=0.5, relax_ess=0.8, patience=2, floor=2), ceiling=16)
    assert guard.observe(1, 0.4) is None  # one low step: patience not reached
    assert guard.observe(2, 0.6) is None  # in between: the streak resets
    assert guard.observe(3, 0.4) is None
    assert guard.observe(4, 0.3) == (16, 8)
    assert guard.observe(5, 0.3) is None and guard.observe(6, 0.3) == (8, 4)
    assert guard.observe(7, 0.3) is None and guard.observe(8, 0.3) == (4, 2)
    assert guard.observe(9, 0.3) is None and guard.observe(10, 0.3) is None  # at the floor
    assert guard.observe(11, math.nan) is None  # a non-finite ESS is not evidence either way
    assert guard.observe(12, 0.9) is None and guard.observe(13, 0.85) == (2, 4)
    for step in range(14, 30):
        guard.observe(step, 0.95)
    assert guard.effective == 16  # never above the ceiling
    kinds = [change["kind"] for change in guard.changes]
    assert kinds == ["tighten"] * 3 + ["relax"] * 3
    assert guard.metrics() == {"guard/max_lag": 16.0, "guard/tightened": 3.0, "guard/relaxed": 3.0}
    restored = StalenessGuard(guard.config, ceiling=16)
    restored.load_state_dict(guard.state_dict())
    assert restored == guard


def test_the_core_decides_with_the_tightened_bound_and_saves_it():
    policy = StalenessPolicy(max_lag=4, strategy="drop")
    core = StalenessCore(policy, GuardConfig(enable=True, patience=1, floor=1))
    core.finished("old", 3, 3)  # lag 3 at learner version 6
    core.finished("new", 6, 6)
    assert core.evictions(6) == {}
    note = core.observe_ess(6, 0.1)
    assert note is not None and "tightened 4 -> 2" in note and core.policy.max_lag == 2
    assert core.evictions(6) == {"old": "stale"}  # now beyond the effective bound: dropped, with its reason
    assert not core.may_start(6, 3)  # admission follows the tightened bound too
    with pytest.raises(BoundViolation):
        core.train(["old"], 6)
    metrics = core.metrics()
    assert metrics["guard/max_lag"] == 2.0 and metrics["guard/tightened"] == 1.0
    resumed = StalenessCore(policy, GuardConfig(enable=True, patience=1, floor=1))
    resumed.load_state_dict(core.state_dict())
    assert resumed.policy.max_lag == 2 and resumed.guard.changes == core.guard.changes
    assert "relaxed 2 -> 4" in resumed.observe_ess(7, 0.99)
    assert resumed.policy == policy


def test_without_the_guard_the_core_ignores_ess():
    core = StalenessCore(StalenessPolicy(max_lag=4))
    assert core.observe_ess(1, 0.0) is None and core.policy.max_lag == 4
    assert "guard/max_lag" not in core.metrics()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"max_lag": None, "guard": {"enable": True}}, "max_lag must be a number"),
        ({"max_lag": 2, "guard": {"enable": True, "floor": 3}}, "guard.floor (3) > max_lag (2)"),
        (
            {"max_lag": 4, "strategy": "wait", "admission_margin": 2, "guard": {"enable": True, "floor": 1}},
            "guard.floor (1) < admission_margin (2)",
        ),
        ({"guard": {"enable": True, "min_ess": 0.9, "relax_ess": 0.5}}, "relax_ess (0.5) must be >= min_ess (0.9)"),
        ({"guard": {"enable": "yes"}}, "guard.enable"),
    ],
)
def test_impossible_guards_are_refused_naming_the_key(block, message):
    with pytest.raises(HeteroConfigError, match="hetero"):
        parse_hetero({"enable": True, **block})
    with pytest.raises(HeteroConfigError) as error:
        parse_hetero({"enable": True, **block})
    assert message in str(error.value)


def test_the_core_refuses_a_guard_without_a_bound_by_the_settings_rule():
    with pytest.raises(ValueError, match="max_lag must be a number"):
        StalenessCore(StalenessPolicy(max_lag=None), GuardConfig(enable=True))


def test_check_guard_accepts_a_working_guard():
    check_guard(GuardConfig(enable=True, floor=2), StalenessPolicy(max_lag=8, strategy="wait", admission_margin=2))
