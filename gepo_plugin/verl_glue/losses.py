"""GEPO and GEPO+ registered as verl policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode=gepo|gepo_plus``).

The maths is :func:`gepo_plugin.maths.gepo_token_losses` (GEPO+'s denominator rule:
:mod:`gepo_plugin.maths.gepo_plus`); this module only adapts verl's
calling convention, reads the trainer-computed group term, aggregates with verl's
``agg_loss`` (so the loss is invariant to data-parallel size and micro-batch split) and names
the metrics for verl's tracker.

The weight statistics that are means over sequences (``iw_mean``, ``iw_std``, ``ess``, ``clipfrac``, ...) are
reported as additive totals (``actor/gepo/step_totals/*``, summed over micro-batches and ranks) and turned into the
step's exact means by :func:`finalize_gepo_metrics`, which the plugin's trainers call after verl's actor update:
verl would average per-micro-batch means with equal weight, and a micro-batch made only of verl's padding rows has
no mean at all (:mod:`gepo_plugin.maths.gepo_metrics`). ``iw_max``, ``iw_min`` and ``log_iw_max`` aggregate as MAX/MIN;
such a micro-batch reports a value that never wins.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils.metric import Metric

from gepo_plugin import metric_names
from gepo_plugin.hetero.lag_buckets import BY_LAG, IS_BY_LAG, weight_sums_by_lag
from gepo_plugin.maths import GroupIndex, gepo_token_losses, group_log_expectation, sequence_log_prob
from gepo_plugin.maths.gepo_metrics import STEP_STATISTICS, STEP_TOTALS, TOTALS, stats_from_totals
from gepo_plugin.maths.gepo_plus import GEPOPlusRule
from gepo_plugin.maths.m2po import m2_masked_tokens
from gepo_plugin.maths.options import policy_loss_options
from gepo_plugin.verl_glue.m2_cap import cap_metrics, scoped_cap
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, RESPONSE_LAG, current_response_terms

GROUP_TERM_MISSING = (
    "GEPO's per-prompt group term (field '" + LOG_GROUP_EXPECTATION + "') did not reach the loss. verl's "
    "ppo_loss passes only five fields to a registered policy loss and splits prompt groups across ranks "
    "and micro-batches, so the plugin computes the term in the trainer, where groups are whole. Fix one of:\n"
    "  * launch with `python -m gepo_plugin.main_ppo algorithm.loss=gepo ...` (sets everything), or\n"
    "  * with `python -m verl.trainer.main_ppo`, also set `trainer.v1.trainer_mode=gepo_sync` "
    "(or gepo_colocate_async / gepo_separate_async) so the plugin's trainer computes and ships the term, or\n"
    "  * to reproduce the reference code's micro-batch-scoped 'group' instead, set "
    "`actor_rollout_ref.actor.policy_loss._target_=gepo_plugin.verl_glue.config.GEPOPolicyLossConfig "
    "+actor_rollout_ref.actor.policy_loss.group_scope=batch`."
)


class GroupTermMissingError(RuntimeError):
    """The gepo loss ran without the trainer-side group term."""


def _clip_range(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(low), float(high)


def resolve_log_group_expectation(
    old_log_prob: torch.Tensor, response_mask: torch.Tensor, group_scope: str
) -> torch.Tensor:
    """The per-row denominator ``log E_hat_q[q]`` for this micro-batch, by ``group_scope``."""
    if group_scope == "prompt":
        terms = current_response_terms()
        if LOG_GROUP_EXPECTATION not in terms:
            raise GroupTermMissingError(GROUP_TERM_MISSING)
        term = terms[LOG_GROUP_EXPECTATION].to(device=old_log_prob.device)
        if term.shape != (old_log_prob.shape[0],):
            raise GroupTermMissingError(
                f"the group term has shape {tuple(term.shape)} but the micro-batch has {old_log_prob.shape[0]} rows"
            )
        return term
    if group_scope == "batch":
        mask = response_mask.to(torch.bool)
        valid = mask.any(dim=-1)
        seq_log_q = sequence_log_prob(old_log_prob.to(torch.promote_types(old_log_prob.dtype, torch.float32)), mask)
        rows = old_log_prob.shape[0]
        index = GroupIndex(
            inverse=torch.zeros(rows, dtype=torch.int64, device=old_log_prob.device),
            num_groups=1,
            sizes=torch.tensor([rows], device=old_log_prob.device),
        )
        return group_log_expectation(seq_log_q, index, valid)
    raise ValueError(f"unknown group_scope {group_scope!r}; use 'prompt' or 'batch'")


@register_policy_loss("gepo")
def compute_policy_loss_gepo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GEPO policy loss for verl (arXiv 2508.17850); see :mod:`gepo_plugin.maths.gepo`.

    ``old_log_prob`` must be the sampler's log-probs for the weight to mean what the paper
    means (``algorithm.rollout_correction.bypass_mode=true``, set by the gepo preset).
    """
    return _gepo_family_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, plus=False
    )


@register_policy_loss("gepo_plus")
def compute_policy_loss_gepo_plus(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GEPO+ policy loss for verl: GEPO whose denominator each sequence's KL to the sampler chooses (hard) or mixes
    (soft) between its own ``q_i`` and ``E_hat_q[q]``; see :mod:`gepo_plugin.maths.gepo_plus`."""
    return _gepo_family_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, plus=True
    )


def _gepo_family_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
    plus: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    if config is None:
        raise ValueError("the gepo losses need the actor config (verl passes it as `config`)")
    options = policy_loss_options(config.policy_loss)
    group_scope = options.group_scope
    log_denominator = resolve_log_group_expectation(old_log_prob, response_mask, group_scope)
    low, high = _clip_range(config)
    terms = gepo_token_losses(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        log_group_expectation=log_denominator,
        clip_ratio_low=low,
        clip_ratio_high=high,
        sampler_kl_coef=options.sampler_kl_coef,
        log_ratio_cap=options.log_ratio_cap,
        plus=GEPOPlusRule(options.gepo_plus_mode, options.gepo_plus_kl_threshold) if plus else None,
    )
    token_losses = terms.token_losses
    m2_metrics: dict[str, float] = {}
    if options.m2_mask:  # M2PO's second-moment mask on GEPO's weights: no gradient where M2PO's clip would bind
        cap = scoped_cap(options, log_prob, old_log_prob, advantages, response_mask)
        masked = m2_masked_tokens(log_prob, old_log_prob, advantages, cap) & response_mask.to(torch.bool)
        token_losses = token_losses * (~masked).to(token_losses.dtype)
        tokens = max(int(response_mask.sum()), 1)
        m2_metrics = {**cap_metrics(cap), f"{metric_names.M2PO_LOSS}masked_frac": float(masked.sum()) / tokens}
    if rollout_is_weights is not None:
        token_losses = token_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=token_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    m = {key: float(value) for key, value in terms.metrics.items()}
    empty = not m  # verl's padding rows only: no sequence, a zero loss
    metrics: dict[str, Any] = {
        "actor/pg_clipfrac": m.get("token_clipfrac", 0.0),
        "actor/ppo_kl": m.get("ppo_kl", 0.0),
        "actor/pg_clipfrac_lower": 0.0,
        # MAX / MIN over micro-batches: a micro-batch without sequences reports a value that never wins
        f"{metric_names.GEPO_LOSS}iw_max": 0.0 if empty else m["iw_max"],
        f"{metric_names.GEPO_LOSS}iw_min": math.exp(options.log_ratio_cap) if empty else m["iw_min"],
        f"{metric_names.GEPO_LOSS}log_iw_max": -sys.float_info.max if empty else m["log_iw_max"],
        **m2_metrics,
    }
    for name in TOTALS:
        if plus or name != "own_sum":
            metrics[f"{metric_names.GEPO_LOSS}{STEP_TOTALS}{name}"] = terms.totals[name]
    metrics[f"{metric_names.GEPO_LOSS}group_term_present"] = 1.0 if group_scope == "prompt" else 0.0
    lags = current_response_terms().get(RESPONSE_LAG)
    if lags is not None and terms.log_weights is not None:
        # HeteroRL: the loss's weight and the sequence ratio p_i / q_i (the staleness guard's ESS/N) by staleness
        # bucket. Every bucket is reported in every micro-batch as additive totals (verl needs the same keys
        # everywhere); the trainer turns the step's totals into mean / var / ESS / fraction.
        lags = lags.to(terms.log_weights.device)
        for segment, log_w in ((BY_LAG, terms.log_weights), (IS_BY_LAG, terms.log_seq_ratios)):
            for label, entry in weight_sums_by_lag(log_w, lags, terms.row_valid).items():
                for field, value in entry.items():
                    metrics[f"{metric_names.GEPO_LOSS}{segment}{label}/{field}"] = value
    return pg_loss, metrics


def finalize_gepo_metrics(metrics: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Replace a step's ``actor/gepo/step_totals/*`` by the step's exact means (``actor/gepo/iw_mean``, ``iw_std``,
    ``ess``, ``clipfrac``, ``log_ratio_cap_frac``, ``sampler_kl``, and GEPO+'s ``own_denominator_frac``). In place."""
    prefix = metric_names.GEPO_LOSS + STEP_TOTALS
    totals = {key.removeprefix(prefix): float(metrics.pop(key)) for key in [k for k in metrics if k.startswith(prefix)]}
    if not totals:
        return metrics
    for name, value in stats_from_totals(totals).items():
        if name in STEP_STATISTICS and (name != "own_denominator_frac" or "own_sum" in totals):
            metrics[metric_names.GEPO_LOSS + name] = value
    return metrics


def step_metrics(micro_batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """One rank's metrics of a mini-batch from its micro-batches' metric dicts, aggregated as verl's engine does
    (each verl ``Metric`` by its own aggregation, plain values as a mean), then finalised
    (:func:`finalize_gepo_metrics`): for the demo, tests and benchmarks that drive ``ppo_loss`` themselves."""
    merged: dict[str, Any] = {}
    for metrics in micro_batches:
        for key, value in metrics.items():
            if isinstance(value, Metric):
                merged.setdefault(key, Metric(value.aggregation)).extend(value)
            else:
                merged.setdefault(key, []).append(float(value))
    reduced = {key: float(v.aggregate() if isinstance(v, Metric) else sum(v) / len(v)) for key, v in merged.items()}
    return dict(finalize_gepo_metrics(reduced))
