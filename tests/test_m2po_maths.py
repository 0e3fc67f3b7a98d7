"""M2PO's budget and loss (gepo_plugin/maths/m2po.py) against a transcription of the authors' code, in float64.

The transcription follows ``Infini-AI-Lab/M2PO`` at ``4514ce2``, ``verl/trainer/ppo/core_algos.py`` lines 683-867
line for line: the Python loop over the sorted squared log-ratios, the tolerances, the harmful-token selection, the
float32 ``torch.exp(torch.tensor(+-tau))`` of the bounds, the clip widths and the clipped surrogate.
"""

from __future__ import annotations

import math

import pytest
import torch

from gepo_plugin.maths.m2po import NO_CLIP, harmful_delta_sq, m2_cap, m2po_token_losses, solve_cap


def their_solve_tau(sorted_delta2: torch.Tensor, target_sum: float):
    """``_solve_tau_from_sorted_delta2``, line for line (the branches that return a bare number cannot be reached
    from ``kpo_clip_harmful_tokens`` with a positive budget)."""
    total = float(sorted_delta2.sum().item())
    assert target_sum < total - 1e-12 and target_sum > 1e-12
    csum = torch.cumsum(sorted_delta2, dim=0)
    n = sorted_delta2.numel()
    for k in range(0, n):
        left_sum = float(csum[k].item())
        rest = n - k - 1
        m2 = sorted_delta2[k].item() - 1e-12
        if m2 * rest + left_sum >= target_sum - 1e-12:
            if k == 0:
                return 0.0, csum[-1].item() / n
            m2_after = (sorted_delta2[k - 1].item() * (rest + 1) + float(csum[k - 1].item())) / n
            return float(sorted_delta2[k - 1].item() - 1e-12) ** 0.5, m2_after
    raise AssertionError("unreachable")


def their_bounds(old_log_prob, log_prob, advantages, response_mask, budget):
    """``_get_trust_region_tokens_delta_sq`` and ``kpo_clip_harmful_tokens``; returns (low, high, M2, M2_after)."""
    mask = response_mask.bool()
    adv_example = advantages[:, 0]
    pos_adv_mask = adv_example > 1e-12
    neg_adv_mask = adv_example < -1e-12
    delta = old_log_prob - log_prob
    ratio = torch.exp(-delta)
    pos_adv_r_gt_1_mask = ratio[pos_adv_mask] > 1.0 + 1e-12
    neg_adv_r_lt_1_mask = ratio[neg_adv_mask] < 1.0 - 1e-12
    delta_sq = delta.pow(2)
    tr = torch.cat(
        [
            delta_sq[pos_adv_mask][pos_adv_r_gt_1_mask & mask[pos_adv_mask]],
            delta_sq[neg_adv_mask][neg_adv_r_lt_1_mask & mask[neg_adv_mask]],
        ]
    )
    token_num = tr.numel()
    if token_num == 0:
        return 0.0, 100000, 0.0, 0.0
    m2_now = float(tr.sum().item() / token_num)
    if m2_now <= budget + 1e-12:
        return 0.0, 100000, m2_now, m2_now
    tau, m2_after = their_solve_tau(torch.sort(tr)[0], budget * float(token_num))
    low = float(torch.exp(torch.tensor(-tau)).item())  # torch's default dtype: float32, as theirs
    high = float(torch.exp(torch.tensor(+tau)).item())
    return low, high, m2_now, m2_after


def their_loss(old_log_prob, log_prob, advantages, response_mask, budget):
    """``compute_m2po_policy_loss`` with the scripts' ``miniclip_low/high=None``: the per-token losses before
    ``agg_loss`` and the clipped fraction."""
    clip_low, clip_high, _, _ = their_bounds(old_log_prob, log_prob, advantages, response_mask, budget)
    clip_low = 1 - clip_low
    clip_high = clip_high - 1
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(pg_losses1, pg_losses2), torch.gt(pg_losses2, pg_losses1)


def batch(seed: int, rows: int = 12, length: int = 20, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 3
    new = old + torch.randn(rows, length, generator=generator, dtype=torch.float64) * spread
    advantages = torch.randn(rows, 1, generator=generator, dtype=torch.float64).expand(rows, length).clone()
    advantages[0] = 0.0  # a sequence with no advantage is never harmful
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    return new, old, advantages, mask


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [0.001, 0.04, 0.2])
def test_the_cap_and_the_losses_are_the_authors(seed, budget):
    new, old, advantages, mask = batch(seed)
    ours = m2_cap(new, old, advantages, mask, budget)
    low, high, m2, m2_after = their_bounds(old, new, advantages, mask, budget)
    assert (ours.tau is None) == ((low, high) == (0.0, 100000))
    assert ours.ratio_bounds() == (1 - (1 - low), 1 + (high - 1))  # bit for bit
    assert ours.m2 == pytest.approx(m2, rel=1e-12) and ours.m2_after == pytest.approx(m2_after, rel=1e-12)
    losses, clipped = m2po_token_losses(new, old, advantages, ours.ratio_bounds())
    their_losses, their_clipped = their_loss(old, new, advantages, mask, budget)
    assert torch.equal(losses, their_losses) and torch.equal(clipped, their_clipped)


def test_the_cap_brings_the_second_moment_within_the_budget():
    """The property the budget is for: capping every harmful |log-ratio| at tau leaves their mean square within it
    (tau is the largest data value that does, so one value more would exceed it)."""
    new, old, advantages, mask = batch(3, rows=64, spread=0.5)
    delta_sq = harmful_delta_sq(new, old, advantages, mask)
    budget = 0.04
    cap = solve_cap(delta_sq, budget)
    tau, m2, m2_after = cap.tau, cap.m2, cap.m2_after
    assert m2 > budget and tau is not None
    capped = torch.clamp(delta_sq, max=tau**2 + 1e-12)
    assert float(capped.mean()) == pytest.approx(m2_after, rel=1e-9)
    assert m2_after <= budget + 1e-12
    larger = delta_sq[delta_sq > tau**2 + 1e-9].min()
    assert float(torch.clamp(delta_sq, max=float(larger)).mean()) > budget


def test_within_the_budget_nothing_is_clipped_and_without_harmful_tokens_neither():
    new, old, advantages, mask = batch(5, spread=0.01)
    assert m2_cap(new, old, advantages, mask, 1.0).ratio_bounds() == NO_CLIP
    assert m2_cap(old.clone(), old, advantages, mask, 0.04).harmful_tokens == 0
    assert math.isfinite(m2_cap(new, old, advantages, mask, 1e-6).ratio_bounds()[1])


def test_a_zero_budget_clips_every_harmful_token():
    """Their solver returns a bare 0.0 there, which their caller cannot unpack; here tau is 0: bounds [1, 1]."""
    new, old, advantages, mask = batch(2, spread=0.3)
    cap = m2_cap(new, old, advantages, mask, 0.0)
    assert cap.tau == 0.0 and cap.ratio_bounds() == (1.0, 1.0)
    _, clipped = m2po_token_losses(new, old, advantages, cap.ratio_bounds())
    harmful = ((advantages[:, :1] > 0) & (new > old)) | ((advantages[:, :1] < 0) & (new < old))
    assert torch.equal(clipped & mask.bool(), harmful & mask.bool())


def test_the_token_losses_are_their_clipped_surrogate_and_clipped_tokens_get_no_gradient():
    """Their surrogate with the widths they derive (1 - low and high - 1, then 1 -/+ width), and the gradient: zero
    exactly on the tokens reported clipped, -A r elsewhere."""
    new, old, advantages, mask = batch(7, spread=0.5)
    bounds = m2_cap(new, old, advantages, mask, 0.04).ratio_bounds()
    assert bounds[0] < 1 < bounds[1] < NO_CLIP[1]
    width_low, width_high = 1 - bounds[0], bounds[1] - 1
    ratio = torch.exp(new - old)
    expected = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - width_low, 1 + width_high))
    leaf = new.clone().requires_grad_(True)
    losses, clipped = m2po_token_losses(leaf, old, advantages, bounds)
    torch.testing.assert_close(losses, expected, rtol=1e-14, atol=1e-15)
    (losses * mask).sum().backward()
    assert clipped.any() and (~clipped).any()
    assert torch.all(leaf.grad[clipped] == 0)
    torch.testing.assert_close(leaf.grad[~clipped], (-advantages * ratio * mask)[~clipped])
