"""The end-to-end tier's timing table (docs/development.md) from what ``tests/e2e_timing.py`` wrote.

    GEPO_E2E_TIMING=/tmp/timing.json bash test.sh -m "(ray or e2e)"
    python scripts/e2e_timing_table.py /tmp/timing.json

One row per test module, seconds: its tests' wall time (set-up, calls and tear-down together), the trainer runs it
started, and where their time went (start-up to the first step's metrics, and of it: Ray and the driver to verl's
TaskRunner's first line, verl's learner workers, the rollout engines and the rest of verl's set-up, step 1 with its
lazy starts, from the TaskRunner's log lines, ``tests/trainer_run.py``'s ``LANDMARKS``; verl's time of the later
steps; deliberate waits the scenario declares; the rest between the first and the last step; tear-down after the
last step), and what the module spent outside any trainer run (clusters, stores, sampler hosts, checks).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

COLUMNS = ("start_up", "ray_and_driver", "learner", "engines", "step_1", "training", "waits", "between", "tear_down")


def table(record: dict) -> str:
    wall: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    for nodeid, phases in record["tests"].items():
        module = nodeid.split("::")[0]
        wall[module] += sum(phases.values())
        tests[module] += 1
    runs: dict[str, list[dict]] = defaultdict(list)
    for run in record["runs"]:
        runs[run["test"].split("::")[0]].append(run)
    header = (
        "| module | tests | wall | runs | start-up | (Ray, driver | learner | engines | step 1) | training | waits "
        "| between | tear-down | outside runs |"
    )
    lines = [header, "|---|" + "---:|" * (len(COLUMNS) + 4)]
    totals = defaultdict(float)
    for module in sorted(wall, key=wall.get, reverse=True):
        spent = {column: sum(run["summary"].get(column, 0.0) for run in runs[module]) for column in COLUMNS}
        inside = sum(run["exited"] or 0.0 for run in runs[module])
        row = {"wall": wall[module], **spent, "outside": max(wall[module] - inside, 0.0)}
        for key, value in row.items():
            totals[key] += value
        totals["tests"] += tests[module]
        totals["runs"] += len(runs[module])
        cells = " | ".join(f"{row[key]:.0f}" for key in ("wall", *COLUMNS, "outside"))
        lines.append(
            f"| `{module}` | {tests[module]} | {cells.split(' | ', 1)[0]} | {len(runs[module])} | "
            f"{cells.split(' | ', 1)[1]} |"
        )
    cells = " | ".join(f"{totals[key]:.0f}" for key in (*COLUMNS, "outside"))
    lines.append(f"| **all** | {totals['tests']:.0f} | {totals['wall']:.0f} | {totals['runs']:.0f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timing", help="the JSON file GEPO_E2E_TIMING named")
    args = parser.parse_args(argv)
    print(table(json.loads(Path(args.timing).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
