"""M2PO registered as a verl policy loss (``actor_rollout_ref.actor.policy_loss.loss_mode=m2po``; arXiv 2510.01161).

The maths is :mod:`gepo_plugin.maths.m2po` (the authors' arithmetic); this module adapts verl's calling convention,
takes the cap from the configured scope and aggregates with verl's ``agg_loss``. ``m2_scope=micro_batch`` computes
the cap over the micro-batch it is handed, as the authors' code does, so the result depends on how verl splits the
mini-batch; ``m2_scope=mini_batch`` (the default) reads the cap the mini-batch's pre-pass computed over every
micro-batch and rank (:mod:`gepo_plugin.verl_glue.m2po_mini_batch`), handed over as per-response fields and read
by :mod:`gepo_plugin.verl_glue.m2_cap`.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from gepo_plugin.maths.m2po import m2po_token_losses
from gepo_plugin.maths.options import policy_loss_options
from gepo_plugin.names import M2PO_LOSS
from gepo_plugin.verl_glue.m2_cap import cap_metrics, scoped_cap


@register_policy_loss(M2PO_LOSS)
def compute_policy_loss_m2po(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """M2PO's policy loss for verl: PPO's clipped surrogate (no dual clip) with the bounds exp(+-tau) that keep the
    harmful tokens' second moment within ``policy_loss.m2_budget``; verl's clip ratios are not read.

    ``old_log_prob`` must be the behaviour policy's log-probs (the sampler's: ``bypass_mode=true``, set by the
    m2po preset): the version that generated the batch, as in the authors' runs, where the training actor
    recomputes them right after generation (docs/losses.md, M2PO).
    """
    if config is None:
        raise ValueError("the m2po loss needs the actor config (verl passes it as `config`)")
    options = policy_loss_options(config.policy_loss)
    cap = scoped_cap(options, log_prob, old_log_prob, advantages, response_mask)
    token_losses, clipped = m2po_token_losses(log_prob, old_log_prob, advantages, cap.ratio_bounds())
    if rollout_is_weights is not None:
        token_losses = token_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=token_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    mask = response_mask.to(torch.bool)
    tokens = max(int(mask.sum()), 1)
    with torch.no_grad():
        ppo_kl = float(((old_log_prob - log_prob) * mask).sum()) / tokens
    metrics: dict[str, Any] = {
        "actor/pg_clipfrac": float((clipped & mask).sum()) / tokens,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": 0.0,
        **cap_metrics(cap),
    }
    return pg_loss, metrics
