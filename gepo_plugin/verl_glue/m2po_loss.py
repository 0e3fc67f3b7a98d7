"""M2PO registered as a verl policy loss (``actor_rollout_ref.actor.policy_loss.loss_mode=m2po``; arXiv 2510.01161).

The maths is :mod:`gepo_plugin.maths.m2po` (the authors' arithmetic); this module adapts verl's calling convention,
takes the cap from the configured scope and aggregates with verl's ``agg_loss``. ``m2_scope=micro_batch`` computes
the cap over the micro-batch it is handed, as the authors' code does, so the result depends on how verl splits the
mini-batch; ``m2_scope=mini_batch`` (the default) reads the cap the mini-batch's pre-pass computed over every
micro-batch and rank (:mod:`gepo_plugin.verl_glue.m2po_mini_batch`), handed over as per-response fields.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from gepo_plugin import metric_names
from gepo_plugin.maths.m2po import NO_CAP, M2Cap, m2_cap, m2po_token_losses
from gepo_plugin.maths.options import PolicyLossOptions, policy_loss_options
from gepo_plugin.names import M2PO_LOSS
from gepo_plugin.verl_glue.response_terms import M2PO_CAP_FIELDS, current_response_terms

CAP_MISSING = (
    "M2PO's mini-batch cap (fields " + ", ".join(M2PO_CAP_FIELDS) + ") did not reach the loss: with "
    "policy_loss.m2_scope=mini_batch the plugin measures the second moment over the whole mini-batch before verl's "
    "update, which needs the plugin's launcher (`python -m gepo_plugin.main_ppo algorithm.loss=m2po ...`). Or set "
    "`actor_rollout_ref.actor.policy_loss.m2_scope=micro_batch` to take it over each micro-batch, as the authors' "
    "code does."
)


class MiniBatchCapMissingError(RuntimeError):
    """The m2po loss ran with ``m2_scope=mini_batch`` but without the pre-pass's cap."""


def mini_batch_cap(rows: int) -> M2Cap:
    """The cap the mini-batch's pre-pass handed over for this micro-batch's ``rows`` (the same in every row)."""
    terms = current_response_terms()
    if not all(name in terms for name in M2PO_CAP_FIELDS):
        raise MiniBatchCapMissingError(CAP_MISSING)
    values = [terms[name] for name in M2PO_CAP_FIELDS]
    if any(value.shape != (rows,) for value in values):
        raise MiniBatchCapMissingError(
            f"M2PO's mini-batch cap has shapes {[tuple(v.shape) for v in values]}, not {rows}"
        )
    tau, m2, m2_after, harmful = (float(value[0]) for value in values)
    return M2Cap(None if tau == NO_CAP else tau, m2, m2_after, int(harmful))


def scoped_cap(
    options: PolicyLossOptions,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> M2Cap:
    """M2PO's cap in the configured ``m2_scope``: the mini-batch pre-pass's, or this micro-batch's own."""
    if options.m2_scope == "mini_batch":
        return mini_batch_cap(old_log_prob.shape[0])
    return m2_cap(log_prob, old_log_prob, advantages, response_mask, options.m2_budget)


def cap_metrics(cap: M2Cap) -> dict[str, float]:
    """The cap's metrics (``actor/m2po/*``), reported by every loss that reads it."""
    return {
        f"{metric_names.M2PO_LOSS}m2": cap.m2,
        f"{metric_names.M2PO_LOSS}m2_after": cap.m2_after,
        f"{metric_names.M2PO_LOSS}cap_binds": 0.0 if cap.tau is None else 1.0,
        f"{metric_names.M2PO_LOSS}harmful_tokens": float(cap.harmful_tokens),
    }


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
    m2po preset), as the authors' runs store the log-probs of the policy that generated each batch.
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
