"""Importance-weight statistics by staleness bucket (framework-free), to see how lag hurts the weights."""

from __future__ import annotations

import torch

#: Lower edges of the lag buckets; each bucket runs to the next edge - 1.
LAG_EDGES: tuple[int, ...] = (0, 1, 3, 9, 33)


def bucket_labels(edges: tuple[int, ...] = LAG_EDGES) -> list[str]:
    labels = []
    for lo, hi in zip(edges, (*edges[1:], None), strict=True):
        labels.append(f"{lo}+" if hi is None else (str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"))
    return labels


@torch.no_grad()
def weight_stats_by_lag(
    log_weights: torch.Tensor, lags: torch.Tensor, valid: torch.Tensor | None = None, edges: tuple[int, ...] = LAG_EDGES
) -> dict[str, dict[str, float]]:
    """Mean, variance and count of ``exp(log_weights)`` per lag bucket (buckets with no sample are absent).

    ``lags`` are per-sequence lags in weight versions (negative lags are an error: a group cannot be
    newer than the learner).
    """
    lags = lags.reshape(-1).to(torch.long)
    weights = torch.exp(log_weights.detach().reshape(-1).double())
    if valid is not None:
        keep = valid.reshape(-1).bool()
        lags, weights = lags[keep], weights[keep]
    if lags.numel() and int(lags.min()) < 0:
        raise ValueError(f"negative lag {int(lags.min())}: a sample cannot be newer than the learner")
    bucket = torch.bucketize(lags, torch.tensor(edges[1:], dtype=torch.long), right=True)
    out: dict[str, dict[str, float]] = {}
    for index, label in enumerate(bucket_labels(edges)):
        chosen = weights[bucket == index]
        if chosen.numel():
            out[label] = {
                "mean": float(chosen.mean()),
                "var": float(chosen.var(unbiased=False)),
                "count": float(chosen.numel()),
            }
    return out
