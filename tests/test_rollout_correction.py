"""verl's rollout correction beside the plugin's losses: what the lab computes with verl's function, and what the
launcher refuses because verl 0.9.1's V1 trainers would ignore it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from gepo_plugin.launch import compose_config, plan_launch
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.rollout_correction import correct, lab_preset

RESPONSES = "actor_rollout_ref.rollout.n=4"


def test_the_labs_correction_is_verls_truncated_sequence_weight_of_the_learner_over_the_sampler():
    b = make_batch(group_sizes=(4, 4), seed=6, spread=0.2)
    mask = b.mask
    weights, kept, metrics = correct(b.log_prob, b.old_log_prob, mask, lab_preset("decoupled_seq_is"))
    expected = torch.exp(((b.log_prob - b.old_log_prob) * mask).sum(-1)).clamp(max=2.0)  # pi_old / pi_rollout
    torch.testing.assert_close(weights, expected[:, None] * mask, rtol=1e-6, atol=1e-9)
    assert torch.equal(kept, mask)  # no rejection in this preset
    assert metrics["rollout_corr/rollout_is_max"] <= 2.0


def test_a_rejection_preset_masks_the_sequences_too_far_from_the_sampler():
    b = make_batch(group_sizes=(4, 4), seed=6, spread=0.2)
    _, kept, _ = correct(b.log_prob, b.old_log_prob, b.mask, lab_preset("decoupled_k3_rs"))
    log_ratio = b.log_prob - b.old_log_prob  # verl's k3 of the sampler against pi_old, per sequence mean
    k3 = ((torch.exp(-log_ratio) - 1 + log_ratio) * b.mask).sum(-1) / b.mask.sum(-1)
    rejected = k3 > 0.01
    assert rejected.any() and (~rejected).any()
    assert torch.all(kept[rejected] == 0) and torch.equal(kept[~rejected], b.mask[~rejected])


def settle(*overrides):
    return plan_launch(compose_config(overrides), list(overrides))


@pytest.mark.parametrize("loss", ["gepo", "m2po", "grpo"])
def test_a_correction_that_bypass_mode_would_ignore_is_refused_naming_the_key(loss):
    bypass = [] if loss != "grpo" else ["algorithm.rollout_correction.bypass_mode=true"]
    with pytest.raises(PluginConfigError, match=r"rollout_is=sequence with algorithm.rollout_correction.bypass_mode"):
        settle(f"algorithm.loss={loss}", RESPONSES, *bypass, "algorithm.rollout_correction.rollout_is=sequence")
    with pytest.raises(PluginConfigError, match=r"rollout_rs=seq_mean_k3"):
        settle(
            f"algorithm.loss={loss}",
            RESPONSES,
            *bypass,
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.01",
        )


def test_gepo_with_verls_decoupled_correction_starts_and_says_what_q_becomes():
    plan = settle(
        "algorithm.loss=gepo",
        RESPONSES,
        "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is=sequence",
    )
    assert plan.config.algorithm.rollout_correction.rollout_is == "sequence"
    assert any("q is the recomputed old policy" in warning for warning in plan.warnings)


@pytest.mark.parametrize("loss_mode", ["gepo", "gepo_plus", "m2po"])
def test_verls_weights_scale_each_token_of_the_plugins_losses(loss_mode):
    """verl's ppo_loss hands the decoupled weights to the registered loss: a row weighted 0 gets no gradient, the
    other rows keep theirs, and a constant weight scales the loss (through verl's real ppo_loss)."""
    from gepo_plugin.maths import group_log_expectation_from_tokens
    from gepo_plugin.maths.m2po import m2_cap
    from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config
    from gepo_plugin.verl_glue.m2po_mini_batch import cap_fields
    from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms

    b = make_batch(group_sizes=(4, 4), seed=8, spread=0.3)
    config = compose_actor_config(
        ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=2", f"policy_loss.loss_mode={loss_mode}"]
    )
    advantages = b.advantages * b.mask
    terms = {LOG_GROUP_EXPECTATION: group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)}
    terms.update(cap_fields(m2_cap(b.log_prob, b.old_log_prob, advantages, b.mask, 0.04), len(b.group_ids)))

    def loss_and_grad(weights):
        logp = b.log_prob.clone().requires_grad_()
        extra = {**terms} if weights is None else {**terms, "rollout_is_weights": weights}
        model_output, data = build_loss_inputs(logp, b.old_log_prob, advantages, b.mask, extra)
        loss, _ = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
        return loss, torch.autograd.grad(loss, logp)[0]

    loss, grad = loss_and_grad(None)
    halved, half_grad = loss_and_grad(torch.full_like(b.mask, 0.5, dtype=b.log_prob.dtype))
    torch.testing.assert_close(halved, loss / 2, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(half_grad, grad / 2, rtol=1e-12, atol=1e-15)
    dropped = torch.tensor([True, False] * 4)
    weights = torch.ones_like(b.mask, dtype=b.log_prob.dtype)
    weights[dropped] = 0.0
    _, dropped_grad = loss_and_grad(weights)
    assert torch.all(dropped_grad[dropped] == 0) and grad[dropped].abs().max() > 0
    torch.testing.assert_close(dropped_grad[~dropped], grad[~dropped], rtol=1e-12, atol=1e-15)
