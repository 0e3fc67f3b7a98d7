"""Delay models: configured quantiles, seeding, trace replay, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from gepo_plugin.hetero.delays import (
    DelayConfigError,
    LogNormalDelay,
    TraceDelay,
    WeibullDelay,
    build_delay_model,
    delay_rng,
)

N = 400_000


@pytest.mark.parametrize("kind", ["lognormal", "weibull"])
def test_interval_parameterisation_hits_the_configured_quantiles(kind):
    """Paper setting 60-1920 s at 0.995: unclipped samples put 0.25% below 60 s and 0.25% above 1920 s."""
    model = build_delay_model({"distribution": kind, "low": 60, "high": 1920, "confidence": 0.995, "clip": False})
    assert model.quantile(0.0025) == pytest.approx(60, rel=1e-9)
    assert model.quantile(0.9975) == pytest.approx(1920, rel=1e-9)
    draws = model.sample(delay_rng(0), N)
    # binomial standard error of a 0.25% tail with N draws is ~0.008%; allow 4 standard errors
    tol = 4 * np.sqrt(0.0025 * 0.9975 / N)
    assert np.mean(draws < 60) == pytest.approx(0.0025, abs=tol)
    assert np.mean(draws > 1920) == pytest.approx(0.0025, abs=tol)


def test_clipping_keeps_delays_inside_the_interval():
    model = LogNormalDelay.from_interval(60, 1920, 0.9)  # a wide tail outside, clipped by default
    draws = model.sample(delay_rng(1), 50_000)
    assert draws.min() >= 60 and draws.max() <= 1920
    assert np.mean(draws == 60) > 0.03  # the 5% lower tail sits on the bound


def test_weibull_native_parameters_match_the_closed_form_mean():
    import math

    model = WeibullDelay(shape=1.5, scale=300.0)
    draws = model.sample(delay_rng(2), N)
    assert draws.mean() == pytest.approx(300 * math.gamma(1 + 1 / 1.5), rel=0.01)


def test_constant_and_exponential():
    assert np.all(build_delay_model({"distribution": "constant", "seconds": 5}).sample(delay_rng(0), 4) == 5)
    draws = build_delay_model({"distribution": "exponential", "mean": 30}).sample(delay_rng(3), N)
    assert draws.mean() == pytest.approx(30, rel=0.01)


def test_same_seed_same_delays_and_groups_are_independent():
    model = build_delay_model({"distribution": "lognormal", "low": 60, "high": 1920})
    a = model.sample(delay_rng(7, group=0), 16)
    assert np.array_equal(a, model.sample(delay_rng(7, group=0), 16))
    assert not np.array_equal(a, model.sample(delay_rng(7, group=1), 16))
    assert not np.array_equal(a, model.sample(delay_rng(8, group=0), 16))


def test_trace_replay_cycles_in_order(tmp_path):
    trace = tmp_path / "delays.txt"
    trace.write_text("# recorded weight-arrival delays\n10\n20.5\n\n30  # slow link\n")
    model = build_delay_model({"distribution": "trace", "path": str(trace)})
    assert model.sample(delay_rng(0), 5).tolist() == [10, 20.5, 30, 10, 20.5]
    random_order = TraceDelay((1.0, 2.0), order="random").sample(delay_rng(0), 100)
    assert set(random_order.tolist()) == {1.0, 2.0}


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"distribution": "lognormal", "low": 1920, "high": 60}, "low < high"),
        ({"distribution": "weibull", "low": 60, "high": 1920, "confidence": 1.5}, "confidence"),
        ({"distribution": "lognormal", "low": -1, "high": 60}, r"delay\.low=-1: input should be greater than 0"),
        ({"distribution": "gamma", "mean": 3}, r"delay\.distribution='gamma': input should be 'none', 'constant'"),
        ({"distribution": "exponential"}, r"exponential needs \['mean'\]"),
        ({"distribution": "constant", "seconds": -2}, "greater than or equal to 0"),
        ({"distribution": "constant", "seconds": float("inf")}, r"delay\.seconds=inf: input should be a finite"),
        ({"distribution": "constant", "seconds": "abc"}, r"delay\.seconds='abc'"),
        ({"seconds": 5}, r"\['seconds'\] are set but distribution=none"),
        ({"distribution": "weibull", "shape": 0, "scale": 1}, r"delay\.shape=0: input should be greater than 0"),
        ({"distribution": "weibull", "shape": 1, "scale": 1, "low": 1, "high": 2}, "not both"),
        ({"distribution": "trace", "path": "/nonexistent/delays.txt"}, "does not exist"),
    ],
)
def test_impossible_delay_settings_are_rejected(spec, match):
    with pytest.raises(DelayConfigError, match=match):
        build_delay_model(spec)


def test_bad_trace_lines_are_reported_with_their_line(tmp_path):
    trace = tmp_path / "bad.txt"
    trace.write_text("10\nfast\n")
    with pytest.raises(DelayConfigError, match=r"bad\.txt:2"):
        TraceDelay.from_file(trace)
