"""How late the gateway's event loop runs, and why: the wait a sampler's call has before its handler starts.

The gateway times each handler (``hetero/remote/gateway/<route>/*``), but a call that arrives while the loop is busy
waits before its handler runs, and that wait is in no handler's time. :class:`LoopWatch` measures it: a coroutine on
the same loop sleeps ``period_s`` at a time and records how late it wakes, which is what a call arriving at that
moment waited too. Beside each lateness it records the loop thread's CPU time over the interval, which says why the
loop was late: a share near 1 means it was busy with its own work (the gateway is saturated: more of its work, or
another gateway process, is what would help); near 0 means it waited for a core that other processes held (the
machine is: a core for the gateway is what would help).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

#: an interval counts as late (for the CPU share of late intervals) past this many seconds
LATE_S = 0.01


class LoopWatch:
    """Lateness of the running loop, sampled every ``period_s`` (start it from a coroutine on that loop)."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self._late: list[float] = []
        self._wall: list[float] = []
        self._cpu: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(self.period_s)
            elapsed = time.perf_counter() - wall
            self._late.append(max(0.0, elapsed - self.period_s))
            self._wall.append(elapsed)
            self._cpu.append(time.thread_time() - cpu)

    def take(self) -> dict[str, float]:
        """Since the last take: ``loop_late_p50_ms``/``loop_late_p99_ms`` (how late the loop ran), ``loop_busy``
        (the loop thread's CPU share of the time) and, if any interval was late past :data:`LATE_S`,
        ``loop_busy_when_late`` (its CPU share over those intervals). Empty before the first interval ends."""
        late, wall, cpu = (np.asarray(values) for values in (self._late, self._wall, self._cpu))
        self._late, self._wall, self._cpu = [], [], []
        if late.size == 0:
            return {}
        p50, p99 = np.percentile(late * 1e3, [50, 99])
        out = {"loop_late_p50_ms": float(p50), "loop_late_p99_ms": float(p99)}
        out["loop_busy"] = float(min(1.0, cpu.sum() / wall.sum()))
        lagged = late > LATE_S
        if lagged.any():
            out["loop_busy_when_late"] = float(min(1.0, cpu[lagged].sum() / wall[lagged].sum()))
        return out
