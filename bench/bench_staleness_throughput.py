"""Benchmark: what each step of allowed staleness buys, with verl's real trainer and a modelled GPU sampler, on CPU.

On 2 CPU cores the samplers and the learner compete for the same cores, so wall time cannot show the speed-up of
running them apart. The CPU rollout's latency model (``rollout.engine_kwargs.hf.latency``) makes it measurable:
tokens are generated for real, but each request is answered when a modelled GPU would have finished it, and the
wait uses no CPU. The learner's update stays real CPU time.

Runs (same tiny model, data and seed): verl's ``sync`` trainer (the rollout on the learner), then HeteroRL on
verl's ``separate_async`` with ``max_lag`` in ``--lags``, each ``--strategies`` and each ``--samplers`` count.
Per run: trained tokens (prompt and response) per second over the steps after ``--skip``, the learner's idle time
per step (``timing_s/gen``: waiting for finished rollouts) and the trained groups' lag (mean, max).

    python bench/bench_staleness_throughput.py                      # the README's sweep (about 35 minutes)
    python bench/bench_staleness_throughput.py --lags 0 2 --samplers 2 --strategies wait --steps 6
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

from common import (
    add_output_options,
    cpu_training_metrics,
    max_lag_axis,
    pyplot,
    run_summary,
    save_figure,
    script_parser,
    write_json_around,
)
from tqdm import tqdm

from gepo_plugin.tiny import cpu_run_overrides, write_all


def latency_overrides(args: argparse.Namespace) -> list[str]:
    key = "+actor_rollout_ref.rollout.engine_kwargs.hf.latency"
    return [
        f"{key}.decode_tokens_per_s={args.decode_tokens_per_s}",
        f"{key}.prefill_s={args.prefill_s}",
        f"{key}.batch_slowdown={args.batch_slowdown}",
    ]


def run_overrides(tiny: dict[str, str], args: argparse.Namespace, lag: int | None, strategy: str, samplers: int):
    """``lag`` None: verl's sync trainer; otherwise HeteroRL with that bound."""
    mode = "sync" if lag is None else "separate_async"
    overrides = [
        *cpu_run_overrides(tiny, loss=args.loss, mode=mode, steps=args.steps, learners=1),
        *latency_overrides(args),
        f"trainer.experiment_name=staleness_{mode}_{lag}_{strategy}_{samplers}",
    ]
    if lag is None:
        return overrides
    return [
        *overrides,
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={samplers}",
        "hetero.enable=true",
        f"hetero.max_lag={lag}",
        f"hetero.strategy={strategy}",
    ]


def sweep(args: argparse.Namespace) -> list[dict]:
    """Every configuration ``--repeats`` times, the repeats interleaved (machine drift hits all configurations)."""
    configs = [(None, "-", 0)]
    configs += [(lag, strategy, n) for n, strategy, lag in itertools.product(args.samplers, args.strategies, args.lags)]
    plan = [(repeat, config) for repeat in range(args.repeats) for config in configs]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_staleness_") as folder:
        tiny = write_all(Path(folder) / "tiny")
        for index, (repeat, (lag, strategy, samplers)) in enumerate(tqdm(plan, desc="runs", unit="run")):
            overrides = run_overrides(tiny, args, lag, strategy, samplers)
            metrics = cpu_training_metrics(
                overrides, Path(folder) / f"run_{index}", f"run {lag=} {strategy=} {samplers=}"
            )
            mode = "sync" if lag is None else "hetero"
            rows.append(
                {"mode": mode, "max_lag": lag, "strategy": strategy, "samplers": samplers, "repeat": repeat}
                | run_summary(metrics, args.skip)
            )
    return rows


def _config(row: dict) -> tuple:
    return (row["mode"], row["samplers"], row["strategy"], -1 if row["max_lag"] is None else row["max_lag"])


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per configuration: the mean over its repeats of every figure, ``x_sync`` per repeat against that
    repeat's own sync run, and its spread (``x_sync_min`` / ``x_sync_max``)."""
    sync = {row.get("repeat", 0): row["tokens_per_s"] for row in rows if row["mode"] == "sync"}
    out = []
    for _, group in itertools.groupby(sorted(rows, key=_config), key=_config):
        group = list(group)
        ratios = [row["tokens_per_s"] / sync[row.get("repeat", 0)] for row in group]
        first = group[0]
        out.append(
            {key: first[key] for key in ("mode", "max_lag", "strategy", "samplers")}
            | {
                key: statistics.mean(row[key] for row in group)
                for key in ("tokens_per_s", "step_s", "idle_s", "lag_mean", "lag_max", "dropped")
            }
            | {"repeats": len(group), "x_sync": statistics.mean(ratios), "x_sync_min": min(ratios)}
            | {"x_sync_max": max(ratios)}
        )
    return out


def report(rows: list[dict]) -> None:
    print(
        f"\n{'mode':<8}{'samplers':>9}{'strategy':>9}{'max_lag':>8}{'tokens/s':>10}{'x sync':>8}{'range':>12}"
        f"{'idle s':>8}{'lag mean':>9}{'lag max':>8}{'dropped':>8}"
    )
    for row in aggregate(rows):
        lag = "-" if row["max_lag"] is None else row["max_lag"]
        spread = f"{row['x_sync_min']:.2f}-{row['x_sync_max']:.2f}"
        print(
            f"{row['mode']:<8}{row['samplers']:>9}{row['strategy']:>9}{lag:>8}{row['tokens_per_s']:>10.1f}"
            f"{row['x_sync']:>8.2f}{spread:>12}{row['idle_s']:>8.2f}{row['lag_mean']:>9.2f}{row['lag_max']:>8.0f}"
            f"{row['dropped']:>8.0f}"
        )


def plot(rows: list[dict], path: str) -> None:
    fig, axis = pyplot().subplots(figsize=(6, 3.6))
    hetero = [row for row in aggregate(rows) if row["mode"] == "hetero"]
    for index, (key, group) in enumerate(itertools.groupby(hetero, key=lambda r: (r["samplers"], r["strategy"]))):
        group = list(group)
        axis.errorbar(
            [r["max_lag"] for r in group],
            [r["x_sync"] for r in group],
            yerr=[
                [r["x_sync"] - r["x_sync_min"] for r in group],
                [r["x_sync_max"] - r["x_sync"] for r in group],
            ],
            marker="o",
            capsize=3,
            color=f"C{index}",
            label=f"{key[0]} samplers, {key[1]}",
        )
    max_lag_axis(axis, (r["max_lag"] for r in hetero), sync_linestyle="--")
    axis.set_ylabel("trained tokens/s vs sync (mean, range)")
    axis.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--lags", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="max_lag values (default 0 1 2 4 8)"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["wait", "drop"],
        choices=["wait", "drop"],
        help="hetero.strategy values (default wait drop)",
    )
    parser.add_argument("--samplers", type=int, nargs="+", default=[2, 4], help="rollout replicas (default 2 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every configuration, interleaved (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up; default 2)")
    parser.add_argument("--loss", default="gepo", help="algorithm.loss of every run (default gepo)")
    parser.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=16.0,
        help="modelled decode speed of one sequence (default 16: the tiny model's 8-token answers "
        "take 0.5 s, about one learner update on 2 cores)",
    )
    parser.add_argument("--prefill-s", type=float, default=0.1, help="modelled prefill per batch (default 0.1 s)")
    parser.add_argument(
        "--batch-slowdown",
        type=float,
        default=0.02,
        help="modelled slowdown per further sequence in a batch (default 0.02)",
    )
    add_output_options(parser, "every run's summary", "throughput against max_lag")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        parser.error("--steps must be larger than --skip")
    rows = sweep(args)

    def reported() -> dict[str, list[dict]]:
        report(rows)
        return {"configurations": aggregate(rows)}

    write_json_around(args.json, {"args": vars(args), "runs": rows}, reported)
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
