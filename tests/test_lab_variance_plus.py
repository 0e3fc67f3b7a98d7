"""GEPO+'s weight variance on the toy families: exact against brute-force sums and fine quadrature, and equal to
the closed forms of p/q and GEPO where its gate sends every sample to one side."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gepo_plugin.lab import variance as v
from gepo_plugin.lab import variance_plus as vp


def brute_force_gaussian(a: float, b: float, mode: str, threshold: float) -> float:
    """Var_q[p/D] by a very fine trapezoidal rule, one pair at a time (independent of the module's closed form)."""
    x = np.linspace(min(a, 2 * a - b) - 16, max(b, 2 * a - b) + 16, 400_001)
    log_p = -((x - a) ** 2) / 2 - 0.5 * math.log(2 * math.pi)
    log_q = -((x - b) ** 2) / 2 - 0.5 * math.log(2 * math.pi)
    r = np.exp(log_q - log_p)
    kl = r - np.log(r) - 1
    g = (kl < threshold).astype(float) if mode == "hard" else np.exp(-kl / threshold)
    q = np.exp(log_q)
    w = np.exp(log_p) / ((1 - g) / (2 * math.sqrt(math.pi)) + g * q)
    return float(np.trapezoid(q * w * w, x) - np.trapezoid(q * w, x) ** 2)


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("threshold", [0.002, 0.08, 1.0])
def test_gaussian_variance_matches_a_brute_force_integral(mode, threshold):
    for a, b in [(0.3, -0.4), (-1.0, 1.0), (0.5, 0.45), (0.0, 0.9)]:
        got = float(vp.gaussian_var_gepo_plus(np.array([a]), np.array([b]), mode, threshold)[0])
        # the hard gate's jumps cost the brute-force rule O(h) accuracy (the module's hard form is exact); the soft
        # integrand is smooth, so there the module's coarser rule must agree closely
        rel = 1e-4 if mode == "hard" else 1e-5
        assert got == pytest.approx(brute_force_gaussian(a, b, mode, threshold), rel=rel, abs=1e-7), (a, b)


def test_bernoulli_variance_matches_the_two_outcome_sum():
    for a, b, threshold in [(0.3, 0.35, 0.002), (0.2, 0.8, 0.5), (0.6, 0.58, 0.01)]:
        p, q = np.array([a, 1 - a]), np.array([b, 1 - b])
        e = (q**2).sum()
        for mode in ("hard", "soft"):
            kl = q / p - np.log(q / p) - 1
            g = (kl < threshold).astype(float) if mode == "hard" else np.exp(-kl / threshold)
            w = p / ((1 - g) * e + g * q)
            expected = (q * w**2).sum() - (q * w).sum() ** 2
            got = float(vp.bernoulli_var_gepo_plus(np.array([a]), np.array([b]), mode, threshold)[0])
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-15), (a, b, mode)


@pytest.mark.parametrize("family", ["bernoulli", "gaussian"])
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_the_two_ends_of_the_threshold_are_p_over_q_and_gepo(family, mode):
    """T -> inf: every sample keeps its own q (GSPO's weight); T -> 0: every sample with k3 > 0 takes E_q[q]
    (GEPO), and on the diagonal (k3 = 0 everywhere) the weight is p/q = 1."""
    res = v.compute_family(family, 11)
    huge = vp.var_gepo_plus(family, res.a, res.b, mode, 1e300)
    np.testing.assert_allclose(huge, res.var_is, rtol=1e-7, atol=1e-12)
    tiny = vp.var_gepo_plus(family, res.a, res.b, mode, 1e-300)
    off = res.a != res.b
    # the soft gate at T -> 0 is a spike at k3 = 0 far narrower than the Gaussian quadrature's step
    rtol = 2e-3 if (family, mode) == ("gaussian", "soft") else 1e-7
    np.testing.assert_allclose(tiny[off], res.var_gepo[off], rtol=rtol, atol=1e-12)
    assert np.all(tiny[~off] == 0.0)


def test_the_summary_reports_where_gepo_plus_is_worse_than_the_better_weight():
    kl = np.array([0.01, 0.5, 2.0])
    summary = vp.summarise_plus(np.array([1.0, 2.0, 0.5]), np.array([2.0, 1.0, 3.0]), np.array([3.0, 3.0, 1.0]), kl)
    assert summary["fraction_worse_than_better"] == pytest.approx(1 / 3)
    assert summary["kl_range_worse"] == [0.5, 0.5] and summary["max_excess_over_better"] == 1.0
    assert summary["fraction_better_than_both"] == pytest.approx(2 / 3)
