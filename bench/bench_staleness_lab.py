"""Benchmark: the lab simulator's throughput-against-staleness curve, with the timings of a verl run, beside verl's.

``bench_staleness_throughput.py`` measures verl's real trainer with a modelled GPU sampler. The lab's simulator
(:func:`gepo_plugin.lab.stability_sim.simulate_run`) makes the same staleness decisions (both run
:class:`~gepo_plugin.hetero.core.StalenessCore`) in simulated time, with none of verl's machinery. Given the same
timings it should give the same curve; where it does not, the difference is what verl's machinery costs or buys.

The lab is set up from the verl sweep's JSON:

* a sampler batch is one sampler's share of a step's prompts (``prompts_per_step / samplers`` groups of
  ``responses`` answers), and takes what the verl run's latency model says such a batch takes on the modelled GPU
  (prefill, then every answer decoded to ``max_response_length`` tokens, with the batch slowdown);
* an update takes the learner's time measured in verl's ``sync`` run (its step time less its generation time);
* weights arrive at once (the verl sweep has no WAN delay), and at most one step of groups is queued or in flight
  (the lab's default buffer).

Its "sync" is the same schedule run serially: one step's generation on one sampler, then the update.

    python bench/bench_staleness_lab.py --verl-json docs/bench/staleness_throughput.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from common import add_output_options, max_lag_axis, pyplot, save_figure, script_parser, write_json
from tqdm import tqdm

#: the tiny verl runs' shape (gepo_plugin.tiny.cpu_run_overrides): prompts per step, answers per prompt, tokens
PROMPTS_PER_STEP, RESPONSES, RESPONSE_TOKENS = 4, 4, 8


def modelled_batch_seconds(args: dict, groups: int) -> float:
    """The verl run's latency model: seconds for a batch of ``groups`` x ``RESPONSES`` answers of full length."""
    from gepo_plugin.cpu_backend.rollout.latency import LatencyOptions, finish_offsets

    latency = LatencyOptions(
        decode_tokens_per_s=args["decode_tokens_per_s"],
        prefill_s=args["prefill_s"],
        batch_slowdown=args["batch_slowdown"],
    )
    return float(finish_offsets(np.full(groups * RESPONSES, RESPONSE_TOKENS), latency).max())


def lab_updates_per_s(lag: int, strategy: str, samplers: int, batch_s: float, learner_s: float, steps: int, skip: int):
    """Updates per simulated second after ``skip`` updates, and the trained groups' mean lag."""
    import torch

    from gepo_plugin.lab.stability_config import StabilityConfig
    from gepo_plugin.lab.stability_sim import MethodSpec, RunSetup, simulate_run
    from gepo_plugin.lab.stability_task import build_policy, build_task

    config = StabilityConfig(
        methods=["gepo"],
        lags=[lag],
        seeds=[0],
        rl_steps=steps,
        eval_every=steps,
        eval_samples=0,
        group_size=RESPONSES,
        prompts_per_step=PROMPTS_PER_STEP,
        groups_per_batch=PROMPTS_PER_STEP // samplers,
        sampler_seconds=[batch_s] * samplers,
        learner_seconds=learner_s,
        delay_low=1e-6,
        delay_high=2e-6,
        strategy=strategy,
    )
    task = build_task(config.max_a, config.max_b, config.eval_fraction, config.task_seed)
    torch.manual_seed(0)
    model = build_policy(task, 0, config.hidden, config.layers, config.heads)
    record = simulate_run(RunSetup(model, MethodSpec.from_preset("gepo"), task, config, lag, 0))
    times = [step["sim_time"] for step in record.steps]
    rate = (len(times) - 1 - skip) / (times[-1] - times[skip])
    return rate, float(np.mean(record.lags))


def compare(verl: dict, steps: int, skip: int) -> list[dict]:
    """One row per verl configuration (its repeats averaged), with the lab's figures for the same settings."""
    from bench_staleness_throughput import aggregate

    args = verl["args"]
    configurations = aggregate(verl["runs"])
    sync = next(row for row in configurations if row["mode"] == "sync")
    learner_s = sync["step_s"] - sync["idle_s"]
    sync_batch_s = modelled_batch_seconds(args, PROMPTS_PER_STEP)
    sync_rate = 1.0 / (sync_batch_s + learner_s)
    rows = [_row(sync, 1.0, 0.0, 1.0 / sync_rate, sync_batch_s, learner_s)]
    for verl_row in tqdm([row for row in configurations if row["mode"] == "hetero"], desc="lab runs", unit="run"):
        lag, strategy, samplers = verl_row["max_lag"], verl_row["strategy"], verl_row["samplers"]
        batch_s = modelled_batch_seconds(args, PROMPTS_PER_STEP // samplers)
        rate, lab_lag = lab_updates_per_s(lag, strategy, samplers, batch_s, learner_s, steps, skip)
        rows.append(_row(verl_row, rate / sync_rate, lab_lag, 1.0 / rate, batch_s, learner_s))
    return rows


def _row(verl_row: dict, lab_x_sync: float, lab_lag: float, lab_step_s: float, batch_s: float, learner_s: float):
    return {
        "max_lag": verl_row["max_lag"],
        "strategy": verl_row["strategy"],
        "samplers": verl_row["samplers"],
        "verl_x_sync": verl_row["x_sync"],
        "verl_x_sync_range": [verl_row["x_sync_min"], verl_row["x_sync_max"]],
        "verl_lag_mean": verl_row["lag_mean"],
        "verl_step_s": verl_row["step_s"],
        "lab_x_sync": lab_x_sync,
        "lab_lag_mean": lab_lag,
        "lab_step_s": lab_step_s,
        "lab_batch_s": batch_s,
        "learner_s": learner_s,
    }


def report(rows: list[dict], learner_s: float, sync_gen_s: float, modelled_s: float) -> None:
    print(
        f"\nlearner update {learner_s:.2f} s (verl sync step less its generation); verl sync generation "
        f"{sync_gen_s:.2f} s per step against {modelled_s:.2f} s on the modelled GPU"
    )
    print(
        f"{'samplers':>8}{'strategy':>9}{'max_lag':>8}{'verl x sync':>12}{'lab x sync':>11}{'verl step s':>12}"
        f"{'lab step s':>11}{'verl lag':>9}{'lab lag':>8}"
    )
    for row in rows:
        lag = "sync" if row["max_lag"] is None else row["max_lag"]
        print(
            f"{row['samplers']:>8}{row['strategy']:>9}{lag:>8}{row['verl_x_sync']:>12.2f}"
            f"{row['lab_x_sync']:>11.2f}{row['verl_step_s']:>12.2f}{row['lab_step_s']:>11.2f}"
            f"{row['verl_lag_mean']:>9.2f}{row['lab_lag_mean']:>8.2f}"
        )


def plot(rows: list[dict], path: str) -> None:
    import itertools

    rows = [row for row in rows if row["max_lag"] is not None]
    fig, axis = pyplot().subplots(figsize=(6, 3.6))
    key = lambda row: (row["samplers"], row["strategy"])  # noqa: E731
    for index, ((samplers, strategy), group) in enumerate(itertools.groupby(sorted(rows, key=key), key=key)):
        group = sorted(group, key=lambda row: row["max_lag"])
        lags = [row["max_lag"] for row in group]
        label = f"{samplers} samplers, {strategy}"
        axis.plot(lags, [row["verl_x_sync"] for row in group], marker="o", color=f"C{index}", label=f"verl: {label}")
        axis.plot(lags, [row["lab_x_sync"] for row in group], marker="x", linestyle="--", color=f"C{index}")
    axis.plot([], [], "k--", marker="x", label="lab simulator (same timings)")
    max_lag_axis(axis, (row["max_lag"] for row in rows), sync_linestyle=":")
    axis.set_ylabel("throughput vs sync")
    axis.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--verl-json", required=True, help="the JSON bench_staleness_throughput.py --json wrote")
    parser.add_argument("--steps", type=int, default=40, help="simulated updates per lab run (default 40)")
    parser.add_argument("--skip", type=int, default=4, help="first updates left out of the rate (default 4)")
    add_output_options(parser, "the comparison", "both curves")
    args = parser.parse_args(argv)
    if args.steps <= args.skip + 1:
        parser.error("--steps must be larger than --skip + 1")
    verl = json.loads(Path(args.verl_json).read_text())
    rows = compare(verl, args.steps, args.skip)
    sync = next(run for run in verl["runs"] if run["mode"] == "sync")
    modelled = modelled_batch_seconds(verl["args"], PROMPTS_PER_STEP)
    report(rows, sync["step_s"] - sync["idle_s"], sync["idle_s"], modelled)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
