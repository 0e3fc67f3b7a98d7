"""M2PO's second-moment budget (arXiv 2510.01161) as the authors' code computes it: clip bounds from the harmful
tokens' log-ratios, so that capping them keeps the mean squared log-ratio within the budget.

Reference: ``Infini-AI-Lab/M2PO`` at ``4514ce2``, ``verl/trainer/ppo/core_algos.py``
(``_get_trust_region_tokens_delta_sq``, ``_solve_tau_from_sorted_delta2``, ``kpo_clip_harmful_tokens``,
``compute_m2po_policy_loss``). Their solver walks the sorted values in a Python loop; here the same first index is found
at once (the quantity it tests is non-decreasing along the sorted values), with the same result.

Work in progress (issue 40): not yet a registered loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the authors' tolerance in every comparison
EPS = 1e-12
#: their bounds when no token needs clipping: ratio in [0, 100000]
NO_CLIP = (0.0, 100000.0)


@dataclass(frozen=True)
class M2Bounds:
    """The clip bounds on the ratio, and the harmful tokens' second moment before and after capping."""

    low: float
    high: float
    m2: float
    m2_after: float
    harmful_tokens: int


def harmful_delta_sq(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Squared log-ratios of the harmful tokens: a sequence advantage (its first token's) above 0 with the ratio above
    1, or below 0 with the ratio below 1, inside ``mask`` (the authors' tolerances)."""
    delta = old_log_prob - log_prob
    ratio = torch.exp(-delta)
    sequence_advantage = advantages[:, :1]
    harmful = ((sequence_advantage > EPS) & (ratio > 1.0 + EPS)) | ((sequence_advantage < -EPS) & (ratio < 1.0 - EPS))
    return delta.pow(2)[harmful & mask.bool()]


def solve_tau(delta_sq: torch.Tensor, budget: float) -> tuple[float | None, float, float]:
    """The cap on |log-ratio| that brings the mean of ``delta_sq`` within ``budget``: None when it already is; else
    the authors' grid answer sqrt(v[k-1] - 1e-12), k the first index of the sorted values v where capping the rest at
    v[k] would reach the budget (0 when k is 0). Returns (tau, the mean before, the mean after their cap)."""
    n = delta_sq.numel()
    if n == 0:
        return None, 0.0, 0.0
    values = torch.sort(delta_sq.double()).values
    m2 = float(values.sum()) / n
    if m2 <= budget + EPS:
        return None, m2, m2
    target = budget * float(n)
    if target <= EPS:  # their solver's "clip everything to 0"
        return 0.0, m2, m2
    csum = torch.cumsum(values, dim=0)
    rest = torch.arange(n - 1, -1, -1, dtype=values.dtype)
    reaches = (values - EPS) * rest + csum >= target - EPS  # non-decreasing along k: the first True is theirs
    k = int(torch.nonzero(reaches)[0])
    if k == 0:
        return 0.0, m2, float(csum[-1]) / n
    cap = float(values[k - 1])
    return math.sqrt(cap - EPS), m2, (cap * (n - k) + float(csum[k - 1])) / n


def m2_bounds(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, budget: float
) -> M2Bounds:
    """Ratio bounds [exp(-tau), exp(tau)] (``NO_CLIP`` when the budget holds) over the tokens given."""
    delta_sq = harmful_delta_sq(log_prob, old_log_prob, advantages, mask)
    tau, m2, m2_after = solve_tau(delta_sq, budget)
    if tau is None:
        return M2Bounds(*NO_CLIP, m2, m2_after, delta_sq.numel())
    return M2Bounds(math.exp(-tau), math.exp(tau), m2, m2_after, delta_sq.numel())


def m2po_token_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, bounds: M2Bounds
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of ``compute_m2po_policy_loss``: PPO's clipped surrogate max(-A r, -A clip(r, low, high))
    with M2PO's bounds (no dual clip), and where the clip bound (the token gets no gradient there)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, bounds.low, bounds.high)
    return torch.maximum(unclipped, clipped), clipped > unclipped
