"""verl's rollout correction (``algorithm.rollout_correction``) beside the plugin's losses: which settings verl 0.9.1's
V1 trainers act on, checked at start-up, and verl's own functions for the lab.

Why this exists: in bypass mode (``bypass_mode=true``, which the gepo, gepo_plus and m2po presets set) verl's V1
trainers copy the rollout log-probs into ``old_log_probs`` and compute no correction at all
(``verl/trainer/ppo/v1/trainer_base.py``: ``_compute_old_log_prob`` returns after the copy, and
``_compute_advantage`` calls ``compute_rollout_correction_and_add_to_batch`` only ``not bypass_mode``), so
``rollout_is`` or ``rollout_rs`` set there would be ignored without a word. In decoupled mode (``bypass_mode=false``)
verl recomputes the old log-probs, weights each token by the truncated ratio pi_old / pi_rollout and filters the
response mask before the advantages; every registered loss receives the weights as ``rollout_is_weights`` (the
plugin's losses multiply their token losses by them). :func:`ignored_settings` is that rule, written once: the
launcher refuses such a config (:func:`check_rollout_correction`) and the lab refuses such a preset
(:func:`lab_preset`). The lab corrects its batches with verl's own function (:func:`correct`), not a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from gepo_plugin.config_keys import BYPASS_MODE, ROLLOUT_CORRECTION
from gepo_plugin.verl_glue.errors import PluginConfigError

#: The settings verl's V1 trainers read only in decoupled mode.
DECOUPLED_ONLY = ("rollout_is", "rollout_rs")


def ignored_settings(bypass_mode: bool, values: dict[str, Any]) -> list[str]:
    """Which of ``values`` (``rollout_is``, ``rollout_rs``) verl's V1 trainers would ignore under ``bypass_mode``."""
    return [name for name in DECOUPLED_ONLY if bypass_mode and values.get(name) is not None]


def check_rollout_correction(config: DictConfig) -> None:
    """Refuse ``rollout_is``/``rollout_rs`` with ``bypass_mode=true``: verl 0.9.1's V1 trainers would ignore them."""
    node = OmegaConf.select(config, ROLLOUT_CORRECTION) or {}
    ignored = ignored_settings(bool(OmegaConf.select(config, BYPASS_MODE, default=False)), dict(node))
    if ignored:
        keys = ", ".join(f"{ROLLOUT_CORRECTION}.{name}={node[name]}" for name in ignored)
        raise PluginConfigError(
            f"{keys} with {BYPASS_MODE}=true: in bypass mode verl's V1 trainers use the rollout log-probs as the old "
            "policy and compute no importance weights or rejection, so the setting would be ignored. Set "
            f"{BYPASS_MODE}=false (decoupled: verl recomputes the old log-probs and weights each token by the "
            "truncated pi_old / pi_rollout; for gepo, gepo_plus and m2po q is then the recomputed policy), or remove it"
        )


def preset_names() -> tuple[str, ...]:
    """The presets of verl's ``RolloutCorrectionConfig`` (its classmethods that build one)."""
    # lazy: verl's config module, only where a correction is asked for (gepo-lab starts without verl)
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    return tuple(
        sorted(name for name, value in vars(RolloutCorrectionConfig).items() if isinstance(value, classmethod))
    )


def lab_preset(name: str) -> Any:
    """verl's ``RolloutCorrectionConfig.<name>()`` with its defaults, refused (ValueError) where a verl run would
    ignore it (the bypass presets that set ``rollout_is`` or ``rollout_rs``): the lab runs what a verl run does."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig  # lazy, as above

    names = preset_names()
    if name not in names:
        raise ValueError(f"unknown rollout correction {name!r}; verl's presets: {', '.join(names)}")
    preset = getattr(RolloutCorrectionConfig, name)()
    ignored = ignored_settings(preset.bypass_mode, {key: getattr(preset, key) for key in DECOUPLED_ONLY})
    if ignored:
        raise ValueError(
            f"rollout correction {name!r} sets {', '.join(ignored)} in bypass mode, which verl's V1 trainers ignore; "
            f"use a decoupled preset ({', '.join(n for n in names if n.startswith('decoupled_'))})"
        )
    return preset


def correct(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, preset: Any
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's decoupled correction of one batch: the truncated weights pi_old / pi_rollout (None without
    ``rollout_is``), the response mask after rejection, and verl's ``rollout_corr/*`` metrics."""
    if preset.bypass_mode:
        return None, response_mask, {}
    # lazy: verl's trainer helpers, in the lab's runs that ask for a correction
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob,
        rollout_log_prob=rollout_log_prob,
        response_mask=response_mask,
        rollout_is=preset.rollout_is,
        rollout_is_threshold=preset.rollout_is_threshold,
        rollout_is_batch_normalize=preset.rollout_is_batch_normalize,
        rollout_rs=preset.rollout_rs,
        rollout_rs_threshold=preset.rollout_rs_threshold,
    )
    is_weights = None if weights is None else weights.batch["rollout_is_weights"]
    return is_weights, mask, {key: float(value) for key, value in metrics.items()}
