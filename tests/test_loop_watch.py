"""The gateway's loop watch: a loop held up shows as lateness, and the CPU share of the late intervals tells a loop
saturated with its own work from one waiting for the machine."""

from __future__ import annotations

import asyncio
import time

from gepo_plugin.verl_glue.hetero.remote.loop_watch import LoopWatch


def _hold(seconds: float, spin: bool) -> None:
    """Keep the loop from running for ``seconds``: burning its thread's CPU (``spin``) or asleep off the CPU."""
    if not spin:
        time.sleep(seconds)
        return
    until = time.thread_time() + seconds  # CPU seconds: the share stays high even if the machine deschedules us
    while time.thread_time() < until:
        pass


async def _watched(spin: bool) -> tuple[dict[str, float], dict[str, float]]:
    watch = LoopWatch(period_s=0.01)
    watch.start()
    await asyncio.sleep(0.2)
    quiet = watch.take()
    for _ in range(3):
        await asyncio.sleep(0.02)
        _hold(0.15, spin)
    await asyncio.sleep(0.05)
    held = watch.take()
    await watch.stop()
    return quiet, held


def test_a_held_loop_is_late_and_says_why():
    quiet, slept = asyncio.run(_watched(spin=False))
    _, spun = asyncio.run(_watched(spin=True))
    assert quiet["loop_late_p50_ms"] < 10.0
    for held in (slept, spun):
        assert held["loop_late_p99_ms"] >= 100.0  # the three 150 ms holds
        assert 0.0 <= held["loop_busy"] <= 1.0
    # asleep, the loop's thread took almost no CPU while late; spinning, it took most of the late intervals' time
    assert slept["loop_busy_when_late"] < 0.2
    assert spun["loop_busy_when_late"] > 0.4
    assert spun["loop_busy_when_late"] > 3 * slept["loop_busy_when_late"]
    assert spun["loop_busy"] > slept["loop_busy"]


def test_nothing_to_take_before_an_interval_ends():
    assert LoopWatch().take() == {}
