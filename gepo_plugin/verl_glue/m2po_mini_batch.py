"""M2PO's cap over the whole mini-batch, so that the m2po loss does not depend on how verl splits it.

Why this exists: M2PO's cap comes from the second moment of the harmful tokens' log-ratios under the *current*
policy, which the loss sees one micro-batch at a time (verl accumulates gradients micro-batch by micro-batch and
splits the mini-batch across data-parallel ranks and, with dynamic batch sizes, by token count). The authors' code
takes the cap over each micro-batch; ``policy_loss.m2_scope=mini_batch`` takes it over the mini-batch instead: before
verl's engine trains a mini-batch, :func:`attach_mini_batch_cap` runs the same engine forward only (no gradient, the
policy the update will differentiate), gathers the harmful tokens' squared log-ratios from every data-parallel rank,
solves the cap once and writes it into every response of the mini-batch (:data:`~gepo_plugin.verl_glue.
response_terms.M2PO_CAP_FIELDS`), whence verl's split carries it to each micro-batch's loss. Cost: one forward pass
per mini-batch. ``patches/m2po_mini_batch.py`` calls it from verl's ``BaseEngine.train_batch``, in the runs the
plugin's launcher starts with M2PO in this scope (``GEPO_M2PO_MINI_BATCH=1`` in the Ray runtime env).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from gepo_plugin.config_keys import LOSS_MODE, M2_MASK, M2_SCOPE, POLICY_LOSS, RAY_ENV_VARS
from gepo_plugin.maths.m2po import M2Cap, harmful_delta_sq, solve_cap
from gepo_plugin.maths.options import POLICY_LOSS_DEFAULTS, policy_loss_options
from gepo_plugin.names import GEPO_LOSSES, M2PO_LOSS
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.registration import M2PO_MINI_BATCH_ENV
from gepo_plugin.verl_glue.response_terms import M2PO_CAP_FIELDS

#: The patch that calls :func:`attach_mini_batch_cap`, and its seam feature.
PATCH_NAME = FEATURE = "m2po_mini_batch"
#: The launcher's switch in the Ray runtime env (where ``--cfg job`` shows it).
SWITCH_KEY = f"{RAY_ENV_VARS}.{M2PO_MINI_BATCH_ENV}"


class MiniBatchScopeError(RuntimeError):
    """The engine gave no log-probs to measure the mini-batch with (pipeline-parallel stages without outputs)."""


def reads_m2_cap(loss_mode: Any, m2_mask: Any) -> bool:
    """Does a loss read M2PO's cap? M2PO's does; the GEPO losses do with ``policy_loss.m2_mask=true``."""
    return loss_mode == M2PO_LOSS or (loss_mode in GEPO_LOSSES and m2_mask is True)


def uses_mini_batch_scope(config: DictConfig) -> bool:
    """Does the run's actor read M2PO's cap over whole mini-batches? (The options are checked by the start-up
    validation, which names a wrong value's key: here only the switches and the scope are read.)"""
    m2_mask = OmegaConf.select(config, M2_MASK, default=POLICY_LOSS_DEFAULTS.m2_mask)
    if not reads_m2_cap(OmegaConf.select(config, LOSS_MODE), m2_mask):
        return False
    return OmegaConf.select(config, M2_SCOPE, default=POLICY_LOSS_DEFAULTS.m2_scope) == "mini_batch"


def launch_settings(config: DictConfig) -> dict[str, str]:
    """What the launcher fills in: the switch that applies the patch in the run's processes, where it is needed."""
    return {SWITCH_KEY: "1"} if uses_mini_batch_scope(config) else {}


def check_switch(config: DictConfig) -> None:
    """A run in this scope whose switch is not ``1`` would stop at its first update: refuse it at start-up."""
    value = OmegaConf.select(config, SWITCH_KEY)
    if uses_mini_batch_scope(config) and value != "1":
        raise PluginConfigError(
            f"{SWITCH_KEY}={value!r}, but {POLICY_LOSS}.m2_scope=mini_batch measures each mini-batch before verl's "
            f"update in every actor process, which this switch enables: remove it (the launcher sets '1'), or set "
            f"{POLICY_LOSS}.m2_scope=micro_batch"
        )


def mini_batch_budget(actor_config: Any) -> float | None:
    """The budget when ``actor_config`` (verl's ``ActorConfig``) trains with M2PO's cap over whole mini-batches,
    else None."""
    policy_loss = getattr(actor_config, "policy_loss", None)
    if policy_loss is None:
        return None
    options = policy_loss_options(policy_loss)
    if not reads_m2_cap(getattr(policy_loss, "loss_mode", None), options.m2_mask):
        return None
    return options.m2_budget if options.m2_scope == "mini_batch" else None


def requested_budget(loss_function: Any) -> float | None:
    """:func:`mini_batch_budget` of the actor config ``loss_function`` is bound to: verl's workers hold the loss as
    ``functools.partial(<loss>, config=<ActorConfig>)`` (the plugin's wrapper or verl's ``ppo_loss``)."""
    return mini_batch_budget(getattr(loss_function, "keywords", {}).get("config"))


def gather_across(values: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``values`` (1-D, any length) concatenated, in rank order, on every rank of ``group``."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    world = dist.get_world_size(group)
    size = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([part[:length] for part, length in zip(gathered, lengths, strict=True)])


def cap_fields(cap: M2Cap, rows: int) -> dict[str, torch.Tensor]:
    """The cap as per-response fields (float64: tau travels exactly)."""
    values = (cap.encoded(), cap.m2, cap.m2_after, float(cap.harmful_tokens))
    return {
        name: torch.full((rows,), value, dtype=torch.float64)
        for name, value in zip(M2PO_CAP_FIELDS, values, strict=True)
    }


def attach_mini_batch_cap(engine: Any, data: Any, budget: float) -> M2Cap:
    """Measure the mini-batch ``data`` with ``engine``'s forward (no gradient), solve the cap over every
    data-parallel rank's harmful tokens and write it into ``data``'s responses; returns the cap."""
    # lazy: verl's worker utilities, in the actor processes that train (this module is imported by the launcher too)
    from verl.workers.utils.padding import no_padding_2_padding

    output = engine.infer_batch(data, loss_function=None)
    log_probs = (output or {}).get("model_output", {}).get("log_probs")
    if log_probs is None:
        raise MiniBatchScopeError(
            "M2PO's mini-batch scope found no log-probs on this rank (a pipeline-parallel stage without outputs): "
            "set actor_rollout_ref.actor.policy_loss.m2_scope=micro_batch"
        )
    log_prob = no_padding_2_padding(log_probs, data)
    fields = data.select("response_mask", "old_log_probs", "advantages").to_padded_tensor()
    device = log_prob.device
    delta_sq = harmful_delta_sq(
        log_prob.float(),
        fields["old_log_probs"].to(device).float(),
        fields["advantages"].to(device),
        fields["response_mask"].to(device),
    )
    cap = solve_cap(gather_across(delta_sq, engine.get_data_parallel_group()), budget)
    for name, value in cap_fields(cap, data.batch_size[0]).items():
        data[name] = value
    return cap
