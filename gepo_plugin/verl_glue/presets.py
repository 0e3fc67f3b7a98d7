"""``algorithm.loss=<name>``: one key that sets the verl options a loss family member needs.

Each preset is a set of ordinary verl config values. A value the user set explicitly on the
command line (or in their own yaml layered over ours) always wins: the preset fills in only
what the user left alone. The same table documents, in one place, what each name means in
verl terms (``python -m gepo_plugin presets`` prints it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from gepo_plugin.config_keys import (
    ADV_ESTIMATOR,
    ALGORITHM_LOSS,
    BYPASS_MODE,
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    GROUP_SCOPE,
    LOSS_AGG_MODE,
    LOSS_MODE,
    NORM_ADV_BY_STD,
)
from gepo_plugin.config_tree import NO_USER_KEYS, UserKeys
from gepo_plugin.options import did_you_mean
from gepo_plugin.verl_glue.errors import PluginConfigError


@dataclass(frozen=True)
class LossPreset:
    """A named loss: its verl settings and whether it reads per-response terms that the plugin's trainer hands it
    (GEPO's group term, M2PO's mini-batch cap).

    ``defines`` are the settings that make the member what it is (its loss mode, and for BNPO and ΔL its
    estimator): setting one of them explicitly to another value contradicts ``algorithm.loss`` and is an error.
    Every other setting is a tunable default that an explicit user value replaces.
    """

    name: str
    summary: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    needs_response_terms: bool = False
    defines: tuple[str, ...] = (LOSS_MODE,)


def _ppo_clip(low: float, high: float) -> dict[str, Any]:
    return {CLIP_RATIO_LOW: low, CLIP_RATIO_HIGH: high}


PRESETS: dict[str, LossPreset] = {
    preset.name: preset
    for preset in (
        LossPreset(
            "gepo",
            "GEPO (arXiv 2508.17850): sequence weight p_i / E_hat_q[q] over the prompt's group; "
            "mean-centred advantages; sampler log-probs as q (bypass mode)",
            {
                LOSS_MODE: "gepo",
                GROUP_SCOPE: "prompt",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: False,
                LOSS_AGG_MODE: "seq-mean-token-mean",
                BYPASS_MODE: True,
                **_ppo_clip(0.2, 0.2),
            },
            needs_response_terms=True,
        ),
        LossPreset(
            "gepo_plus",
            "GEPO+ (the GEPO authors' adaptive denominator): GEPO whose denominator is the sequence's own q_i "
            "where its KL to the sampler is below policy_loss.gepo_plus_kl_threshold (hard; soft mixes)",
            {
                LOSS_MODE: "gepo_plus",
                GROUP_SCOPE: "prompt",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: False,
                LOSS_AGG_MODE: "seq-mean-token-mean",
                BYPASS_MODE: True,
                **_ppo_clip(0.2, 0.2),
            },
            needs_response_terms=True,
        ),
        LossPreset(
            "m2po",
            "M2PO (arXiv 2510.01161, the authors' code): PPO's clip with bounds exp(+-tau) that keep the harmful "
            "tokens' mean squared log-ratio within policy_loss.m2_budget, over the mini-batch; sampler log-probs as "
            "the behaviour policy (bypass mode)",
            {
                LOSS_MODE: "m2po",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "token-mean",
                BYPASS_MODE: True,
            },
            needs_response_terms=True,
        ),
        LossPreset(
            "grpo",
            "GRPO: token ratio p_t/q_t, std-normalised group advantages (verl's vanilla loss)",
            {
                LOSS_MODE: "vanilla",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "seq-mean-token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "dr_grpo",
            "Dr.GRPO: no std normalisation, token sum / constant length (seq-mean-token-sum-norm)",
            {
                LOSS_MODE: "vanilla",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: False,
                LOSS_AGG_MODE: "seq-mean-token-sum-norm",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "gspo",
            "GSPO: length-normalised sequence ratio p_i/q_i (verl's gspo loss)",
            {
                LOSS_MODE: "gspo",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "seq-mean-token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "gmpo",
            "GMPO: geometric-mean token ratio (verl's geo_mean) with the original +-0.4 log-ratio clip",
            {
                LOSS_MODE: "geo_mean",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "seq-mean-token-mean",
                **_ppo_clip(0.4, 0.4),
            },
        ),
        LossPreset(
            "bnpo",
            "BNPO (arXiv 2506.02864): (R - p) / Beta(p; a, b) advantages, Beta fitted to group means",
            {
                LOSS_MODE: "vanilla",
                ADV_ESTIMATOR: "bnpo",
                LOSS_AGG_MODE: "seq-mean-token-sum",
                **_ppo_clip(0.2, 0.2),
            },
            defines=(LOSS_MODE, ADV_ESTIMATOR),
        ),
        LossPreset(
            "delta_l",
            "Delta-L normalisation (arXiv 2509.07558): per-sequence weights L_i^-alpha / sum_j L_j^-alpha",
            {
                LOSS_MODE: "vanilla",
                ADV_ESTIMATOR: "delta_l",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "seq-mean-token-sum-norm",
                **_ppo_clip(0.2, 0.2),
            },
            defines=(LOSS_MODE, ADV_ESTIMATOR),
        ),
        LossPreset(
            "cispo",
            "CISPO: clipped, stop-gradient IS weight times log-prob (verl's cispo loss)",
            {
                LOSS_MODE: "cispo",
                ADV_ESTIMATOR: "grpo",
                NORM_ADV_BY_STD: True,
                LOSS_AGG_MODE: "token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
    )
}


class UnknownLossError(PluginConfigError):
    """``algorithm.loss`` names no preset."""


def get_preset(name: str) -> LossPreset:
    if name not in PRESETS:
        hint = did_you_mean(name, PRESETS)
        raise UnknownLossError(
            f"algorithm.loss={name!r} is not a known loss{hint}. Valid names: {', '.join(sorted(PRESETS))} "
            "(or leave algorithm.loss unset for plain verl behaviour)."
        )
    return PRESETS[name]


def check_contradictions(config: DictConfig, preset: LossPreset, explicit: UserKeys) -> None:
    """An explicit value for a key that ``preset.defines`` must agree with the preset (else: which key wins how)."""
    for key in preset.defines:
        if explicit.covers(key):
            value = OmegaConf.select(config, key)
            if value != preset.settings[key]:
                raise PluginConfigError(
                    f"algorithm.loss={preset.name} sets {key}={preset.settings[key]}, but {key}={value} was given. "
                    f"algorithm.loss decides the {key.rsplit('.', 1)[-1]} (your own values win only for the other, "
                    f"tunable settings): remove {key}, or choose the algorithm.loss that matches it, or drop "
                    "algorithm.loss to configure verl by hand."
                )


def selected_preset(config: DictConfig) -> LossPreset | None:
    """The preset ``algorithm.loss`` names (None when it names none; an unknown name is an error)."""
    name = OmegaConf.select(config, ALGORITHM_LOSS, default=None)
    return None if name is None else get_preset(str(name))


def apply_loss_preset(config: DictConfig, explicit: UserKeys = NO_USER_KEYS) -> LossPreset | None:
    """Fill in ``config`` from ``algorithm.loss``'s preset, leaving the user's explicit keys alone.

    Returns the applied preset (None if no loss is named); which trainer runs it is
    :func:`gepo_plugin.verl_glue.trainer_mode.settle_trainer_mode`'s decision.
    """
    preset = selected_preset(config)
    if preset is None:
        return None
    check_contradictions(config, preset, explicit)
    apply_settings(config, preset.settings, explicit)
    return preset


def apply_settings(config: DictConfig, settings: Mapping[str, Any], explicit: UserKeys = NO_USER_KEYS) -> None:
    """Set each ``key=value`` of ``settings`` in ``config`` unless the user set that key (or a parent)."""
    with open_dict(config):
        for key, value in settings.items():
            if not explicit.covers(key):
                OmegaConf.update(config, key, value, force_add=True)
