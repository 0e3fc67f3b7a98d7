"""GEPO: Group Expectation Policy Optimization (arXiv 2508.17850), as plain torch functions.

For a prompt x with responses y_1..y_G (one *group*), sampler policy q and learner p_theta::

    s_j      = (1/|y_j|) sum_t log q(y_j,t | ...)          length-normalised sequence log-prob
    log E_q  = logsumexp_j(2 s_j) - logsumexp_j(s_j)         log of sum_j q_j^2 / sum_j q_j
    w_i      = exp( (1/|y_i|) sum_t log p_theta(y_i,t) - log E_q )
    L        = - mean_i min(w_i A_i, clip(w_i, 1 - eps_low, 1 + eps_high) A_i)

The denominator depends on the sampler's log-probs only, so it is a per-group constant that
can be computed once, wherever whole groups are visible (verl's trainer process), and shipped
per sample to wherever the loss runs. Everything is done in log space, so sequence length
does not matter, and in at least float32 whatever the input dtype.

The per-token loss uses a GSPO-style straight-through ratio
``r_i,t = sg[w_i] * p_t / sg[p_t]``: its value is ``w_i`` on every token of sequence i, and its
gradient is ``w_i * d log p_t``. Under ``seq-mean-token-mean`` aggregation the gradient is
exactly ``A_i * d w_i`` (paper eq. 5); the other verl aggregation modes weight tokens as they
do for GSPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gepo_plugin.maths.gepo_metrics import gepo_metrics, step_totals
from gepo_plugin.maths.gepo_plus import GEPOPlusRule
from gepo_plugin.maths.groups import GroupIndex, segment_logsumexp, segment_sum
from gepo_plugin.maths.options import MAX_LOG_RATIO_CAP, POLICY_LOSS_DEFAULTS


class GEPOInputError(ValueError):
    """Inputs to a GEPO function are malformed or non-finite."""


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 if any input is float64."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


HINTS = {
    "log_prob": "The learner produced NaN/inf log-probs: check the model's logits and dtype.",
    "old_log_prob": "The sampler/old log-probs are NaN/inf: check rollout.calculate_log_probs and the rollout backend.",
    "advantages": "Check the reward function and the advantage estimator.",
}


def _describe_non_finite(name: str, values: torch.Tensor, mask: torch.Tensor) -> str | None:
    """Where ``values`` is non-finite, said plainly; None if it is finite everywhere."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    unmasked = bad & mask
    if bool(unmasked.any()):
        first = unmasked.nonzero()[0].tolist()
        return (
            f"{name} has {int(unmasked.sum())} non-finite value(s) at unmasked positions (first at index {first}). "
            f"{HINTS.get(name, '')}"
        )
    first = bad.nonzero()[0].tolist()
    return (
        f"{name} has {int(bad.sum())} non-finite value(s) in padded positions (first at index {first}); "
        "padding must hold finite values (verl pads with 0): the input batch is corrupt."
    )


def raise_non_finite(tensors: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """Diagnose which input is non-finite and raise :class:`GEPOInputError` (the slow path)."""
    for name, values in tensors.items():
        message = _describe_non_finite(name, values, mask)
        if message:
            raise GEPOInputError(message)
    raise GEPOInputError("the GEPO loss is non-finite although its inputs are finite (overflow?)")


def validate_shapes(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> None:
    """Four ``[batch, response_len]`` tensors of one shape; raises :class:`GEPOInputError`."""
    shapes = {
        "log_prob": tuple(log_prob.shape),
        "old_log_prob": tuple(old_log_prob.shape),
        "advantages": tuple(advantages.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if len(set(shapes.values())) != 1 or log_prob.dim() != 2:
        raise GEPOInputError(f"expected four [batch, response_len] tensors of one shape, got {shapes}")


def sequence_log_prob(token_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence log-prob ``(1/|y|) sum_t log p_t`` -> ``[B]``.

    Rows without any unmasked token give 0. A non-finite value anywhere in a row (padding
    included) makes that row's result non-finite, which callers check cheaply on ``[B]``.
    """
    mask = response_mask.to(token_log_probs.dtype)
    lengths = mask.sum(dim=-1)
    return (token_log_probs * mask).sum(dim=-1) / lengths.clamp(min=1)


def group_log_expectation(
    seq_log_q: torch.Tensor,
    group_index: GroupIndex,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row ``log E_hat_q[q]`` of the row's group: ``logsumexp(2 s) - logsumexp(s)`` -> ``[B]``.

    Args:
        seq_log_q: ``[B]`` length-normalised sampler log-probs (:func:`sequence_log_prob`).
        group_index: the prompt group of every row.
        valid: ``[B]`` bool; rows set False (e.g. verl's padding rows) are left out of every
            group's sums and receive 0. A group without any valid row (verl's padding rows share one
            uid of their own) has no expectation: its rows receive 0 and carry no weight in the loss.
    """
    if seq_log_q.dim() != 1 or seq_log_q.shape[0] != group_index.inverse.shape[0]:
        raise GEPOInputError(
            f"seq_log_q has shape {tuple(seq_log_q.shape)} but there are {group_index.inverse.shape[0]} group ids"
        )
    if valid is None:
        valid = torch.ones_like(seq_log_q, dtype=torch.bool)
    if not bool(torch.isfinite(seq_log_q[valid]).all()):
        raise GEPOInputError("sequence log-probs of the sampler are non-finite: check the rollout log-probs")
    dtype = compute_dtype(seq_log_q)
    s = seq_log_q.to(dtype)
    lse_2s = segment_logsumexp(2.0 * s, group_index, valid)
    lse_s = segment_logsumexp(s, group_index, valid)
    per_group = lse_2s - lse_s
    has_valid = segment_sum(valid.to(s.dtype), group_index) > 0
    if not bool(torch.isfinite(per_group[has_valid]).all()):
        raise GEPOInputError("GEPO's group expectation overflowed for a group with valid responses")
    return torch.where(valid, per_group[group_index.inverse], torch.zeros_like(s))


def group_log_expectation_from_tokens(
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Convenience: token-level sampler log-probs + group ids (or their
    :class:`~gepo_plugin.maths.groups.GroupIndex`) -> per-row ``log E_hat_q[q]``.

    Non-padding rows must have at least one response token; an empty real response is an error.
    """
    if old_log_prob.shape != response_mask.shape or old_log_prob.dim() != 2:
        raise GEPOInputError(
            f"old_log_prob {tuple(old_log_prob.shape)} and response_mask {tuple(response_mask.shape)} "
            "must be one [B, T] shape"
        )
    dtype = compute_dtype(old_log_prob)
    fmask = response_mask.to(dtype)
    lengths = fmask.sum(dim=-1)
    if valid is None:
        valid = torch.ones(fmask.shape[0], dtype=torch.bool, device=fmask.device)
    empty_real = (lengths == 0) & valid
    if bool(empty_real.any()):
        rows = empty_real.nonzero().flatten().tolist()[:8]
        raise GEPOInputError(
            f"{int(empty_real.sum())} response(s) are empty (rows {rows}): a response with no token has no "
            "sequence probability. Drop them before training or mark them as padding."
        )
    index = group_ids if isinstance(group_ids, GroupIndex) else GroupIndex.from_ids(group_ids, old_log_prob.device)
    if index.inverse.shape[0] != fmask.shape[0]:
        raise GEPOInputError(f"{index.inverse.shape[0]} group ids for {fmask.shape[0]} responses")
    s = (old_log_prob.to(dtype) * fmask).sum(dim=-1) / lengths.clamp(min=1)
    if not bool(torch.isfinite(s[valid]).all()):
        raise_non_finite({"old_log_prob": old_log_prob[valid]}, response_mask[valid].to(torch.bool))
    return group_log_expectation(s, index, valid)


@dataclass
class GEPOLossTerms:
    """Per-token loss matrix (before aggregation) and detached diagnostics."""

    token_losses: torch.Tensor
    metrics: dict[str, torch.Tensor]
    #: detached per-sequence log of the weight the loss uses, ``min(log w_i, log_ratio_cap)``
    log_weights: torch.Tensor | None = None
    #: rows that hold a response
    row_valid: torch.Tensor | None = None
    #: detached per-sequence ``log(p_i / q_i)`` (length-normalised), 0 on-policy: staleness's own measure
    log_seq_ratios: torch.Tensor | None = None
    #: additive totals over the non-empty sequences (:func:`~gepo_plugin.maths.gepo_metrics.step_totals`): what a
    #: training step's exact statistics are made of
    totals: dict[str, float] | None = None


def k3_kl(log_prob: torch.Tensor, sampler_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(p || q): ``exp(q - p) - (q - p) - 1`` (non-negative)."""
    delta = torch.clamp(sampler_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.exp(delta) - delta - 1.0


def check_clip_range(
    low: float | None, high: float | None, prefix: str = "", error: type[Exception] = GEPOInputError
) -> None:
    """The one rule for the clip range ``[1 - low, 1 + high]`` of ``w``, at start-up and in the loss: both finite
    and ``>= 0``, ``low < 1``. ``None``: not set here, not checked; ``prefix``: where the keys live in a config."""
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if value is None:
            continue
        if not math.isfinite(float(value)):
            raise error(f"{prefix}{name}={value}: must be a finite number")
        if float(value) < 0:
            raise error(f"{prefix}{name}={value}: must be >= 0 (the clip range is 1-low .. 1+high)")
    if low is not None and float(low) >= 1:
        raise error(f"{prefix}clip_ratio_low={low}: must be < 1 (the lower bound is 1 - low)")


def gepo_token_losses(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    log_group_expectation: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    sampler_kl_coef: float = POLICY_LOSS_DEFAULTS.sampler_kl_coef,
    log_ratio_cap: float = POLICY_LOSS_DEFAULTS.log_ratio_cap,
    plus: GEPOPlusRule | None = None,
) -> GEPOLossTerms:
    """GEPO's clipped surrogate per token, plus the optional k3 KL toward the sampler.

    Args:
        log_prob: ``[B, T]`` learner log-probs (with grad).
        old_log_prob: ``[B, T]`` sampler log-probs q (used only by the KL term and metrics).
        advantages: ``[B, T]`` advantages (constant along a sequence for outcome rewards).
        response_mask: ``[B, T]`` 1 on response tokens.
        log_group_expectation: ``[B]`` ``log E_hat_q[q]`` of each row's group.
        clip_ratio_low, clip_ratio_high: the clip range ``[1 - low, 1 + high]`` of ``w``.
        sampler_kl_coef: weight of ``k3(p || q)`` per token (the paper's async runs: 0.005).
        log_ratio_cap: upper cap of ``log w`` (as verl's GSPO), for numerical safety.
        plus: GEPO+ (:mod:`gepo_plugin.maths.gepo_plus`): each sequence's denominator is chosen (hard) or mixed
            (soft) between its own ``q_i`` and ``E_hat_q[q]`` by its KL to the sampler; None is GEPO.

    Returns:
        :class:`GEPOLossTerms` whose ``token_losses`` is to be aggregated with verl's
        ``agg_loss`` (or any other aggregation) over ``response_mask``.
    """
    check_clip_range(clip_ratio_low, clip_ratio_high)
    if sampler_kl_coef < 0:
        raise GEPOInputError(f"sampler_kl_coef must be >= 0, got {sampler_kl_coef}")
    if not 0 < log_ratio_cap <= MAX_LOG_RATIO_CAP:
        raise GEPOInputError(f"log_ratio_cap must be in (0, {MAX_LOG_RATIO_CAP}], got {log_ratio_cap}")
    validate_shapes(log_prob, old_log_prob, advantages, response_mask)
    if log_group_expectation.shape != (log_prob.shape[0],):
        raise GEPOInputError(
            f"log_group_expectation must have shape [{log_prob.shape[0]}] (one value per response), "
            f"got {tuple(log_group_expectation.shape)}"
        )
    dtype = compute_dtype(log_prob, old_log_prob)
    fmask = response_mask.to(dtype)
    lengths = fmask.sum(dim=-1)
    row_valid = lengths > 0
    if not bool(row_valid.any()):
        return _no_sequence(log_prob, dtype, row_valid, log_ratio_cap, plus)
    logp = log_prob.to(dtype)
    logq = old_log_prob.to(dtype)
    adv = advantages.to(dtype)

    with torch.no_grad():
        # the weight's value only: its gradient reaches each token through the straight-through term below, so the
        # sequence sums need no autograd graph (dot products per row, no [B, T] product tensor)
        seq_log_p = torch.linalg.vecdot(logp.detach(), fmask) / lengths.clamp(min=1)
        # log q - log p per token; k3 = exp(d) - d - 1, so its row sum reuses sum(d). One [B, T] buffer, freed
        # before the loss's own tensors exist; exp runs in place.
        neg_log_ratio = logq - logp.detach()
        seq_neg_log_ratio = torch.linalg.vecdot(neg_log_ratio, fmask)
        seq_exp = torch.linalg.vecdot(neg_log_ratio.exp_(), fmask)  # inf only if q/p > e^88: an honest metric
        del neg_log_ratio
        seq_kl = seq_exp - seq_neg_log_ratio - lengths
        log_denominator, own_share = log_group_expectation.to(dtype), None
        if plus is not None:
            seq_log_q = torch.linalg.vecdot(logq, fmask) / lengths.clamp(min=1)
            log_denominator, own_share = plus.log_denominator(log_denominator, seq_log_q, seq_kl / lengths.clamp(min=1))
        log_w = seq_log_p - log_denominator
    # straight-through: value log_w on every token, gradient d log p_t (as verl's GSPO)
    log_ratio = torch.clamp(logp - logp.detach() + log_w.detach().unsqueeze(-1), max=log_ratio_cap)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -adv * ratio
    losses_clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    token_losses = torch.maximum(losses_unclipped, losses_clipped)
    if sampler_kl_coef > 0:
        token_losses = token_losses + sampler_kl_coef * k3_kl(logp, logq)

    with torch.no_grad():
        # one cheap check covers every token of every input: 0 * NaN = NaN in these sums
        checks = torch.stack([log_w, seq_neg_log_ratio, token_losses.detach().sum().expand_as(log_w)])
        if not bool(torch.isfinite(checks).all()):
            raise_non_finite(
                {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages},
                response_mask.to(torch.bool),
            )
        if not bool(torch.isfinite(log_group_expectation[row_valid]).all()):
            raise GEPOInputError("the group term log E_hat_q[q] is non-finite for some response")
        clipped = losses_clipped > losses_unclipped  # bool [B, T]: a quarter of a float buffer
        clipped_tokens = clipped.logical_and_(fmask > 0).sum(dim=-1).to(dtype)
        del clipped
        log_w = log_w.detach()
        metrics = gepo_metrics(log_w, log_ratio_cap, lengths, row_valid, clipped_tokens, seq_kl, seq_neg_log_ratio)
        if own_share is not None:
            metrics["own_denominator_frac"] = own_share[row_valid].double().mean()
        totals = step_totals(log_w, log_ratio_cap, lengths, row_valid, clipped_tokens, seq_kl, own_share)
    capped = torch.clamp(log_w, max=log_ratio_cap)
    log_seq_ratios = -seq_neg_log_ratio / lengths.clamp(min=1)
    return GEPOLossTerms(
        token_losses=token_losses,
        metrics=metrics,
        log_weights=capped,
        row_valid=row_valid,
        log_seq_ratios=log_seq_ratios,
        totals=totals,
    )


def _no_sequence(
    log_prob: torch.Tensor, dtype: torch.dtype, row_valid: torch.Tensor, log_ratio_cap: float, plus
) -> GEPOLossTerms:
    """A micro-batch without a single response token (verl's padding rows can fill one): a zero loss that still
    reaches every parameter's gradient (as 0), no statistics, zero totals."""
    logp = log_prob.to(dtype)
    zeros = torch.zeros(log_prob.shape[0], dtype=dtype, device=log_prob.device)
    totals = step_totals(zeros, log_ratio_cap, zeros, row_valid, zeros, zeros, zeros if plus is not None else None)
    return GEPOLossTerms(
        token_losses=(logp - logp.detach()) * 0.0,
        metrics={},
        log_weights=zeros,
        row_valid=row_valid,
        log_seq_ratios=zeros,
        totals=totals,
    )
