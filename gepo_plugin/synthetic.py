"""Random GEPO batches (ragged responses, several prompt groups) for the demo, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SyntheticBatch:
    """Padded ``[B, T]`` tensors as verl's actor loss sees them, plus the prompt id of each row."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    group_ids: np.ndarray


def random_batch(
    group_sizes=(4, 3, 1, 5),
    width: int = 7,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    spread: float = 0.3,
    shuffle: bool = True,
    min_length: int = 1,
) -> SyntheticBatch:
    """Groups of the given sizes, row lengths uniform in [min_length, width], learner log-probs
    ``spread``-close to the sampler's, one advantage per row; rows shuffled so groups interleave."""
    gen = torch.Generator().manual_seed(seed)
    ids = np.array([f"prompt-{g}" for g, size in enumerate(group_sizes) for _ in range(size)], dtype=object)
    batch = len(ids)
    lengths = torch.randint(min_length, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(batch, width, generator=gen, dtype=dtype) * 2.0
    logp = old + spread * torch.randn(batch, width, generator=gen, dtype=dtype)
    logp = torch.minimum(logp, torch.zeros_like(logp))
    adv = torch.randn(batch, 1, generator=gen, dtype=dtype).expand(batch, width).clone()
    if shuffle:
        perm = torch.randperm(batch, generator=gen)
        ids, mask, old, logp, adv = ids[perm.numpy()], mask[perm], old[perm], logp[perm], adv[perm]
    return SyntheticBatch(logp, old, adv, mask, ids)
