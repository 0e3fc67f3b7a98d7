"""``gepo-lab paired``'s command line: read the summaries, print the table, write the JSON and the picture."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gepo_plugin.lab.paired import METRICS, compare, intervals_markdown, load_runs, markdown, method_intervals
from gepo_plugin.lab.paired_plot import draw_forest, draw_staleness
from gepo_plugin.lab.plots import plots_available


def add_paired_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("summaries", nargs="+", type=Path, help="stability_summary.json files of the runs to pair")
    parser.add_argument(
        "--a",
        nargs="+",
        required=True,
        help="first method(s) (the difference is a - b, every a against every b), e.g. gepo (guarded runs: gepo+guard)",
    )
    parser.add_argument("--b", nargs="+", required=True, help="method(s) to compare against, e.g. gspo grpo")
    parser.add_argument("--metric", choices=METRICS, default="last_eval", help="per-run number compared")
    parser.add_argument("--json", type=Path, help="also write every comparison (with the per-seed differences) here")
    parser.add_argument(
        "--png", type=Path, help="also draw every comparison here: per-seed differences, mean, 95%% interval"
    )
    parser.add_argument(
        "--intervals",
        type=Path,
        help="also write every method's best eval, last eval and best − last per max lag here (markdown: mean and "
        "95%% interval over its seeds)",
    )
    parser.add_argument(
        "--staleness-png",
        type=Path,
        help="also draw --metric against max lag here, one line per method in the summaries with its 95%% interval",
    )
    return parser


def run_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        runs = load_runs(args.summaries)
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    results = [r for a in args.a for b in args.b if a != b for r in compare(runs, a, b, args.metric)]
    if not results:
        parser.error(f"no (seed, max_lag) has runs of both {args.a} and {args.b}")
    print(markdown(results), end="")
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in results], indent=2) + "\n")
    if args.png and plots_available():
        draw_forest(results, args.png)
    if args.intervals:
        args.intervals.write_text(intervals_markdown(runs))
    if args.staleness_png and plots_available():
        draw_staleness(method_intervals(runs, args.metric), args.staleness_png)
    return 0
