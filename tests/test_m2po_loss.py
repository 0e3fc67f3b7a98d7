"""The m2po loss through verl's REAL ppo_loss: the authors' loss on each micro-batch in their scope, and the same
gradient whatever verl's split in the mini-batch scope."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch
from test_m2po_maths import their_loss

from gepo_plugin.maths.m2po import m2_cap
from gepo_plugin.verl_glue.loss_batch import compose_actor_config, loss_over_micro_batches
from gepo_plugin.verl_glue.m2_cap import MiniBatchCapMissingError
from gepo_plugin.verl_glue.m2po_mini_batch import cap_fields

BASE = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=2", "policy_loss.loss_mode=m2po", "loss_agg_mode=token-mean"]
#: every micro-batch mixes prompts, of unequal sizes
SPLIT = [[0, 5, 10, 15, 3], [1, 6, 11], [12, 2, 7, 8], [13, 4, 9, 14]]
OTHER_SPLIT = [[15, 14, 13, 12, 11, 10, 9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]


def actor_config(*extra):
    return compose_actor_config([*BASE, *extra])


def run_micro_batches(config, b, micro_batches, fields=None):
    """Total loss and gradient over micro-batches, each through verl's ppo_loss as the engine calls it."""
    advantages = b.advantages * b.mask
    return loss_over_micro_batches(config, b.log_prob, b.old_log_prob, advantages, b.mask, micro_batches, fields)


def whole_batch_fields(b, budget=0.04):
    """What the mini-batch's pre-pass hands over: the cap over every row."""
    cap = m2_cap(b.log_prob, b.old_log_prob, b.advantages * b.mask, b.mask, budget)
    assert cap.tau is not None, "the test batch must exceed the budget"
    return cap_fields(cap, len(b.group_ids))


@pytest.mark.parametrize("budget", [0.01, 0.04])
def test_in_the_authors_scope_each_micro_batch_is_their_loss(budget):
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=3, spread=0.4)
    config = actor_config("policy_loss.m2_scope=micro_batch", f"policy_loss.m2_budget={budget}")
    total, _, metrics = run_micro_batches(config, b, SPLIT)
    expected = 0.0
    for rows in SPLIT:
        advantages = b.advantages[rows] * b.mask[rows]
        losses, _ = their_loss(b.old_log_prob[rows], b.log_prob[rows], advantages, b.mask[rows], budget)
        expected += float((losses * b.mask[rows]).sum())
    assert float(total.detach()) == pytest.approx(expected / float(b.mask.sum()), rel=1e-12)
    assert any(m["actor/m2po/cap_binds"].aggregate() == 1.0 for m in metrics)


def test_in_the_mini_batch_scope_the_gradient_does_not_depend_on_the_split():
    """The mini-batch's cap makes every split train the same gradient, equal to the authors' scope on one micro-batch
    holding the whole mini-batch; their scope on verl's micro-batches trains another one."""
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=3, spread=0.4)
    fields = whole_batch_fields(b)
    mini = actor_config("policy_loss.m2_scope=mini_batch")
    loss_a, grad_a, metrics = run_micro_batches(mini, b, SPLIT, fields)
    loss_b, grad_b, _ = run_micro_batches(mini, b, OTHER_SPLIT, fields)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-15)
    theirs = actor_config("policy_loss.m2_scope=micro_batch")
    loss_whole, grad_whole, _ = run_micro_batches(theirs, b, [list(range(16))])
    torch.testing.assert_close(grad_a, grad_whole, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss_a, loss_whole, rtol=1e-12, atol=1e-15)
    _, grad_split, _ = run_micro_batches(theirs, b, SPLIT)
    assert (grad_split - grad_whole).abs().max() > 1e-3
    cap = m2_cap(b.log_prob, b.old_log_prob, b.advantages * b.mask, b.mask, 0.04)
    assert metrics[0]["actor/m2po/m2"].aggregate() == pytest.approx(cap.m2, rel=1e-12)
    assert metrics[0]["actor/m2po/m2_after"].aggregate() == pytest.approx(cap.m2_after, rel=1e-12)


def test_clipped_tokens_get_no_gradient_and_the_others_get_the_surrogates():
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=5, spread=0.4)
    fields = whole_batch_fields(b)
    _, grad, _ = run_micro_batches(actor_config(), b, SPLIT, fields)
    cap = m2_cap(b.log_prob, b.old_log_prob, b.advantages * b.mask, b.mask, 0.04)
    low, high = cap.ratio_bounds()
    ratio = torch.exp(b.log_prob - b.old_log_prob)
    advantages = b.advantages * b.mask
    clipped = ((advantages > 0) & (ratio > high)) | ((advantages < 0) & (ratio < low))
    inside = b.mask.bool() & ~clipped
    assert (clipped & b.mask.bool()).any()
    assert torch.all(grad[clipped] == 0)
    expected = -advantages * ratio / float(b.mask.sum())  # token-mean over the mini-batch's tokens
    torch.testing.assert_close(grad[inside], expected[inside], rtol=1e-12, atol=1e-15)


def test_the_mini_batch_scope_without_its_cap_says_how_to_get_it():
    b = make_batch(group_sizes=(4, 4), seed=1)
    with pytest.raises(MiniBatchCapMissingError, match="m2_scope=micro_batch"):
        run_micro_batches(actor_config(), b, [list(range(8))])
