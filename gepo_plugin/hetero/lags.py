"""Lags as numbers: per response of a batch, and the summary a step reports (framework-free numpy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def response_lags(keys: Sequence[str], tags: Sequence[Mapping], learner_version: int) -> np.ndarray:
    """Per response: ``learner_version - min(min_global_steps over its prompt group)``; 0 for padding rows.

    ``keys`` are verl's trajectory keys ``{uid}_{session}_{index}`` and ``tags`` their TransferQueue tags
    (``min_global_steps``: the weight version of the response's oldest token; ``is_padding`` on verl's padding).
    """
    uids = np.array([key.split("_")[0] for key in keys], dtype=object)
    padding = np.array([bool(tag.get("is_padding", False)) for tag in tags], dtype=bool)
    versions = np.array(
        [learner_version if pad else int(tag["min_global_steps"]) for tag, pad in zip(tags, padding, strict=True)],
        dtype=np.int64,
    )
    if versions.size == 0:
        return versions
    _, group = np.unique(uids, return_inverse=True)
    oldest = np.full(group.max() + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(oldest, group, versions)
    lags = learner_version - oldest[group]
    lags[padding] = 0
    return lags


def lag_summary(lags: np.ndarray) -> dict[str, float]:
    """min / p50 / p95 / max / mean of the trained groups' lags (empty: nothing; unprefixed names)."""
    if lags.size == 0:
        return {}
    p50, p95 = np.percentile(lags, [50, 95])
    return {
        "min": float(lags.min()),
        "p50": float(p50),
        "p95": float(p95),
        "max": float(lags.max()),
        "mean": float(lags.mean()),
    }
