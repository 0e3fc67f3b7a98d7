"""Benchmark: does the tiny model learn its task through verl's real trainer, and how far does it get in how many steps?

The tiny task (``gepo_plugin.tiny``: a random 86k-parameter Llama, a character tokenizer, ``a+b=`` prompts, a reward
equal to the share of the answer's characters that are digits) is trained from random initialisation with verl's real
trainer on this machine, at the end-to-end tests' settings (``cpu_run_overrides``: 4 prompts x 4 responses a step, Adam
at ``LEARNING_RATE``, responses of at most 8 tokens), for ``--seeds`` seeds of the model, its data and the trainer.
Each configuration, per seed, reports ``critic/score/mean`` (the mean reward of the step's trained batch) at every step:

* ``gepo_sync`` and ``grpo_sync``: on-policy (verl's sync trainer), with the plugin's GEPO loss and with verl's own
  PPO-clip loss on GRPO advantages (``algorithm.loss=grpo``: no plugin loss);
* ``gepo_lr0``: the same as ``gepo_sync`` with a learning rate of 0 (the control: nothing may rise);
* ``gepo_lag`` and ``grpo_lag``: HeteroRL on verl's separate_async trainer, two sampler groups, the second's weights
  3 s late, ``hetero.max_lag=2`` (the trained batches run up to two versions behind);
* ``gepo_frozen``: HeteroRL with a second sampler group that never receives the learner's weights (``max_lag`` above
  the run's length, so its rollouts are trained): its reward (``hetero/sampler_group_1/reward_mean``) must stay at
  chance while the first group's climbs;
* the end-to-end tests' own learning runs, configured by the same functions the tests call (``tests/cpu_runs.py``,
  ``tests/vllm_runs.py``): ``megatron_frozen`` (``gepo_frozen`` with verl's Megatron learner and the first group's
  weights 2 s late), ``gepo_sync_vllm`` (sync GEPO with verl's vLLM rollout on batches verl pads, beside verl's
  decoupled truncated IS) and ``gspo_vllm_lag`` (HeteroRL with two vLLM samplers fed by the relay, verl's gspo loss,
  answers of up to 96 tokens).

What it prints, per configuration: the reward at step 1 (chance: its mean and maximum over the seeds), the mean reward
over the last five steps (the statistic the end-to-end tests bound, ``tests/learning.py``), its minimum, median and
maximum over the seeds, and the ratio of GEPO's to verl's GRPO (same seeds, side by side). ``--png`` draws the curves
(median and range over seeds).

    python bench/bench_tiny_learning.py --json docs/bench/tiny_learning.json --png docs/bench/tiny_learning.png
    python bench/bench_tiny_learning.py --configs gepo_sync gepo_lr0 --seeds 2 --steps 10     # a quick look

With ``--json`` every run is written as it ends, and a study run again with the same file and steps goes on with the
runs it lacks.

About a minute per run on 2 cores (start-up included; two with vLLM or Megatron): all nine configurations over ten
seeds take about two and a half hours.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import (
    add_output_options,
    cpu_training_metrics,
    pyplot,
    save_figure,
    script_parser,
    write_json,
    write_json_around,
)
from tqdm import tqdm

SCORE = "critic/score/mean"
#: the never-updated group's reward, logged per sampler group
FROZEN_GROUP = "hetero/sampler_group_1/reward_mean"
LIVE_GROUP = "hetero/sampler_group_0/reward_mean"
#: steps over which the end-to-end tests average the reward (tests/learning.py reads the same window)
WINDOW = 5

HETERO = [
    "trainer.v1.separate_async.parameter_sync_step=1",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=2",
    "actor_rollout_ref.hybrid_engine=False",
    "hetero.enable=true",
    "hetero.strategy=wait",
]


def config_overrides(name: str, steps: int) -> tuple[str, str, list[str]]:
    """(loss, verl mode, extra overrides) of the configurations built here from ``cpu_run_overrides``."""
    lagged = [
        *HETERO,
        "hetero.max_lag=2",
        "hetero.group_delays=[{distribution: none},{distribution: constant, seconds: 3}]",
    ]
    frozen = [
        *HETERO,
        f"hetero.max_lag={steps + 1}",
        "hetero.group_delays=[{distribution: none},{distribution: constant, seconds: 1e9}]",
    ]
    return {
        "gepo_sync": ("gepo", "sync", []),
        "grpo_sync": ("grpo", "sync", []),
        "gepo_lr0": ("gepo", "sync", ["actor_rollout_ref.actor.optim.lr=0"]),
        "gepo_lag": ("gepo", "separate_async", lagged),
        "grpo_lag": ("grpo", "separate_async", lagged),
        "gepo_frozen": ("gepo", "separate_async", frozen),
    }[name]


#: the end-to-end tests' own learning runs: name -> (the function that builds their overrides, a vLLM-shaped model)
E2E_RUNS = {
    "megatron_frozen": ("cpu_runs", "megatron_hetero_overrides", False),
    "gepo_sync_vllm": ("vllm_runs", "vllm_sync_learning_overrides", True),
    "gspo_vllm_lag": ("vllm_runs", "vllm_hetero_learning_overrides", True),
}
CONFIGS = ("gepo_sync", "grpo_sync", "gepo_lr0", "gepo_lag", "grpo_lag", "gepo_frozen", *E2E_RUNS)


def run(name: str, seed: int, steps: int, root: Path) -> dict[str, list[float]]:
    """One run: the per-step reward curves it logged (the batch's, and each sampler group's where there are groups)."""
    from gepo_plugin.tiny import cpu_run_overrides, write_all

    workdir = root / f"{name}_{seed}"
    if name in E2E_RUNS:
        module, function, for_vllm = E2E_RUNS[name]
        tiny = write_all(root / f"tiny_{seed}_{for_vllm}", seed=seed, for_vllm=for_vllm)
        overrides = getattr(importlib.import_module(module), function)(tiny, workdir, steps)
    else:
        loss, mode, extra = config_overrides(name, steps)
        tiny = write_all(root / f"tiny_{seed}", seed=seed)
        overrides = [*cpu_run_overrides(tiny, loss=loss, mode=mode, steps=steps, learners=1), *extra]
    overrides += [f"data.seed={seed}", f"trainer.experiment_name=learning_{name}_{seed}"]
    metrics = cpu_training_metrics(overrides, workdir, f"{name} seed {seed}")
    ordered = [metrics[step] for step in sorted(metrics)]
    curves = {SCORE: [m[SCORE] for m in ordered]}
    for key in (LIVE_GROUP, FROZEN_GROUP):
        if any(key in m for m in ordered):
            curves[key] = [m.get(key, float("nan")) for m in ordered]
    return curves


def tail_mean(curve: list[float]) -> float:
    values = [v for v in curve[-WINDOW:] if v == v]
    return statistics.fmean(values) if values else float("nan")


def summary(results: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, dict]:
    out = {}
    for name, seeds in results.items():
        for key in (SCORE, LIVE_GROUP, FROZEN_GROUP):
            curves = [c[key] for c in seeds.values() if key in c]
            if not curves:
                continue
            ends = [tail_mean(c) for c in curves]
            out[f"{name} {key}"] = {
                "seeds": len(curves),
                "step1_max": max(c[0] for c in curves if c[0] == c[0]) if any(c[0] == c[0] for c in curves) else None,
                "step1_mean": statistics.fmean(c[0] for c in curves if c[0] == c[0]) if curves else None,
                "last5_min": min(ends),
                "last5_median": statistics.median(ends),
                "last5_max": max(ends),
            }
    return out


def report(results, steps: int) -> dict:
    rows = summary(results)
    print(f"\nmean reward over the last {WINDOW} of {steps} steps, over seeds (chance: step 1)")
    print(f"{'configuration':58} {'seeds':>5} {'step 1':>7} {'(max)':>6} {'min':>6} {'median':>7} {'max':>6}")
    for name, row in rows.items():
        print(
            f"{name:58} {row['seeds']:5d} {row['step1_mean']:7.3f} {row['step1_max']:6.3f} {row['last5_min']:6.3f} "
            f"{row['last5_median']:7.3f} {row['last5_max']:6.3f}"
        )
    ratios = {}
    for setting in ("sync", "lag"):
        gepo, grpo = results.get(f"gepo_{setting}", {}), results.get(f"grpo_{setting}", {})
        common = sorted(set(gepo) & set(grpo))
        if common:
            ratio = statistics.median(tail_mean(gepo[s][SCORE]) / tail_mean(grpo[s][SCORE]) for s in common)
            ratios[setting] = ratio
            print(f"GEPO / verl's GRPO ({setting}, {len(common)} paired seeds): final reward, median ratio {ratio:.2f}")
    return {"summary": rows, "gepo_over_grpo": ratios}


def draw(results, path: str) -> None:
    plt = pyplot()
    panels = [(SCORE, "the trained batch's mean reward"), (FROZEN_GROUP, "a frozen sampler beside: per group")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, seeds in results.items():
        curves = [c[SCORE] for c in seeds.values()]
        if not curves:
            continue
        steps = range(1, len(curves[0]) + 1)
        columns = list(zip(*curves, strict=False))
        axes[0].plot(steps, [statistics.median(c) for c in columns], label=name)
        axes[0].fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], alpha=0.15)
    for name in ("gepo_frozen", "megatron_frozen"):
        for key, label in ((LIVE_GROUP, "group 0 (receives the weights)"), (FROZEN_GROUP, "group 1 (never does)")):
            curves = [c[key] for c in results.get(name, {}).values() if key in c]
            if curves:
                steps = range(1, len(curves[0]) + 1)
                columns = [[v for v in column if v == v] or [float("nan")] for column in zip(*curves, strict=False)]
                axes[1].plot(steps, [statistics.median(c) for c in columns], label=f"{name}: {label}")
                axes[1].fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], alpha=0.15)
    for axis, (_, title) in zip(axes, panels, strict=True):
        axis.set_xlabel("step")
        axis.set_ylabel("mean reward (share of digits)")
        axis.set_ylim(0, 1.02)
        axis.set_title(title)
        axis.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="configurations (all)")
    parser.add_argument("--seeds", type=int, default=10, help="seeds per configuration (10)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (0)")
    parser.add_argument("--steps", type=int, default=25, help="training steps per run (25)")
    add_output_options(parser, "every curve and the summary", "the curves (median and range over seeds)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the e2e runs' configurations
    record = {"steps": args.steps, "window": WINDOW, "results": {name: {} for name in args.configs}}
    if args.json and Path(args.json).exists():  # an interrupted study goes on where it stopped (same steps only)
        saved = json.loads(Path(args.json).read_text())
        if saved.get("steps") == args.steps:
            for name, seeds in saved["results"].items():
                record["results"].setdefault(name, {}).update(seeds)
    results: dict[str, dict[str, dict[str, list[float]]]] = record["results"]
    todo = [
        (seed, name)
        for seed in range(args.first_seed, args.first_seed + args.seeds)
        for name in args.configs
        if str(seed) not in results[name]
    ]
    with tempfile.TemporaryDirectory(prefix="tiny_learning_") as root:
        for seed, name in tqdm(todo, desc="runs"):
            results[name][str(seed)] = run(name, seed, args.steps, Path(root))
            if args.json:  # every run kept as it ends: a study takes hours
                write_json(args.json, record)
    write_json_around(args.json, record, lambda: report(results, args.steps))
    if args.png:
        draw(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
