"""Paired comparison of two methods over seeds: is one really better, or is it seed noise?

Under one seed every method sees the same warm start, the same prompts and the same lag pattern (the stability
lab's schedule does not depend on rewards), so runs pair up by (seed, max_lag). For a metric (``last_eval`` by
default) and a pair of methods this reports, per max_lag: every per-seed difference ``a - b``, their mean with a
two-sided 95% Student-t confidence interval, how many pairs favour each side, and the two-sided sign-test p-value
(exact binomial, ties dropped). The t interval assumes roughly normal differences; the sign test assumes nothing
but independence of the seeds, so the two together say how firm a difference is.

``gepo-lab paired SUMMARY.json [SUMMARY.json ...] --a gepo --b gspo`` reads one or more
``stability_summary.json`` files (runs of different seeds may be split over several) and prints a markdown table.
A run made with the staleness guard on is named ``METHOD+guard`` (``--a gepo+guard --b gepo`` pairs a guarded
run with the unguarded one of the same method, seed and max lag), one corrected with verl's rollout correction
``METHOD+PRESET`` (``gepo+decoupled_seq_is``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("last_eval", "best_eval", "best_to_last_gap")


@dataclass(frozen=True)
class PairedResult:
    """One (method a, method b, max_lag) comparison over paired seeds."""

    a: str
    b: str
    max_lag: int
    metric: str
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    ci_low: float
    ci_high: float
    a_wins: int
    b_wins: int
    ties: int
    sign_p: float

    def as_dict(self) -> dict[str, Any]:
        return {field: getattr(self, field) for field in self.__dataclass_fields__}


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: P(a split at least this uneven | no difference), ties already dropped."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def t_interval(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t confidence interval of the mean (nan interval for fewer than 2 values)."""
    from scipy import stats  # optional: the [lab] extra

    mean = float(values.mean())
    if values.size < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + confidence) / 2, df=values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def compare(runs: Sequence[dict[str, Any]], a: str, b: str, metric: str = "last_eval") -> list[PairedResult]:
    """Paired comparisons of ``a`` against ``b`` for every max_lag both were run at."""
    by_key = {(r["method"], r["max_lag"], r["seed"]): r for r in runs}
    results = []
    for lag in sorted({r["max_lag"] for r in runs}):
        seeds = sorted(s for m, k, s in by_key if m == a and k == lag and (b, lag, s) in by_key)
        if not seeds:
            continue
        diffs = np.array([by_key[(a, lag, s)][metric] - by_key[(b, lag, s)][metric] for s in seeds], dtype=float)
        mean, low, high = t_interval(diffs)
        wins, losses = int((diffs > 0).sum()), int((diffs < 0).sum())
        results.append(
            PairedResult(
                a,
                b,
                lag,
                metric,
                tuple(seeds),
                tuple(float(d) for d in diffs),
                mean,
                low,
                high,
                wins,
                losses,
                int(diffs.size - wins - losses),
                sign_test_p(wins, losses),
            )
        )
    return results


@dataclass(frozen=True)
class MethodInterval:
    """One method's ``metric`` at one max lag over its seeds: the mean with its 95% Student-t interval."""

    method: str
    max_lag: int
    metric: str
    seeds: int
    mean: float
    ci_low: float
    ci_high: float


def method_intervals(runs: Sequence[dict[str, Any]], metric: str) -> list[MethodInterval]:
    """Every (method, max lag) of ``runs``: ``metric``'s mean and interval over its seeds (methods in first-seen
    order, lags ascending)."""
    methods = list(dict.fromkeys(r["method"] for r in runs))
    out = []
    for method in methods:
        for lag in sorted({r["max_lag"] for r in runs if r["method"] == method}):
            values = np.array([r[metric] for r in runs if r["method"] == method and r["max_lag"] == lag], dtype=float)
            mean, low, high = t_interval(values)
            out.append(MethodInterval(method, lag, metric, int(values.size), mean, low, high))
    return out


def intervals_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """One row per (method, max lag): best eval, last eval and best − last, each mean [95% CI] over the seeds."""
    columns = {metric: method_intervals(runs, metric) for metric in METRICS}
    lines = [
        "| method | max lag | seeds | best eval [95% CI] | last eval [95% CI] | best − last [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for best, last, gap in zip(columns["best_eval"], columns["last_eval"], columns["best_to_last_gap"], strict=True):
        cells = [f"{c.mean:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]" for c in (best, last, gap)]
        lines.append(f"| {best.method} | {best.max_lag} | {best.seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


GUARD_SUFFIX = "+guard"


def run_name(method: str, config: dict[str, Any]) -> str:
    """The name a run is paired under: its method, marked when its summary's config had the staleness guard on
    (``+guard``) and with verl's rollout-correction preset it was corrected with (``+decoupled_seq_is``)."""
    guarded = bool(config.get("guard", {}).get("enable", False))
    correction = config.get("rollout_correction")
    return method + (GUARD_SUFFIX if guarded else "") + (f"+{correction}" if correction else "")


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The runs of one or more stability summaries, named by :func:`run_name` ((name, lag, seed) twice: an error)."""
    runs, seen = [], set()
    for path in paths:
        summary = json.loads(Path(path).read_text())
        for run in summary["runs"]:
            run = {**run, "method": run_name(run["method"], summary.get("config", {}))}
            key = (run["method"], run["max_lag"], run["seed"])
            if key in seen:
                raise ValueError(f"{path}: run {key} appears in more than one summary")
            seen.add(key)
            runs.append(run)
    return runs


def markdown(results: Sequence[PairedResult]) -> str:
    lines = [
        "| a − b | max lag | metric | pairs | mean difference [95% CI] | a better / b better / tie | sign test p |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.a} − {r.b} | {r.max_lag} | {r.metric} | {len(r.seeds)} | {r.mean:+.3f} [{r.ci_low:+.3f}, "
            f"{r.ci_high:+.3f}] | {r.a_wins} / {r.b_wins} / {r.ties} | {r.sign_p:.3g} |"
        )
    return "\n".join(lines) + "\n"
