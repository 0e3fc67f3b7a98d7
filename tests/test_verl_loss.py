"""The gepo loss through verl's REAL ppo_loss, with prompt groups scattered over micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config, loss_over_micro_batches
from gepo_plugin.verl_glue.losses import step_metrics
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION

BASE = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=2", "clip_ratio_low=0.2", "clip_ratio_high=0.2"]


def actor_config(*extra):
    return compose_actor_config([*BASE, "policy_loss.loss_mode=gepo", *extra])


def run_micro_batches(config, b, micro_batches, with_term=True):
    """Sum of gradients and losses over micro-batches, each through verl's ppo_loss as the engine calls it."""
    # trainer side: whole groups; rows without a response token (verl's padding) get no term
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids, valid=b.mask.sum(-1) > 0)
    fields = {LOG_GROUP_EXPECTATION: log_eq} if with_term else {}
    return loss_over_micro_batches(config, b.log_prob, b.old_log_prob, b.advantages, b.mask, micro_batches, fields)


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
    import numpy as np
    from verl.utils.metric import AggregationType

    from gepo_plugin.maths import sequence_log_prob

    b = make_batch(group_sizes=(4, 4, 4), seed=4, spread=0.5)
    micro_batches = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]  # of unequal sizes
    _, _, metrics = run_micro_batches(actor_config(), b, micro_batches)
    m = metrics[0]
    assert m["actor/gepo/iw_max"].aggregation == AggregationType.MAX
    assert m["actor/gepo/iw_min"].aggregation == AggregationType.MIN
    assert m["actor/gepo/step_totals/w_sum"].aggregation == AggregationType.SUM
    assert m["actor/gepo/group_term_present"].aggregate() == 1.0
    assert "actor/pg_loss" in m and "actor/pg_clipfrac" in m
    # the step's statistics are exact over its sequences, not a mean of the micro-batches' means
    step = step_metrics(metrics)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    w = np.exp((sequence_log_prob(b.log_prob, b.mask) - log_eq).numpy())
    assert step["actor/gepo/iw_mean"] == pytest.approx(w.mean(), rel=1e-9)
    assert step["actor/gepo/iw_std"] == pytest.approx(w.std(), rel=1e-6)
    assert step["actor/gepo/ess"] == pytest.approx(w.sum() ** 2 / (len(w) * (w**2).sum()), rel=1e-9)
    assert step["actor/gepo/iw_max"] == pytest.approx(w.max()) and step["actor/gepo/iw_min"] == pytest.approx(w.min())
    means_of_means = np.mean([w[rows].mean() for rows in micro_batches])
    assert abs(means_of_means - w.mean()) > 1e-6  # what verl's equal-weight mean would have reported
    assert not any("step_totals" in key for key in step)


def test_a_micro_batch_of_padding_rows_only_changes_no_statistic_and_no_loss():
    import numpy as np

    """verl's padding rows (no response token) can fill a micro-batch: the step's loss, gradient and statistics are
    those of the real rows."""
    from gepo_plugin.synthetic import SyntheticBatch

    b = make_batch(group_sizes=(4, 4), seed=9, spread=0.4)
    fields = ("log_prob", "old_log_prob", "advantages", "mask")
    pad = {name: torch.zeros(2, b.mask.shape[1], dtype=getattr(b, name).dtype) for name in fields}
    padded = SyntheticBatch(  # two rows as verl pads: a uid of their own, no response token; alone in a micro-batch
        *(torch.cat([getattr(b, name), pad[name]]) for name in fields),
        np.concatenate([b.group_ids, np.array(["pad0", "pad0"], dtype=object)]),
    )
    config = actor_config("loss_agg_mode=token-mean")
    loss, grad, metrics = run_micro_batches(config, b, [[0, 1, 2, 3], [4, 5, 6, 7]])
    padded_loss, padded_grad, padded_metrics = run_micro_batches(config, padded, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(padded_grad[:8], grad, rtol=1e-12, atol=1e-14)
    assert torch.count_nonzero(padded_grad[8:]) == 0
    assert step_metrics(padded_metrics) | {"actor/pg_clipfrac": 0, "actor/ppo_kl": 0} == pytest.approx(
        step_metrics(metrics) | {"actor/pg_clipfrac": 0, "actor/ppo_kl": 0}, rel=1e-12
    )


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
    kl = step_metrics(metrics)["actor/gepo/sampler_kl"]
    assert kl > 0
    assert float((with_kl - base).detach()) == pytest.approx(0.5 * kl, rel=1e-6)
