"""The gepo loss through verl's REAL ppo_loss, with prompt groups scattered over micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms

BASE = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=2", "clip_ratio_low=0.2", "clip_ratio_high=0.2"]


def actor_config(*extra):
    return compose_actor_config([*BASE, "policy_loss.loss_mode=gepo", *extra])


def run_micro_batches(config, b, micro_batches, with_term=True):
    """Sum of gradients and losses over micro-batches, each through verl's ppo_loss as the engine calls it."""
    logp = b.log_prob.clone().requires_grad_()
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)  # trainer side: whole groups
    total_tokens = int(b.mask.sum())
    losses, metrics = [], []
    for rows in micro_batches:
        rows = torch.as_tensor(rows)
        extra = {LOG_GROUP_EXPECTATION: log_eq[rows]} if with_term else {}
        model_output, data = build_loss_inputs(
            logp[rows],
            b.old_log_prob[rows],
            b.advantages[rows],
            b.mask[rows],
            extra,
            batch_num_tokens=total_tokens,
            global_batch_size=len(b.group_ids),
        )
        loss, m = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
        losses.append(loss)
        metrics.append(m)
    total = torch.stack(losses).sum()
    (grad,) = torch.autograd.grad(total, logp)
    return total, grad, metrics


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_scattered_groups_give_the_whole_group_gradient(mode):
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=2, spread=0.3)
    config = actor_config(f"loss_agg_mode={mode}")
    n = len(b.group_ids)
    whole_loss, whole_grad, _ = run_micro_batches(config, b, [list(range(n))])
    # every micro-batch mixes several prompts; no group is whole in any micro-batch
    scattered = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]
    loss, grad, _ = run_micro_batches(config, b, scattered)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-9, atol=1e-12)


def test_micro_batch_scope_differs_from_the_per_prompt_group():
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=2, spread=0.3)
    scattered = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]
    _, prompt_grad, _ = run_micro_batches(actor_config(), b, scattered)
    batch_scope = actor_config("policy_loss.group_scope=batch")
    _, batch_grad, metrics = run_micro_batches(batch_scope, b, scattered, with_term=False)
    assert (prompt_grad - batch_grad).abs().max() > 1e-3
    assert metrics[0]["actor/gepo/group_term_present"].aggregate() == 0.0


def test_metrics_are_named_and_aggregated_for_verls_tracker():
    from verl.utils.metric import AggregationType

    b = make_batch(group_sizes=(4, 4), seed=4, spread=0.5)
    _, _, metrics = run_micro_batches(actor_config(), b, [[0, 1, 2, 3], [4, 5, 6, 7]])
    m = metrics[0]
    for key in ("iw_mean", "iw_std", "iw_max", "iw_min", "ess", "clipfrac", "sampler_kl", "group_term_present"):
        assert f"actor/gepo/{key}" in m
    assert m["actor/gepo/iw_max"].aggregation == AggregationType.MAX
    assert m["actor/gepo/iw_min"].aggregation == AggregationType.MIN
    assert m["actor/gepo/iw_mean"].aggregation == AggregationType.MEAN
    assert m["actor/gepo/group_term_present"].aggregate() == 1.0
    assert "actor/pg_loss" in m and "actor/pg_clipfrac" in m


def test_missing_group_term_raises_with_the_fix():
    from gepo_plugin.verl_glue.losses import GroupTermMissingError

    b = make_batch(group_sizes=(2, 2), seed=1)
    with pytest.raises(GroupTermMissingError, match="trainer_mode=gepo_sync"):
        run_micro_batches(actor_config(), b, [[0, 1, 2, 3]], with_term=False)


def test_plain_verl_ppo_loss_without_the_plugin_trainer_raises_too():
    """A user who sets loss_mode=gepo in verl's own main_ppo, without the plugin trainer, gets the error."""
    from verl.workers.utils.losses import ppo_loss

    from gepo_plugin.verl_glue.losses import GroupTermMissingError

    b = make_batch(group_sizes=(2, 2), seed=1)
    model_output, data = build_loss_inputs(b.log_prob, b.old_log_prob, b.advantages, b.mask)
    with pytest.raises(GroupTermMissingError, match="group term"):
        ppo_loss(actor_config(), model_output=model_output, data=data)


def test_kl_coefficient_from_config_reaches_the_loss():
    b = make_batch(group_sizes=(4, 4), seed=6, spread=0.5)
    rows = [list(range(8))]
    agg = "loss_agg_mode=seq-mean-token-mean"  # the paper's "token-mean then mean"
    base, _, _ = run_micro_batches(actor_config(agg), b, rows)
    with_kl, _, metrics = run_micro_batches(actor_config(agg, "policy_loss.sampler_kl_coef=0.5"), b, rows)
    kl = metrics[0]["actor/gepo/sampler_kl"].aggregate()
    assert kl > 0
    assert float((with_kl - base).detach()) == pytest.approx(0.5 * kl, rel=1e-6)


def test_the_trainers_group_term_leaves_padding_out_of_its_metrics_and_matches_the_closed_form():
    """verl pads a batch with copies of sample 0 (same uid): they must not change the term or count as responses."""
    import math

    import numpy as np

    from gepo_plugin.verl_glue.trainers import compute_group_terms

    uids = np.array(["p", "q", "p", "r", "q", "p", "p"], dtype=object)  # the last row: padding copying row 0
    is_padding = [False] * 6 + [True]
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(7, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(7, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    log_eq, metrics = compute_group_terms(uids, old, mask, is_padding)
    seq = [float((old[i] * mask[i]).sum() / mask[i].sum()) for i in range(7)]
    # E_hat_q[q] = sum q^2 / sum q over the group's real responses (GEPO's q-weighted expectation of q)
    members = {g: [seq[i] for i in range(6) if uids[i] == g] for g in "pqr"}
    expected = {g: math.log(sum(math.exp(2 * v) for v in m) / sum(math.exp(v) for v in m)) for g, m in members.items()}
    for i in range(6):
        assert float(log_eq[i]) == pytest.approx(expected[uids[i]], rel=1e-6)
    assert metrics["gepo/num_groups"] == 3.0
    assert metrics["gepo/group_size_mean"] == pytest.approx(6 / 3)
