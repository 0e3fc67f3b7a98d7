"""Build the exact inputs verl's actor loss receives, from padded tensors.

verl's engine calls ``loss_fn(model_output=..., data=micro_batch, dp_group=...)`` where
``model_output["log_probs"]`` is the flat (no-padding) log-prob of every prompt+response token
and ``data`` is the micro-batch ``TensorDict``. This module builds both, so the demo, the tests
and the benchmark drive verl's real ``ppo_loss`` without a model or a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

from gepo_plugin.verl_glue.response_terms import ppo_loss_with_response_terms


def compose_actor_config(overrides: list[str] | None = None):
    """verl's ``ActorConfig`` dataclass, composed from the plugin's Hydra config with ``overrides``.

    Overrides are relative to ``actor_rollout_ref.actor`` (e.g. ``["policy_loss.loss_mode=gepo"]``).
    """
    full = [f"actor_rollout_ref.actor.{item}" for item in (overrides or [])]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="gepo_plugin.config", version_base=None):
        config = compose(config_name="gepo_trainer", overrides=full)
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def build_loss_inputs(
    log_prob: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    extra_fields: Mapping[str, torch.Tensor] | None = None,
    prompt_len: int = 2,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], TensorDict]:
    """(model_output, data) for verl's ``ppo_loss`` from ``[B, T]`` padded tensors.

    ``log_prob`` may require grad; gradients flow back to it through the flat layout.
    ``response_mask`` must mark a prefix of each row (verl's right-padded responses).
    """
    batch, width = response_mask.shape
    mask = response_mask.to(torch.int64)
    lengths = mask.sum(-1)
    prefix = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    if not torch.equal(prefix, mask):
        raise ValueError("response_mask must be a prefix mask (ones then zeros) in every row")
    prompts = torch.ones(batch, prompt_len, dtype=torch.int64)
    attention_mask = torch.cat([torch.ones(batch, prompt_len, dtype=torch.int64), mask], dim=1)
    full = torch.zeros(batch, prompt_len + width, dtype=log_prob.dtype)
    full = torch.cat([full[:, : prompt_len - 1], log_prob, full[:, prompt_len - 1 + width :]], dim=1)
    flat_log_probs = full[attention_mask.bool()]
    fields = {
        "prompts": prompts,
        "responses": torch.ones(batch, width, dtype=torch.int64),
        "attention_mask": attention_mask,
        "response_mask": mask,
        "old_log_probs": old_log_probs,
        "advantages": advantages,
    }
    fields.update(extra_fields or {})
    data = TensorDict(fields, batch_size=[batch])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    return {"log_probs": flat_log_probs}, data


def loss_over_micro_batches(
    config,
    log_prob: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    micro_batches,
    fields: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """The loss summed over ``micro_batches`` (row indices), each through the plugin's loss wrapper around verl's
    ``ppo_loss`` as verl's engine calls it (the mini-batch's token and row totals in ``global_batch_info``), its
    gradient with respect to ``log_prob``, and each micro-batch's metrics. ``fields``: per-row terms, split with it."""
    logp = log_prob.clone().requires_grad_()
    losses, metrics = [], []
    for rows in micro_batches:
        rows = torch.as_tensor(rows)
        model_output, data = build_loss_inputs(
            logp[rows],
            old_log_probs[rows],
            advantages[rows],
            response_mask[rows],
            {name: value[rows] for name, value in (fields or {}).items()},
            batch_num_tokens=int(response_mask.sum()),
            global_batch_size=response_mask.shape[0],
        )
        loss, m = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
        losses.append(loss)
        metrics.append(m)
    total = torch.stack(losses).sum()
    (grad,) = torch.autograd.grad(total, logp)
    return total, grad, metrics
