"""Importance-weight statistics by staleness bucket (framework-free), to see how lag hurts the weights.

Why sums and not per-bucket means: a training step's metrics are gathered from every micro-batch of
every data-parallel rank, and verl (0.9.1) requires every rank to report every metric key the same
number of times. A bucket is often empty in some micro-batches, so the loss reports, for EVERY
bucket, the count, sum and sum of squares of the weights (zeros when empty); these add up exactly
across micro-batches and ranks, and :func:`finalize_lag_metrics` turns the step's totals into the
mean, variance and share of each bucket (exact over the whole step, not a mean of means).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from gepo_plugin.hetero.guard import ess_fraction_from_sums

#: Lower edges of the lag buckets; each bucket runs to the next edge - 1.
LAG_EDGES: tuple[int, ...] = (0, 1, 3, 9, 33)
#: Per-bucket additive statistics the loss reports.
SUM_FIELDS: tuple[str, ...] = ("count", "sum", "sumsq")
#: Metric path segment of the by-lag statistics of the loss's own weight (``actor/gepo/iw_by_lag/<bucket>/<field>``).
BY_LAG = "iw_by_lag/"
#: The same for the sequence importance ratio ``p_i / q_i`` (1 on-policy; the staleness guard's input).
IS_BY_LAG = "seq_is_by_lag/"
BY_LAG_SEGMENTS: tuple[str, ...] = (BY_LAG, IS_BY_LAG)
#: Metric name (beside ``seq_is_by_lag/``) of the whole step's ESS/N of ``p_i / q_i``, exact over every
#: micro-batch and rank.
STEP_ESS = "ess_step"


def bucket_labels(edges: tuple[int, ...] = LAG_EDGES) -> list[str]:
    labels = []
    for lo, hi in zip(edges, (*edges[1:], None), strict=True):
        labels.append(f"{lo}+" if hi is None else (str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"))
    return labels


@torch.no_grad()
def weight_sums_by_lag(
    log_weights: torch.Tensor, lags: torch.Tensor, valid: torch.Tensor | None = None, edges: tuple[int, ...] = LAG_EDGES
) -> dict[str, dict[str, float]]:
    """Count, sum and sum of squares of ``exp(log_weights)`` for EVERY lag bucket (zeros when empty).

    ``lags`` are per-sequence lags in weight versions (negative lags are an error: a group cannot be
    newer than the learner). Vectorised: one ``index_add_`` per statistic.
    """
    lags = lags.reshape(-1).to(torch.long)
    weights = torch.exp(log_weights.detach().reshape(-1).double())
    if valid is not None:
        keep = valid.reshape(-1).bool()
        lags, weights = lags[keep], weights[keep]
    if lags.numel() and int(lags.min()) < 0:
        raise ValueError(f"negative lag {int(lags.min())}: a sample cannot be newer than the learner")
    bucket = torch.bucketize(lags, torch.tensor(edges[1:], dtype=torch.long, device=lags.device), right=True)
    table = torch.zeros(3, len(edges), dtype=torch.float64, device=weights.device)
    table[0].index_add_(0, bucket, torch.ones_like(weights))
    table[1].index_add_(0, bucket, weights)
    table[2].index_add_(0, bucket, weights * weights)
    rows = table.T.tolist()
    labels = bucket_labels(edges)
    return {label: dict(zip(SUM_FIELDS, row, strict=True)) for label, row in zip(labels, rows, strict=True)}


def stats_from_sums(sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, (population) variance, ESS/N and share of the samples per bucket; buckets with no sample are absent."""
    total = sum(entry["count"] for entry in sums.values())
    out: dict[str, dict[str, float]] = {}
    for label, entry in sums.items():
        count = entry["count"]
        if count > 0:
            mean = entry["sum"] / count
            out[label] = {
                "mean": mean,
                "var": max(entry["sumsq"] / count - mean * mean, 0.0),
                "ess": ess_fraction_from_sums(count, entry["sum"], entry["sumsq"]),
                "count": count,
                "fraction": count / total,
            }
    return out


def weight_stats_by_lag(
    log_weights: torch.Tensor, lags: torch.Tensor, valid: torch.Tensor | None = None, edges: tuple[int, ...] = LAG_EDGES
) -> dict[str, dict[str, float]]:
    """Mean, variance, count and share of ``exp(log_weights)`` per lag bucket (buckets with no sample are absent)."""
    return stats_from_sums(weight_sums_by_lag(log_weights, lags, valid, edges))


def finalize_lag_metrics(metrics: MutableMapping[str, float]) -> MutableMapping[str, float]:
    """Replace ``.../iw_by_lag/<bucket>/{count,sum,sumsq}`` (a step's totals; ``seq_is_by_lag/`` alike) by
    ``mean``, ``var``, ``ess``, ``fraction``, and add the whole step's ESS/N of ``p_i / q_i`` as ``.../ess_step``.

    The totals may all carry one common scale (verl averages over ranks and mini-batches); mean,
    variance, ESS/N and fraction are ratios, so the scale cancels. Empty buckets get no mean/var/ess. In place.
    """
    groups: dict[str, dict[str, dict[str, float]]] = {}
    by_lag = [k for k in metrics if any(seg in k for seg in BY_LAG_SEGMENTS) and k.rsplit("/", 1)[-1] in SUM_FIELDS]
    for key in by_lag:
        head, field = key.rsplit("/", 1)
        prefix, label = head.rsplit("/", 1)
        groups.setdefault(prefix, {}).setdefault(label, {})[field] = float(metrics.pop(key))
    for prefix, sums in groups.items():
        for label, stats in stats_from_sums(sums).items():
            for name in ("mean", "var", "ess", "fraction"):
                metrics[f"{prefix}/{label}/{name}"] = stats[name]
        if prefix.endswith(IS_BY_LAG.rstrip("/")):
            totals = [sum(entry.get(name, 0.0) for entry in sums.values()) for name in SUM_FIELDS]
            metrics[prefix.removesuffix(IS_BY_LAG.rstrip("/")) + STEP_ESS] = ess_fraction_from_sums(*totals)
    return metrics
