"""What dropping costs: the length and reward of dropped trajectories against trained ones.

Discarding stale samples is not neutral: long answers take longer to generate, so they are the ones that go stale
and get dropped, and training drifts toward short, fast answers (reported for tinker-cookbook's asynchronous RL).
Both verl's replay buffer and the lab report the same figures through this module, from additive totals (they add
up over verl's polls within a step and over a lab run):

* ``dropped/length_mean`` / ``reward_mean``: trajectories evicted for staleness (``stale``, ``stale_overflow``,
  ``mixed_versions``), response tokens and reward;
* ``trained/length_mean`` / ``reward_mean``: the trajectories trained;
* ``drop_bias/length``: dropped minus trained mean length (positive: dropping removes the long answers, so what is
  trained is biased toward short ones).

(Unprefixed names: verl's glue logs them under ``hetero/``, :mod:`gepo_plugin.metric_names`.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

DROPPED, TRAINED = "dropped", "trained"
#: Where verl's replay buffer reports a step's dropped totals (added up over its polls, read by the trainer).
DROPPED_STEP = "dropped_step/"
#: The additive totals behind the means.
TOTALS: tuple[str, ...] = ("trajectories", "length_sum", "reward_sum")


def totals(lengths: Sequence[float] | np.ndarray, rewards: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Count, summed response length and summed reward of some trajectories."""
    lengths = np.asarray(lengths, dtype=np.float64)
    rewards = np.asarray(rewards, dtype=np.float64)
    if lengths.shape != rewards.shape:
        raise ValueError(f"{lengths.shape[0]} lengths but {rewards.shape[0]} rewards")
    return {"trajectories": float(lengths.size), "length_sum": float(lengths.sum()), "reward_sum": float(rewards.sum())}


def add(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    return {name: a.get(name, 0.0) + b.get(name, 0.0) for name in TOTALS}


def means(kind: str, sums: Mapping[str, float]) -> dict[str, float]:
    """``<kind>/length_mean`` and ``reward_mean`` (absent when there was no such trajectory)."""
    count = sums.get("trajectories", 0.0)
    if count <= 0:
        return {}
    return {
        f"{kind}/length_mean": sums["length_sum"] / count,
        f"{kind}/reward_mean": sums["reward_sum"] / count,
    }


def bias_metrics(dropped: Mapping[str, float], trained: Mapping[str, float]) -> dict[str, float]:
    """Both sides' means and the length gap (the gap only when both sides have trajectories)."""
    out = {**means(DROPPED, dropped), **means(TRAINED, trained)}
    gap = out.get(f"{DROPPED}/length_mean", math.nan) - out.get(f"{TRAINED}/length_mean", math.nan)
    if math.isfinite(gap):
        out["drop_bias/length"] = gap
    return out
