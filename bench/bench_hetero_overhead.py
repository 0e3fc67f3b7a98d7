"""Benchmark: what HeteroRL and GEPO cost inside verl's real ``separate_async`` trainer, on CPU.

Three runs of the same tiny model, data and seed, interleaved pair by pair so that machine drift hits all alike:

* ``verl``   verl's own ``separate_async`` with its replay buffer and ``max_off_policy_threshold`` (loss ``gspo``);
* ``hetero`` the plugin's HeteroRL (``hetero.enable=true``, no simulated delay, ``max_lag`` equal to verl's
  threshold, strategy ``drop`` as verl's), same loss: the plugin's trainer, replay buffer and weight sync;
* ``gepo``   the same HeteroRL run with ``algorithm.loss=gepo`` (the group term in the trainer, GEPO's loss).

All three use the sampler's log-probs as the old policy (``algorithm.rollout_correction.bypass_mode=true``, which
GEPO's preset sets), so they do the same work except for what is compared.

Per run: the median step time (``timing_s/step``, the first ``--skip`` steps left out: they compile and warm up),
the learner's idle time (``timing_s/gen``: the trainer waiting for a batch of finished rollouts) and trained
tokens (prompt and response) per second. Ratios ``hetero/verl`` and ``gepo/hetero`` are per pair, then their median.

verl's threshold counts prompt submission steps and the plugin's ``max_lag`` weight versions (README, "HeteroRL");
with one weight sync per step (``parameter_sync_step=1``) and no delay both admit the same batches here.

    python bench/bench_hetero_overhead.py                    # 3 pairs x 10 steps (about 15 minutes on 2 cores)
    python bench/bench_hetero_overhead.py --pairs 1 --steps 6 --json out.json --png docs/bench/hetero_overhead.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (
    add_output_options,
    cpu_training_metrics,
    paired_median_ratio,
    pyplot,
    run_summary,
    save_figure,
    script_parser,
    write_json_around,
)
from tqdm import tqdm

from gepo_plugin.tiny import cpu_run_overrides, write_all

VARIANTS = ("verl", "hetero", "gepo")


def overrides_for(variant: str, tiny: dict[str, str], steps: int, bound: int, samplers: int) -> list[str]:
    """The command line of one variant: everything but the sampler and the loss is shared."""
    loss = "gepo" if variant == "gepo" else "gspo"
    common = [
        *cpu_run_overrides(tiny, loss=loss, mode="separate_async", steps=steps, learners=1),
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={samplers}",
        f"trainer.experiment_name=overhead_{variant}",
        # q = the sampler's log-probs for every variant (GEPO's preset sets it): the same work but the loss
        "algorithm.rollout_correction.bypass_mode=true",
    ]
    if variant == "verl":
        return [
            *common,
            f"trainer.v1.sampler.max_off_policy_threshold={bound}",
            "trainer.v1.sampler.max_off_policy_strategy=drop",
        ]
    return [*common, "hetero.enable=true", f"hetero.max_lag={bound}", "hetero.strategy=drop"]


def run_pairs(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as folder:
        tiny = write_all(Path(folder) / "tiny")
        jobs = [(pair, variant) for pair in range(args.pairs) for variant in VARIANTS]
        for pair, variant in tqdm(jobs, desc="runs", unit="run"):
            overrides = overrides_for(variant, tiny, args.steps, args.bound, args.samplers)
            started = time.perf_counter()
            metrics = cpu_training_metrics(overrides, Path(folder) / f"{variant}_{pair}", f"{variant} run {pair}")
            summary = run_summary(metrics, args.skip) | {"wall_s": time.perf_counter() - started}
            results[variant].append(summary)
    return results


def paired_ratio(results, top: str, bottom: str, key: str) -> float:
    return paired_median_ratio((r[key] for r in results[top]), (r[key] for r in results[bottom]))


def report(results) -> dict[str, float]:
    print(f"\n{'variant':<8}{'step s':>10}{'idle s':>10}{'tokens/s':>11}   (medians over pairs)")
    for variant in VARIANTS:
        rows = results[variant]
        print(
            f"{variant:<8}{statistics.median(r['step_s'] for r in rows):>10.3f}"
            f"{statistics.median(r['idle_s'] for r in rows):>10.3f}"
            f"{statistics.median(r['tokens_per_s'] for r in rows):>11.1f}"
        )
    ratios = {
        "hetero/verl step time": paired_ratio(results, "hetero", "verl", "step_s"),
        "gepo/hetero step time": paired_ratio(results, "gepo", "hetero", "step_s"),
        "hetero/verl tokens per s": paired_ratio(results, "hetero", "verl", "tokens_per_s"),
    }
    for name, value in ratios.items():
        print(f"{name:<28}{value:>8.3f}x")
    phases = sorted({phase for rows in results.values() for row in rows for phase in row["phase_s"]})
    print(f"\n{'phase (median s)':<22}" + "".join(f"{variant:>9}" for variant in VARIANTS))
    for phase in phases:
        values = [statistics.median(row["phase_s"].get(phase, 0.0) for row in results[v]) for v in VARIANTS]
        print(f"{phase:<22}" + "".join(f"{value:>9.3f}" for value in values))
    return ratios


def plot(results, path: str) -> None:
    fig, axes = pyplot().subplots(1, 2, figsize=(8, 3.2))
    for axis, key, label in ((axes[0], "step_s", "step time (s)"), (axes[1], "idle_s", "learner idle (s)")):
        for index, variant in enumerate(VARIANTS):
            values = [r[key] for r in results[variant]]
            axis.bar(index, statistics.median(values), color=f"C{index}")
            axis.scatter([index] * len(values), values, color="black", s=8, zorder=3)
        axis.set_xticks(range(len(VARIANTS)), VARIANTS)
        axis.set_ylabel(label)
    fig.suptitle("verl separate_async vs HeteroRL (no delay) vs HeteroRL + GEPO, tiny model on CPU")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (verl, hetero, gepo) triples (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--bound", type=int, default=2, help="verl's threshold = HeteroRL's max_lag (default 2)")
    parser.add_argument("--samplers", type=int, default=1, help="rollout replicas (default 1)")
    add_output_options(parser, "every run's summary and the ratios", "step and idle time per variant")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        parser.error("--steps must be larger than --skip")
    results = run_pairs(args)
    write_json_around(args.json, {"args": vars(args), "runs": results}, lambda: {"ratios": report(results)})
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
