"""`gepo-lab paired`: the statistics against scipy, the pairing by (seed, max lag), guarded runs named apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from gepo_plugin.lab import paired


def _summary(path: Path, runs: list[tuple[str, int, int, float]], guard: bool = False) -> Path:
    """A stability_summary.json with the fields `paired` reads (method, max_lag, seed, the metrics)."""
    body = {
        "config": {"guard": {"enable": guard}},
        "runs": [
            {"method": m, "max_lag": lag, "seed": s, "last_eval": v, "best_eval": v + 0.1, "best_to_last_gap": 0.1}
            for m, lag, s, v in runs
        ],
    }
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize(("wins", "losses"), [(0, 0), (20, 0), (12, 8), (3, 9), (1, 1)])
def test_sign_test_is_scipys_exact_binomial_test(wins: int, losses: int) -> None:
    expected = 1.0 if wins + losses == 0 else stats.binomtest(wins, wins + losses, 0.5).pvalue
    assert paired.sign_test_p(wins, losses) == pytest.approx(expected, rel=1e-12)


def test_t_interval_is_scipys() -> None:
    values = np.random.default_rng(0).normal(0.05, 0.1, size=17)
    mean, low, high = paired.t_interval(values)
    expected = stats.t.interval(0.95, df=16, loc=values.mean(), scale=stats.sem(values))
    assert mean == pytest.approx(values.mean())
    assert (low, high) == pytest.approx(expected, rel=1e-12)


def test_runs_pair_by_seed_and_lag_across_files_and_guarded_runs_are_named_apart(tmp_path: Path) -> None:
    # the unguarded baseline over two files (seeds split), the guarded method in a third with the same method name
    base_a = _summary(tmp_path / "a.json", [("gepo", 64, 0, 0.50), ("gepo", 64, 1, 0.40), ("gepo", 0, 0, 0.3)])
    base_b = _summary(tmp_path / "b.json", [("gepo", 64, 2, 0.45)])
    guarded = _summary(
        tmp_path / "g.json", [("gepo", 64, 0, 0.55), ("gepo", 64, 1, 0.38), ("gepo", 64, 2, 0.45)], guard=True
    )
    runs = paired.load_runs([base_a, base_b, guarded])
    assert {r["method"] for r in runs} == {"gepo", "gepo+guard"}
    (result,) = paired.compare(runs, "gepo+guard", "gepo")  # lag 0 has no guarded run: no comparison there
    assert result.max_lag == 64 and result.seeds == (0, 1, 2)
    assert result.differences == pytest.approx((0.05, -0.02, 0.0))
    assert (result.a_wins, result.b_wins, result.ties) == (1, 1, 1)
    assert result.sign_p == 1.0


def test_a_run_given_twice_is_refused(tmp_path: Path) -> None:
    one = _summary(tmp_path / "one.json", [("gspo", 64, 3, 0.4)])
    two = _summary(tmp_path / "two.json", [("gspo", 64, 3, 0.5)])
    with pytest.raises(ValueError, match="more than one summary"):
        paired.load_runs([one, two])


def test_the_command_line_prints_the_table_and_draws_the_picture(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from gepo_plugin.lab import cli

    base = _summary(tmp_path / "a.json", [("grpo", 64, s, 0.3 + 0.01 * s) for s in range(4)])
    guarded = _summary(tmp_path / "g.json", [("grpo", 64, s, 0.35 + 0.01 * s) for s in range(4)], guard=True)
    png, out = tmp_path / "forest.png", tmp_path / "paired.json"
    argv = [
        "paired",
        str(base),
        str(guarded),
        "--a",
        "grpo+guard",
        "--b",
        "grpo",
        "--png",
        str(png),
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert "| grpo+guard − grpo | 64 | last_eval | 4 | +0.050" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["a_wins"] == 4
    height, width, _ = image.imread(png).shape
    assert width > 400 and height > 100


def test_several_first_methods_compare_each_against_every_other(tmp_path: Path, capsys) -> None:
    from gepo_plugin.lab import cli

    runs = [(m, 64, s, v + 0.01 * s) for m, v in (("gepo", 0.5), ("gspo", 0.4), ("grpo", 0.3)) for s in range(3)]
    base = _summary(tmp_path / "runs.json", runs)
    assert cli.main(["paired", str(base), "--a", "gepo", "gspo", "--b", "gspo", "grpo"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["gepo − gspo", "gepo − grpo", "gspo − grpo"]  # a method is not compared with itself


def test_per_method_intervals_are_each_methods_own_t_interval_and_the_staleness_plot_is_drawn(tmp_path: Path) -> None:
    """--intervals: every (method, max lag) with its mean and scipy's t interval over its seeds, for each metric;
    --staleness-png: one picture of the metric against max lag."""
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from gepo_plugin.lab import cli

    rng = np.random.default_rng(1)
    values = {(m, lag): rng.uniform(0.2, 0.6, size=5) for m in ("gepo", "m2po") for lag in (0, 64, 256)}
    runs = [(m, lag, s, float(v[s])) for (m, lag), v in values.items() for s in range(5)]
    summary = _summary(tmp_path / "runs.json", runs)
    table, png = tmp_path / "intervals.md", tmp_path / "staleness.png"
    argv = ["paired", str(summary), "--a", "m2po", "--b", "gepo", "--intervals", str(table)]
    argv += ["--staleness-png", str(png)]
    assert cli.main(argv) == 0
    rows = [line.split("|")[1:-1] for line in table.read_text().splitlines()[2:]]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(m, lag) for m in ("gepo", "m2po") for lag in (0, 64, 256)]
    for row in rows:
        v = values[row[0].strip(), int(row[1])]
        low, high = stats.t.interval(0.95, df=4, loc=v.mean(), scale=stats.sem(v))
        assert row[4].strip() == f"{v.mean():.3f} [{low:.3f}, {high:.3f}]"  # last eval
        best_low, best_high = low + 0.1, high + 0.1  # the summary's best eval is last + 0.1
        assert row[3].strip() == f"{v.mean() + 0.1:.3f} [{best_low:.3f}, {best_high:.3f}]"
    height, width, _ = image.imread(png).shape
    assert width > 400 and height > 200
