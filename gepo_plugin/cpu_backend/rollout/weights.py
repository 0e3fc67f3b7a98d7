"""The rollout model's weights: loaded from disk at launch, then replaced by named tensors from the trainer."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig

from gepo_plugin.cpu_backend.rollout.options import HFRolloutOptions


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly FSDP2-sharded) tensor; a collective for DTensors."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def load_model(model_config: HFModelConfig, options: HFRolloutOptions) -> torch.nn.Module:
    """The rollout model from ``model_config.local_path`` in ``options.dtype``, frozen for inference."""
    dtype = getattr(torch, options.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_config.local_path,
        config=model_config.hf_config,
        dtype=dtype,
        attn_implementation=options.attn_implementation,
        trust_remote_code=model_config.trust_remote_code,
    )
    model.eval()
    model.requires_grad_(False)
    return model


def tensor_index(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its HF name, tied ones under each of their names (the trainer sends all)."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


@torch.no_grad()
def load_tensors(index: dict[str, torch.Tensor], items: list[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into the model in place (see :func:`tensor_index`); returns the count.

    Unknown names and shape mismatches raise: a silently skipped tensor would serve stale weights.
    """
    for name, tensor in items:
        tensor = full_tensor(tensor)
        target = index.get(name)
        if target is None:
            known = ", ".join(list(index)[:5])
            raise KeyError(f"update_weights: the rollout model has no tensor {name!r} (it has e.g. {known})")
        if target.shape != tensor.shape:
            raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {target.shape}")
        target.copy_(tensor)
    return len(items)
