"""The paired comparisons as one picture: per comparison, every seed's difference and the mean's 95% interval."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gepo_plugin.lab.paired import PairedResult


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
