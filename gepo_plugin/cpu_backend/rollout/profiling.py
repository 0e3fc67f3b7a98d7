"""The rollout server's side of verl's profiler: a torch CPU profiler writing Chrome traces (``tool=torch``)."""

from __future__ import annotations

import os
import time

import torch
from verl.workers.config import RolloutConfig


class RolloutProfiler:
    """Starts and stops a CPU profiler on verl's request, on the replicas ``rollout.profiler`` selects.

    Args:
        config: the rollout config; its ``profiler`` block is read at each call (it may be unset).
        replica_rank: this server's replica, matched against the profiler's ``ranks``.
    """

    def __init__(self, config: RolloutConfig, replica_rank: int) -> None:
        self.config = config
        self.replica_rank = replica_rank
        self._profiler: torch.profiler.profile | None = None

    def _should_profile(self) -> bool:
        """Only ``tool=torch`` is served here; ``ranks`` (default: replica 0) or ``all_ranks`` pick the replicas."""
        profiler = self.config.profiler
        if profiler is None or not profiler.enable or profiler.tool != "torch":
            return False
        ranks = list(profiler.ranks or [])
        return bool(profiler.all_ranks) or (self.replica_rank in ranks if ranks else self.replica_rank == 0)

    def start(self) -> None:
        """Start profiling, unless already running or this replica is not profiled."""
        if self._profiler is None and self._should_profile():
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.start()

    def stop(self) -> None:
        """Stop profiling and write a Chrome trace under the profiler's ``save_path`` (nothing if not running)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        save_path = self.config.profiler.save_path or "."
        os.makedirs(save_path, exist_ok=True)
        trace = os.path.join(save_path, f"rollout-hf-replica{self.replica_rank}-{int(time.time() * 1000)}.json")
        profiler.export_chrome_trace(trace)
