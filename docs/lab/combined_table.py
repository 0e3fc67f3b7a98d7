"""Mean ± sample std per (method, max lag) over every run of one or more stability summaries (seeds split over
several processes), as the README's 20-seed table shows it.

Usage: .venv/bin/python docs/lab/combined_table.py SUMMARY.json [SUMMARY.json ...]
"""

from __future__ import annotations

import sys

import numpy as np

from gepo_plugin.lab.paired import GUARD_SUFFIX, load_runs
from gepo_plugin.lab.stability_config import METHODS

#: The lab's methods in their own order, each followed by its guarded runs (the names `gepo-lab paired` gives them)
ORDER = tuple(name for method in METHODS for name in (method, method + GUARD_SUFFIX))


def main(paths: list[str]) -> None:
    runs = load_runs(paths)  # refuses a (method, lag, seed) that appears twice
    keys = sorted(
        {(r["max_lag"], r["method"]) for r in runs},
        key=lambda k: (k[0], ORDER.index(k[1]) if k[1] in ORDER else len(ORDER), k[1]),
    )
    print("| method | max lag | seeds | best eval | last eval | best − last | lag mean / max |")
    print("|---|---|---|---|---|---|---|")
    for lag, method in keys:
        chosen = [r for r in runs if r["max_lag"] == lag and r["method"] == method]

        def column(key: str, chosen=chosen) -> np.ndarray:
            return np.array([r[key] for r in chosen], dtype=float)

        def spread(key: str) -> str:
            values = column(key)
            return f"{values.mean():.3f} ± {values.std(ddof=1):.3f}"

        print(
            f"| {method} | {lag} | {len(chosen)} | {spread('best_eval')} | {spread('last_eval')} | "
            f"{spread('best_to_last_gap')} | {column('lag_mean').mean():.1f} / {int(column('lag_max').max())} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
