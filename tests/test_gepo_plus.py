"""GEPO+ (the authors' adaptive denominator): its rule, its loss through verl's real ppo_loss against a float64 loop
reference with prompt groups scattered over micro-batches, and the authors' own arithmetic when configured as
theirs (a micro-batch 'group', the hard gate)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_batch

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.maths.gepo_plus import GEPOPlusRule
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config, loss_over_micro_batches
from gepo_plugin.verl_glue.losses import step_metrics
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms

SCATTERED = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]


def sequence_kls(log_prob, old_log_prob, mask) -> list[float]:
    """Sequence-mean k3 KL, one token at a time: mean_t exp(q - p) - (q - p) - 1."""
    out = []
    for i in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
        deltas = [float(old_log_prob[i, t] - log_prob[i, t]) for t in tokens]
        out.append(sum(math.exp(d) - d - 1 for d in deltas) / len(tokens))
    return out


def gepo_plus_reference(log_prob, old_log_prob, advantages, mask, group_ids, threshold, mode, eps=0.2):
    """seq-mean-token-mean GEPO+ loss, one sequence at a time (float64, autograd through p_i only)."""
    batch = mask.shape[0]
    lengths = [int(mask[i].sum()) for i in range(batch)]
    q = [math.exp(sum(float(old_log_prob[i, t]) for t in range(lengths[i])) / lengths[i]) for i in range(batch)]
    members: dict = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    expectation = {i: sum(q[j] ** 2 for j in m) / sum(q[j] for j in m) for m in members.values() for i in m}
    kls = sequence_kls(log_prob.detach(), old_log_prob, mask)
    per_seq, shares = [], []
    for i in range(batch):
        share = float(kls[i] < threshold) if mode == "hard" else min(1.0, max(0.0, math.exp(-kls[i] / threshold)))
        shares.append(share)
        denominator = (1 - share) * expectation[i] + share * q[i]
        w = torch.exp(sum(log_prob[i, t] for t in range(lengths[i])) / lengths[i]) / denominator
        a = advantages[i, 0]
        per_seq.append(torch.maximum(-a * w, -a * torch.clamp(w, 1 - eps, 1 + eps)))
    return sum(per_seq) / batch, shares


def run_verl_micro_batches(config, b, micro_batches):
    """The loss summed over micro-batches, each through verl's ppo_loss as the engine calls it, and its gradient."""
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)  # trainer side: whole groups
    fields = {LOG_GROUP_EXPECTATION: log_eq}
    return loss_over_micro_batches(config, b.log_prob, b.old_log_prob, b.advantages, b.mask, micro_batches, fields)


def median_kl_threshold(b) -> float:
    """A threshold between two sequences' KLs, so both branches are taken."""
    kls = sorted(sequence_kls(b.log_prob, b.old_log_prob, b.mask))
    return (kls[len(kls) // 2 - 1] + kls[len(kls) // 2]) / 2


def gepo_plus_config(mode: str, threshold: float, *extra: str):
    return compose_actor_config(
        [
            "strategy=fsdp2",
            "ppo_micro_batch_size_per_gpu=4",
            "clip_ratio_low=0.2",
            "clip_ratio_high=0.2",
            "loss_agg_mode=seq-mean-token-mean",
            "policy_loss.loss_mode=gepo_plus",
            f"policy_loss.gepo_plus_mode={mode}",
            f"policy_loss.gepo_plus_kl_threshold={threshold!r}",
            *extra,
        ]
    )


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gepo_plus_through_verls_ppo_loss_matches_the_float64_reference_with_groups_scattered(mode, seed):
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=seed, spread=0.3)
    threshold = median_kl_threshold(b)
    config = gepo_plus_config(mode, threshold)
    loss, grad, metrics = run_verl_micro_batches(config, b, SCATTERED)

    ref_logp = b.log_prob.clone().requires_grad_()
    ref, shares = gepo_plus_reference(ref_logp, b.old_log_prob, b.advantages, b.mask, b.group_ids, threshold, mode)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    # both denominators are in use, and the metric is the share on q_i over the step's sequences
    assert 0 < sum(shares) < len(shares)
    reported = step_metrics(metrics)["actor/gepo/own_denominator_frac"]
    assert reported == pytest.approx(sum(shares) / len(shares), rel=1e-12)


def test_gepo_plus_is_neither_gepo_nor_gspo_and_becomes_each_at_the_threshold_extremes():
    """A tiny threshold sends every sequence to E_hat_q[q] (GEPO); a huge one to its own q_i (GSPO's weight)."""
    b = make_batch(group_sizes=(4, 4, 4, 4), seed=3, spread=0.3)
    base = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4", "clip_ratio_low=0.2", "clip_ratio_high=0.2"]
    base.append("loss_agg_mode=seq-mean-token-mean")
    gepo = compose_actor_config([*base, "policy_loss.loss_mode=gepo"])
    gepo_loss, gepo_grad, _ = run_verl_micro_batches(gepo, b, SCATTERED)
    low_loss, low_grad, _ = run_verl_micro_batches(gepo_plus_config("hard", 1e-300), b, SCATTERED)
    torch.testing.assert_close(low_grad, gepo_grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(low_loss, gepo_loss, rtol=1e-12, atol=1e-14)

    high_loss, _, metrics = run_verl_micro_batches(gepo_plus_config("hard", 1e300), b, SCATTERED)
    assert step_metrics(metrics)["actor/gepo/own_denominator_frac"] == 1.0
    # GSPO's seq-mean-token-mean loss with the sequence's own q_i: -min(w A, clip(w) A), w = p_i / q_i
    lengths = b.mask.sum(-1)
    w = torch.exp(((b.log_prob - b.old_log_prob) * b.mask).sum(-1) / lengths)
    a = b.advantages[:, 0]
    gspo = torch.maximum(-a * w, -a * w.clamp(0.8, 1.2)).mean()
    torch.testing.assert_close(high_loss, gspo, rtol=1e-10, atol=1e-12)
    mid_loss, _, _ = run_verl_micro_batches(gepo_plus_config("hard", median_kl_threshold(b)), b, SCATTERED)
    assert abs(float(mid_loss - gepo_loss)) > 1e-6 and abs(float(mid_loss - gspo)) > 1e-6


def test_the_authors_arithmetic_when_configured_as_theirs():
    """Their loss (probability space, E_hat_q[q] = sum q^2 / sum q over the micro-batch the loss sees, the gate
    KL_i < kl_temp on the sequence-mean k3 KL, -min(coef_1 A, coef_2 A) averaged over sequences), written here from
    their formulas, equals the plugin's with group_scope=batch on one micro-batch: loss and gradient."""
    b = make_batch(group_sizes=(8,), seed=5, spread=0.3, min_length=2)
    threshold = median_kl_threshold(b)
    config = gepo_plus_config("hard", threshold, "policy_loss.group_scope=batch")
    logp = b.log_prob.clone().requires_grad_()
    model_output, data = build_loss_inputs(
        logp, b.old_log_prob, b.advantages, b.mask, {}, batch_num_tokens=int(b.mask.sum()), global_batch_size=8
    )
    loss, _ = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
    (grad,) = torch.autograd.grad(loss, logp)

    theirs_logp = b.log_prob.clone().requires_grad_()
    mask = b.mask.to(torch.float64)
    length = mask.sum(dim=1).clamp(min=1.0)
    token_kl = torch.exp(b.old_log_prob - theirs_logp) - (b.old_log_prob - theirs_logp) - 1
    seq_kl = (token_kl * mask).sum(-1) / length
    learner_p = ((theirs_logp * mask).sum(dim=1) / length).exp()
    sampler_p = ((b.old_log_prob * mask).sum(dim=1) / length).exp()
    normalised_q = sampler_p.detach() / sampler_p.sum().detach()
    expectation = (normalised_q * sampler_p).sum()
    gate = (seq_kl < threshold).to(seq_kl.dtype)  # their .float(), kept in float64 for the comparison
    coef_1 = learner_p / ((1 - gate) * expectation + gate * sampler_p)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    advantages = b.advantages[:, 0]
    theirs = (-torch.min(coef_1 * advantages, coef_2 * advantages)).mean()
    (their_grad,) = torch.autograd.grad(theirs, theirs_logp)
    assert 0 < float(gate.sum()) < 8
    torch.testing.assert_close(loss, theirs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)


def test_the_rule_in_log_space_equals_the_direct_mixture():
    log_e = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=torch.float64)
    log_q = torch.tensor([-1.2, -1.0, -0.7, -2.5, -1.5], dtype=torch.float64)
    kl = torch.tensor([0.0, 0.001, 0.002, 0.05, 1.0], dtype=torch.float64)
    soft = GEPOPlusRule("soft", 0.002)
    log_d, share = soft.log_denominator(log_e, log_q, kl)
    g = torch.exp(-kl / 0.002)
    torch.testing.assert_close(log_d, torch.log((1 - g) * log_e.exp() + g * log_q.exp()), rtol=1e-12, atol=1e-14)
    assert float(share[0]) == 1.0 and float(log_d[0]) == float(log_q[0])  # no KL: the sequence's own q_i
    hard = GEPOPlusRule("hard", 0.002)
    log_d, share = hard.log_denominator(log_e, log_q, kl)
    assert share.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]  # strictly below the threshold, as the authors' gate
    torch.testing.assert_close(log_d, torch.where(share > 0, log_q, log_e))
    with pytest.raises(ValueError, match="kl_threshold"):
        GEPOPlusRule("hard", 0.0)
    with pytest.raises(ValueError, match="mode"):
        GEPOPlusRule("medium", 0.002)  # type: ignore[arg-type]
