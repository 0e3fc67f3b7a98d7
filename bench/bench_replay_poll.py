"""Benchmark: verl's 2 s replay-buffer polls against the plugin's paced polls, and what they cost on a GPU-sized step.

Part 1 (runs) trains the tiny model with verl's real trainer on this machine, each configuration twice in a row:
with verl's own waits (``GEPO_PACED_REPLAY_POLL=0``: verl's buffers sleep 2 s between polls, the HeteroRL buffer
too) and with the plugin's paced polls (the default). Configurations: ``sync``, ``separate_async`` (one rollout
replica beside the learner) and ``hetero`` (HeteroRL on separate_async, one sampler group, max lag 2), each with the
plugin's transformers server (``hf``) and verl's vLLM rollout (``vllm``, vLLM's CPU build). Reported per run, over
the steps after ``--skip``: the median ``timing_s/gen`` (generation in sync mode; the learner's wait for finished
groups in the asynchronous ones) and ``timing_s/step``, and paced / verl ratios of both.

Part 2 (a GPU-sized step) measures what one poll of verl's buffer costs over a real TransferQueue holding a GPU
run's batch (``--gpu-prompts`` prompt groups of ``--gpu-responses`` trajectories), which sets the paced interval
(:class:`gepo_plugin.verl_glue.replay_wait.PollPacing`), then computes the expected time a wait overshoots the end
of generation for generation times drawn uniformly from ``--gpu-gen`` seconds: with polls every ``d`` seconds from
the wait's start, a generation of ``t`` seconds is noticed at ``ceil(t / d) * d``. Reported: the mean overshoot of
2 s polls and of paced polls, in seconds and as a share of the step.

    python bench/bench_replay_poll.py                      # both parts, about 15 minutes on 2 cores
    python bench/bench_replay_poll.py --engines hf --steps 6 --json out.json
    python bench/bench_replay_poll.py --skip-runs          # part 2 only (a minute)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import add_output_options, cpu_training_metrics, script_parser, write_json_around
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rollout side's writer (a test helper)

MODES = ("sync", "separate_async", "hetero")
ENGINES = ("hf", "vllm")
POLLS = {"verl": "0", "paced": "1"}
SWITCH = "+ray_kwargs.ray_init.runtime_env.env_vars.GEPO_PACED_REPLAY_POLL"


def run_overrides(tiny: dict[str, str], engine: str, mode: str, steps: int, polls: str) -> list[str]:
    from gepo_plugin.tiny import cpu_run_overrides

    verl_mode = "sync" if mode == "sync" else "separate_async"
    overrides = [
        *cpu_run_overrides(tiny, loss="gepo", mode=verl_mode, steps=steps, learners=1),
        f"actor_rollout_ref.rollout.name={engine}",
        f"trainer.experiment_name=poll_{engine}_{mode}_{polls}",
        f"{SWITCH}='{POLLS[polls]}'",
    ]
    if mode == "hetero":
        overrides += ["actor_rollout_ref.hybrid_engine=False", "hetero.enable=true", "hetero.max_lag=2"]
    return overrides


def run_row(metrics: dict[int, dict], skip: int) -> dict[str, float]:
    steps = [m for step, m in sorted(metrics.items()) if step > skip]
    return {
        "gen_s": statistics.median(m["timing_s/gen"] for m in steps),
        "gen_mean_s": statistics.mean(m["timing_s/gen"] for m in steps),
        "step_s": statistics.median(m["timing_s/step"] for m in steps),
        "gen_per_step": [m["timing_s/gen"] for m in steps],
    }


def part_runs(args) -> list[dict]:
    from gepo_plugin.tiny import write_all

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_poll_") as tmp:
        tiny = write_all(Path(tmp) / "tiny", for_vllm=True)
        plan = [(engine, mode, polls) for engine in args.engines for mode in args.modes for polls in POLLS]
        for engine, mode, polls in tqdm(plan, desc="runs", unit="run"):
            workdir = Path(tmp) / f"{engine}_{mode}_{polls}"
            overrides = run_overrides(tiny, engine, mode, args.steps, polls)
            metrics = cpu_training_metrics(overrides, workdir, f"{engine} {mode} ({polls} polls)")
            rows.append({"engine": engine, "mode": mode, "polls": polls, **run_row(metrics, args.skip)})
    return rows


def poll_cost_s(prompts: int, responses: int, repeats: int) -> float:
    """Median seconds of one poll of verl's async buffer (TransferQueue's metadata and the buffer's decisions) over
    ``prompts`` finished groups of ``responses`` trajectories, on a local Ray with a real TransferQueue."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from rollout_writer import RolloutWriter, clear_all
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        writer = RolloutWriter(tq, group_size=responses)
        writer.fill(groups=prompts, inflight=0, global_steps=2, spread=1, mixed=0.0, per_group=False)
        buffer = ReplayBufferAsync(
            trainer_mode="separate_async",
            trainer_config=OmegaConf.create({}),
            max_off_policy_threshold=8,
            max_off_policy_strategy="drop",
            sampler_kwargs=OmegaConf.create({}),
            refill_fn=lambda n: n,
        )
        costs = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer._sync_metadata_from_transfer_queue()
            reasons = buffer._terminal_eviction_reasons(2, "train")
            buffer._sampleable_terminal_keys("train", reasons)
            costs.append(time.perf_counter() - start)
        clear_all(tq)
        return statistics.median(costs)
    finally:
        tq.close()
        ray.shutdown()


def overshoot_s(gen_s: np.ndarray, interval_s: float) -> np.ndarray:
    """How long after generation ends a wait polling every ``interval_s`` from its start notices it."""
    return np.ceil(gen_s / interval_s) * interval_s - gen_s


def part_gpu(args) -> dict[str, float]:
    from gepo_plugin.verl_glue.replay_wait import PACING

    cost = poll_cost_s(args.gpu_prompts, args.gpu_responses, repeats=20)
    interval = PACING.interval(cost)
    low, high = args.gpu_gen
    gen = np.random.default_rng(0).uniform(low, high, 100_000)
    verl_over, paced_over = overshoot_s(gen, 2.0), overshoot_s(gen, interval)
    step = gen + args.gpu_rest
    return {
        "keys": args.gpu_prompts * (args.gpu_responses + 1),
        "poll_cost_s": cost,
        "paced_interval_s": interval,
        "verl_overshoot_s": float(verl_over.mean()),
        "paced_overshoot_s": float(paced_over.mean()),
        "saved_share_of_step": float(((verl_over - paced_over) / (step + verl_over)).mean()),
    }


def report(rows: list[dict], gpu: dict | None, args) -> dict:
    derived: dict = {}
    if rows:
        print(
            f"\nthe tiny model, {args.steps} steps ({args.skip} skipped): medians, and the mean of gen (an "
            "asynchronous learner waits on some steps only); ratio = paced / verl"
        )
        print(
            f"{'engine':>6} {'mode':>15} {'gen verl':>9} {'gen paced':>9} {'ratio':>6} {'mean verl':>9} "
            f"{'mean paced':>10} {'step verl':>9} {'step paced':>10} {'ratio':>6}"
        )
        by_key = {(row["engine"], row["mode"], row["polls"]): row for row in rows}
        ratios = {}
        for engine in args.engines:
            for mode in args.modes:
                verl, paced = by_key[(engine, mode, "verl")], by_key[(engine, mode, "paced")]
                gen_ratio, step_ratio = paced["gen_s"] / verl["gen_s"], paced["step_s"] / verl["step_s"]
                ratios[f"{engine}/{mode}"] = {"gen": gen_ratio, "step": step_ratio}
                print(
                    f"{engine:>6} {mode:>15} {verl['gen_s']:>9.3f} {paced['gen_s']:>9.3f} {gen_ratio:>6.2f} "
                    f"{verl['gen_mean_s']:>9.3f} {paced['gen_mean_s']:>10.3f} "
                    f"{verl['step_s']:>9.3f} {paced['step_s']:>10.3f} {step_ratio:>6.2f}"
                )
        derived["ratios"] = ratios
    if gpu:
        print(
            f"\nGPU-sized step: one poll over {gpu['keys']} TransferQueue keys costs {gpu['poll_cost_s'] * 1e3:.1f} ms "
            f"-> paced interval {gpu['paced_interval_s'] * 1e3:.0f} ms; generation uniform in {args.gpu_gen} s "
            f"plus {args.gpu_rest} s of training: a wait overshoots generation by {gpu['verl_overshoot_s']:.2f} s "
            f"with 2 s polls and {gpu['paced_overshoot_s']:.3f} s paced; saved "
            f"{100 * gpu['saved_share_of_step']:.2f}% of a step"
        )
    return derived


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="rollout engines")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="trainer modes")
    parser.add_argument("--skip-runs", action="store_true", help="only part 2 (the GPU-sized step)")
    parser.add_argument("--gpu-prompts", type=int, default=1024, help="prompt groups of a GPU run's batch (1024)")
    parser.add_argument("--gpu-responses", type=int, default=8, help="trajectories per group (8)")
    parser.add_argument(
        "--gpu-gen", type=float, nargs=2, default=(30.0, 120.0), help="generation seconds, low high (30 120)"
    )
    parser.add_argument("--gpu-rest", type=float, default=30.0, help="seconds of a step after generation (30)")
    add_output_options(parser, "the runs and the GPU-sized model")
    args = parser.parse_args(argv)
    rows = [] if args.skip_runs else part_runs(args)
    gpu = part_gpu(args)
    record = {"runs": rows, "gpu": gpu, "steps": args.steps, "skip": args.skip}
    write_json_around(args.json, record, lambda: report(rows, gpu, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
