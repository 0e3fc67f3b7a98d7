"""The CPU rollout's latency model: the closed form, the scheduler that waits for it, and its options."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from gepo_plugin.cpu_backend.rollout.latency import LatencyOptions, finish_offsets
from gepo_plugin.cpu_backend.rollout.options import parse_hf_options
from gepo_plugin.cpu_backend.rollout.sampling import SamplingSpec
from gepo_plugin.cpu_backend.rollout.scheduler import RequestScheduler
from gepo_plugin.options import OptionsError


def finish_times_step_by_step(lengths: list[int], latency: LatencyOptions) -> list[float]:
    """The model written as a clock that ticks one decode step at a time (independent of the vectorised form)."""
    clock, done, step = latency.prefill_s, {}, 0
    while len(done) < len(lengths):
        active = [i for i, length in enumerate(lengths) if length > step]
        clock += (1 + latency.batch_slowdown * (len(active) - 1)) / latency.decode_tokens_per_s
        step += 1
        for i in active:
            if lengths[i] == step:
                done[i] = clock
    return [done.get(i, latency.prefill_s) for i in range(len(lengths))]


@pytest.mark.parametrize("seed", range(5))
def test_finish_offsets_match_a_step_by_step_clock(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=int(rng.integers(1, 12))).tolist()
    latency = LatencyOptions(
        decode_tokens_per_s=float(rng.uniform(10, 500)),
        prefill_s=float(rng.uniform(0, 0.5)),
        batch_slowdown=float(rng.uniform(0, 1)),
    )
    got = finish_offsets(np.array(lengths), latency)
    assert got == pytest.approx(finish_times_step_by_step(lengths, latency), rel=1e-12)


def test_batching_is_free_or_serial_at_the_two_ends_of_the_slowdown():
    lengths = np.array([10, 10, 10, 10])
    free = finish_offsets(lengths, LatencyOptions(decode_tokens_per_s=100, batch_slowdown=0))
    serial = finish_offsets(lengths, LatencyOptions(decode_tokens_per_s=100, batch_slowdown=1))
    assert free == pytest.approx([0.1] * 4)  # four sequences in the time of one
    assert serial == pytest.approx([0.4] * 4)  # no gain: four times one sequence's time


def generate_instantly(batch, finish):
    """The scheduler's decoding interface, done at once: every request generates ``max_tokens`` tokens."""
    for request in batch:
        request.token_ids.extend(range(request.spec.max_tokens))
        finish(request, "completed")


async def answer_times(latency: LatencyOptions, lengths: dict[str, int], abort_after_s: float | None = None):
    scheduler = RequestScheduler(16, 0.001, lambda request, reason: (len(request.token_ids), reason), latency)
    scheduler.start(generate_instantly)
    started = time.monotonic()
    cpu_started = time.process_time()
    answered: dict[str, tuple[float, tuple[int, str]]] = {}

    async def ask(key: str):
        output = await scheduler.submit(key, [1, 2], SamplingSpec(max_tokens=lengths[key]))
        answered[key] = (time.monotonic() - started, output)

    tasks = [asyncio.create_task(ask(key)) for key in lengths]
    if abort_after_s is not None:
        await asyncio.sleep(abort_after_s)
        await scheduler.abort_all(reject_request=False)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu_started
    scheduler.task.cancel()
    return answered, cpu, scheduler


def test_requests_are_answered_when_the_modelled_gpu_finishes_them_without_using_the_cpu():
    latency = LatencyOptions(decode_tokens_per_s=20, prefill_s=0.2, batch_slowdown=0.0)
    lengths = {"short": 4, "long": 16}
    answered, cpu, scheduler = asyncio.run(answer_times(latency, lengths))
    assert answered["short"][1] == (4, "completed") and answered["long"][1] == (16, "completed")
    # never earlier than the modelled GPU; later only by the event loop's scheduling (generous on a loaded CI box)
    short, long = answered["short"][0], answered["long"][0]
    assert 0.2 + 4 / 20 - 0.01 <= short < long and 0.2 + 16 / 20 - 0.01 <= long <= 0.2 + 16 / 20 + 0.5
    assert cpu < 0.25, f"waiting for the modelled GPU used {cpu:.2f} s of CPU"
    assert 1.0 - 0.01 <= scheduler.modelled_wait_s <= 1.5


def test_an_abort_answers_held_requests_at_once():
    latency = LatencyOptions(decode_tokens_per_s=2, prefill_s=0.0)  # 10 s for the long request
    answered, _, _ = asyncio.run(answer_times(latency, {"a": 20, "b": 20}, abort_after_s=0.3))
    assert all(elapsed < 1.5 for elapsed, _ in answered.values()), answered


def test_without_a_latency_model_answers_are_immediate():
    answered, _, scheduler = asyncio.run(answer_times(None, {"a": 50}))
    assert answered["a"][0] < 0.5 and scheduler.modelled_wait_s == 0.0


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"latency": {"decode_tokens_per_s": 0}}, "latency.decode_tokens_per_s"),
        ({"latency": {"decode_tokens_per_s": 100, "prefill_s": -1}}, "latency.prefill_s"),
        ({"latency": {"prefill_s": 0.1}}, "latency.decode_tokens_per_s"),
        ({"latency": {"decode_tokens_per_s": 100, "tokens_per_s": 3}}, "latency.tokens_per_s"),
    ],
)
def test_bad_latency_options_are_refused_naming_the_key(block, key):
    with pytest.raises(OptionsError, match=key.replace(".", r"\.")):
        parse_hf_options(block)
