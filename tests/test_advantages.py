"""Group-relative, BNPO and Delta-L advantages against verl's own estimator and hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import beta_pdf

from gepo_plugin.maths import (
    AdvantageInputError,
    GroupIndex,
    bnpo_advantages,
    delta_l_aggregate,
    delta_l_weights,
    group_advantages,
)


def _rewards_and_ids(seed=0, groups=6, size=4):
    rng = np.random.default_rng(seed)
    ids = np.array([f"u{g}" for g in range(groups) for _ in range(size)], dtype=object)
    perm = rng.permutation(len(ids))
    rewards = torch.tensor(rng.integers(0, 2, len(ids)), dtype=torch.float32)
    return rewards[perm], ids[perm]


@pytest.mark.parametrize("normalize", [True, False])
def test_group_advantages_equal_verls_grpo_estimator(normalize):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards, ids = _rewards_and_ids()
    width = 3
    token_rewards = torch.zeros(len(ids), width)
    token_rewards[:, -1] = rewards
    mask = torch.ones(len(ids), width)
    verl_adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, ids, norm_adv_by_std_in_grpo=normalize)
    ours = group_advantages(rewards, GroupIndex.from_ids(ids), normalize_by_std=normalize)
    torch.testing.assert_close(ours, verl_adv[:, 0], rtol=1e-5, atol=1e-6)


def test_group_of_one_has_no_baseline():
    with pytest.raises(AdvantageInputError, match="single response"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), GroupIndex.from_ids(["a", "a", "b"]))


def test_bnpo_matches_hand_computation():
    # 3 prompts x 2 responses; group means p = 0.5, 1.0, 0.0 -> m = 0.5, v = 0.25 (unbiased)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    ids = ["a", "a", "b", "b", "c", "c"]
    adv, stats = bnpo_advantages(rewards, GroupIndex.from_ids(ids))
    m, v = 0.5, 0.25
    k = m * (1 - m) / v - 1  # 0.0
    a, b = max(1 + k * m / 3, 1.0), max(1 + k * (1 - m) / 3, 1.0)
    assert stats["beta_a"] == pytest.approx(a) and stats["beta_b"] == pytest.approx(b)
    expected = [(1 - 0.5) / beta_pdf(0.5, a, b), (0 - 0.5) / beta_pdf(0.5, a, b), 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_bnpo_with_a_non_uniform_beta():
    # groups of 4: p = 0.25, 0.5, 0.75, 0.5 -> m = 0.5, v = 1/24
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1], dtype=torch.float64)
    ids = [g for g in "abcd" for _ in range(4)]
    adv, stats = bnpo_advantages(rewards, GroupIndex.from_ids(ids))
    p = np.array([0.25, 0.5, 0.75, 0.5])
    m, v = p.mean(), p.var(ddof=1)
    k = m * (1 - m) / v - 1
    a, b = 1 + k * m / 3, 1 + k * (1 - m) / 3
    assert a > 1 and stats["beta_a"] == pytest.approx(a)
    expected = [(r - p[i // 4]) / beta_pdf(p[i // 4], a, b) for i, r in enumerate(rewards.tolist())]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_bnpo_rejects_rewards_outside_the_range():
    with pytest.raises(AdvantageInputError, match="reward_min"):
        bnpo_advantages(torch.tensor([2.0, 0.0]), GroupIndex.from_ids(["a", "a"]))
    adv, _ = bnpo_advantages(torch.tensor([2.0, 0.0, 2.0, 2.0]), GroupIndex.from_ids(list("aabb")), reward_max=2.0)
    assert torch.isfinite(adv).all()


def test_delta_l_weights_hand_computed():
    lengths = torch.tensor([1.0, 2.0, 4.0, 0.0])
    w = delta_l_weights(lengths, alpha=1.0)
    total = 1 + 1 / 2 + 1 / 4
    torch.testing.assert_close(w, torch.tensor([1 / total, 0.5 / total, 0.25 / total, 0.0]))
    w0 = delta_l_weights(lengths[:3], alpha=0.0)
    torch.testing.assert_close(w0, torch.full((3,), 1 / 3))
    with pytest.raises(AdvantageInputError, match="alpha"):
        delta_l_weights(lengths, alpha=-1.0)


def test_delta_l_aggregate_hand_computed():
    losses = torch.tensor([[1.0, 9.0, 9.0], [2.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    got = delta_l_aggregate(losses, mask, alpha=1.0, max_length=3)
    x = [1 / 1.5, 0.5 / 1.5]
    assert float(got) == pytest.approx((x[0] * 1.0 + x[1] * 4.0) / 3)


def test_registered_delta_l_estimator_with_verls_vanilla_loss_is_the_paper_estimator():
    """delta_l advantages + verl's vanilla loss (seq-mean-token-sum-norm) = (1/M) sum_i x_i sum_t l_it."""
    import verl  # noqa: F401  (plugin registration)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import agg_loss, get_adv_estimator_fn

    width = 5
    lengths = torch.tensor([1, 3, 5, 2])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    token_rewards = torch.zeros(4, width)
    token_rewards[torch.arange(4), lengths - 1] = rewards
    ids = np.array(["a", "a", "b", "b"], dtype=object)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": False, "delta_l": {"alpha": 1.0}})
    adv, _ = get_adv_estimator_fn("delta_l")(token_rewards, mask, index=ids, config=config)

    ratio = torch.exp(torch.linspace(-0.1, 0.1, 4 * width).reshape(4, width))
    token_loss_per_unit_adv = -ratio  # no clipping at these ratios
    ours = agg_loss(adv * token_loss_per_unit_adv, mask, "seq-mean-token-sum-norm", loss_scale_factor=width)
    base = torch.tensor([0.5, -0.5, -0.5, 0.5])
    x = (1 / lengths.float()) / (1 / lengths.float()).sum()
    paper = (x * (base[:, None] * token_loss_per_unit_adv * mask).sum(-1)).sum() / width
    torch.testing.assert_close(ours, paper)


def test_registered_bnpo_estimator_skips_padding_rows():
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    mask = torch.ones(5, 2)
    mask[4] = 0  # verl's padding row copies sample 0's uid and has no response
    token_rewards = torch.zeros(5, 2)
    token_rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    ids = np.array(["a", "a", "b", "b", "a"], dtype=object)
    config = OmegaConf.create({"bnpo": {"reward_min": 0.0, "reward_max": 1.0}})
    adv, _ = get_adv_estimator_fn("bnpo")(token_rewards, mask, index=ids, config=config)
    assert adv[4].abs().sum() == 0
    # group a's mean is 0.5 (the padding row did not pull it down)
    assert float(adv[0, 0]) == pytest.approx(-float(adv[1, 0]))
    assert math.isfinite(float(adv.sum()))
