"""Benchmark: the HeteroRL sampler against verl's ReplayBufferAsync, and the cost of the delay models, on CPU.

Part 1 (sampler) starts a local Ray and a real TransferQueue, and for each repetition and each
implementation (interleaved, so machine drift hits all alike) plays verl's rollout side: it writes
``--groups`` finished prompt groups of ``--group-size`` trajectories (prompt keys tagged
``is_prompt``/``status``/``global_steps``, trajectories ``{uid}_{i}_0`` tagged with
``min_global_steps``/``max_global_steps``, exactly as ``AgentLoopWorkerTQ`` does), plus ``--inflight``
pending/running prompts, then times ``sample(global_steps=g, partition_id="train", batch_size=B)``
until every finished group is trained, clearing each batch's keys from TransferQueue afterwards as
verl's trainer does. Versions stay within every bound, so nothing is evicted (checked). Timed
repetitions write with four batched puts (``--fill``); the warm-up writes one put per group as rollout
workers do, and both fill times are reported.

Implementations: verl's ``ReplayBufferAsync`` (``separate_async``, ``max_off_policy_threshold``,
strategy ``drop``) and the plugin's ``HeteroReplayBuffer`` with ``{"enable": True, "max_lag": 64}``
(``--max-lag``) under strategy ``drop`` and ``wait``. Reported: median ms per ``sample()`` call, its
ratio to verl's (of the medians, and the median of per-repetition paired ratios), and the time of
the fill itself (the rollout side's writes, not part of the ratio). ``--profile`` adds cProfile
tables of ``sample()`` (automatically when a ratio exceeds ``--target``).

Part 2 (delays) times ``gepo_plugin.hetero.delays`` models: one draw per call (how the weight
schedule draws), a bulk draw of ``--bulk`` values, numpy's ``rng.lognormal`` (bare, and followed by the
``np.clip`` the interval-fitted models apply) as the baseline, and a
``WeightArrivalSchedule`` of 4 log-normal groups: one ``publish()`` + ``advance()`` per learner step.

    nice python bench/bench_sampler.py            # defaults: about 1-1.5 minutes on 2 busy cores
    python bench/bench_sampler.py --help
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from common import add_output_options, median_seconds, paired_median_ratio, script_parser, write_json

# The rollout side is played by the tests' writer (a test helper, not shipped in the package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rollout_writer import PARTITION, RolloutWriter, clear_all

VERL = "verl ReplayBufferAsync"
HETERO_DROP = "HeteroReplayBuffer (drop)"
HETERO_WAIT = "HeteroReplayBuffer (wait)"
IMPLEMENTATIONS = (VERL, HETERO_DROP, HETERO_WAIT)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- part 1: sampler
def make_buffer(name: str, args):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    from gepo_plugin.hetero.settings import parse_hetero
    from gepo_plugin.verl_glue.hetero.replay_buffer import HeteroReplayBuffer

    common = dict(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=args.verl_threshold,
        max_off_policy_strategy="drop",
        refill_fn=lambda n: n,
        poll_interval=args.poll_interval,
    )
    if name == VERL:
        return ReplayBufferAsync(sampler_kwargs=OmegaConf.create({}), **common)
    strategy = "drop" if name == HETERO_DROP else "wait"
    hetero = {"enable": True, "max_lag": args.max_lag, "strategy": strategy}
    buffer = HeteroReplayBuffer(sampler_kwargs=OmegaConf.create(hetero), **common)
    buffer.attach(parse_hetero(hetero))  # as the plugin's trainer does
    return buffer


def drain(tq, buffer, args, global_steps: int, sample_times: list, clear_times: list, profiler=None) -> None:
    """Sample until every finished group is trained; check that nothing was evicted or lost."""
    left, trained = args.groups, 0
    while left:
        batch_size = min(args.batch_size, left)
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        batch, metrics = buffer.sample(global_steps=global_steps, partition_id=PARTITION, batch_size=batch_size)
        if profiler is not None:
            profiler.disable()
        sampled = time.perf_counter()
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        sample_times.append(sampled - start)
        clear_times.append(time.perf_counter() - sampled)
        groups = {key.split("_")[0] for key in batch.keys}
        evicted = {k: v for k, v in metrics.items() if "evicted" in k or (k.startswith("hetero/dropped") and v)}
        if len(groups) != batch_size or len(batch.keys) != batch_size * args.group_size or evicted:
            raise RuntimeError(f"unexpected batch: {len(groups)} groups, {len(batch.keys)} keys, evictions {evicted}")
        left -= batch_size
        trained += len(groups)
    remaining = tq.kv_list(PARTITION) or {}
    prompts = [k for k, tag in remaining.get(PARTITION, {}).items() if tag.get("is_prompt")]
    if len(prompts) != args.inflight or trained != args.groups:
        raise RuntimeError(f"after the drain: {len(prompts)} prompts left (expected {args.inflight} in flight)")


def quiet_logs() -> None:
    import verl.trainer.ppo.v1.replay_buffer  # noqa: F401  (creates its INFO-level logger)

    import gepo_plugin.verl_glue.hetero.replay_buffer  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("verl"):  # "off-policy version control disabled" on every HeteroReplayBuffer
            logging.getLogger(name).setLevel(logging.WARNING)
        if name.startswith("transfer_queue"):  # a thread-count warning on every put on a small machine
            logging.getLogger(name).setLevel(logging.ERROR)


def bench_sampler(args) -> dict:
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    log(f"starting Ray ({args.ray_cpus} logical CPUs) and TransferQueue ...")
    ray.init(
        address="local", num_cpus=args.ray_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False
    )
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    quiet_logs()
    try:
        rollouts = RolloutWriter(tq, args.group_size, args.width, args.seed, partition=PARTITION)
        names = [n for n in IMPLEMENTATIONS if not (args.skip_wait and n == HETERO_WAIT)]
        fills = {n: [] for n in names}
        fills_per_group = {n: [] for n in names}
        samples = {n: [] for n in names}
        clears = {n: [] for n in names}
        rep_medians = {n: [] for n in names}
        firsts = {n: [] for n in names}
        global_steps = args.global_steps
        total = args.warmup + args.repeats
        for rep in range(total):
            timed = rep >= args.warmup
            per_group = not timed or args.fill == "per-group"  # warm-ups time the per-group protocol
            order = names if rep % 2 == 0 else names[::-1]  # alternate the order too
            for name in order:
                clear_all(tq)
                buffer = make_buffer(name, args)
                start = time.perf_counter()
                rollouts.fill(args.groups, args.inflight, global_steps, args.spread, args.mixed, per_group)
                fill = time.perf_counter() - start
                sample_times, clear_times = [], []
                drain(tq, buffer, args, global_steps, sample_times, clear_times)
                (fills_per_group if per_group else fills)[name].append(fill)
                if timed:
                    samples[name] += sample_times
                    clears[name] += clear_times
                    rep_medians[name].append(statistics.median(sample_times))
                    firsts[name].append(sample_times[0])
                log(
                    f"  [{rep + 1}/{total}{'' if timed else ' warm-up'}] {name:<26} "
                    f"fill ({'per-group' if per_group else 'batched'}) {fill * 1e3:7.0f} ms   "
                    f"sample() median {statistics.median(sample_times) * 1e3:6.2f} ms x{len(sample_times)}"
                )
            global_steps += args.spread  # fresh uids and steps for each repetition
        result = {}
        for name in names:
            result[name] = {
                "sample_ms_median": statistics.median(samples[name]) * 1e3,
                "sample_ms_p90": float(np.percentile(samples[name], 90) * 1e3),
                "sample_calls": len(samples[name]),
                "first_call_ms_median": statistics.median(firsts[name]) * 1e3,
                "ratio_paired_median": paired_median_ratio(rep_medians[name], rep_medians[VERL]),
                "clear_ms_median": statistics.median(clears[name]) * 1e3,
                "fill_batched_ms_median": statistics.median(fills[name]) * 1e3 if fills[name] else None,
                "fill_per_group_ms_median": (
                    statistics.median(fills_per_group[name]) * 1e3 if fills_per_group[name] else None
                ),
            }
        base = result[VERL]["sample_ms_median"]
        worst = max(result[n]["sample_ms_median"] / base for n in names if n != VERL)
        profiles = {}
        if args.profile == "always" or (args.profile == "auto" and worst > args.target):
            profiles = profile_sampler(tq, rollouts, args, global_steps, names)
        return {"rows": result, "profile": profiles}
    finally:
        clear_all(tq)
        tq.close()
        ray.shutdown()


def profile_sampler(tq, rollouts, args, global_steps: int, names) -> dict[str, str]:
    """cProfile of ``sample()`` over one drain per implementation (top functions by own time)."""
    out = {}
    for name in names:
        clear_all(tq)
        buffer = make_buffer(name, args)
        per_group = args.fill == "per-group"
        rollouts.fill(args.groups, args.inflight, global_steps, args.spread, args.mixed, per_group)
        profiler = cProfile.Profile()
        drain(tq, buffer, args, global_steps, [], [], profiler)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.profile_lines)
        stats.sort_stats("cumulative").print_stats(args.profile_lines)
        out[name] = text.getvalue()
        global_steps += args.spread
    return out


def print_sampler(result: dict, args) -> None:
    rows = result["rows"]
    base = rows[VERL]["sample_ms_median"]
    calls = -(-args.groups // args.batch_size)
    print(
        f"\n### Sampler: {args.groups} finished groups x {args.group_size} trajectories + {args.inflight} in flight, "
        f"batch {args.batch_size} groups ({calls} sample() calls per fill), {args.repeats} repetitions\n"
    )
    print(
        "| implementation | median ms / sample() | p90 ms | first call of a fill, ms | vs verl (ratio of medians) "
        "| vs verl (paired, median) | kv_clear ms / batch | fill ms, batched puts | fill ms, per-group puts |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    for name, row in rows.items():
        ratio = row["sample_ms_median"] / base
        flag = "" if name == VERL or ratio <= args.target else " (over target)"
        print(
            f"| {name} | {row['sample_ms_median']:.2f} | {row['sample_ms_p90']:.2f} | "
            f"{row['first_call_ms_median']:.2f} | {ratio:.2f}x{flag} | "
            f"{row['ratio_paired_median']:.2f}x | {row['clear_ms_median']:.2f} | {ms(row['fill_batched_ms_median'])} | "
            f"{ms(row['fill_per_group_ms_median'])} |"
        )
    print(
        f"\ntarget: HeteroReplayBuffer / ReplayBufferAsync <= {args.target}x. The fill (the rollout side's writes) "
        "is not part of sample(); per-group puts are what rollout workers do (timed in the warm-up), batched puts "
        "are the same keys and tags in four calls (timed repetitions). The first sample() after a fill is where "
        "HeteroReplayBuffer reads the versions of all newly finished groups."
    )
    for name, text in result["profile"].items():
        print(f"\n#### cProfile of sample(), {name}\n\n```\n{text.strip()}\n```")


# ---------------------------------------------------------------------------------------------- part 2: delays
def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean µs per call of ``fn`` over ``calls`` calls."""
    return median_seconds(fn, repeats, calls) * 1e6


def bench_delays(args) -> dict:
    from gepo_plugin.hetero.delays import ConstantDelay, ExponentialDelay, LogNormalDelay, WeibullDelay, delay_rng
    from gepo_plugin.hetero.weight_schedule import WeightArrivalSchedule

    lognormal = LogNormalDelay.from_interval(60, 1920, 0.995)
    models = {
        "ConstantDelay(300)": ConstantDelay(300.0),
        "ExponentialDelay(300)": ExponentialDelay(300.0),
        "LogNormalDelay.from_interval(60, 1920, 0.995)": lognormal,
        "WeibullDelay.from_interval(60, 1920, 0.995)": WeibullDelay.from_interval(60, 1920, 0.995),
    }
    rows = {}
    rng = delay_rng(args.seed)
    bulk = args.bulk
    bulk_calls = max(1, args.bulk_calls)
    mu, sigma = lognormal.mu, lognormal.sigma
    rows["numpy rng.lognormal (baseline)"] = (
        per_call_us(lambda: rng.lognormal(mu, sigma, 1), args.draws, args.delay_repeats),
        per_call_us(lambda: rng.lognormal(mu, sigma, bulk), bulk_calls, args.delay_repeats),
    )
    low, high = lognormal.clip_low, lognormal.clip_high
    rows["numpy rng.lognormal + np.clip (what the clipped models add)"] = (
        per_call_us(lambda: np.clip(rng.lognormal(mu, sigma, 1), low, high), args.draws, args.delay_repeats),
        per_call_us(lambda: np.clip(rng.lognormal(mu, sigma, bulk), low, high), bulk_calls, args.delay_repeats),
    )
    for name, model in models.items():
        log(f"  delays: {name}")
        rows[name] = (
            per_call_us(lambda model=model: model.sample(rng, 1), args.draws, args.delay_repeats),
            per_call_us(lambda model=model: model.sample(rng, bulk), bulk_calls, args.delay_repeats),
        )

    log(f"  delays: WeightArrivalSchedule, {args.publications} publications")
    schedule_us = []
    draws = []
    for rep in range(args.delay_repeats):
        schedule = WeightArrivalSchedule([lognormal] * 4, seed=args.seed + rep)
        start = time.perf_counter()
        for version in range(1, args.publications + 1):
            now = version * args.step_seconds
            schedule.publish(version, now)
            schedule.advance(now + args.step_seconds / 2)
        schedule_us.append((time.perf_counter() - start) / args.publications * 1e6)
        draws.append(sum(len(d) for d in schedule.drawn))
    return {
        "models_us": {name: {"one_draw_us": one, "bulk_call_us": many} for name, (one, many) in rows.items()},
        "schedule_us_per_step": statistics.median(schedule_us),
        "schedule_draws": int(statistics.median(draws)),
    }


def print_delays(result: dict, args) -> None:
    print(f"\n### Delay models: µs per call ({args.draws} single draws, {args.bulk}-value bulk draws)\n")
    print(f"| model | µs / sample(rng, 1) | µs / sample(rng, {args.bulk}) | ns / value (bulk) |")
    print("|---|---:|---:|---:|")
    for name, row in result["models_us"].items():
        per_value_ns = row["bulk_call_us"] / args.bulk * 1e3
        print(f"| {name} | {row['one_draw_us']:.2f} | {row['bulk_call_us']:.0f} | {per_value_ns:.1f} |")
    steps = args.publications
    draws = result["schedule_draws"]
    print(
        f"| WeightArrivalSchedule, 4 log-normal groups: publish() + advance() "
        f"({steps} steps every {args.step_seconds:g} s, {draws} delay draws) | "
        f"{result['schedule_us_per_step']:.1f} per step | - | - |"
    )


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = script_parser(__doc__)
    part1 = parser.add_argument_group("part 1: sampler over a real TransferQueue")
    part1.add_argument("--groups", type=int, default=256, help="finished prompt groups per fill (default 256)")
    part1.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    part1.add_argument(
        "--inflight",
        type=int,
        default=64,
        help="extra prompts left in flight during the drain, half pending and half running (default 64)",
    )
    part1.add_argument(
        "--batch-size", type=int, default=32, help="groups per sample() call; the drain takes groups/B calls (32)"
    )
    part1.add_argument(
        "--width", type=int, default=16, help="elements of the one float tensor stored per trajectory (default 16)"
    )
    part1.add_argument("--repeats", type=int, default=20, help="timed fill+drain repetitions per implementation (20)")
    part1.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed repetitions first; their fills use per-group puts and are reported (default 1)",
    )
    part1.add_argument(
        "--fill",
        choices=("batched", "per-group"),
        default="batched",
        help="how timed repetitions fill TransferQueue: four batched puts (fast, default) or one trajectory put "
        "and one status put per group, as rollout workers write (slow on a small machine)",
    )
    part1.add_argument(
        "--global-steps", type=int, default=100, help="learner step g passed to sample() in the first repetition (100)"
    )
    part1.add_argument(
        "--spread",
        type=int,
        default=8,
        help="finished groups were submitted over the last SPREAD steps (versions g-SPREAD..g-1) (default 8)",
    )
    part1.add_argument(
        "--mixed", type=float, default=0.1, help="fraction of groups whose tokens span two versions (default 0.1)"
    )
    part1.add_argument(
        "--max-lag", type=int, default=64, help="hetero max_lag for both HeteroReplayBuffer variants (default 64)"
    )
    part1.add_argument(
        "--verl-threshold",
        type=int,
        default=8,
        help="verl max_off_policy_threshold (drop); must be >= --spread so nothing is evicted (default 8)",
    )
    part1.add_argument(
        "--poll-interval",
        type=float,
        default=0.01,
        help="buffers' poll interval in seconds (never slept: enough groups are always finished) (default 0.01)",
    )
    part1.add_argument("--skip-wait", action="store_true", help="leave out the HeteroReplayBuffer 'wait' variant")
    part1.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs given to the local Ray (default 4)")
    part1.add_argument("--target", type=float, default=1.2, help="acceptable hetero/verl ratio (default 1.2)")
    part1.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="cProfile one extra drain per implementation: when a ratio exceeds --target (auto), always or never",
    )
    part1.add_argument("--profile-lines", type=int, default=20, help="functions listed per profile table (20)")
    part2 = parser.add_argument_group("part 2: delay models and the weight-arrival schedule")
    part2.add_argument("--draws", type=int, default=20000, help="single-value sample(rng, 1) calls timed (20000)")
    part2.add_argument("--bulk", type=int, default=100000, help="values per bulk sample() call (default 100000)")
    part2.add_argument("--bulk-calls", type=int, default=10, help="bulk calls timed per repetition (default 10)")
    part2.add_argument(
        "--publications", type=int, default=10000, help="publish()+advance() steps of the schedule (default 10000)"
    )
    part2.add_argument(
        "--step-seconds", type=float, default=30.0, help="simulated seconds between publications (default 30)"
    )
    part2.add_argument("--delay-repeats", type=int, default=3, help="repetitions for part 2 medians (default 3)")
    parser.add_argument("--skip-sampler", action="store_true", help="skip part 1 (no Ray / TransferQueue)")
    parser.add_argument("--skip-delays", action="store_true", help="skip part 2")
    parser.add_argument("--seed", type=int, default=0, help="seed for versions and delays (default 0)")
    add_output_options(parser, "the results")
    args = parser.parse_args(argv)
    if args.verl_threshold < args.spread:
        parser.error("--verl-threshold must be >= --spread, or verl would evict groups and the drain would not match")
    if args.max_lag < args.spread:
        parser.error("--max-lag must be >= --spread, or the hetero sampler would drop groups")
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

    import ray
    import transfer_queue
    import verl

    started = time.perf_counter()
    tq_version = getattr(transfer_queue, "__version__", "?")
    print(
        f"verl {verl.__version__}, ray {ray.__version__}, transfer_queue {tq_version}, "
        f"numpy {np.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    result = {"args": vars(args)}
    if not args.skip_sampler:
        result["sampler"] = bench_sampler(args)
        print_sampler(result["sampler"], args)
    if not args.skip_delays:
        result["delays"] = bench_delays(args)
        print_delays(result["delays"], args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
