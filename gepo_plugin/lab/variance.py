"""Figure 2 of GEPO (arXiv 2508.17850) at laptop scale: variance of ``p/q`` versus ``p/E_q[q]``.

GEPO replaces the per-sample importance weight ``p(x)/q(x)`` by ``p(x)/E_q[q]``, where the
denominator is the *group expectation* of the sampler's probability, ``E_q[q] = sum_x q(x)^2``
(discrete) or ``integral q(x)^2 dx`` (continuous). The paper's Figure 2 shows, on two toy
families, that the second weight has a much smaller variance under ``q`` once ``KL(p||q)`` is
large, while there is a low-KL region where it is slightly *higher*. This module recomputes
that comparison exactly (closed forms, no sampling), so the claim can be checked, quantified
and re-plotted without a GPU or the paper's code.

Why closed forms rather than Monte Carlo: the interesting region is where the two variances
cross, and a sampling estimate of ``Var_q[p/q]`` is itself heavy-tailed exactly where KL is
large. Exact values make the crossing region and the constant of the lower bound sharp.

What is modelled, and what is not:

* ``E_q[q]`` is the *exact* expectation, treated as a constant. In GEPO training it is
  estimated from the sequences of one group, which adds its own noise; that noise is not here.
* The weight ``p/E_q[q]`` is biased: ``E_q[p/E_q q] = E_q[p]/E_q[q]``, which is not 1 unless
  ``p = q`` (and not even then in general). Figure 2 compares variances only, and so do we.
* "Theorem 1" below means the paper's statement in the form "the gap ``Var_q[p/q] - Var_q[p/E_q q]``
  is bounded below by ``exp(KL) - C``" (arXiv 2508.17850, Section 3). Its exact hypotheses and its
  constant ``C`` are *not* reproduced here. What we compute instead is the smallest constant ``C*``
  for which ``gap >= exp(KL) - C*`` holds on the grid that was evaluated (an empirical,
  grid-dependent quantity), plus, for the Gaussian family, the exact supremum over all means.

Run: ``python -m gepo_plugin.lab variance --out DIR`` (or ``gepo-lab variance ...``, or
``python -m gepo_plugin.lab.variance ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from gepo_plugin.lab.plots import plots_available
from gepo_plugin.maths.options import POLICY_LOSS_DEFAULTS

FloatArray = NDArray[np.float64]

BERNOULLI_RANGE: tuple[float, float] = (0.05, 0.95)
"""Grid range for the Bernoulli parameters ``a`` (of ``p``) and ``b`` (of ``q``), as in the paper's Figure 2."""

GAUSSIAN_RANGE: tuple[float, float] = (-1.0, 1.0)
"""Grid range for the Gaussian means ``a`` (of ``p``) and ``b`` (of ``q``), as in the paper's Figure 2."""

GAUSSIAN_C_STAR: float = 2.0 / math.sqrt(3.0)
"""Exact ``sup_{a,b} [exp(KL) - gap]`` for unit-variance Gaussians; see :func:`gaussian_bound_residual`."""

RATIO_KL_THRESHOLDS: tuple[float, ...] = (0.1, 1.0)
"""KL levels above which the median ratio ``var_gepo / var_is`` is reported."""

CSV_COLUMNS: tuple[str, ...] = ("a", "b", "kl", "var_is", "var_gepo", "var_gepo_plus_hard", "var_gepo_plus_soft")


# ----------------------------------------------------------------------------------------------
# Bernoulli closed forms
# ----------------------------------------------------------------------------------------------


def bernoulli_var_is(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``Var_q[p/q]`` for ``p = Bern(a)``, ``q = Bern(b)``, ``0 < b < 1``.

    Derivation. Under ``q`` the weight ``w = p/q`` takes the value ``a/b`` with probability ``b``
    and ``(1-a)/(1-b)`` with probability ``1-b``. Its mean is ``b*(a/b) + (1-b)*(1-a)/(1-b) = 1``
    (importance weights are unbiased), and its second moment is
    ``b*(a/b)^2 + (1-b)*((1-a)/(1-b))^2 = a^2/b + (1-a)^2/(1-b)``. Hence

        Var_q[p/q] = a^2/b + (1-a)^2/(1-b) - 1.

    Putting everything over ``b(1-b)``, the numerator is
    ``a^2(1-b) + (1-a)^2 b - b(1-b) = a^2 - 2ab + b^2``, so equivalently

        Var_q[p/q] = (a - b)^2 / (b (1 - b))          (the chi-square divergence chi^2(p||q)).

    The second form is what is evaluated: it is exactly zero on the diagonal ``a == b`` instead
    of a rounding residue of either sign, which matters for the "which weight is higher"
    comparison and for the log-scale plot.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a - b) ** 2 / (b * (1.0 - b))


def bernoulli_group_expectation(b: ArrayLike) -> FloatArray:
    """``E_q[q] = sum_x q(x)^2 = b^2 + (1-b)^2`` for ``q = Bern(b)``.

    Derivation: ``q(1) = b`` is drawn with probability ``b`` and ``q(0) = 1-b`` with probability
    ``1-b``, so ``E_q[q] = b*b + (1-b)*(1-b)``. It lies in ``[1/2, 1]``, minimal at ``b = 1/2``.
    """
    b = np.asarray(b, dtype=np.float64)
    return b**2 + (1.0 - b) ** 2


def bernoulli_var_gepo(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``Var_q[p/E_q[q]]`` for ``p = Bern(a)``, ``q = Bern(b)``.

    Derivation. ``E_q[q]`` is a constant, so ``Var_q[p/E_q q] = Var_q[p] / E_q[q]^2``. Under ``q``
    the random variable ``p(x)`` takes the value ``a`` (at ``x = 1``, probability ``b``) and
    ``1-a`` (at ``x = 0``, probability ``1-b``), so

        E_q[p]   = a b + (1-a)(1-b)
        E_q[p^2] = b a^2 + (1-b)(1-a)^2
        Var_q[p/E_q q] = (b a^2 + (1-b)(1-a)^2 - (a b + (1-a)(1-b))^2) / (b^2 + (1-b)^2)^2.

    A two-point variable with values ``u, v`` and probabilities ``b, 1-b`` has variance
    ``b(1-b)(u-v)^2``; with ``u - v = a - (1-a) = 2a - 1`` the numerator simplifies to
    ``b(1-b)(2a-1)^2``, which is the form evaluated (non-negative by construction):

        Var_q[p/E_q q] = b (1-b) (2a-1)^2 / (b^2 + (1-b)^2)^2.

    Note it vanishes at ``a = 1/2`` whatever ``b`` is (``p`` is then constant), and it does
    *not* vanish at ``a = b``: that is where the low-KL "GEPO is higher" region comes from.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return b * (1.0 - b) * (2.0 * a - 1.0) ** 2 / bernoulli_group_expectation(b) ** 2


def bernoulli_kl(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``KL(Bern(a) || Bern(b)) = a log(a/b) + (1-a) log((1-a)/(1-b))`` for ``a, b`` in ``(0, 1)``.

    Derivation: ``KL(p||q) = sum_x p(x) log(p(x)/q(x))`` over the two outcomes ``x = 1``
    (``p = a``, ``q = b``) and ``x = 0`` (``p = 1-a``, ``q = 1-b``). Exactly zero when ``a == b``.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return a * np.log(a / b) + (1.0 - a) * np.log((1.0 - a) / (1.0 - b))


# ----------------------------------------------------------------------------------------------
# Gaussian closed forms (unit variance; only d = a - b matters)
# ----------------------------------------------------------------------------------------------


def gaussian_var_is(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``Var_q[p/q]`` for ``p = N(a, 1)``, ``q = N(b, 1)``: ``exp(d^2) - 1`` with ``d = a - b``.

    Derivation. ``E_q[p/q] = integral p = 1``. The second moment is
    ``E_q[(p/q)^2] = integral p^2/q dx = (2 pi)^(-1/2) integral exp(-(x-a)^2 + (x-b)^2/2) dx``.
    The exponent is ``-x^2/2 + (2a-b) x - a^2 + b^2/2``; completing the square gives
    ``-(x-(2a-b))^2/2 + (2a-b)^2/2 - a^2 + b^2/2`` and the constant equals
    ``2a^2 - 2ab + b^2/2 - a^2 + b^2/2 = (a-b)^2 = d^2``. The remaining Gaussian integral is
    ``sqrt(2 pi)``, so ``E_q[(p/q)^2] = exp(d^2)`` and

        Var_q[p/q] = exp(d^2) - 1          (= exp(2 KL) - 1, since KL = d^2/2).

    Evaluated with ``expm1`` so it is exactly zero at ``d = 0`` and accurate for small ``d``.
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return np.expm1(d**2)


def gaussian_group_expectation() -> float:
    """``E_q[q] = integral q(x)^2 dx = 1 / (2 sqrt(pi))`` for ``q = N(b, 1)``, independent of ``b``.

    Derivation: ``q(x)^2 = (2 pi)^(-1) exp(-(x-b)^2)`` and ``integral exp(-(x-b)^2) dx = sqrt(pi)``,
    so the integral is ``sqrt(pi) / (2 pi) = 1 / (2 sqrt(pi))``.
    """
    return 1.0 / (2.0 * math.sqrt(math.pi))


def gaussian_var_gepo(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``Var_q[p/E_q[q]]`` for ``p = N(a, 1)``, ``q = N(b, 1)``: ``(2/sqrt 3) e^(-d^2/3) - e^(-d^2/2)``.

    Derivation. ``Var_q[p/E_q q] = Var_q[p] / E_q[q]^2`` with ``E_q[q]^2 = 1/(4 pi)``. Use
    ``integral exp(-al (x-a)^2 - be (x-b)^2) dx = sqrt(pi/(al+be)) exp(-al be/(al+be) d^2)``:

    * ``E_q[p] = integral p q = (2 pi)^(-1) * [al = be = 1/2] sqrt(pi) exp(-d^2/4)
      = exp(-d^2/4) / (2 sqrt(pi))`` (the N(0, 2) density at ``d``), so
      ``E_q[p]^2 = exp(-d^2/2) / (4 pi)``.
    * ``E_q[p^2] = integral p^2 q = (2 pi)^(-3/2) * [al = 1, be = 1/2] sqrt(2 pi/3) exp(-d^2/3)
      = exp(-d^2/3) / (2 pi sqrt(3))``.

    Therefore ``Var_q[p] = exp(-d^2/3)/(2 pi sqrt 3) - exp(-d^2/2)/(4 pi)`` and, multiplying by
    ``4 pi``,

        Var_q[p/E_q q] = (2/sqrt(3)) exp(-d^2/3) - exp(-d^2/2).

    At ``d = 0`` this is ``2/sqrt(3) - 1 ~ 0.155 > 0 = Var_q[p/q]``; for large ``d`` it decays to 0
    while ``Var_q[p/q]`` grows like ``exp(d^2)``.
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return GAUSSIAN_C_STAR * np.exp(-(d**2) / 3.0) - np.exp(-(d**2) / 2.0)


def gaussian_kl(a: ArrayLike, b: ArrayLike) -> FloatArray:
    """``KL(N(a,1) || N(b,1)) = d^2 / 2``.

    Derivation: ``log p/q = (-(x-a)^2 + (x-b)^2)/2 = d x - (a^2 - b^2)/2``; under ``p`` (mean ``a``)
    its expectation is ``d a - (a-b)(a+b)/2 = d (a - (a+b)/2) = d^2/2``.
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return d**2 / 2.0


def gaussian_bound_residual(d: ArrayLike) -> FloatArray:
    """Closed form of ``exp(KL) - gap`` for unit Gaussians, as a function of ``d = a - b``.

    With ``gap = Var_q[p/q] - Var_q[p/E_q q]`` and ``KL = d^2/2``, writing ``t = d^2``:

        r(t) = exp(KL) - gap = e^(t/2) - e^t + 1 + (2/sqrt 3) e^(-t/3) - e^(-t/2).

    Why this gives the constant exactly: ``r'(t) = [cosh(t/2) - e^t] - (2/(3 sqrt 3)) e^(-t/3)``
    (after grouping ``e^(t/2)/2 + e^(-t/2)/2 = cosh(t/2)``), and ``cosh(t/2) <= e^(t/2) <= e^t``
    for ``t >= 0``, so ``r`` is strictly decreasing in ``t``. Its supremum over all means is
    therefore ``r(0) = 2/sqrt(3) ~ 1.1547`` (:data:`GAUSSIAN_C_STAR`), attained on the diagonal
    ``a = b``. Consequently ``gap >= exp(KL) - 2/sqrt(3)`` for *every* pair of unit-variance
    Gaussians, with equality only at ``a = b``; any grid that contains a diagonal point has
    ``C* = 2/sqrt(3)`` exactly. The bound is loose for large KL: ``gap ~ exp(2 KL)``.
    """
    t = np.asarray(d, dtype=np.float64) ** 2
    return np.exp(t / 2.0) - np.exp(t) + 1.0 + GAUSSIAN_C_STAR * np.exp(-t / 3.0) - np.exp(-t / 2.0)


def gaussian_crossing_kl(tol: float = 1e-14) -> float:
    """The KL at which the two Gaussian variances are equal (continuous, grid-free).

    ``h(t) = Var_q[p/q] - Var_q[p/E_q q] = e^t - 1 - (2/sqrt 3) e^(-t/3) + e^(-t/2)`` with
    ``t = d^2`` has ``h(0) = 1 - 2/sqrt 3 < 0`` and ``h'(t) = e^t + (2/(3 sqrt 3)) e^(-t/3) -
    e^(-t/2)/2 > 0`` (since ``e^t >= 1 > e^(-t/2)/2``), so there is exactly one root ``t*``:
    GEPO's weight has the higher variance exactly when ``KL < t*/2``. Found by bisection (a
    loop over bisection steps, not over grid points).
    """
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        h = math.expm1(mid) - GAUSSIAN_C_STAR * math.exp(-mid / 3.0) + math.exp(-mid / 2.0)
        lo, hi = (mid, hi) if h < 0.0 else (lo, mid)
    return 0.5 * (0.5 * (lo + hi))


# ----------------------------------------------------------------------------------------------
# Grids and the per-family comparison
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyResult:
    """Everything computed for one family on one grid (flattened ``a``-major arrays)."""

    family: str
    grid_points: int
    param_range: tuple[float, float]
    a: FloatArray
    b: FloatArray
    kl: FloatArray
    var_is: FloatArray
    var_gepo: FloatArray

    @property
    def gap(self) -> FloatArray:
        """``Var_q[p/q] - Var_q[p/E_q q]``: positive where GEPO's weight is the steadier one."""
        return self.var_is - self.var_gepo

    @property
    def gepo_higher(self) -> NDArray[np.bool_]:
        """Cells where GEPO's weight has the strictly higher variance."""
        return self.var_gepo > self.var_is


def parameter_grid(low: float, high: float, grid_points: int) -> tuple[FloatArray, FloatArray]:
    """Flattened ``(a, b)`` meshgrid of ``grid_points`` evenly spaced values in ``[low, high]``.

    Both axes use the same 1-D grid, so the diagonal ``a == b`` (KL = 0) is always included;
    that is where ``C*`` is attained for the Gaussian family.
    """
    if grid_points < 2:
        raise ValueError(f"grid_points must be >= 2, got {grid_points}")
    axis = np.linspace(low, high, grid_points)
    a, b = np.meshgrid(axis, axis, indexing="ij")
    return a.ravel(), b.ravel()


def compute_family(family: str, grid_points: int = 50) -> FamilyResult:
    """Evaluate KL and both weight variances for ``family`` ("bernoulli" or "gaussian") on its grid."""
    if family == "bernoulli":
        rng = BERNOULLI_RANGE
        a, b = parameter_grid(*rng, grid_points)
        kl, var_is, var_gepo = bernoulli_kl(a, b), bernoulli_var_is(a, b), bernoulli_var_gepo(a, b)
    elif family == "gaussian":
        rng = GAUSSIAN_RANGE
        a, b = parameter_grid(*rng, grid_points)
        kl, var_is, var_gepo = gaussian_kl(a, b), gaussian_var_is(a, b), gaussian_var_gepo(a, b)
    else:
        raise ValueError(f"unknown family {family!r}; expected 'bernoulli' or 'gaussian'")
    return FamilyResult(family, grid_points, rng, a, b, kl, var_is, var_gepo)


def bound_constant(kl: FloatArray, gap: FloatArray) -> tuple[float, int]:
    """Smallest ``C`` with ``gap >= exp(KL) - C`` on every given point, and the index attaining it.

    ``C* = max(exp(KL) - gap)``. This is an *empirical* constant for the points supplied: it is
    not the paper's ``C`` (whose definition we could not check) and it depends on the domain.
    For Gaussians it is ``2/sqrt(3)`` on any grid containing ``a = b`` (see
    :func:`gaussian_bound_residual`). For Bernoullis it grows as the domain widens: at
    ``b = 1/2``, ``a -> 0`` both variances tend to 1 (gap -> 0) while ``KL -> log 2``, so on the
    open square ``(0, 1)^2`` no ``C < 2`` works; on ``[0.05, 0.95]^2`` it is about 1.65.
    """
    residual = np.exp(kl) - gap
    idx = int(np.argmax(residual))
    return float(residual[idx]), idx


def summarise_family(res: FamilyResult) -> dict[str, Any]:
    """Reduce a :class:`FamilyResult` to the numbers reported in the summary JSON and table.

    Keys (all plain Python floats/ints so the dict is JSON-serialisable):

    * ``fraction_gepo_higher``: share of grid cells with ``var_gepo > var_is`` (strict).
    * ``kl_range_gepo_higher``: ``[min, max]`` KL over those cells (``None`` if there are none).
    * ``kl_min_is_higher``: smallest KL at which ``p/q`` already has the higher variance; together
      with the previous key it shows how the two regions overlap in KL (for the Bernoulli family
      the sign of the gap is not a function of KL alone).
    * ``max_excess_gepo``: largest ``var_gepo - var_is``, to check the paper's "slightly higher"
      (a relative excess is not reported: ``var_is`` is exactly 0 on the diagonal).
    * ``c_star`` and ``c_star_at``: the Theorem-1-style constant (see :func:`bound_constant`).
    * ``median_ratio_kl_gt_<k>``: median of ``var_gepo / var_is`` over cells with ``KL > k``.
    """
    higher = res.gepo_higher
    gap = res.gap
    c_star, idx = bound_constant(res.kl, gap)
    excess = res.var_gepo - res.var_is
    out: dict[str, Any] = {
        "family": res.family,
        "grid_points": res.grid_points,
        "n_cells": int(res.kl.size),
        "param_range": list(res.param_range),
        "kl_min": float(res.kl.min()),
        "kl_max": float(res.kl.max()),
        "var_is_max": float(res.var_is.max()),
        "var_gepo_max": float(res.var_gepo.max()),
        "n_gepo_higher": int(higher.sum()),
        "fraction_gepo_higher": float(higher.mean()),
        "kl_range_gepo_higher": [float(res.kl[higher].min()), float(res.kl[higher].max())] if higher.any() else None,
        "kl_min_is_higher": float(res.kl[gap > 0].min()) if (gap > 0).any() else None,
        "max_excess_gepo": float(excess.max()) if higher.any() else 0.0,
        "c_star": c_star,
        "c_star_at": {"a": float(res.a[idx]), "b": float(res.b[idx]), "kl": float(res.kl[idx])},
        "bound_min_slack": float((gap - (np.exp(res.kl) - c_star)).min()),
    }
    for k in RATIO_KL_THRESHOLDS:
        sel = res.kl > k
        key = f"median_ratio_kl_gt_{k:g}"
        out[key] = float(np.median(res.var_gepo[sel] / res.var_is[sel])) if sel.any() else None
    if res.family == "gaussian":
        out["c_star_closed_form"] = GAUSSIAN_C_STAR
        out["kl_crossing_closed_form"] = gaussian_crossing_kl()
    else:
        out["c_star_closed_form"] = None
        out["c_star_fine_grid_1001"] = bound_constant(*_bernoulli_kl_gap(1001))[0]
    return out


def _bernoulli_kl_gap(grid_points: int) -> tuple[FloatArray, FloatArray]:
    """KL and gap on a fine Bernoulli grid, to show how far the 50-point ``C*`` is from the domain sup."""
    a, b = parameter_grid(*BERNOULLI_RANGE, grid_points)
    return bernoulli_kl(a, b), bernoulli_var_is(a, b) - bernoulli_var_gepo(a, b)


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


def write_csv(res: FamilyResult, path: Path, plus: dict[str, FloatArray]) -> None:
    """One row per grid cell with the columns of :data:`CSV_COLUMNS`, written at full precision.

    ``%.17g`` round-trips float64, so numbers recomputed from the CSV match the summary exactly.
    """
    data = np.column_stack([res.a, res.b, res.kl, res.var_is, res.var_gepo, plus["hard"], plus["soft"]])
    np.savetxt(path, data, delimiter=",", header=",".join(CSV_COLUMNS), comments="", fmt="%.17g")


def plot_family(res: FamilyResult, c_star: float, path: Path) -> None:
    """Two panels: both variances against KL (log y), and the gap against ``exp(KL) - C*``.

    Cells with zero variance (the ``p/q`` weight on the diagonal, GEPO's at ``a = 1/2``) cannot
    be drawn on a log axis and are omitted from the left panel; the legend says how many.
    """
    import matplotlib  # optional: the [lab] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    title = {"bernoulli": "p=Bern(a), q=Bern(b)", "gaussian": "p=N(a,1), q=N(b,1)"}[res.family]
    fig, (ax_var, ax_gap) = plt.subplots(1, 2, figsize=(11, 4.2))
    for values, label, colour in (
        (res.var_is, "Var_q[p/q]", "tab:red"),
        (res.var_gepo, "Var_q[p/E_q[q]] (GEPO)", "tab:blue"),
    ):
        pos = values > 0
        dropped = int((~pos).sum())
        suffix = f" ({dropped} zero cells omitted)" if dropped else ""
        ax_var.scatter(res.kl[pos], values[pos], s=4, alpha=0.5, color=colour, label=label + suffix)
    ax_var.set_yscale("log")
    ax_var.set_xlabel("KL(p || q)")
    ax_var.set_ylabel("variance under q")
    ax_var.set_title(f"{title}: weight variance vs KL")
    ax_var.legend(loc="lower right", fontsize=8)

    order = np.argsort(res.kl)
    ax_gap.scatter(res.kl, res.gap, s=4, alpha=0.5, color="tab:green", label="gap = Var[p/q] - Var[p/E_q q]")
    ax_gap.plot(
        res.kl[order], np.exp(res.kl[order]) - c_star, color="black", lw=1.2, label=f"exp(KL) - C*, C*={c_star:.4f}"
    )
    ax_gap.axhline(0.0, color="grey", lw=0.6, ls=":")
    ax_gap.set_xlabel("KL(p || q)")
    ax_gap.set_ylabel("variance gap")
    ax_gap.set_title("Theorem-1-style lower bound (empirical C*)")
    ax_gap.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gepo_plus(res: FamilyResult, plus: dict[str, FloatArray], threshold: float, path: Path) -> None:
    """GEPO+'s weight variance (hard and soft) against KL, beside ``p/q``'s and GEPO's (log y; zeros omitted)."""
    import matplotlib  # optional: the [lab] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    title = {"bernoulli": "p=Bern(a), q=Bern(b)", "gaussian": "p=N(a,1), q=N(b,1)"}[res.family]
    fig, axis = plt.subplots(figsize=(6.5, 4.2))
    for values, label, colour, size in (
        (res.var_is, "p/q (GSPO's weight)", "tab:red", 4),
        (res.var_gepo, "p/E_q[q] (GEPO)", "tab:blue", 4),
        (plus["hard"], f"GEPO+ hard, T={threshold:g}", "black", 2),
        (plus["soft"], f"GEPO+ soft, T={threshold:g}", "tab:green", 2),
    ):
        pos = values > 0
        axis.scatter(res.kl[pos], values[pos], s=size, alpha=0.5, color=colour, label=label)
    axis.set_yscale("log")
    axis.set_xlabel("KL(p || q)")
    axis.set_ylabel("weight variance under q")
    axis.set_title(f"{title}: GEPO+ against its two denominators")
    axis.legend(loc="lower right", fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x: Any) -> str:
    """Compact formatting for the markdown table; ``None`` prints as a dash."""
    if x is None:
        return "-"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def markdown_table(summary: dict[str, Any]) -> str:
    """A families-as-columns markdown table of the headline numbers, for pasting into docs."""
    fams = [summary["bernoulli"], summary["gaussian"]]
    rows = [
        ("grid (points per axis / cells)", [f"{f['grid_points']} / {f['n_cells']}" for f in fams]),
        ("parameter range", [_fmt(f["param_range"]) for f in fams]),
        ("KL range on grid", [_fmt([f["kl_min"], f["kl_max"]]) for f in fams]),
        ("fraction where GEPO variance is higher", [_fmt(f["fraction_gepo_higher"]) for f in fams]),
        ("KL range of that region", [_fmt(f["kl_range_gepo_higher"]) for f in fams]),
        (
            "max KL in that region",
            [_fmt(f["kl_range_gepo_higher"][1] if f["kl_range_gepo_higher"] else None) for f in fams],
        ),
        ("min KL where p/q variance is higher", [_fmt(f["kl_min_is_higher"]) for f in fams]),
        ("max excess of GEPO variance (absolute)", [_fmt(f["max_excess_gepo"]) for f in fams]),
        ("C* = max(exp(KL) - gap) on grid", [_fmt(f["c_star"]) for f in fams]),
        ("C* attained at (a, b)", [_fmt([f["c_star_at"]["a"], f["c_star_at"]["b"]]) for f in fams]),
        (
            "C* closed form / fine-grid reference",
            [
                _fmt(summary["bernoulli"]["c_star_fine_grid_1001"]) + " (1001-pt grid)",
                _fmt(summary["gaussian"]["c_star_closed_form"]) + " (= 2/sqrt 3, exact)",
            ],
        ),
        ("median var_gepo/var_is, KL > 0.1", [_fmt(f["median_ratio_kl_gt_0.1"]) for f in fams]),
        ("median var_gepo/var_is, KL > 1", [_fmt(f["median_ratio_kl_gt_1"]) for f in fams]),
        ("max Var[p/q] / max Var[p/E_q q]", [f"{_fmt(f['var_is_max'])} / {_fmt(f['var_gepo_max'])}" for f in fams]),
    ]
    for mode in ("hard", "soft"):
        plus = [f["gepo_plus"][mode] for f in fams]
        rows += [
            (
                f"GEPO+ {mode}: fraction worse than the better of the two",
                [_fmt(p["fraction_worse_than_better"]) for p in plus],
            ),
            (f"GEPO+ {mode}: max excess over the better (absolute)", [_fmt(p["max_excess_over_better"]) for p in plus]),
            (f"GEPO+ {mode}: fraction better than both", [_fmt(p["fraction_better_than_both"]) for p in plus]),
        ]
    lines = ["| quantity | Bernoulli | Gaussian |", "|---|---|---|"]
    lines += [f"| {name} | {vals[0]} | {vals[1]} |" for name, vals in rows]
    crossing = summary["gaussian"]["kl_crossing_closed_form"]
    lines += [
        "",
        f"Gaussian: GEPO's weight has the higher variance exactly when KL < {crossing:.6f} (closed form, grid-free).",
        "C* is the smallest constant with gap >= exp(KL) - C on the evaluated grid; it is not the paper's"
        " Theorem 1 constant, which was not checked against the paper.",
        f"GEPO+ at T = {summary['gepo_plus_threshold']:g}: the gate reads each sample's k3 = r - log r - 1"
        " (r = q/p), as the loss reads each sequence's mean k3.",
    ]
    return "\n".join(lines) + "\n"


def run_variance(
    out_dir: Path, grid_points: int = 50, progress: bool = True, gepo_plus_threshold: float | None = None
) -> dict[str, Any]:
    """Compute both families, write CSVs, summary JSON, markdown table and the PNGs; return the summary.

    Files written to ``out_dir`` (created if missing): ``variance_bernoulli.csv``,
    ``variance_gaussian.csv``, ``variance_summary.json``, ``variance_table.md``,
    ``figure2_bernoulli.png``, ``figure2_gaussian.png`` and GEPO+'s ``figure2_gepo_plus_<family>.png``
    (:mod:`gepo_plugin.lab.variance_plus`, at ``gepo_plus_threshold``: the loss's default if None).
    """
    from gepo_plugin.lab.variance_plus import summarise_plus, var_gepo_plus  # optional: scipy, the [lab] extra

    threshold = POLICY_LOSS_DEFAULTS.gepo_plus_kl_threshold if gepo_plus_threshold is None else gepo_plus_threshold
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draw = plots_available()

    def say(msg: str) -> None:
        if progress:
            print(f"[variance] {msg}", file=sys.stderr, flush=True)

    summary: dict[str, Any] = {
        "grid_points": grid_points,
        "definitions": {
            "var_is": "Var_q[p/q]",
            "var_gepo": "Var_q[p/E_q[q]] with exact E_q[q] = sum q^2 or integral q^2",
            "gap": "var_is - var_gepo",
            "c_star": "max over grid of exp(KL) - gap (smallest C with gap >= exp(KL) - C on the grid)",
            "gepo_plus": "Var_q[p/D], D = (1-g) E_q[q] + g q, g = 1[k3 < T] (hard) or exp(-k3/T) (soft), "
            "k3 = r - log r - 1 with r = q/p per sample",
        },
        "gepo_plus_threshold": threshold,
    }
    results, plus = {}, {}
    for family in ("bernoulli", "gaussian"):
        say(f"{family}: {grid_points}x{grid_points} grid")
        res = compute_family(family, grid_points)
        fam = summarise_family(res)
        summary[family] = fam
        results[family] = res
        plus[family] = {mode: var_gepo_plus(family, res.a, res.b, mode, threshold) for mode in ("hard", "soft")}
        fam["gepo_plus"] = {
            mode: summarise_plus(values, res.var_is, res.var_gepo, res.kl) for mode, values in plus[family].items()
        }
        write_csv(res, out_dir / f"variance_{family}.csv", plus[family])
        say(
            f"{family}: GEPO higher on {fam['fraction_gepo_higher']:.3f} of cells "
            f"(KL up to {_fmt(fam['kl_range_gepo_higher'][1] if fam['kl_range_gepo_higher'] else None)}), "
            f"C* = {fam['c_star']:.4f}"
        )
    (out_dir / "variance_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "variance_table.md").write_text(markdown_table(summary))
    if draw:  # the results are on disk before any plot is attempted
        for family, res in results.items():
            plot_family(res, summary[family]["c_star"], out_dir / f"figure2_{family}.png")
            plot_gepo_plus(res, plus[family], threshold, out_dir / f"figure2_gepo_plus_{family}.png")
    say(f"wrote {out_dir}")
    return summary


def add_variance_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Attach this lab's options to ``parser`` (so a parent CLI can reuse them as a subcommand)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("lab_out/variance"),
        help="directory for CSVs, summary JSON, markdown table and PNGs (created if missing)",
    )
    parser.add_argument(
        "--grid-points",
        type=int,
        default=50,
        help="points per parameter axis (>= 2); the grid has this many squared cells (default 50, as in the paper)",
    )
    parser.add_argument(
        "--gepo-plus-threshold",
        type=float,
        default=None,
        help="GEPO+'s KL threshold T for its variance (default: the loss's, "
        "actor_rollout_ref.actor.policy_loss.gepo_plus_kl_threshold)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress messages on stderr")
    return parser


def run_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the lab from parsed :func:`add_variance_arguments` options; prints the table (bad values exit 2)."""
    if args.grid_points < 2:
        parser.error(f"--grid-points must be >= 2, got {args.grid_points}")
    if args.gepo_plus_threshold is not None and not args.gepo_plus_threshold > 0:
        parser.error(f"--gepo-plus-threshold must be > 0, got {args.gepo_plus_threshold}")
    summary = run_variance(
        args.out,
        grid_points=args.grid_points,
        progress=not args.no_progress,
        gepo_plus_threshold=args.gepo_plus_threshold,
    )
    print(markdown_table(summary), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m gepo_plugin.lab.variance --out DIR``; prints the table."""
    parser = add_variance_arguments(
        argparse.ArgumentParser(prog="python -m gepo_plugin.lab.variance", description=__doc__.splitlines()[0])
    )
    return run_cli(parser.parse_args(argv), parser)


if __name__ == "__main__":
    raise SystemExit(main())
