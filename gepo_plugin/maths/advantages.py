"""Group-relative advantages (GRPO / Dr.GRPO / GEPO), BNPO, and Delta-L weights, vectorised.

All functions take one scalar reward per response and a :class:`~gepo_plugin.maths.groups.GroupIndex` of the prompt
each response answers, and return one advantage per response.
"""

from __future__ import annotations

import torch

from gepo_plugin.maths.groups import GroupIndex, segment_mean, segment_sum
from gepo_plugin.maths.options import BNPO_DEFAULTS, DELTA_L_DEFAULTS


class AdvantageInputError(ValueError):
    """Rewards or groups do not allow the requested advantage."""


def _require_groups_of_two(index: GroupIndex, what: str) -> None:
    if bool((index.sizes < 2).any()):
        n_single = int((index.sizes < 2).sum())
        raise AdvantageInputError(
            f"{what} needs at least 2 responses per prompt, but {n_single} group(s) have a single response: "
            "a group of one has no baseline but itself. Sample more responses per prompt "
            "(verl: actor_rollout_ref.rollout.n >= 2)."
        )


def _require_finite(rewards: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise AdvantageInputError(f"rewards must be one scalar per response ([B]), got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise AdvantageInputError("rewards contain NaN/inf: check the reward function")


def group_advantages(
    rewards: torch.Tensor, index: GroupIndex, normalize_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """``A_i = R_i - mean(R_group)`` (GEPO, Dr.GRPO), optionally divided by the group's std (GRPO).

    The std is the unbiased one, as in verl's GRPO estimator.
    """
    _require_finite(rewards)
    _require_groups_of_two(index, "a group-relative advantage")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    mean = segment_mean(rewards, index)
    centred = rewards - mean[index.inverse]
    if not normalize_by_std:
        return centred
    sq = segment_sum(centred**2, index)
    std = torch.sqrt(sq / (index.sizes.to(rewards.dtype) - 1))
    return centred / (std[index.inverse] + eps)


def beta_log_density(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log Beta(x; a, b), finite at x in {0, 1} when a or b equals 1 (``xlogy`` keeps 0*log 0 = 0)."""
    log_norm = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    return torch.xlogy(a - 1, x) + torch.xlogy(b - 1, 1 - x) - log_norm


def bnpo_advantages(
    rewards: torch.Tensor,
    index: GroupIndex,
    reward_min: float = BNPO_DEFAULTS.reward_min,
    reward_max: float = BNPO_DEFAULTS.reward_max,
    weight_cap: float = BNPO_DEFAULTS.weight_cap,
) -> tuple[torch.Tensor, dict[str, float]]:
    """BNPO (arXiv 2506.02864): ``A_i = (R_i - p) / Beta(p; a, b)`` with a Beta fitted by moments.

    Rewards are rescaled to [0, 1] with ``(R - reward_min) / (reward_max - reward_min)``.
    ``p`` is the group mean reward. Over the batch's group means, with mean ``m`` and unbiased
    variance ``v``: ``alpha = (m(1-m)/v - 1) m``, ``beta = (m(1-m)/v - 1)(1-m)``, and the
    normalising Beta has ``a = max(1 + alpha/3, 1)``, ``b = max(1 + beta/3, 1)`` (the authors'
    code). If the group means do not vary (v = 0) the Beta is uniform (weight 1, A = R - p).
    The inverse density is capped at ``weight_cap``.

    Returns:
        advantages ``[B]`` and the fitted parameters (for logging).
    """
    _require_finite(rewards)
    _require_groups_of_two(index, "BNPO")
    if not reward_max > reward_min:
        raise AdvantageInputError(f"BNPO needs reward_max > reward_min, got {reward_min} and {reward_max}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    scaled = (rewards.to(dtype) - reward_min) / (reward_max - reward_min)
    if bool(((scaled < -1e-6) | (scaled > 1 + 1e-6)).any()):
        raise AdvantageInputError(
            f"BNPO models the success probability, so rewards must lie in [{reward_min}, {reward_max}]; "
            f"got values in [{float(rewards.min())}, {float(rewards.max())}]. "
            "Set algorithm.bnpo.reward_min / reward_max to the reward's range."
        )
    scaled = scaled.clamp(0.0, 1.0)
    p = segment_mean(scaled, index)
    m = p.mean()
    v = p.var(unbiased=True) if p.numel() > 1 else torch.zeros((), dtype=dtype)
    one = torch.ones((), dtype=dtype)
    if float(v) > 0:
        k = m * (1 - m) / v - 1
        a = torch.clamp(1 + k * m / 3, min=1.0)
        b = torch.clamp(1 + k * (1 - m) / 3, min=1.0)
    else:
        a, b = one, one
    inverse_density = torch.exp(-beta_log_density(p, a, b)).clamp(max=weight_cap)
    advantages = inverse_density[index.inverse] * (scaled - p[index.inverse])
    stats = {"beta_a": float(a), "beta_b": float(b), "p_mean": float(m), "p_var": float(v)}
    return advantages, stats


def delta_l_weights(lengths: torch.Tensor, alpha: float = DELTA_L_DEFAULTS.alpha) -> torch.Tensor:
    """Delta-L normalisation weights (arXiv 2509.07558): ``x_i = L_i^-alpha / sum_j L_j^-alpha``.

    ``sum_i x_i g_i`` is an unbiased estimate of the policy gradient for any alpha (each
    per-sequence token-sum gradient ``g_i`` is), and alpha = 1 minimises its variance when the
    per-sequence gradient variance grows linearly with length. The weights sum to 1; empty
    rows (length 0, e.g. verl's padding rows) get weight 0.
    """
    if lengths.dim() != 1:
        raise AdvantageInputError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    if not alpha >= 0:
        raise AdvantageInputError(f"Delta-L alpha must be >= 0, got {alpha}")
    if bool((lengths < 0).any()) or not bool((lengths > 0).any()):
        raise AdvantageInputError("Delta-L needs non-negative lengths and at least one non-empty response")
    dtype = torch.promote_types(lengths.dtype, torch.float32)
    lengths = lengths.to(dtype)
    # empty rows (verl's padding) get weight 0
    log_w = torch.where(lengths > 0, -alpha * torch.log(lengths.clamp(min=1)), torch.full_like(lengths, -torch.inf))
    return torch.softmax(log_w, dim=0)


def delta_l_aggregate(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float = DELTA_L_DEFAULTS.alpha,
    max_length: int | None = None,
) -> torch.Tensor:
    """``(1/M) sum_i x_i sum_t l_i,t`` with Delta-L weights ``x_i``; ``M`` defaults to the padded length."""
    mask = response_mask.to(token_losses.dtype)
    lengths = mask.sum(-1)
    weights = delta_l_weights(lengths, alpha).to(token_losses.dtype)
    horizon = token_losses.shape[-1] if max_length is None else max_length
    return (weights * (token_losses * mask).sum(-1)).sum() / horizon
