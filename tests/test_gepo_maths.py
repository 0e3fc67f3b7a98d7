"""GEPO's framework-free maths against independent loop implementations and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_batch
from reference import gepo_reference_loss

from gepo_plugin.maths import (
    GEPOInputError,
    GroupIdError,
    GroupIndex,
    gepo_token_losses,
    group_log_expectation,
    group_log_expectation_from_tokens,
    k3_kl,
    segment_logsumexp,
    sequence_log_prob,
)

AGG_MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def aggregate(loss_mat, mask, mode):
    """verl's agg_loss semantics for one micro-batch (dp_size 1, no global info)."""
    from verl.trainer.ppo.core_algos import agg_loss

    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_reference(mode, seed):
    b = make_batch(seed=seed, spread=0.4)
    low, high = 0.2, 0.25
    logp = b.log_prob.clone().requires_grad_()
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    terms = gepo_token_losses(logp, b.old_log_prob, b.advantages, b.mask, log_eq, low, high)
    loss = aggregate(terms.token_losses, b.mask, mode)
    (grad,) = torch.autograd.grad(loss, logp)

    ref_logp = b.log_prob.clone().requires_grad_()
    ref = gepo_reference_loss(ref_logp, b.old_log_prob, b.advantages, b.mask, b.group_ids, low, high, mode)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)

    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0  # something is trained


def test_clipping_is_active_in_the_comparison():
    """The reference comparison above must exercise the clipped branch (else it proves little)."""
    b = make_batch(seed=0, spread=0.4)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    terms = gepo_token_losses(b.log_prob, b.old_log_prob, b.advantages, b.mask, log_eq, 0.2, 0.25)
    assert 0 < float(terms.metrics["clipfrac"]) < 1


def test_group_of_one_reduces_to_p_over_q():
    b = make_batch(group_sizes=(1, 1, 1), seed=3)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    s_q = sequence_log_prob(b.old_log_prob, b.mask)
    torch.testing.assert_close(log_eq, s_q)


def test_all_equal_q_in_a_group_gives_q():
    old = torch.full((4, 5), -0.7, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.int64)
    log_eq = group_log_expectation_from_tokens(old, mask, ["a"] * 4)
    torch.testing.assert_close(log_eq, torch.full((4,), -0.7, dtype=torch.float64))


def test_group_expectation_closed_form_and_order_invariance():
    q = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    expected = math.log((0.25 + 0.0625 + 0.015625) / 0.875)
    index = GroupIndex.from_ids(["x", "x", "x"])
    got = group_log_expectation(torch.log(q), index)
    torch.testing.assert_close(got, torch.full((3,), expected, dtype=torch.float64))
    perm = [2, 0, 1]
    got_perm = group_log_expectation(torch.log(q[perm]), GroupIndex.from_ids(["x", "x", "x"]))
    torch.testing.assert_close(got_perm, got)


def test_segment_logsumexp_is_stable_and_matches_torch():
    values = torch.tensor([-1e4, -1e4 + 1.0, 3.0, 1e3, 1e3 - 2.0], dtype=torch.float64)
    index = GroupIndex.from_ids([0, 0, 1, 2, 2])
    got = segment_logsumexp(values, index)
    want = torch.stack(
        [torch.logsumexp(values[:2], 0), torch.logsumexp(values[2:3], 0), torch.logsumexp(values[3:], 0)]
    )
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all()


def test_long_sequences_stay_finite_in_log_space():
    """100k tokens at log p = -5 each: the raw product exp(-5e5) underflows, the log-space maths does not."""
    width = 100_000
    old = torch.full((2, width), -5.0)
    mask = torch.ones(2, width, dtype=torch.int64)
    log_eq = group_log_expectation_from_tokens(old, mask, ["g", "g"])
    torch.testing.assert_close(log_eq, torch.full((2,), -5.0))
    terms = gepo_token_losses(old + 0.01, old, torch.ones(2, width), mask, log_eq)
    assert float(terms.metrics["iw_mean"]) == pytest.approx(math.exp(0.01), rel=1e-5)  # float32 inputs


def test_low_precision_inputs_accumulate_in_fp32():
    b = make_batch(seed=5, dtype=torch.float64)
    log_eq64 = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    ref = gepo_token_losses(b.log_prob, b.old_log_prob, b.advantages, b.mask, log_eq64)
    bf = {k: getattr(b, k).to(torch.bfloat16) for k in ("log_prob", "old_log_prob", "advantages")}
    log_eq = group_log_expectation_from_tokens(bf["old_log_prob"], b.mask, b.group_ids)
    assert log_eq.dtype == torch.float32
    terms = gepo_token_losses(bf["log_prob"], bf["old_log_prob"], bf["advantages"], b.mask, log_eq)
    assert terms.token_losses.dtype == torch.float32
    torch.testing.assert_close(terms.metrics["iw_mean"].double(), ref.metrics["iw_mean"], rtol=2e-2, atol=0)


def test_sampler_kl_term_is_k3_and_adds_to_the_loss():
    b = make_batch(seed=7)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    base = gepo_token_losses(b.log_prob, b.old_log_prob, b.advantages, b.mask, log_eq)
    with_kl = gepo_token_losses(b.log_prob, b.old_log_prob, b.advantages, b.mask, log_eq, sampler_kl_coef=0.5)
    d = b.old_log_prob - b.log_prob
    k3 = torch.exp(d) - d - 1
    m = b.mask.bool()
    torch.testing.assert_close((with_kl.token_losses - base.token_losses)[m], 0.5 * k3[m])
    torch.testing.assert_close(k3_kl(b.log_prob, b.old_log_prob), k3)
    lengths = b.mask.sum(-1)
    expected_metric = ((k3 * b.mask).sum(-1) / lengths).mean()
    torch.testing.assert_close(base.metrics["sampler_kl"], expected_metric)
    assert (k3 >= 0).all()


def test_weight_metrics_match_numpy():
    b = make_batch(seed=11, spread=0.5)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    terms = gepo_token_losses(b.log_prob, b.old_log_prob, b.advantages, b.mask, log_eq)
    w = np.exp(sequence_log_prob(b.log_prob, b.mask).numpy() - log_eq.numpy())
    assert float(terms.metrics["iw_mean"]) == pytest.approx(w.mean())
    assert float(terms.metrics["iw_std"]) == pytest.approx(w.std())
    assert float(terms.metrics["iw_max"]) == pytest.approx(w.max())
    assert float(terms.metrics["ess"]) == pytest.approx(w.sum() ** 2 / (len(w) * (w**2).sum()))
    assert float(terms.metrics["log_ratio_cap_frac"]) == 0.0
    assert float(terms.metrics["log_iw_max"]) == pytest.approx(np.log(w).max())


@pytest.mark.parametrize("shift", [30.0, 500.0, 1e5])
def test_a_binding_cap_keeps_every_weight_statistic_finite_and_says_so(shift):
    """Raw weights far beyond float range: the loss uses exp(min(log w, cap)); its statistics stay finite and
    equal numpy's on the capped weights, and the share of sequences whose weight the cap replaced is reported."""
    b = make_batch(seed=3, spread=0.3)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    lifted = b.log_prob.clone()
    lifted[:3] += shift  # three sequences with astronomically large raw weights
    cap = 10.0
    terms = gepo_token_losses(lifted, b.old_log_prob, b.advantages, b.mask, log_eq, log_ratio_cap=cap)
    raw = sequence_log_prob(lifted.double(), b.mask).numpy() - log_eq.double().numpy()
    w = np.exp(np.minimum(raw, cap))
    for key, value in terms.metrics.items():
        assert math.isfinite(float(value)), key
    assert float(terms.metrics["iw_mean"]) == pytest.approx(w.mean())
    assert float(terms.metrics["iw_std"]) == pytest.approx(w.std())
    assert float(terms.metrics["iw_max"]) == pytest.approx(math.exp(cap))
    assert float(terms.metrics["ess"]) == pytest.approx(w.sum() ** 2 / (len(w) * (w**2).sum()))
    assert float(terms.metrics["log_ratio_cap_frac"]) == pytest.approx(np.mean(raw > cap)) and np.mean(raw > cap) > 0
    assert float(terms.metrics["log_iw_max"]) == pytest.approx(raw.max())
    assert torch.isfinite(terms.token_losses).all()


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan"), float("inf"), 81.0])
def test_log_ratio_caps_outside_the_finite_range_are_rejected(batch, cap):
    with pytest.raises(GEPOInputError, match="log_ratio_cap"):
        gepo_token_losses(**_args(batch), log_ratio_cap=cap)


# ---- bad input -------------------------------------------------------------------------------


def _args(b):
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    return dict(
        log_prob=b.log_prob.clone(),
        old_log_prob=b.old_log_prob.clone(),
        advantages=b.advantages.clone(),
        response_mask=b.mask.clone(),
        log_group_expectation=log_eq,
    )


@pytest.mark.parametrize("field", ["log_prob", "old_log_prob", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_at_unmasked_positions_are_rejected(batch, field, bad):
    args = _args(batch)
    args[field][0, 0] = bad
    with pytest.raises(GEPOInputError, match=f"{field} has 1 non-finite"):
        gepo_token_losses(**args)


def test_non_finite_values_in_padding_are_reported_as_corrupt_padding(batch):
    args = _args(batch)
    row = int(torch.argmin(batch.mask.sum(-1)))
    assert not batch.mask[row].all(), "the fixture must have a padded position"
    col = int(batch.mask[row].sum())
    args["log_prob"][row, col] = float("nan")
    with pytest.raises(GEPOInputError, match="padded positions"):
        gepo_token_losses(**args)


def test_a_micro_batch_without_any_response_token_gives_a_zero_loss_and_zero_totals(batch):
    """verl's padding rows can fill a whole micro-batch: nothing to train on, nothing to report, no error."""
    args = _args(batch)
    args["response_mask"] = torch.zeros_like(args["response_mask"])
    args["log_prob"] = args["log_prob"].clone().requires_grad_()
    terms = gepo_token_losses(**args)
    assert terms.metrics == {} and not terms.row_valid.any()
    assert set(terms.totals.values()) == {0.0}
    assert torch.count_nonzero(terms.token_losses) == 0
    (grad,) = torch.autograd.grad(terms.token_losses.sum(), args["log_prob"])
    assert torch.count_nonzero(grad) == 0


def test_mismatched_shapes_are_rejected(batch):
    args = _args(batch)
    args["advantages"] = args["advantages"][:, :-1]
    with pytest.raises(GEPOInputError, match="one shape"):
        gepo_token_losses(**args)
    args = _args(batch)
    args["log_group_expectation"] = args["log_group_expectation"][:-1]
    with pytest.raises(GEPOInputError, match="one value per response"):
        gepo_token_losses(**args)


@pytest.mark.parametrize("low,high", [(-0.1, 0.2), (0.2, -0.1), (1.0, 0.2), (float("nan"), 0.2), (0.2, float("inf"))])
def test_impossible_clip_ranges_are_rejected(batch, low, high):
    with pytest.raises(GEPOInputError, match="clip"):
        gepo_token_losses(**_args(batch), clip_ratio_low=low, clip_ratio_high=high)


def test_negative_kl_coefficient_is_rejected(batch):
    with pytest.raises(GEPOInputError, match="sampler_kl_coef"):
        gepo_token_losses(**_args(batch), sampler_kl_coef=-1.0)


def test_empty_real_response_is_rejected_but_padding_rows_are_skipped(batch):
    mask = batch.mask.clone()
    mask[0] = 0
    with pytest.raises(GEPOInputError, match="empty"):
        group_log_expectation_from_tokens(batch.old_log_prob, mask, batch.group_ids)
    valid = torch.ones(mask.shape[0], dtype=torch.bool)
    valid[0] = False
    log_eq = group_log_expectation_from_tokens(batch.old_log_prob, mask, batch.group_ids, valid=valid)
    assert log_eq[0] == 0 and torch.isfinite(log_eq).all()
    # the other members' term ignores the padding row
    others = [i for i in range(1, mask.shape[0]) if batch.group_ids[i] == batch.group_ids[0]]
    if others:
        s = sequence_log_prob(batch.old_log_prob, batch.mask)[others]
        expected = torch.logsumexp(2 * s, 0) - torch.logsumexp(s, 0)
        torch.testing.assert_close(log_eq[others[0]], expected)


def test_missing_or_malformed_group_ids_are_rejected(batch):
    with pytest.raises(GroupIdError, match="missing"):
        group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, None)
    ids = batch.group_ids.copy()
    ids[1] = None
    with pytest.raises(GroupIdError, match="None"):
        group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, ids)
    with pytest.raises(GEPOInputError, match="group ids for"):
        group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, batch.group_ids[:-1])
