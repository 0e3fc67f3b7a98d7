"""Named tensors on their way from the trainer to a rollout server."""

from __future__ import annotations

import torch


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly FSDP2-sharded) tensor; a collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
