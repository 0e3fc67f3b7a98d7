"""BNPO and Delta-L registered as verl advantage estimators (``algorithm.adv_estimator=bnpo|delta_l``).

verl calls a registered estimator with the whole training batch (groups whole, ``index=uid``),
which is exactly where both need to look: BNPO fits a Beta to the batch's group-mean rewards,
Delta-L normalises length weights over the batch. Rows with an empty response (verl's padding
rows, which copy sample 0's uid) are left out of every statistic and get advantage 0.

Delta-L is applied by scaling each advantage by ``B * x_i`` (``x_i`` the Delta-L weight). With
verl's ``loss_agg_mode=seq-mean-token-sum-norm`` (sum over tokens / batch / max length), the
loss becomes ``(1/M) sum_i x_i sum_t l_i,t``, the paper's estimator; the scaling is exact for
PPO's clipped objective because it is positively homogeneous in the advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import register_adv_est

from gepo_plugin.maths import GroupIndex, bnpo_advantages, delta_l_weights, group_advantages
from gepo_plugin.maths.options import BNPO_OPTIONS_KEY, DELTA_L_OPTIONS_KEY, BNPOOptions, DeltaLOptions
from gepo_plugin.options import parse_options


def _options(model, config, name: str, key: str):
    """The estimator's options from ``algorithm.<name>`` (the model's defaults where the config has none)."""
    section = None if config is None else config.get(name, None)
    if section is not None and not isinstance(section, dict):
        section = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
    return parse_options(model, section, key)


def _require_index(index) -> np.ndarray:
    if index is None:
        raise ValueError(
            "this advantage estimator needs the prompt id of every response (verl's `uid`), "
            "which verl passes as `index`; it was missing"
        )
    return np.asarray(index, dtype=object)


#: ``(scores, groups, valid_mask) -> advantages`` of the non-empty responses (one value per response).
SequenceAdvantages = Callable[[torch.Tensor, GroupIndex, torch.Tensor], torch.Tensor]


def _outcome_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, per_sequence: SequenceAdvantages
) -> tuple[torch.Tensor, torch.Tensor]:
    """The skeleton both estimators share: groups from verl's ``index`` over the non-empty responses, one advantage
    per response from ``per_sequence``, 0 for empty (padding) rows, broadcast over each response's tokens."""
    ids = _require_index(index)
    valid = response_mask.sum(dim=-1) > 0
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores, dtype=torch.float32)
    with torch.no_grad():
        groups = GroupIndex.from_ids(ids[valid.cpu().numpy()], device=scores.device)
        advantages[valid] = per_sequence(scores[valid], groups, response_mask[valid]).to(advantages.dtype)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("bnpo")
def compute_bnpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BNPO advantages (arXiv 2506.02864), broadcast over each response's tokens.

    Options under ``algorithm.bnpo``: ``reward_min`` / ``reward_max`` (the reward's range,
    default 0 / 1) and ``weight_cap`` (cap on the inverse Beta density, default 1e6).
    """
    options = _options(BNPOOptions, config, "bnpo", BNPO_OPTIONS_KEY)

    def per_sequence(scores: torch.Tensor, groups: GroupIndex, mask: torch.Tensor) -> torch.Tensor:
        return bnpo_advantages(
            scores,
            groups,
            reward_min=options.reward_min,
            reward_max=options.reward_max,
            weight_cap=options.weight_cap,
        )[0]

    return _outcome_advantages(token_level_rewards, response_mask, index, per_sequence)


@register_adv_est("delta_l")
def compute_delta_l_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages scaled by Delta-L weights ``B * x_i`` (arXiv 2509.07558).

    Options: ``algorithm.delta_l.alpha`` (default 1: minimum variance; the paper used 0.75 for
    math) and verl's ``algorithm.norm_adv_by_std_in_grpo`` for the base advantage.
    """
    alpha = _options(DeltaLOptions, config, "delta_l", DELTA_L_OPTIONS_KEY).alpha
    normalize = bool(config.get("norm_adv_by_std_in_grpo", True)) if config is not None else True

    def per_sequence(scores: torch.Tensor, groups: GroupIndex, mask: torch.Tensor) -> torch.Tensor:
        base = group_advantages(scores, groups, normalize_by_std=normalize)
        lengths = mask.sum(dim=-1)
        return base * (delta_l_weights(lengths, alpha) * lengths.shape[0])

    return _outcome_advantages(token_level_rewards, response_mask, index, per_sequence)
