"""Training stability under staleness at laptop scale: does GEPO keep its best score to the end?

The GEPO paper (arXiv 2508.17850) reports that under large policy lag GEPO keeps its best evaluation
score until the end of training while GSPO and GRPO degrade (README table, max delay 64: GEPO best/last
43.5/43.5 vs GSPO 41.9/20.9). This lab tests that claim on a CPU with a tiny model and simulated
heterogeneous samplers:

* **Policy**: a ~86k-parameter Llama-architecture LM (:func:`gepo_plugin.tiny.tiny_model_config`,
  random init, float32, CPU) with the character tokenizer of :func:`gepo_plugin.tiny.build_tokenizer`.
* **Task** (:mod:`gepo_plugin.lab.stability_task`): zero-padded addition ``ab+c=`` (500 problems, a
  quarter held out for eval); reward 1 for the exact sum followed by ``<eos>``, else 0 (an optional
  ``format_reward`` for "digits then <eos>" is off by default). Eval = exact-answer pass@1 on the
  held-out problems, averaged over ``eval_samples`` (8) sampled answers each with a fixed seed (the
  paper's pass@1 over 8 samples; ``eval_samples=0`` gives greedy exact match).
* **Warm start**: teacher-forced SFT until greedy accuracy on the *training* problems reaches
  ``warm_target`` (default 0.35; held-out pass@1 is then about 0.2), a weak but non-zero policy shared by
  every method and lag under one seed.
* **Optimiser**: AdamW (lr 1e-3, linear warm-up over 20 updates, weight decay 0.01, grad-norm clip 1),
  one update per learner version (one mini-batch, one epoch), temperature 1 for sampling.
* **RL** (:mod:`gepo_plugin.lab.stability_sim`): G responses per prompt, rewards on the sampler,
  advantages per method, and one optimizer step per learner version using verl's REGISTERED policy loss
  (``get_policy_loss_fn(loss_mode)``) called as verl's ``ppo_loss`` calls it, with the settings of
  :data:`gepo_plugin.verl_glue.presets.PRESETS` (loss mode, aggregation, std normalisation, clip
  0.2/0.2; BNPO through :func:`~gepo_plugin.maths.bnpo_advantages`). ``old_log_prob`` is the sampler's
  log-probs (bypass mode); GEPO's group term comes from them via
  :func:`~gepo_plugin.maths.group_log_expectation_from_tokens` and
  :func:`~gepo_plugin.verl_glue.response_terms.provide_response_terms`.
* **Asynchrony**: a seeded discrete-event simulation (simulated time, reproducible bit for bit):
  samplers of different speeds, weights arriving as HeteroRL's
  :class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule` says, with log-normal delays
  (:mod:`gepo_plugin.hetero.delays`), and the learner's queue run by HeteroRL's
  :class:`~gepo_plugin.hetero.core.StalenessCore` (the decisions and books verl's replay buffer uses), with
  ``max_lag = K`` and HeteroRL's default strategy and margin. ``K = 0`` is on-policy; a trained group's lag
  above ``K`` is refused.

Reported per method x max_lag x seed: eval accuracy over training, best / last eval and their gap,
mean +- sample std over seeds, the variance of each method's own importance weight (token ratio
p_t/q_t for GRPO/Dr.GRPO/BNPO, length-normalised p/q for GSPO, p/E_hat_q[q] for GEPO; the last two are
also logged for every method), and the learner-sampler k3 KL. Outputs: CSVs, a summary JSON, a
markdown table and PNG plots.

Presets (run times on a shared 2-core machine, one torch thread, about 0.1 s per learner update):

* ``ci``: gepo + grpo, max_lag 0 and 8, seed 0, 60 RL steps, for the tests (measured 35-40 s).
* ``quick``: gepo, gspo, grpo at max_lag 0 and 64, seeds 0 and 1, 150 RL steps (measured 207 s).
* ``paper``: all five methods, max_lag 0 / 8 / 64, seeds 0-4, 200 RL steps (measured 1520 s, 25 min:
  75 runs plus five warm starts; its table is in the README and ``docs/lab/paper/``).

Best eval is a maximum over noisy evaluations (125 problems x 8 samples), so it is biased upward;
compare gaps between methods rather than reading one gap in isolation. The k3 KL is heavy-tailed (one
token the learner has all but ruled out dominates a batch mean), so read it on a log scale.

**Live mode** (``--live``, :mod:`gepo_plugin.lab.stability_live`): the same samplers and learner, but
the samplers are Ray actors (one process each) and everything runs in wall-clock time, with simulated
seconds scaled by ``--time-scale`` (default 0.05 wall s per simulated s). Same outputs, with
``"mode": "live"`` in the summary JSON. Not bit-reproducible (the schedule depends on the operating
system); the lag bound and the ledger are still asserted.

Every option is a field of :class:`~gepo_plugin.lab.stability_config.StabilityConfig` (the command line is
generated from it, with its help and defaults). Run: ``python -m gepo_plugin.lab stability --preset quick --out
DIR`` (or ``gepo-lab stability ...``, or ``python -m gepo_plugin.lab.stability ...``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gepo_plugin.hetero import drop_bias
from gepo_plugin.lab.plots import plots_available
from gepo_plugin.lab.stability_config import (
    PRESET_SUMMARIES,
    PRESETS,
    StabilityConfig,
    StabilityConfigError,
    resolve,
)
from gepo_plugin.lab.stability_sim import METHODS, OWN_WEIGHT, MethodSpec, RunSetup, simulate_run
from gepo_plugin.lab.stability_task import build_policy, build_task, supervised_warm_start
from gepo_plugin.options_cli import add_model_arguments, given_values

__all__ = [
    "METHODS",
    "PRESETS",
    "StabilityConfig",
    "StabilityConfigError",
    "add_stability_arguments",
    "aggregate",
    "markdown_table",
    "resolve",
    "run_cli",
    "run_stability",
]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single seed)."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


def aggregate(runs: list[dict[str, Any]], methods: list[str], lags: list[int]) -> list[dict[str, Any]]:
    """One row per (method, max_lag): mean +- std over seeds of the headline numbers."""
    rows = []
    for lag in lags:
        for method in methods:
            chosen = [r for r in runs if r["method"] == method and r["max_lag"] == lag]
            row: dict[str, Any] = {"method": method, "max_lag": lag, "n_seeds": len(chosen)}
            for key in ("warm_eval", "best_eval", "last_eval", "best_to_last_gap", "iw_var_mean", "kl_mean"):
                row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([r[key] for r in chosen])
            row["lag_mean"] = float(np.mean([r["lag_mean"] for r in chosen]))
            row["lag_max"] = int(max(r["lag_max"] for r in chosen))
            row["own_weight"] = OWN_WEIGHT[method]
            row["ess_mean"] = float(np.mean([r.get("ess_mean", float("nan")) for r in chosen]))
            row["drop_bias"] = _pooled_drop_bias(chosen)
            rows.append(row)
    return rows


def _pooled_drop_bias(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Dropped against trained trajectories over every seed of a (method, lag): means of the pooled totals."""
    dropped: dict[str, float] = {}
    trained: dict[str, float] = {}
    for run in runs:
        totals = run.get("drop_totals", {})
        dropped = drop_bias.add(dropped, totals.get("dropped", {}))
        trained = drop_bias.add(trained, totals.get("trained", {}))
    return drop_bias.bias_metrics(dropped, trained) | {"dropped_trajectories": dropped.get("trajectories", 0.0)}


def markdown_table(summary: dict[str, Any]) -> str:
    """The aggregate rows as a markdown table (mean +- sample std over seeds)."""
    lines = [
        "| method | max lag | seeds | warm eval | best eval | last eval | best-last gap | IW var (own weight) "
        "| KL(learner, sampler) | lag mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["aggregate"]:

        def pm(key: str, digits: int = 3, row: dict[str, Any] = row) -> str:
            return f"{row[key + '_mean']:.{digits}f} ± {row[key + '_std']:.{digits}f}"

        lines.append(
            f"| {row['method']} | {row['max_lag']} | {row['n_seeds']} | {pm('warm_eval')} | {pm('best_eval')} "
            f"| {pm('last_eval')} | {pm('best_to_last_gap')} | {row['iw_var_mean_mean']:.3g} ({row['own_weight']}) "
            f"| {row['kl_mean_mean']:.3g} | {row['lag_mean']:.1f} / {row['lag_max']} |"
        )
    lines += [
        "",
        "Eval = exact-answer pass@1 on the held-out problems (mean over `eval_samples` sampled answers each, "
        "greedy if 0); best includes the warm start (step 0); ± is the sample std over seeds.",
        "IW var: variance over the batch of the method's own importance weight, averaged over steps "
        "(token_is = p_t/q_t, seq_is = length-normalised p/q, gepo = p/E_hat_q[q], gepo_plus = p/D with GEPO+'s "
        "denominator); KL: k3 token mean.",
    ]
    dropping = [row for row in summary["aggregate"] if row["drop_bias"].get("dropped_trajectories", 0) > 0]
    if dropping:
        lines += [
            "",
            "What dropping costs (trajectories dropped for staleness against those trained, pooled over seeds):",
            "",
            "| method | max lag | dropped | length dropped / trained | reward dropped / trained |",
            "|---|---|---|---|---|",
        ]
        for row in dropping:
            bias = row["drop_bias"]
            lines.append(
                f"| {row['method']} | {row['max_lag']} | {bias['dropped_trajectories']:.0f} "
                f"| {bias['dropped/length_mean']:.2f} / {bias['trained/length_mean']:.2f} "
                f"| {bias['dropped/reward_mean']:.3f} / {bias['trained/reward_mean']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _write_csvs(out_dir: Path, records: list[Any]) -> None:
    with (out_dir / "stability_eval.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seed", "method", "max_lag", "step", "eval_acc"])
        for rec in records:
            for step, acc in zip(rec.eval_steps, rec.eval_acc, strict=True):
                writer.writerow([rec.seed, rec.method, rec.max_lag, step, repr(acc)])
    keys = sorted(records[0].steps[0]) if records and records[0].steps else []
    with (out_dir / "stability_steps.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seed", "method", "max_lag", *keys])
        for rec in records:
            for row in rec.steps:
                writer.writerow([rec.seed, rec.method, rec.max_lag, *(repr(row[k]) for k in keys)])


def _plot(out_dir: Path, records: list[Any], methods: list[str], lags: list[int]) -> None:
    """Eval-accuracy curves (one panel per max lag), and the weight-variance / KL diagnostics."""
    import matplotlib  # optional: the [lab] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    palette = (
        "tab:blue",
        "tab:orange",
        "tab:red",
        "tab:green",
        "tab:purple",
        "tab:brown",
        "tab:cyan",
        "tab:olive",
        "tab:pink",
    )
    colours = dict(zip(METHODS, palette, strict=True))
    # distinct dashes: on-policy GSPO and GRPO are gradient-identical, so their curves coincide exactly
    dashes = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (3, 1)), (0, (1, 2)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)))
    styles = dict(zip(METHODS, dashes, strict=True))
    fig, axes = plt.subplots(1, len(lags), figsize=(4.6 * len(lags), 3.8), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        for method in methods:
            runs = [r for r in records if r.method == method and r.max_lag == lag]
            steps = np.asarray(runs[0].eval_steps)
            acc = np.asarray([r.eval_acc for r in runs])
            mean, std = acc.mean(0), acc.std(0)
            ax.plot(steps, mean, color=colours[method], ls=styles[method], label=f"{method} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(steps, mean - std, mean + std, color=colours[method], alpha=0.15)
        ax.set_title(f"max lag {lag}" + (" (on-policy)" if lag == 0 else ""))
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out eval pass@1")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "stability_curves.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, len(lags), figsize=(4.6 * len(lags), 6.4), squeeze=False)
    for col, lag in enumerate(lags):
        for method in methods:
            runs = [r for r in records if r.method == method and r.max_lag == lag]
            n = min(len(r.steps) for r in runs)
            for row, key in enumerate(("iw_var", "kl")):
                values = np.asarray([[s[key] for s in r.steps[:n]] for r in runs]).mean(0)
                axes[row][col].plot(
                    np.arange(1, n + 1), values, color=colours[method], ls=styles[method], label=method, lw=1
                )
        axes[0][col].set_title(f"max lag {lag}")
        for row in (0, 1):
            axes[row][col].set_yscale("symlog", linthresh=1e-4)
            axes[row][col].set_ylim(bottom=0)
        axes[1][col].set_xlabel("learner step")
    axes[0][0].set_ylabel("variance of own IS weight")
    axes[1][0].set_ylabel("k3 KL(learner || sampler)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "stability_diagnostics.png", dpi=110)
    plt.close(fig)


def run_stability(out_dir: Path, config: StabilityConfig, preset: str = "", progress: bool = True) -> dict[str, Any]:
    """Warm-start one policy per seed, RL-train it per (method, max_lag), write every output; return the summary.

    Files in ``out_dir`` (created if missing): ``stability_summary.json``, ``stability_table.md``,
    ``stability_eval.csv`` (eval accuracy per run and step), ``stability_steps.csv`` (per-update diagnostics) and,
    with matplotlib, ``stability_curves.png`` and ``stability_diagnostics.png`` (drawn after the results are on
    disk). Wall-clock times are kept apart under ``summary["timing"]``; everything else is a deterministic function
    of the config (except with ``config.live``: real sampler processes, and the summary says ``"mode": "live"``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draw = plots_available()
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    cluster = None
    time_scale = None
    try:
        task = build_task(config.max_a, config.max_b, config.eval_fraction, config.task_seed)
        specs = {m: MethodSpec.from_preset(m) for m in config.methods}
        if config.clip is not None:
            specs = {m: s.with_clip(config.clip) for m, s in specs.items()}
        if config.rollout_correction is not None:
            specs = {m: s.with_correction(config.rollout_correction) for m, s in specs.items()}
        run_fn = simulate_run
        n_runs = len(config.seeds) * len(config.methods) * len(config.lags)
        bar = tqdm(total=n_runs * config.rl_steps, disable=not progress, desc="stability", unit="step")
        records, warm, timing = [], {}, {}
        for seed in config.seeds:
            tick = time.perf_counter()
            bar.set_postfix_str(f"seed {seed} warm start")
            base = build_policy(task, seed, config.hidden, config.layers, config.heads)
            warm[str(seed)] = supervised_warm_start(
                base,
                task,
                seed,
                config.warm_lr,
                config.warm_batch,
                config.warm_target,
                config.warm_max_steps,
                config.warm_check_every,
            )
            timing[f"warm_start/seed{seed}"] = time.perf_counter() - tick
            if config.live and cluster is None:
                from gepo_plugin.lab.stability_live import DEFAULT_TIME_SCALE, LiveCluster  # lazy: Ray, for --live

                tick = time.perf_counter()
                bar.set_postfix_str("starting Ray sampler actors")
                time_scale = config.time_scale or DEFAULT_TIME_SCALE
                cluster = LiveCluster(config.sampler_seconds, time_scale, task, base, config, ray_cpus=config.ray_cpus)
                run_fn = cluster.run
                timing["live/ray_start"] = time.perf_counter() - tick
            for lag in config.lags:
                for method in config.methods:
                    tick = time.perf_counter()
                    bar.set_postfix_str(f"seed {seed} {method} lag {lag}")
                    setup = RunSetup(copy.deepcopy(base), specs[method], task, config, lag, seed)
                    record = run_fn(setup, on_step=lambda _r: bar.update(1))
                    records.append(record)
                    timing[f"run/seed{seed}/{method}/lag{lag}"] = time.perf_counter() - tick
        bar.close()
    finally:
        torch.set_num_threads(previous_threads)
        if cluster is not None:
            cluster.close()
    runs = [rec.to_dict() for rec in records]
    summary: dict[str, Any] = {
        "mode": "live" if config.live else "simulated",
        "preset": preset,
        "methods": list(config.methods),
        "lags": list(config.lags),
        "seeds": list(config.seeds),
        "config": config.model_dump(mode="json"),
        "task": {"train_problems": int(task.train_idx.numel()), "eval_problems": int(task.eval_idx.numel())},
        "warm_start": warm,
        "runs": runs,
        "aggregate": aggregate(runs, list(config.methods), list(config.lags)),
    }
    if config.live:
        summary["live"] = {
            "time_scale": time_scale,
            "ray_cpus": cluster.ray_cpus,
            "reproducible": False,
            "note": "samplers are Ray actors in wall-clock time: the schedule (which version generates which "
            "group) depends on the OS and is not reproducible; sim_time / sim_seconds are wall seconds / "
            "time_scale. The lag bound and the books are checked as in the simulation.",
        }
    _write_csvs(out_dir, records)
    (out_dir / "stability_table.md").write_text(markdown_table(summary))
    timing["total"] = time.perf_counter() - started
    summary["timing"] = timing
    (out_dir / "stability_summary.json").write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    if draw:  # the results are on disk before any plot is attempted
        _plot(out_dir, records, list(config.methods), list(config.lags))
    return summary


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


#: Options of the command line that are not config fields.
RUN_OPTIONS = ("out", "preset", "no_progress")


def add_stability_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Attach this lab's options to ``parser``: ``--out``, ``--preset``, ``--no-progress`` and one option per
    field of :class:`StabilityConfig` (generated, with the field's help)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("lab_out/stability"),
        help="directory for CSVs, summary JSON, markdown table and PNGs (created if missing)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="; ".join(f"{name}: {text}" for name, text in PRESET_SUMMARIES.items()) + " (default quick)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return add_model_arguments(parser, StabilityConfig, defaults_from="the preset's")


def config_from_args(args: argparse.Namespace) -> StabilityConfig:
    """The config a parsed command line asks for: the preset, then every option given."""
    return resolve(args.preset, given_values(args, StabilityConfig))


def run_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the lab from parsed :func:`add_stability_arguments` options; bad values exit 2 via ``parser.error``."""
    try:
        config = config_from_args(args)
    except StabilityConfigError as error:
        parser.error(str(error))
    summary = run_stability(args.out, config, preset=args.preset, progress=not args.no_progress)
    print(markdown_table(summary), end="")
    print(f"wrote {args.out} ({summary['mode']}) in {summary['timing']['total']:.0f} s", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m gepo_plugin.lab.stability --preset quick --out DIR``."""
    parser = add_stability_arguments(
        argparse.ArgumentParser(prog="python -m gepo_plugin.lab.stability", description=__doc__.splitlines()[0])
    )
    return run_cli(parser.parse_args(argv), parser)


if __name__ == "__main__":
    raise SystemExit(main())
