"""GEPO's weight statistics: per micro-batch, and as additive totals that make a training step's statistics exact.

A step's loss runs over many micro-batches on many data-parallel ranks, and verl averages a metric over them with
equal weight, whatever their sizes; a micro-batch made only of verl's padding rows (it pads batches to a multiple of
the data-parallel and mini-batch sizes) has no sequence at all, so it has no mean to report. The loss therefore
reports :func:`step_totals` (counts, sums and sums of squares over its sequences: zeros when it has none), which add
up exactly across micro-batches and ranks, and :func:`stats_from_totals` turns a step's totals into its means, as
:mod:`gepo_plugin.hetero.lag_buckets` does per staleness bucket.
"""

from __future__ import annotations

import torch

#: The additive totals of one micro-batch (or a step) over its sequences (``own_sum``: GEPO+ only).
TOTALS: tuple[str, ...] = ("rows", "w_sum", "w_sumsq", "clipped_rows", "capped_rows", "kl_sum", "own_sum")
#: Metric path segment of the totals as the verl losses report them (``actor/gepo/step_totals/<total>``).
STEP_TOTALS = "step_totals/"
#: The step statistics :func:`stats_from_totals` gives (means over the step's sequences).
STEP_STATISTICS: tuple[str, ...] = (
    "iw_mean",
    "iw_std",
    "ess",
    "clipfrac",
    "log_ratio_cap_frac",
    "sampler_kl",
    "own_denominator_frac",
)


@torch.no_grad()
def gepo_metrics(
    log_w: torch.Tensor,
    log_ratio_cap: float,
    lengths: torch.Tensor,
    row_valid: torch.Tensor,
    clipped_tokens: torch.Tensor,
    seq_kl_sum: torch.Tensor,
    seq_neg_log_ratio_sum: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Importance-weight statistics over the non-empty sequences of one batch, from ``[B]`` sums.

    ``iw_*`` and ``ess`` describe the weight the loss actually uses, ``w = exp(min(log w, log_ratio_cap))``,
    and are computed from log-sum-exps in float64, so they stay finite however far the raw weights run
    (``log_ratio_cap`` is at most :data:`~gepo_plugin.maths.options.MAX_LOG_RATIO_CAP`). ``log_ratio_cap_frac`` is
    the share of sequences whose raw weight the cap replaced (the cap changes their gradient), and ``log_iw_max`` the
    largest raw ``log w``, so a binding cap is visible. The batch must hold at least one non-empty sequence.
    """
    raw = log_w.detach()[row_valid].double()
    capped = torch.clamp(raw, max=log_ratio_cap)
    n = raw.numel()
    log_n = torch.log(torch.tensor(float(n), dtype=torch.float64))
    log_mean = torch.logsumexp(capped, 0) - log_n
    log_second = torch.logsumexp(2 * capped, 0) - log_n
    mean = torch.exp(log_mean)
    # Var = E[w^2] - E[w]^2 = E[w]^2 (exp(log E[w^2] - 2 log E[w]) - 1), without cancelling large numbers
    variance = mean**2 * torch.expm1((log_second - 2 * log_mean).clamp(min=0))
    total_tokens = lengths.sum()
    return {
        "iw_mean": mean,
        "iw_std": torch.sqrt(variance) if n > 1 else torch.zeros((), dtype=torch.float64),
        "iw_max": torch.exp(capped.max()),
        "iw_min": torch.exp(capped.min()),
        "ess": torch.exp(2 * log_mean - log_second),
        "log_iw_max": raw.max(),
        "log_ratio_cap_frac": (raw > log_ratio_cap).double().mean(),
        "clipfrac": (clipped_tokens[row_valid] > 0).double().mean(),
        "token_clipfrac": clipped_tokens.sum() / total_tokens,
        "sampler_kl": (seq_kl_sum[row_valid] / lengths[row_valid]).mean(),
        "ppo_kl": seq_neg_log_ratio_sum.sum() / total_tokens,
    }


@torch.no_grad()
def step_totals(
    log_w: torch.Tensor,
    log_ratio_cap: float,
    lengths: torch.Tensor,
    row_valid: torch.Tensor,
    clipped_tokens: torch.Tensor,
    seq_kl_sum: torch.Tensor,
    own_share: torch.Tensor | None = None,
) -> dict[str, float]:
    """The additive totals (:data:`TOTALS`) over the non-empty sequences; all zeros when there is none.

    The weight is the one the loss uses, capped at ``exp(log_ratio_cap)`` (at most e^80, so its square stays far
    inside float64)."""
    valid = row_valid.bool()
    raw = log_w.detach()[valid].double()
    w = torch.exp(torch.clamp(raw, max=log_ratio_cap))
    own = own_share.detach()[valid].double().sum() if own_share is not None else torch.zeros((), dtype=torch.float64)
    values = torch.stack(
        [
            torch.tensor(float(raw.numel()), dtype=torch.float64),
            w.sum(),
            (w * w).sum(),
            (clipped_tokens.detach()[valid] > 0).double().sum(),
            (raw > log_ratio_cap).double().sum(),
            (seq_kl_sum.detach()[valid].double() / lengths.detach()[valid].double()).sum(),
            own,
        ]
    )
    return dict(zip(TOTALS, values.tolist(), strict=True))


def stats_from_totals(totals: dict[str, float]) -> dict[str, float]:
    """A step's means (:data:`STEP_STATISTICS`) from its totals; {} when the step had no sequence.

    The totals may all carry one common scale (verl averages SUM metrics over ranks): every statistic is a ratio of
    totals, so the scale cancels."""
    rows = totals.get("rows", 0.0)
    if rows <= 0:
        return {}
    mean = totals["w_sum"] / rows
    second = totals["w_sumsq"] / rows
    return {
        "iw_mean": mean,
        "iw_std": max(second - mean * mean, 0.0) ** 0.5,
        "ess": mean * mean / second if second > 0 else 1.0,
        "clipfrac": totals["clipped_rows"] / rows,
        "log_ratio_cap_frac": totals["capped_rows"] / rows,
        "sampler_kl": totals["kl_sum"] / rows,
        "own_denominator_frac": totals.get("own_sum", 0.0) / rows,
    }
