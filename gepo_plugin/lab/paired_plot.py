"""The paired comparisons as one picture: per comparison, every seed's difference and the mean's 95% interval."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gepo_plugin.lab.paired import MethodInterval, PairedResult


def draw_forest(results: Sequence[PairedResult], path: Path) -> None:
    """A forest plot (one row per ``a − b`` at one max lag, top to bottom in ``results``' order): the per-seed
    differences as dots, the mean as a diamond with its Student-t interval, zero as a dashed line; the sign test's
    tally and p on the right. Needs matplotlib (the ``[lab]`` extra)."""
    import matplotlib  # optional: the [lab] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    rows = len(results)
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * rows + 1.2))
    for row, result in enumerate(results):
        y = rows - 1 - row
        ax.scatter(result.differences, [y] * len(result.differences), s=10, color="0.6", zorder=2)
        ax.plot([result.ci_low, result.ci_high], [y, y], color="C0", linewidth=2.5, zorder=3)
        ax.scatter([result.mean], [y], marker="D", color="C0", zorder=4)
        ax.annotate(
            f"{result.a_wins}/{result.b_wins}  p={result.sign_p:.2g}",
            xy=(1.01, y),
            xycoords=("axes fraction", "data"),
            va="center",
            fontsize=8,
        )
    ax.axvline(0.0, color="k", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"{r.a} − {r.b} (lag {r.max_lag})" for r in reversed(results)], fontsize=8)
    metric = results[0].metric if results else ""
    ax.set_xlabel(f"paired difference in {metric} (dots: seeds; diamond and bar: mean, 95% t interval)")
    ax.set_ylim(-0.7, rows - 0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_staleness(intervals: Sequence[MethodInterval], path: Path) -> None:
    """The metric against staleness, one line per method: its mean over seeds at each max lag with the 95% t
    interval as error bars (lags evenly spaced, methods slightly offset so the bars do not hide each other)."""
    import matplotlib  # optional: the [lab] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    methods = list(dict.fromkeys(i.method for i in intervals))
    lags = sorted({i.max_lag for i in intervals})
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.5 / max(len(methods), 1)
    for k, method in enumerate(methods):
        mine = sorted((i for i in intervals if i.method == method), key=lambda i: i.max_lag)
        x = [lags.index(i.max_lag) + (k - (len(methods) - 1) / 2) * width for i in mine]
        means = [i.mean for i in mine]
        errors = [[i.mean - i.ci_low for i in mine], [i.ci_high - i.mean for i in mine]]
        ax.errorbar(x, means, yerr=errors, marker="o", capsize=3, linewidth=1.4, label=f"{method} (n={mine[0].seeds})")
    ax.set_xticks(range(len(lags)))
    ax.set_xticklabels([str(lag) for lag in lags])
    ax.set_xlabel("max lag (updates a rollout may be stale; 0 = on-policy)")
    metric = intervals[0].metric if intervals else ""
    ax.set_ylabel(f"{metric} (mean over seeds, 95% t interval)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
