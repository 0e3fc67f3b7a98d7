"""Straightforward (loop-based, float64) re-implementations used as independent oracles.

They follow the papers' formulas literally, one group and one sequence at a time, and share
no code with :mod:`gepo_plugin.maths`.
"""

from __future__ import annotations

import math

import torch


def gepo_reference_loss(log_prob, old_log_prob, advantages, mask, group_ids, eps_low, eps_high, agg_mode):
    """GEPO loss with w_i = p_i / (sum_j q_j^2 / sum_j q_j), autograd through w_i (no straight-through)."""
    batch, width = mask.shape
    lengths = [int(mask[i].sum()) for i in range(batch)]
    q = {}
    for i in range(batch):
        q[i] = math.exp(sum(float(old_log_prob[i, t]) for t in range(lengths[i])) / lengths[i])
    groups = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    expectation = {}
    for members in groups.values():
        e = sum(q[j] ** 2 for j in members) / sum(q[j] for j in members)
        for j in members:
            expectation[j] = e
    per_seq = []
    for i in range(batch):
        mean_logp = sum(log_prob[i, t] for t in range(lengths[i])) / lengths[i]
        w = torch.exp(mean_logp) / expectation[i]
        a = advantages[i, 0]
        clipped = torch.clamp(w, 1 - eps_low, 1 + eps_high)
        per_seq.append(torch.maximum(-a * w, -a * clipped))
    total_tokens = sum(lengths)
    if agg_mode == "seq-mean-token-mean":
        return sum(per_seq) / batch
    if agg_mode == "token-mean":
        return sum(lengths[i] * per_seq[i] for i in range(batch)) / total_tokens
    if agg_mode == "seq-mean-token-sum":
        return sum(lengths[i] * per_seq[i] for i in range(batch)) / batch
    if agg_mode == "seq-mean-token-sum-norm":
        return sum(lengths[i] * per_seq[i] for i in range(batch)) / batch / width
    raise ValueError(agg_mode)


def beta_pdf(x: float, a: float, b: float) -> float:
    """Beta density from the Gamma function."""
    return x ** (a - 1) * (1 - x) ** (b - 1) * math.gamma(a + b) / (math.gamma(a) * math.gamma(b))
