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
  :func:`~gepo_plugin.verl_glue.sample_terms.provide_sample_terms`.
* **Asynchrony**: a seeded discrete-event simulation (simulated time, reproducible bit for bit):
  samplers of different speeds, weight copies arriving after log-normal delays
  (:mod:`gepo_plugin.hetero.delays`), the learner consuming groups through
  :class:`~gepo_plugin.hetero.staleness.BoundedStalenessQueue` with ``StalenessPolicy(max_lag=K)``
  and counting every rollout in a :class:`~gepo_plugin.hetero.accounting.RolloutLedger`. ``K = 0`` is
  on-policy; every trained group's lag is asserted to be ``<= K``.

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

Run: ``python -m gepo_plugin.lab stability --preset quick --out DIR`` (or ``gepo-lab stability ...``, or
``python -m gepo_plugin.lab.stability ...``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gepo_plugin.lab.plots import plots_available
from gepo_plugin.lab.stability_sim import METHODS, OWN_WEIGHT

STRATEGIES = ("wait", "drop")


class StabilityConfigError(ValueError):
    """An impossible or unknown stability-lab option; the message says what is valid."""


@dataclass(frozen=True)
class StabilityConfig:
    """Every knob of a stability run (a preset is a set of these; ``**overrides`` replace any of them)."""

    # task
    max_a: int = 50
    max_b: int = 10
    eval_fraction: float = 0.25
    task_seed: int = 0
    format_reward: float = 0.0
    # policy
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    threads: int = 1
    # supervised warm start
    warm_lr: float = 3e-3
    warm_batch: int = 32
    warm_target: float = 0.35
    warm_max_steps: int = 1500
    warm_check_every: int = 10
    # RL
    rl_steps: int = 120
    lr: float = 1e-3
    lr_warmup_steps: int = 20
    group_size: int = 8
    prompts_per_step: int = 16
    groups_per_batch: int = 4
    buffer_groups: int = 0  # 0 = prompts_per_step
    temperature: float = 1.0
    grad_clip: float = 1.0
    clip: float | None = None  # ratio clip eps for every method, both sides (None = the presets' 0.2/0.2)
    eval_every: int = 10
    eval_samples: int = 8
    # heterogeneous samplers (simulated seconds)
    sampler_seconds: tuple[float, ...] = (1.0, 1.5, 2.0, 4.0)
    learner_seconds: float = 0.5
    delay_low: float = 4.0
    delay_high: float = 256.0
    delay_confidence: float = 0.995
    strategy: str = "wait"

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise StabilityConfigError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        for name in ("rl_steps", "eval_every", "warm_batch", "warm_check_every", "threads", "hidden", "layers"):
            if getattr(self, name) < 1:
                raise StabilityConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < 0:
            raise StabilityConfigError(f"eval_samples must be >= 0 (0 = greedy), got {self.eval_samples}")
        if self.warm_max_steps < 0:
            raise StabilityConfigError(f"warm_max_steps must be >= 0, got {self.warm_max_steps}")
        if not 0 <= self.warm_target <= 1:
            raise StabilityConfigError(f"warm_target is an accuracy in [0, 1], got {self.warm_target}")
        if not 0 <= self.format_reward < 1:
            raise StabilityConfigError(
                f"format_reward must be in [0, 1) (below the exact reward), got {self.format_reward}"
            )
        if not self.lr >= 0:
            raise StabilityConfigError(f"lr must be >= 0, got {self.lr}")
        if self.clip is not None and not 0 < self.clip < 1:
            raise StabilityConfigError(
                f"clip is the ratio clip eps, 1-eps..1+eps, and must be in (0, 1), got {self.clip}"
            )


@dataclass(frozen=True)
class Preset:
    """Which methods, lags and seeds a preset runs, and its config overrides."""

    methods: tuple[str, ...]
    lags: tuple[int, ...]
    seeds: tuple[int, ...]
    overrides: dict[str, Any]
    summary: str


PRESETS: dict[str, Preset] = {
    "ci": Preset(("gepo", "grpo"), (0, 8), (0,), {"rl_steps": 60, "eval_every": 20}, "tests: ~40 s"),
    "quick": Preset(("gepo", "gspo", "grpo"), (0, 64), (0, 1), {"rl_steps": 150}, "GEPO vs GSPO vs GRPO, ~3.5 min"),
    "paper": Preset(
        METHODS, (0, 8, 64), (0, 1, 2, 3, 4), {"rl_steps": 200}, "all methods, lags 0/8/64, 5 seeds, ~25 min"
    ),
}


def resolve(
    preset: str,
    seeds: Sequence[int] | None,
    methods: Sequence[str] | None,
    lags: Sequence[int] | None,
    overrides: dict[str, Any],
) -> tuple[StabilityConfig, list[str], list[int], list[int]]:
    """Validate everything up front, so a typo fails in milliseconds and not after the first run."""
    if preset not in PRESETS:
        raise StabilityConfigError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    fields = {f.name for f in dataclasses.fields(StabilityConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise StabilityConfigError(f"unknown option(s) {unknown}; valid options: {', '.join(sorted(fields))}")
    values = {**spec.overrides, **overrides}
    if "sampler_seconds" in values:
        values["sampler_seconds"] = tuple(float(s) for s in values["sampler_seconds"])
    config = StabilityConfig(**values)
    config.validate()
    try:
        _sim_settings(config, 0).validate()
    except ValueError as error:
        raise StabilityConfigError(str(error)) from None
    methods = list(spec.methods if methods is None else methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise StabilityConfigError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    lags = [int(k) for k in (spec.lags if lags is None else lags)]
    if not lags or any(k < 0 for k in lags):
        raise StabilityConfigError(f"max lags must be integers >= 0 (0 = on-policy), got {lags}")
    seeds = [int(s) for s in (spec.seeds if seeds is None else seeds)]
    if not seeds:
        raise StabilityConfigError("at least one seed is needed")
    return config, methods, lags, seeds


def _sim_settings(config: StabilityConfig, max_lag: int):
    from gepo_plugin.hetero.delays import LogNormalDelay
    from gepo_plugin.lab.stability_sim import SimSettings

    return SimSettings(
        max_lag=max_lag,
        strategy=config.strategy,
        sampler_seconds=config.sampler_seconds,
        delay_model=LogNormalDelay.from_interval(config.delay_low, config.delay_high, config.delay_confidence),
        learner_seconds=config.learner_seconds,
        groups_per_batch=config.groups_per_batch,
        group_size=config.group_size,
        prompts_per_step=config.prompts_per_step,
        buffer_groups=config.buffer_groups or config.prompts_per_step,
        temperature=config.temperature,
        format_reward=config.format_reward,
        grad_clip=config.grad_clip,
    )


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
            rows.append(row)
    return rows


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
        "(token_is = p_t/q_t, seq_is = length-normalised p/q, gepo = p/E_hat_q[q]); KL: k3 token mean.",
    ]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"), strict=True))
    # distinct dashes: on-policy GSPO and GRPO are gradient-identical, so their curves coincide exactly
    styles = dict(zip(METHODS, ("-", "--", ":", "-.", (0, (5, 1, 1, 1))), strict=True))
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


def run_stability(
    out_dir: Path,
    preset: str = "quick",
    seeds: list[int] | None = None,
    methods: Sequence[str] | None = None,
    lags: Sequence[int] | None = None,
    progress: bool = True,
    live: bool = False,
    time_scale: float | None = None,
    ray_cpus: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Warm-start one policy per seed, RL-train it per (method, max_lag), write every output; return the summary.

    Files in ``out_dir`` (created if missing): ``stability_summary.json``, ``stability_table.md``,
    ``stability_eval.csv`` (eval accuracy per run and step), ``stability_steps.csv`` (per-update
    diagnostics), ``stability_curves.png``, ``stability_diagnostics.png``. Wall-clock times are kept apart
    under ``summary["timing"]``; everything else is a deterministic function of the arguments.

    ``live=True`` runs each (method, max_lag) with real sampler processes (Ray actors) in wall-clock time
    instead of the simulation (:mod:`gepo_plugin.lab.stability_live`; ``time_scale`` wall seconds per
    simulated second, default 0.05; ``ray_cpus`` Ray's logical CPUs, default one per sampler). The warm start
    is the same; the RL part is then not reproducible, and the summary says ``"mode": "live"``.
    """
    import torch

    from gepo_plugin.lab.stability_sim import MethodSpec, simulate_run
    from gepo_plugin.lab.stability_task import build_policy, build_task, supervised_warm_start

    config, methods, lags, seeds = resolve(preset, seeds, methods, lags, overrides)
    if not live and (time_scale is not None or ray_cpus is not None):
        raise StabilityConfigError("time_scale and ray_cpus only apply to live mode (live=True / --live)")
    if live:
        from gepo_plugin.lab.stability_live import DEFAULT_TIME_SCALE

        time_scale = DEFAULT_TIME_SCALE if time_scale is None else float(time_scale)
        if not time_scale > 0:
            raise StabilityConfigError(f"time_scale must be > 0 wall seconds per simulated second, got {time_scale}")
        if ray_cpus is not None and ray_cpus < 1:
            raise StabilityConfigError(f"ray_cpus must be >= 1, got {ray_cpus}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draw = plots_available()
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    cluster = None
    try:
        from tqdm.auto import tqdm

        task = build_task(config.max_a, config.max_b, config.eval_fraction, config.task_seed)
        specs = {m: MethodSpec.from_preset(m) for m in methods}
        if config.clip is not None:
            specs = {m: dataclasses.replace(s, clip_low=config.clip, clip_high=config.clip) for m, s in specs.items()}
        run_fn = simulate_run
        n_runs = len(seeds) * len(methods) * len(lags)
        bar = tqdm(total=n_runs * config.rl_steps, disable=not progress, desc="stability", unit="step")
        records, warm, timing = [], {}, {}
        for seed in seeds:
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
            if live and cluster is None:
                from gepo_plugin.lab.stability_live import LiveCluster

                tick = time.perf_counter()
                bar.set_postfix_str("starting Ray sampler actors")
                cluster = LiveCluster(
                    config.sampler_seconds, time_scale, task, base, _sim_settings(config, 0), ray_cpus=ray_cpus
                )
                run_fn = cluster.run
                timing["live/ray_start"] = time.perf_counter() - tick
            for lag in lags:
                settings = _sim_settings(config, lag)
                for method in methods:
                    tick = time.perf_counter()
                    bar.set_postfix_str(f"seed {seed} {method} lag {lag}")
                    record = run_fn(
                        copy.deepcopy(base),
                        specs[method],
                        task,
                        settings,
                        seed=seed,
                        rl_steps=config.rl_steps,
                        lr=config.lr,
                        eval_every=config.eval_every,
                        lr_warmup_steps=config.lr_warmup_steps,
                        eval_samples=config.eval_samples,
                        on_step=lambda _rec: bar.update(1),
                    )
                    records.append(record)
                    timing[f"run/seed{seed}/{method}/lag{lag}"] = time.perf_counter() - tick
        bar.close()
    finally:
        torch.set_num_threads(previous_threads)
        if cluster is not None:
            cluster.close()
    runs = [rec.to_dict() for rec in records]
    summary: dict[str, Any] = {
        "mode": "live" if live else "simulated",
        "preset": preset,
        "methods": methods,
        "lags": lags,
        "seeds": seeds,
        "config": dataclasses.asdict(config),
        "task": {"train_problems": int(task.train_idx.numel()), "eval_problems": int(task.eval_idx.numel())},
        "warm_start": warm,
        "runs": runs,
        "aggregate": aggregate(runs, methods, lags),
    }
    if live:
        summary["live"] = {
            "time_scale": time_scale,
            "ray_cpus": cluster.ray_cpus,
            "reproducible": False,
            "note": "samplers are Ray actors in wall-clock time: the schedule (which version generates which "
            "group) depends on the OS and is not reproducible; sim_time / sim_seconds are wall seconds / "
            "time_scale. The lag bound and the ledger are asserted as in the simulation.",
        }
    _write_csvs(out_dir, records)
    (out_dir / "stability_table.md").write_text(markdown_table(summary))
    timing["total"] = time.perf_counter() - started
    summary["timing"] = timing
    (out_dir / "stability_summary.json").write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    if draw:  # the results are on disk before any plot is attempted
        _plot(out_dir, records, methods, lags)
    return summary


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def add_stability_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Attach this lab's options to ``parser`` (so a parent CLI can reuse them as a subcommand)."""
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
        help="ci (~40 s, for tests), quick (~3.5 min: gepo/gspo/grpo at lag 0 and 64, 2 seeds) or paper "
        "(all methods, lags 0/8/64, 5 seeds, ~25 min measured); default quick",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to run (default: the preset's)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="methods to compare (default: the preset's)")
    parser.add_argument("--lags", type=int, nargs="+", help="max_lag settings; 0 = on-policy (default: the preset's)")
    parser.add_argument("--rl-steps", type=int, help="learner updates per run (default: the preset's)")
    parser.add_argument("--eval-every", type=int, help="evaluate on the held-out set every N updates")
    parser.add_argument("--lr", type=float, help="RL learning rate of AdamW (default 1e-3)")
    parser.add_argument("--group-size", type=int, help="responses per prompt G (default 8)")
    parser.add_argument("--prompts-per-step", type=int, help="prompt groups per learner update (default 16)")
    parser.add_argument(
        "--clip",
        type=float,
        help="ratio clip eps for every method, both sides: 1-eps..1+eps (default: the presets' 0.2/0.2)",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="staleness strategy: wait (the paper's: nothing dropped, the learner waits) or drop (default wait)",
    )
    parser.add_argument(
        "--delay-low", type=float, help="lower end of the log-normal weight-delay interval, simulated s (default 4)"
    )
    parser.add_argument(
        "--delay-high", type=float, help="upper end of the log-normal weight-delay interval, simulated s (default 256)"
    )
    parser.add_argument(
        "--sampler-seconds",
        type=float,
        nargs="+",
        help="simulated seconds per rollout batch, one value per sampler (default 1 1.5 2 4)",
    )
    parser.add_argument(
        "--groups-per-batch",
        type=int,
        help="prompt groups per sampler rollout batch (default 4; divides --prompts-per-step)",
    )
    parser.add_argument(
        "--buffer-groups",
        type=int,
        help="samplers start a batch only while fewer groups than this are queued or in flight "
        "(default: --prompts-per-step)",
    )
    parser.add_argument(
        "--learner-seconds", type=float, help="simulated seconds one learner update takes at least (default 0.5)"
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        help="sampled answers per held-out problem for pass@1 (default 8; 0 = greedy exact match)",
    )
    parser.add_argument("--warm-target", type=float, help="train accuracy at which the SFT warm start stops")
    parser.add_argument("--format-reward", type=float, help="reward for 'digits then <eos>' answers (default 0)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default 1: fastest for this tiny model)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument(
        "--live",
        action="store_true",
        help="run the samplers as real concurrent processes (Ray actors, one torch thread each) in wall-clock "
        "time instead of the seeded simulation; same learner, staleness rule, ledger and outputs, with "
        '"mode": "live" in the summary JSON. NOT bit-reproducible: the schedule depends on OS scheduling',
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        help="live mode only: wall-clock seconds per simulated second, applied to --sampler-seconds, "
        "--learner-seconds and the weight delays (default 0.05)",
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        help="live mode only: logical CPUs for the local Ray session (default: one per sampler)",
    )
    return parser


#: CLI option -> StabilityConfig field, for options that override the config.
_OVERRIDE_OPTIONS = (
    "rl_steps",
    "eval_every",
    "lr",
    "group_size",
    "prompts_per_step",
    "clip",
    "strategy",
    "delay_low",
    "delay_high",
    "sampler_seconds",
    "warm_target",
    "format_reward",
    "threads",
    "groups_per_batch",
    "buffer_groups",
    "learner_seconds",
    "eval_samples",
)


def run_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the lab from parsed :func:`add_stability_arguments` options; bad values exit 2 via ``parser.error``."""
    if not args.live and (args.time_scale is not None or args.ray_cpus is not None):
        parser.error("--time-scale and --ray-cpus only apply with --live")
    overrides = {name: getattr(args, name) for name in _OVERRIDE_OPTIONS if getattr(args, name) is not None}
    live_options = {"live": True, "time_scale": args.time_scale, "ray_cpus": args.ray_cpus} if args.live else {}
    try:
        summary = run_stability(
            args.out,
            preset=args.preset,
            seeds=args.seeds,
            methods=args.methods,
            lags=args.lags,
            progress=not args.no_progress,
            **live_options,
            **overrides,
        )
    except StabilityConfigError as error:
        parser.error(str(error))
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
