"""Segment (per-group) reductions over a flat batch, without a Python loop over groups.

A batch of responses is flat: ``B`` rows, each tagged with the prompt ("group") it answers.
GEPO, GRPO-style advantages and BNPO all need statistics *per group*. These helpers map
arbitrary group ids to dense integers once and then reduce with ``scatter`` kernels, so
the cost is O(B) whatever the number of groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class GroupIdError(ValueError):
    """Group ids are missing or malformed."""


@dataclass(frozen=True)
class GroupIndex:
    """Dense group index of a flat batch.

    Attributes:
        inverse: ``[B]`` int64, the dense group number (0..G-1) of every row.
        num_groups: ``G``.
        sizes: ``[G]`` int64, the number of rows in each group.
    """

    inverse: torch.Tensor
    num_groups: int
    sizes: torch.Tensor

    @classmethod
    def from_ids(
        cls, group_ids: Sequence | np.ndarray | torch.Tensor, device: torch.device | None = None
    ) -> GroupIndex:
        """Build the index from any hashable ids (verl's ``uid`` strings, ints, a tensor).

        Groups are numbered in order of first appearance. Strings are hashed by ``pandas.factorize`` (installed
        with verl; a fraction of ``np.unique``'s sort of 65,536 uid strings), so no Python loop runs over groups
        or samples. Ids are compared as they are: the int ``1`` and the string ``"1"`` are two groups.
        """
        if group_ids is None:
            raise GroupIdError(
                "group ids are missing: every response needs the id of the prompt it answers "
                "(verl's `uid` field). Without them a per-prompt group expectation cannot be formed."
            )
        if isinstance(group_ids, torch.Tensor):
            if group_ids.dim() != 1:
                raise GroupIdError(f"group ids must be one-dimensional, got shape {tuple(group_ids.shape)}")
            _, inverse = torch.unique(group_ids, return_inverse=True)
            inverse = inverse.to(torch.int64)
        else:
            array = group_ids if isinstance(group_ids, np.ndarray) else np.asarray(group_ids, dtype=object)
            if array.ndim != 1:
                raise GroupIdError(f"group ids must be one-dimensional, got shape {array.shape}")
            from pandas import factorize  # imported here: the maths stay cheap to import

            codes, _ = factorize(array)
            if codes.size and int(codes.min()) < 0:
                raise GroupIdError("some group ids are None: every response needs the uid of its prompt")
            inverse = torch.from_numpy(codes.astype(np.int64, copy=False))
        if device is not None:
            inverse = inverse.to(device)
        if inverse.numel() == 0:
            raise GroupIdError("the batch is empty: there are no responses to group")
        num_groups = int(inverse.max().item()) + 1
        sizes = torch.bincount(inverse, minlength=num_groups)
        return cls(inverse=inverse, num_groups=num_groups, sizes=sizes)


def segment_sum(values: torch.Tensor, index: GroupIndex) -> torch.Tensor:
    """Sum of ``values[B]`` per group -> ``[G]``."""
    out = torch.zeros(index.num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index.inverse, values)


def segment_mean(values: torch.Tensor, index: GroupIndex, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) mean of ``values[B]`` per group -> ``[G]``; weights default to 1."""
    if weights is None:
        weights = torch.ones_like(values)
    total = segment_sum(values * weights, index)
    count = segment_sum(weights, index)
    return total / count


def segment_logsumexp(values: torch.Tensor, index: GroupIndex, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``log sum_j exp(values_j)`` over the rows of each group -> ``[G]``, stable for any magnitude.

    Rows with ``valid == False`` are left out (they act as ``-inf``). A group with no valid row
    yields ``-inf``.
    """
    if valid is None:
        valid = torch.ones_like(values, dtype=torch.bool)
    neg_inf = torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)
    masked = torch.where(valid, values, neg_inf)
    group_max = torch.full((index.num_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    group_max = group_max.scatter_reduce(0, index.inverse, masked, reduce="amax", include_self=True)
    safe_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
    shifted = torch.where(valid, torch.exp(masked - safe_max[index.inverse]), torch.zeros_like(values))
    total = segment_sum(shifted, index)
    return torch.log(total) + safe_max
