"""Checks for the Figure-2 variance lab: closed forms against independent numerics, and the outputs.

The closed forms in ``gepo_plugin.lab.variance`` are simplified algebraically (e.g. the chi-square
form of ``Var_q[p/q]``), so each is compared here with a computation that does not share that
algebra: explicit two-outcome sums for the Bernoulli family, trapezoidal quadrature (and one
seeded Monte-Carlo run) for the Gaussian family.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from gepo_plugin.lab import variance as v

BERNOULLI_PAIRS = [(0.05, 0.95), (0.3, 0.3), (0.5, 0.2), (0.9, 0.4), (0.12, 0.61), (0.95, 0.05)]
GAUSSIAN_PAIRS = [(0.0, 0.0), (0.3, -0.2), (-1.0, 1.0), (1.0, 0.25), (-0.7, -0.1)]


def _bernoulli_moments(a: float, b: float) -> dict[str, float]:
    """Explicit sums over the outcomes x in {0, 1}, using np.average with q as weights."""
    p = np.array([1.0 - a, a])
    q = np.array([1.0 - b, b])
    eq_q = float(np.average(q, weights=q))
    w_is = p / q
    w_gepo = p / eq_q
    var_is = float(np.average((w_is - np.average(w_is, weights=q)) ** 2, weights=q))
    var_gepo = float(np.average((w_gepo - np.average(w_gepo, weights=q)) ** 2, weights=q))
    kl = float(np.sum(p * np.log(p / q)))
    return {"eq_q": eq_q, "var_is": var_is, "var_gepo": var_gepo, "kl": kl}


@pytest.mark.parametrize(("a", "b"), BERNOULLI_PAIRS)
def test_bernoulli_closed_forms_match_explicit_sums(a: float, b: float) -> None:
    ref = _bernoulli_moments(a, b)
    assert v.bernoulli_group_expectation(b) == pytest.approx(ref["eq_q"], rel=1e-13)
    assert v.bernoulli_var_is(a, b) == pytest.approx(ref["var_is"], rel=1e-11, abs=1e-14)
    assert v.bernoulli_var_gepo(a, b) == pytest.approx(ref["var_gepo"], rel=1e-11, abs=1e-14)
    assert v.bernoulli_kl(a, b) == pytest.approx(ref["kl"], rel=1e-12, abs=1e-15)
    # The brief's unsimplified forms agree with the simplified ones the module evaluates.
    assert v.bernoulli_var_is(a, b) == pytest.approx(a**2 / b + (1 - a) ** 2 / (1 - b) - 1, rel=1e-11, abs=1e-14)
    eq = b**2 + (1 - b) ** 2
    raw = (b * a**2 + (1 - b) * (1 - a) ** 2 - (a * b + (1 - a) * (1 - b)) ** 2) / eq**2
    assert v.bernoulli_var_gepo(a, b) == pytest.approx(raw, rel=1e-11, abs=1e-14)


# Fine quadrature grid: the integrands are Gaussian-tailed, so [-14, 14] loses < 1e-40 of mass.
_X = np.linspace(-14.0, 14.0, 400_001)


def _normal(x: np.ndarray, mean: float) -> np.ndarray:
    return np.exp(-0.5 * (x - mean) ** 2) / math.sqrt(2.0 * math.pi)


@pytest.mark.parametrize(("a", "b"), GAUSSIAN_PAIRS)
def test_gaussian_closed_forms_match_quadrature(a: float, b: float) -> None:
    p, q = _normal(_X, a), _normal(_X, b)
    eq_q = float(np.trapezoid(q * q, _X))
    mean_is = np.trapezoid(p, _X)  # E_q[p/q] = integral p
    var_is = float(np.trapezoid(p * p / q, _X) - mean_is**2)
    mean_p = np.trapezoid(q * p, _X)
    var_p = float(np.trapezoid(q * p * p, _X) - mean_p**2)
    kl = float(np.trapezoid(p * (np.log(p) - np.log(q)), _X))
    assert v.gaussian_group_expectation() == pytest.approx(eq_q, rel=1e-9)
    assert v.gaussian_var_is(a, b) == pytest.approx(var_is, rel=1e-8, abs=1e-9)
    assert v.gaussian_var_gepo(a, b) == pytest.approx(var_p / eq_q**2, rel=1e-8, abs=1e-9)
    assert v.gaussian_kl(a, b) == pytest.approx(kl, rel=1e-8, abs=1e-9)


def test_gaussian_var_gepo_monte_carlo() -> None:
    """Seeded Monte Carlo, 1e6 draws from q; the weight is bounded so 1% relative is ~10 sigma."""
    rng = np.random.default_rng(0)
    a, b = 0.8, -0.3
    x = rng.normal(b, 1.0, size=1_000_000)
    w = _normal(x, a) / v.gaussian_group_expectation()
    assert float(w.var()) == pytest.approx(float(v.gaussian_var_gepo(a, b)), rel=0.01)


def test_gaussian_bound_residual_and_crossing() -> None:
    d = np.linspace(0.0, 3.0, 3001)
    gap = v.gaussian_var_is(d, 0.0) - v.gaussian_var_gepo(d, 0.0)
    r = v.gaussian_bound_residual(d)
    np.testing.assert_allclose(r, np.exp(v.gaussian_kl(d, 0.0)) - gap, rtol=1e-12, atol=1e-12)
    assert r[0] == pytest.approx(2.0 / math.sqrt(3.0), rel=1e-15)
    assert np.all(np.diff(r) < 0)  # strictly decreasing, so the sup is at d = 0
    kl_star = v.gaussian_crossing_kl()
    d_star = math.sqrt(2.0 * kl_star)
    assert v.gaussian_var_is(d_star, 0.0) == pytest.approx(float(v.gaussian_var_gepo(d_star, 0.0)), rel=1e-10)
    assert v.gaussian_var_is(0.9 * d_star, 0.0) < v.gaussian_var_gepo(0.9 * d_star, 0.0)
    assert v.gaussian_var_is(1.1 * d_star, 0.0) > v.gaussian_var_gepo(1.1 * d_star, 0.0)


@pytest.mark.parametrize("family", ["bernoulli", "gaussian"])
def test_gepo_lower_at_large_kl_higher_in_small_kl_region(family: str) -> None:
    res = v.compute_family(family, 50)
    frac = float(res.gepo_higher.mean())
    assert 0.0 < frac < 1.0
    assert np.all(res.var_gepo[res.kl > 0.5] < res.var_is[res.kl > 0.5])
    assert res.kl[res.gepo_higher].max() < 0.5
    # The bound with the reported constant holds on every cell, and no smaller constant would.
    c_star, _ = v.bound_constant(res.kl, res.gap)
    assert np.all(res.gap >= np.exp(res.kl) - c_star - 1e-12)
    assert np.any(res.gap < np.exp(res.kl) - (c_star - 1e-9))
    if family == "gaussian":
        assert c_star == pytest.approx(v.GAUSSIAN_C_STAR, rel=1e-14)


def test_parameter_grid_rejects_tiny_grid() -> None:
    with pytest.raises(ValueError):
        v.parameter_grid(0.0, 1.0, 1)
    with pytest.raises(ValueError):
        v.compute_family("poisson", 4)


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    with path.open() as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == v.CSV_COLUMNS
    data = np.array(rows[1:], dtype=np.float64)
    return {name: data[:, i] for i, name in enumerate(rows[0])}


def test_run_variance_writes_consistent_outputs(tmp_path: Path) -> None:
    n = 9
    out = tmp_path / "lab"
    summary = v.run_variance(out, grid_points=n, progress=False)
    names = [
        "variance_bernoulli.csv",
        "variance_gaussian.csv",
        "variance_summary.json",
        "variance_table.md",
        "figure2_bernoulli.png",
        "figure2_gaussian.png",
        "figure2_gepo_plus_bernoulli.png",
        "figure2_gepo_plus_gaussian.png",
    ]
    for name in names:
        assert (out / name).is_file(), name
    for fam in ("bernoulli", "gaussian"):
        assert (out / f"figure2_{fam}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "variance_summary.json").read_text()) == summary
    table = (out / "variance_table.md").read_text()
    assert "| quantity | Bernoulli | Gaussian |" in table

    for fam in ("bernoulli", "gaussian"):
        cols = _read_csv(out / f"variance_{fam}.csv")
        s = summary[fam]
        assert len(cols["a"]) == n * n == s["n_cells"]
        higher = cols["var_gepo"] > cols["var_is"]
        gap = cols["var_is"] - cols["var_gepo"]
        assert s["fraction_gepo_higher"] == pytest.approx(higher.mean(), abs=0)
        assert s["n_gepo_higher"] == int(higher.sum())
        assert s["kl_range_gepo_higher"] == pytest.approx([cols["kl"][higher].min(), cols["kl"][higher].max()])
        assert s["kl_max"] == pytest.approx(cols["kl"].max())
        assert s["c_star"] == pytest.approx(float(np.max(np.exp(cols["kl"]) - gap)), rel=1e-12)
        sel = cols["kl"] > 0.1
        assert s["median_ratio_kl_gt_0.1"] == pytest.approx(
            float(np.median(cols["var_gepo"][sel] / cols["var_is"][sel]))
        )
        assert f"{s['fraction_gepo_higher']:.4g}" in table


def test_main_standalone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert v.main(["--out", str(tmp_path), "--grid-points", "5"]) == 0
    assert "fraction where GEPO variance is higher" in capsys.readouterr().out
    assert json.loads((tmp_path / "variance_summary.json").read_text())["grid_points"] == 5


@pytest.mark.slow
def test_without_matplotlib_the_results_are_written_and_the_plots_skipped_with_one_notice(tmp_path):
    """The [lab] extra is optional: say so before the work starts, write every result, skip only the PNGs."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if matplotlib were not installed
        "from gepo_plugin.lab.cli import main\n"
        f"raise SystemExit(main(['variance', '--grid-points', '8', '--out', {str(tmp_path)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("matplotlib is not installed") == 1 and "gepo-plugin[lab]" in result.stderr
    notice, computing = result.stderr.index("matplotlib is not installed"), result.stderr.index("bernoulli")
    assert notice < computing  # said before any work
    written = {path.name for path in tmp_path.iterdir()}
    assert {"variance_summary.json", "variance_table.md", "variance_bernoulli.csv"} <= written
    assert not any(name.endswith(".png") for name in written)
