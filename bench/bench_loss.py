"""Benchmark: GEPO's loss and group term against verl's built-in gspo and vanilla losses, on CPU.

Every loss runs on the same tensors in one run; timings are medians over repetitions with the
methods interleaved (so machine drift hits all alike); peak memory is the peak of the tensor memory a
forward+backward allocates, from torch's profiler (every allocation and free, in order).

    python bench/bench_loss.py                 # 256 x 2048 tokens, 64k sequences for the group term
    python bench/bench_loss.py --help
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
from common import add_output_options, median_seconds, script_parser, write_json

LOSSES = ("gepo", "gspo", "vanilla")


def make_inputs(batch: int, width: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).to(torch.float32)
    old = -torch.rand(batch, width, generator=gen) * 3
    logp = old + 0.05 * torch.randn(batch, width, generator=gen)
    adv = torch.randn(batch, 1, generator=gen).expand(batch, width).contiguous()
    uids = np.array([f"uid-{i // group_size}" for i in range(batch)], dtype=object)
    return logp, old, adv, mask, uids


def actor_config(loss_mode: str):
    from gepo_plugin.verl_glue.loss_batch import compose_actor_config

    return compose_actor_config(
        [
            "strategy=fsdp2",
            "ppo_micro_batch_size_per_gpu=1",
            f"policy_loss.loss_mode={loss_mode}",
            "loss_agg_mode=seq-mean-token-mean",
            "clip_ratio_low=0.2",
            "clip_ratio_high=0.2",
        ]
    )


def make_step(loss_mode: str, logp, old, adv, mask, uids):
    """A closure doing one forward+backward of ``loss_mode`` as verl's ppo_loss would call it.

    For gepo it includes the context hand-off of the trainer-side group term to the loss; the term itself is
    computed once per training step by the trainer, over the whole batch, and timed separately.
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from gepo_plugin.maths import group_log_expectation_from_tokens
    from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, provide_response_terms

    config = actor_config(loss_mode)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    fn = get_policy_loss_fn(loss_mode)

    # the trainer computes the group term once per step over the whole batch, not per loss call: its cost is
    # measured on its own below ("group term")
    term = group_log_expectation_from_tokens(old, mask, uids) if loss_mode == "gepo" else None

    def step():
        leaf = logp.detach().requires_grad_()
        kwargs = dict(
            old_log_prob=old,
            log_prob=leaf,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-mean",
            config=config,
            rollout_is_weights=None,
        )
        if loss_mode == "gepo":
            with provide_response_terms({LOG_GROUP_EXPECTATION: term}):
                loss, _ = fn(**kwargs)
        else:
            loss, _ = fn(**kwargs)
        loss.backward()
        return leaf.grad

    return step


def time_losses(batch, width, group_size, repeats, warmup):
    import verl  # noqa: F401

    inputs = make_inputs(batch, width, group_size)
    steps = {mode: make_step(mode, *inputs) for mode in LOSSES}
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples = {mode: [] for mode in LOSSES}
    for _ in range(repeats):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            samples[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(values) for mode, values in samples.items()}


def peak_tensor_mib(step) -> float:
    """Peak of the tensor memory allocated during one ``step()`` above what was live before it (MiB).

    From torch's profiler: with ``profile_memory=True`` it records every CPU allocation and free as a
    ``[memory]`` event with its signed size, so the running sum in time order is the live tensor memory and its
    maximum the step's peak. Exact and repeatable, unlike sampling the process's resident set (the allocator keeps
    and reuses freed pages, and a sampler misses short peaks).
    """
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up: one-off allocations (thread pools, caches) are not the loss's memory
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = np.cumsum([e.nbytes() for e in events]) if events else np.zeros(1)
    return float(max(live.max(), 0)) / 2**20


def peak_memory(mode, batch, width, group_size) -> float:
    import verl  # noqa: F401

    return peak_tensor_mib(make_step(mode, *make_inputs(batch, width, group_size)))


def time_group_term(sequences: int, group_size: int, width: int, repeats: int):
    """The trainer-side group term for many sequences, next to verl's own GRPO advantage estimator."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from gepo_plugin.maths import GroupIndex, group_log_expectation, group_log_expectation_from_tokens

    gen = torch.Generator().manual_seed(1)
    uids = np.array([f"uid-{i // group_size}" for i in range(sequences)], dtype=object)
    seq_log_q = -torch.rand(sequences, generator=gen) * 3
    old = -torch.rand(sequences, width, generator=gen) * 3
    mask = torch.ones(sequences, width)
    rewards = torch.zeros(sequences, width)
    rewards[:, -1] = torch.randint(0, 2, (sequences,), generator=gen).float()

    return {
        "group term from sequence log-probs": median_seconds(
            lambda: group_log_expectation(seq_log_q, GroupIndex.from_ids(uids)), repeats
        ),
        f"group term from token log-probs (x{width} tokens)": median_seconds(
            lambda: group_log_expectation_from_tokens(old, mask, uids), repeats
        ),
        "verl grpo advantage estimator (same batch)": median_seconds(
            lambda: compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=True), repeats
        ),
    }


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--batch", type=int, default=256, help="sequences per loss call (default 256)")
    parser.add_argument("--width", type=int, default=2048, help="response length in tokens (default 2048)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (default 8)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per loss (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up repetitions (default 3)")
    parser.add_argument(
        "--term-sequences", type=int, default=65536, help="sequences for the group-term cost (default 65536)"
    )
    parser.add_argument(
        "--term-width", type=int, default=256, help="tokens per sequence for the token-level term (default 256)"
    )
    parser.add_argument("--skip-memory", action="store_true", help="skip the peak-memory measurement")
    add_output_options(parser, "the results")
    args = parser.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(f"loss forward+backward: {args.batch} x {args.width} tokens, groups of {args.group_size}")
    times = time_losses(args.batch, args.width, args.group_size, args.repeats, args.warmup)
    memory = {} if args.skip_memory else {m: peak_memory(m, args.batch, args.width, args.group_size) for m in LOSSES}
    print(f"{'loss':<10}{'median ms':>12}{'vs gspo':>10}{'vs vanilla':>12}{'peak MiB':>11}")
    for mode in LOSSES:
        mem = f"{memory[mode]:>11.1f}" if memory else f"{'-':>11}"
        print(
            f"{mode:<10}{times[mode] * 1e3:>12.1f}{times[mode] / times['gspo']:>10.3f}"
            f"{times[mode] / times['vanilla']:>12.3f}{mem}"
        )
    if memory:
        print(f"peak memory ratio gepo/gspo = {memory['gepo'] / memory['gspo']:.3f}")
    print(f"\ngroup term for {args.term_sequences} sequences in groups of {args.group_size}:")
    term = time_group_term(args.term_sequences, args.group_size, args.term_width, max(3, args.repeats // 3))
    for name, seconds in term.items():
        print(f"  {name:<52}{seconds * 1e3:>10.1f} ms")
    result = {"args": vars(args), "loss_seconds": times, "peak_mib": memory, "group_term_seconds": term}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
