"""GEPO+'s weight variance on Figure 2's toy families, so "never worse than the better of the two" can be read off.

GEPO+ (:mod:`gepo_plugin.maths.gepo_plus`) gives each sample the denominator ``D(x) = (1 - g(x)) E_q[q] + g(x) q(x)``
where ``g`` depends on the sample's k3 estimate of the KL between learner and sampler,
``k3(x) = r - log r - 1`` with ``r = q(x)/p(x)`` (what the loss averages over a sequence's tokens):
``g = 1[k3 < T]`` (hard) or ``g = exp(-k3 / T)`` (soft). Its weight is ``w(x) = p(x) / D(x)``, and this module
computes ``Var_q[w]`` exactly where it can:

* Bernoulli: two outcomes, so the variance is a finite sum (exact for both modes);
* Gaussian, hard: ``log r`` is linear in ``x``, so ``k3 < T`` holds on one interval ``(x1, x2)`` and every
  moment is a sum of Gaussian integrals over an interval or its complement (normal CDFs, exact);
* Gaussian, soft: the trapezoidal rule on a wide, fine grid (its integrand is smooth, so the rule converges
  exponentially; the tests check it against the closed forms at both ends, ``T -> 0`` and ``T -> inf``).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr

FloatArray = NDArray[np.float64]

#: Half-width (in standard deviations around the means) and points of the soft mode's Gaussian quadrature.
QUADRATURE_HALF_WIDTH = 14.0
QUADRATURE_POINTS = 8001


def k3(p: ArrayLike, q: ArrayLike) -> FloatArray:
    """Per-sample k3 KL estimate ``r - log r - 1``, ``r = q / p`` (the GEPO+ gate's input)."""
    r = np.asarray(q, dtype=np.float64) / np.asarray(p, dtype=np.float64)
    return r - np.log(r) - 1.0


def own_share(kl: ArrayLike, mode: str, threshold: float) -> FloatArray:
    """``g``: the weight of the sample's own ``q(x)`` in its denominator."""
    kl = np.asarray(kl, dtype=np.float64)
    if mode == "hard":
        return (kl < threshold).astype(np.float64)
    if mode == "soft":
        with np.errstate(over="ignore"):  # kl / tiny T -> inf: exp(-inf) = 0, the exact limit
            return np.clip(np.exp(-kl / threshold), 0.0, 1.0)
    raise ValueError(f"mode must be 'hard' or 'soft', got {mode!r}")


def _two_point_variance(probs: FloatArray, values: FloatArray) -> FloatArray:
    """Variance of a variable taking ``values[..., k]`` with probability ``probs[..., k]``."""
    mean = (probs * values).sum(-1)
    return np.maximum((probs * values**2).sum(-1) - mean**2, 0.0)


def bernoulli_var_gepo_plus(a: ArrayLike, b: ArrayLike, mode: str, threshold: float) -> FloatArray:
    """``Var_q[p / D]`` for ``p = Bern(a)``, ``q = Bern(b)`` (outcome 1: ``p = a``, ``q = b``; outcome 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    p = np.stack([a, 1.0 - a], -1)
    q = np.stack([b, 1.0 - b], -1)
    expectation = (q**2).sum(-1, keepdims=True)
    g = own_share(k3(p, q), mode, threshold)
    return _two_point_variance(q, p / ((1.0 - g) * expectation + g * q))


def _k3_roots(threshold: float) -> tuple[float, float]:
    """The two roots ``u_lo < 0 < u_hi`` of ``e^u - u - 1 = T`` (bisection; ``k3`` is convex in ``u = log r``)."""

    # on [-big, 0]: decreasing in u; on [0, big]: increasing
    lo, hi = -max(50.0, threshold + 10.0), 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if math.expm1(mid) - mid < threshold else (mid, hi)
    u_lo = 0.5 * (lo + hi)
    lo, hi = 0.0, math.log(threshold + 2.0) + 1.0
    while math.expm1(hi) - hi < threshold:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.expm1(mid) - mid < threshold else (lo, mid)
    return u_lo, 0.5 * (lo + hi)


def _interval_mass(mean: FloatArray, std: float, x1: FloatArray, x2: FloatArray) -> FloatArray:
    """``P(x1 < X < x2)`` for ``X ~ N(mean, std^2)``."""
    return ndtr((x2 - mean) / std) - ndtr((x1 - mean) / std)


def gaussian_var_gepo_plus_hard(a: ArrayLike, b: ArrayLike, threshold: float) -> FloatArray:
    """``Var_q[p / D]`` for ``p = N(a, 1)``, ``q = N(b, 1)`` and the hard gate, in closed form.

    ``u(x) = log q/p = (b - a) x + (a^2 - b^2)/2`` is linear, so ``k3 < T`` iff ``u`` lies between the roots
    ``u_lo < 0 < u_hi`` of ``e^u - u - 1 = T``: an interval ``I = (x1, x2)`` (the whole line when ``a = b``).
    On ``I`` the weight is ``p/q``, elsewhere ``p / E_q[q]`` with ``E_q[q] = 1/(2 sqrt pi)``. With the
    Gaussian products of :mod:`gepo_plugin.lab.variance`'s derivations,

    * ``E_q[w]   = P_{N(a,1)}(I) + E_q[p]/E_q[q] * P_{N((a+b)/2, 1/2)}(not I)``, ``E_q[p] = e^(-d^2/4)/(2 sqrt pi)``;
    * ``E_q[w^2] = e^(d^2) P_{N(2a-b,1)}(I) + E_q[p^2]/E_q[q]^2 * P_{N((2a+b)/3, 1/3)}(not I)``,
      ``E_q[p^2] = e^(-d^2/3)/(2 pi sqrt 3)``.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = a - b
    u_lo, u_hi = _k3_roots(threshold)
    slope = b - a
    offset = (a**2 - b**2) / 2.0
    safe = np.where(slope == 0.0, 1.0, slope)
    ends = np.stack([(u_lo - offset) / safe, (u_hi - offset) / safe], -1)
    x1 = np.where(slope == 0.0, -np.inf, ends.min(-1))
    x2 = np.where(slope == 0.0, np.inf, ends.max(-1))
    expectation = 1.0 / (2.0 * math.sqrt(math.pi))
    mean_p = np.exp(-(d**2) / 4.0) / (2.0 * math.sqrt(math.pi))
    second_p = np.exp(-(d**2) / 3.0) / (2.0 * math.pi * math.sqrt(3.0))
    in_pq = _interval_mass((a + b) / 2.0, math.sqrt(0.5), x1, x2)
    in_p2q = _interval_mass((2 * a + b) / 3.0, 3**-0.5, x1, x2)
    first = _interval_mass(a, 1.0, x1, x2) + mean_p / expectation * (1.0 - in_pq)
    second = np.exp(d**2) * _interval_mass(2 * a - b, 1.0, x1, x2) + second_p / expectation**2 * (1.0 - in_p2q)
    return np.maximum(second - first**2, 0.0)


def gaussian_var_gepo_plus_soft(a: ArrayLike, b: ArrayLike, threshold: float) -> FloatArray:
    """``Var_q[p / D]`` for unit Gaussians and the soft gate, by the trapezoidal rule (vectorised over pairs)."""
    a = np.asarray(a, dtype=np.float64)[..., None]
    b = np.asarray(b, dtype=np.float64)[..., None]
    low = np.minimum(a, 2 * a - b) - QUADRATURE_HALF_WIDTH
    high = np.maximum(b, 2 * a - b) + QUADRATURE_HALF_WIDTH
    x = low + (high - low) * np.linspace(0.0, 1.0, QUADRATURE_POINTS)
    log_p = -((x - a) ** 2) / 2.0 - 0.5 * math.log(2 * math.pi)
    log_q = -((x - b) ** 2) / 2.0 - 0.5 * math.log(2 * math.pi)
    u = log_q - log_p
    g = own_share(np.expm1(u) - u, "soft", threshold)
    expectation = 1.0 / (2.0 * math.sqrt(math.pi))
    q = np.exp(log_q)
    w = np.exp(log_p) / ((1.0 - g) * expectation + g * q)
    first = np.trapezoid(q * w, x, axis=-1)
    second = np.trapezoid(q * w**2, x, axis=-1)
    return np.maximum(second - first**2, 0.0)


def gaussian_var_gepo_plus(a: ArrayLike, b: ArrayLike, mode: str, threshold: float) -> FloatArray:
    """``Var_q[p / D]`` for ``p = N(a, 1)``, ``q = N(b, 1)`` (closed form when hard, quadrature when soft)."""
    if mode == "hard":
        return gaussian_var_gepo_plus_hard(a, b, threshold)
    if mode == "soft":
        return gaussian_var_gepo_plus_soft(a, b, threshold)
    raise ValueError(f"mode must be 'hard' or 'soft', got {mode!r}")


def var_gepo_plus(family: str, a: ArrayLike, b: ArrayLike, mode: str, threshold: float) -> FloatArray:
    """GEPO+'s weight variance for ``family`` ("bernoulli" or "gaussian")."""
    if family == "bernoulli":
        return bernoulli_var_gepo_plus(a, b, mode, threshold)
    if family == "gaussian":
        return gaussian_var_gepo_plus(a, b, mode, threshold)
    raise ValueError(f"unknown family {family!r}; expected 'bernoulli' or 'gaussian'")


def summarise_plus(var_plus: FloatArray, var_is: FloatArray, var_gepo: FloatArray, kl: FloatArray) -> dict:
    """Is GEPO+ never worse than the better of ``p/q`` and GEPO? Where it is worse, by how much and at which KL."""
    better = np.minimum(var_is, var_gepo)
    worse = var_plus > better * (1.0 + 1e-9) + 1e-12
    excess = var_plus - better
    return {
        "fraction_worse_than_better": float(worse.mean()),
        "max_excess_over_better": float(excess.max()),
        "kl_range_worse": [float(kl[worse].min()), float(kl[worse].max())] if worse.any() else None,
        "fraction_better_than_both": float((var_plus < better * (1.0 - 1e-9)).mean()),
        "median_ratio_to_better_kl_gt_0.1": float(np.median(var_plus[kl > 0.1] / better[kl > 0.1]))
        if (kl > 0.1).any()
        else None,
    }
