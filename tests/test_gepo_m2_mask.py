"""M2PO's second-moment mask on GEPO's weights (``policy_loss.m2_mask=true``) through verl's REAL ppo_loss: exactly the
tokens M2PO's clip would take the gradient from lose theirs, every other token keeps GEPO's gradient unchanged,
and the mask does not depend on verl's split in the mini-batch scope."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.maths.m2po import EPS, m2_cap, m2_masked_tokens
from gepo_plugin.verl_glue.loss_batch import compose_actor_config, loss_over_micro_batches
from gepo_plugin.verl_glue.m2po_mini_batch import cap_fields, mini_batch_budget, requested_budget
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION

BASE = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4", "clip_ratio_low=0.2", "clip_ratio_high=0.2"]
SCATTERED = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]
OTHER_SPLIT = [[15, 14, 13, 12, 11, 10, 9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]


def gepo_config(*extra: str, agg: str = "token-mean"):
    return compose_actor_config([*BASE, f"loss_agg_mode={agg}", "policy_loss.loss_mode=gepo", *extra])


def run(config, b, micro_batches, extra_fields=None):
    """GEPO's loss over ``micro_batches`` through verl's ppo_loss, the group term computed on whole groups."""
    fields = {LOG_GROUP_EXPECTATION: group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)}
    fields.update(extra_fields or {})
    advantages = b.advantages * b.mask
    return loss_over_micro_batches(config, b.log_prob, b.old_log_prob, advantages, b.mask, micro_batches, fields)


def whole_cap(b, budget=0.04):
    cap = m2_cap(b.log_prob, b.old_log_prob, b.advantages * b.mask, b.mask, budget)
    assert cap.tau is not None, "the test batch must exceed the budget"
    return cap


def test_the_mask_is_the_harmful_tokens_beyond_the_cap():
    """An independent formula: harmful (advantage and log-ratio on the same side of 0) with |log-ratio| > tau."""
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=3, spread=0.4)
    cap = whole_cap(b)
    advantages = b.advantages * b.mask
    masked = m2_masked_tokens(b.log_prob, b.old_log_prob, advantages, cap) & b.mask.bool()
    delta = b.log_prob - b.old_log_prob
    sign = advantages[:, :1]
    harmful = ((sign > EPS) & (delta > 0)) | ((sign < -EPS) & (delta < 0))
    expected = harmful & (delta.abs() > cap.tau) & b.mask.bool()
    assert masked.any() and (harmful & b.mask.bool() & ~masked).any()  # the cap separates the harmful tokens
    assert torch.equal(masked, expected)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_masked_tokens_lose_their_gradient_and_the_others_keep_gepos(agg):
    """Differential against plain GEPO: the gradient with the mask is GEPO's gradient times the mask's complement."""
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=5, spread=0.4)
    cap = whole_cap(b)
    fields = cap_fields(cap, len(b.group_ids))
    _, plain, _ = run(gepo_config(agg=agg), b, SCATTERED)
    _, masked_grad, metrics = run(gepo_config("policy_loss.m2_mask=true", agg=agg), b, SCATTERED, fields)
    masked = m2_masked_tokens(b.log_prob, b.old_log_prob, b.advantages * b.mask, cap) & b.mask.bool()
    assert (plain[masked] != 0).any()  # some of them had a gradient (others GEPO's own clip zeroed)
    torch.testing.assert_close(masked_grad, plain * (~masked), rtol=1e-12, atol=1e-15)
    share = sum(float(m["actor/m2po/masked_frac"].aggregate()) for m in metrics) / len(metrics)
    assert share > 0 and metrics[0]["actor/m2po/cap_binds"].aggregate() == 1.0


def test_in_the_mini_batch_scope_the_split_does_not_matter_and_in_the_micro_batch_scope_it_does():
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=3, spread=0.4)
    fields = cap_fields(whole_cap(b), len(b.group_ids))
    config = gepo_config("policy_loss.m2_mask=true")
    loss_a, grad_a, _ = run(config, b, SCATTERED, fields)
    loss_b, grad_b, _ = run(config, b, OTHER_SPLIT, fields)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-15)
    theirs = gepo_config("policy_loss.m2_mask=true", "policy_loss.m2_scope=micro_batch")
    _, grad_whole, _ = run(theirs, b, [list(range(16))])
    torch.testing.assert_close(grad_a, grad_whole, rtol=1e-12, atol=1e-15)
    _, grad_split, _ = run(theirs, b, SCATTERED)
    assert (grad_split - grad_whole).abs().max() > 1e-4


def test_a_budget_that_holds_masks_nothing():
    b = make_batch(group_sizes=(4, 4), seed=1, spread=0.4)
    config = gepo_config("policy_loss.m2_mask=true", "policy_loss.m2_scope=micro_batch", "policy_loss.m2_budget=1e6")
    _, plain, _ = run(gepo_config(), b, [list(range(8))])
    _, masked, metrics = run(config, b, [list(range(8))])
    torch.testing.assert_close(masked, plain, rtol=0, atol=0)
    assert metrics[0]["actor/m2po/masked_frac"].aggregate() == 0.0


def test_the_engine_pre_pass_runs_for_gepo_only_with_the_mask_in_the_mini_batch_scope():
    """What decides whether verl's engine measures the mini-batch first (the patch asks ``requested_budget``)."""
    import functools

    masked = gepo_config("policy_loss.m2_mask=true", "policy_loss.m2_budget=0.07")
    assert mini_batch_budget(masked) == 0.07
    assert requested_budget(functools.partial(print, config=masked)) == 0.07
    assert mini_batch_budget(gepo_config()) is None
    assert mini_batch_budget(gepo_config("policy_loss.m2_mask=true", "policy_loss.m2_scope=micro_batch")) is None
