"""M2PO (arXiv 2510.01161) as the authors' code computes it: ratio bounds from the harmful tokens' second moment.

The bounds cap the harmful tokens' |log-ratio| so that their mean square stays within the budget.

Reference: ``Infini-AI-Lab/M2PO`` at ``4514ce2``, ``verl/trainer/ppo/core_algos.py`` lines 683-867
(``_solve_tau_from_sorted_delta2``, ``_get_trust_region_tokens_delta_sq``, ``kpo_clip_harmful_tokens``,
``compute_m2po_policy_loss``). Their solver walks the sorted values in a Python loop; here the same first index is
found at once (the quantity it tests is non-decreasing along the sorted values), with the same result.

Where the code and the paper differ: the paper masks the tokens with the largest squared log-ratio until the second
moment of the rest is within the budget; the code turns a cap tau into PPO clip bounds exp(-tau) and exp(tau) and
clips every token with a positive advantage and p/q above exp(tau), or a negative one and p/q below exp(-tau) (those
tokens get no gradient, as masked ones), and its tau is a data value (the last one whose cap keeps the budget), not
the exact root. This module follows the code. Which tokens enter the second moment is the caller's scope: the
authors' code takes whatever micro-batch the loss is handed; the plugin's default takes the whole mini-batch
(:mod:`gepo_plugin.verl_glue.m2po_mini_batch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the authors' tolerance in every comparison
EPS = 1e-12
#: their ratio bounds when no token needs clipping: [0, 100000]
NO_CLIP = (0.0, 100000.0)
#: tau's stand-in in a per-response field when the budget holds (tau itself is never negative)
NO_CAP = -1.0


@dataclass(frozen=True)
class M2Cap:
    """The cap on the harmful tokens' |log-ratio| (None: the budget holds, nothing is clipped), their second moment
    before and after capping as the authors' solver reports it (``m2_after`` is within the budget when ``tau > 0``;
    with ``tau == 0`` every harmful token is clipped and it is the uncapped ``m2``), and how many there are."""

    tau: float | None
    m2: float
    m2_after: float
    harmful_tokens: int

    def ratio_bounds(self) -> tuple[float, float]:
        """The bounds ``compute_m2po_policy_loss`` clamps the ratio to, with its arithmetic: exp(+-tau) of a float32
        tensor, turned into clip widths 1 - exp(-tau) and exp(tau) - 1, then back into 1 - width and 1 + width."""
        if self.tau is None:
            low, high = NO_CLIP
        else:
            low = float(torch.exp(torch.tensor(-self.tau, dtype=torch.float32)).item())
            high = float(torch.exp(torch.tensor(+self.tau, dtype=torch.float32)).item())
        return 1 - (1 - low), 1 + (high - 1)

    def encoded(self) -> float:
        """tau as one number for a per-response field (:data:`NO_CAP` when there is none)."""
        return NO_CAP if self.tau is None else self.tau


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


def solve_cap(delta_sq: torch.Tensor, budget: float) -> M2Cap:
    """The cap on |log-ratio| that brings the mean of ``delta_sq`` within ``budget``: None when it already is; else
    the authors' grid answer sqrt(v[k-1] - 1e-12), k the first index of the sorted values v where capping the rest at
    v[k] would reach the budget (0 when k is 0). Computed in float64."""
    n = delta_sq.numel()
    if n == 0:
        return M2Cap(None, 0.0, 0.0, 0)
    values = torch.sort(delta_sq.detach().double()).values
    m2 = float(values.sum()) / n
    if m2 <= budget + EPS:
        return M2Cap(None, m2, m2, n)
    target = budget * float(n)
    if target <= EPS:  # their solver's "clip everything to 0" (its bare return value would fail their unpacking)
        return M2Cap(0.0, m2, m2, n)
    csum = torch.cumsum(values, dim=0)
    rest = torch.arange(n - 1, -1, -1, dtype=values.dtype)
    reaches = (values - EPS) * rest + csum >= target - EPS  # non-decreasing along k: the first True is theirs
    k = int(torch.nonzero(reaches)[0])
    if k == 0:
        return M2Cap(0.0, m2, float(csum[-1]) / n, n)
    cap = float(values[k - 1])
    return M2Cap(math.sqrt(cap - EPS), m2, (cap * (n - k) + float(csum[k - 1])) / n, n)


def m2_cap(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, budget: float
) -> M2Cap:
    """The cap over the tokens given (``kpo_clip_harmful_tokens`` on them)."""
    return solve_cap(harmful_delta_sq(log_prob.detach(), old_log_prob, advantages, mask), budget)


def m2po_token_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, bounds: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of ``compute_m2po_policy_loss``: PPO's clipped surrogate max(-A r, -A clip(r, low, high))
    with M2PO's bounds (no dual clip), and where the clip binds (the token gets no gradient there)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, *bounds)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def m2_masked_tokens(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, cap: M2Cap
) -> torch.Tensor:
    """The tokens M2PO's clip takes the gradient from under ``cap`` (harmful, with the ratio beyond its bound): the
    mask another loss applies to become "M2PO-masked" (GEPO's ``m2_mask``). No gradient flows through it."""
    with torch.no_grad():
        return m2po_token_losses(log_prob.detach(), old_log_prob, advantages, cap.ratio_bounds())[1]
