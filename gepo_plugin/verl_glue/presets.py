"""``algorithm.loss=<name>``: one key that sets the verl options a loss family member needs.

Each preset is a set of ordinary verl config values. A value the user set explicitly on the
command line (or in their own yaml layered over ours) always wins: the preset fills in only
what the user left alone. The same table documents, in one place, what each name means in
verl terms (``python -m gepo_plugin presets`` prints it).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from gepo_plugin.verl_glue.errors import PluginConfigError

ACTOR = "actor_rollout_ref.actor"
TRAINER_MODE_KEY = "trainer.v1.trainer_mode"


LOSS_MODE_KEY = f"{ACTOR}.policy_loss.loss_mode"
ESTIMATOR_KEY = "algorithm.adv_estimator"


@dataclass(frozen=True)
class LossPreset:
    """A named loss: its verl settings and whether it needs the plugin's trainer-side group term.

    ``defines`` are the settings that make the member what it is (its loss mode, and for BNPO and ΔL its
    estimator): setting one of them explicitly to another value contradicts ``algorithm.loss`` and is an error.
    Every other setting is a tunable default that an explicit user value replaces.
    """

    name: str
    summary: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    needs_group_term: bool = False
    defines: tuple[str, ...] = (LOSS_MODE_KEY,)


def _ppo_clip(low: float, high: float) -> dict[str, Any]:
    return {f"{ACTOR}.clip_ratio_low": low, f"{ACTOR}.clip_ratio_high": high}


PRESETS: dict[str, LossPreset] = {
    preset.name: preset
    for preset in (
        LossPreset(
            "gepo",
            "GEPO (arXiv 2508.17850): sequence weight p_i / E_hat_q[q] over the prompt's group; "
            "mean-centred advantages; sampler log-probs as q (bypass mode)",
            {
                f"{ACTOR}.policy_loss.loss_mode": "gepo",
                f"{ACTOR}.policy_loss.group_scope": "prompt",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": False,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
                "algorithm.rollout_correction.bypass_mode": True,
                **_ppo_clip(0.2, 0.2),
            },
            needs_group_term=True,
        ),
        LossPreset(
            "grpo",
            "GRPO: token ratio p_t/q_t, std-normalised group advantages (verl's vanilla loss)",
            {
                f"{ACTOR}.policy_loss.loss_mode": "vanilla",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": True,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "dr_grpo",
            "Dr.GRPO: no std normalisation, token sum / constant length (seq-mean-token-sum-norm)",
            {
                f"{ACTOR}.policy_loss.loss_mode": "vanilla",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": False,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "gspo",
            "GSPO: length-normalised sequence ratio p_i/q_i (verl's gspo loss)",
            {
                f"{ACTOR}.policy_loss.loss_mode": "gspo",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": True,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
        LossPreset(
            "gmpo",
            "GMPO: geometric-mean token ratio (verl's geo_mean) with the original +-0.4 log-ratio clip",
            {
                f"{ACTOR}.policy_loss.loss_mode": "geo_mean",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": True,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
                **_ppo_clip(0.4, 0.4),
            },
        ),
        LossPreset(
            "bnpo",
            "BNPO (arXiv 2506.02864): (R - p) / Beta(p; a, b) advantages, Beta fitted to group means",
            {
                f"{ACTOR}.policy_loss.loss_mode": "vanilla",
                "algorithm.adv_estimator": "bnpo",
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum",
                **_ppo_clip(0.2, 0.2),
            },
            defines=(LOSS_MODE_KEY, ESTIMATOR_KEY),
        ),
        LossPreset(
            "delta_l",
            "Delta-L normalisation (arXiv 2509.07558): per-sequence weights L_i^-alpha / sum_j L_j^-alpha",
            {
                f"{ACTOR}.policy_loss.loss_mode": "vanilla",
                "algorithm.adv_estimator": "delta_l",
                "algorithm.norm_adv_by_std_in_grpo": True,
                f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm",
                **_ppo_clip(0.2, 0.2),
            },
            defines=(LOSS_MODE_KEY, ESTIMATOR_KEY),
        ),
        LossPreset(
            "cispo",
            "CISPO: clipped, stop-gradient IS weight times log-prob (verl's cispo loss)",
            {
                f"{ACTOR}.policy_loss.loss_mode": "cispo",
                "algorithm.adv_estimator": "grpo",
                "algorithm.norm_adv_by_std_in_grpo": True,
                f"{ACTOR}.loss_agg_mode": "token-mean",
                **_ppo_clip(0.2, 0.2),
            },
        ),
    )
}


class UnknownLossError(PluginConfigError):
    """``algorithm.loss`` names no preset."""


def get_preset(name: str) -> LossPreset:
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), sorted(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownLossError(
            f"algorithm.loss={name!r} is not a known loss{hint}. Valid names: {', '.join(sorted(PRESETS))} "
            "(or leave algorithm.loss unset for plain verl behaviour)."
        )
    return PRESETS[name]


def check_contradictions(config: DictConfig, preset: LossPreset, explicit: set[str]) -> None:
    """An explicit value for a key that ``preset.defines`` must agree with the preset (else: which key wins how)."""
    for key in preset.defines:
        if _is_set_by_user(key, explicit):
            value = OmegaConf.select(config, key)
            if value != preset.settings[key]:
                raise PluginConfigError(
                    f"algorithm.loss={preset.name} sets {key}={preset.settings[key]}, but {key}={value} was given. "
                    f"algorithm.loss decides the {key.rsplit('.', 1)[-1]} (your own values win only for the other, "
                    f"tunable settings): remove {key}, or choose the algorithm.loss that matches it, or drop "
                    "algorithm.loss to configure verl by hand."
                )


def explicit_override_keys(overrides: Iterable[str]) -> set[str]:
    """Config keys a user set on the command line (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b``)."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith("hydra."):
            keys.add(key)
    return keys


def _is_set_by_user(key: str, explicit: set[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in explicit)


def apply_loss_preset(config: DictConfig, explicit: set[str] | None = None) -> LossPreset | None:
    """Fill in ``config`` from ``algorithm.loss``'s preset, leaving the user's explicit keys alone.

    Also maps ``trainer.v1.trainer_mode`` to the plugin's trainer of the same mode when the loss
    needs the trainer-side group term. Returns the applied preset (None if no loss is named).
    """
    name = OmegaConf.select(config, "algorithm.loss", default=None)
    if name is None:
        return None
    preset = get_preset(str(name))
    check_contradictions(config, preset, explicit or set())
    apply_settings(config, preset.settings, explicit)
    if preset.needs_group_term:
        with open_dict(config):
            _select_group_term_trainer(config)
    return preset


def apply_settings(config: DictConfig, settings: Mapping[str, Any], explicit: set[str] | None = None) -> None:
    """Set each ``key=value`` of ``settings`` in ``config`` unless the user set that key (or a parent)."""
    explicit = explicit or set()
    with open_dict(config):
        for key, value in settings.items():
            if not _is_set_by_user(key, explicit):
                OmegaConf.update(config, key, value, force_add=True)


def _select_group_term_trainer(config: DictConfig) -> None:
    """verl's trainer mode -> the plugin's trainer of that mode (any other name is checked at validation)."""
    from gepo_plugin.names import GEPO_TRAINER_FOR_MODE

    mode = OmegaConf.select(config, TRAINER_MODE_KEY)
    if mode in GEPO_TRAINER_FOR_MODE:
        OmegaConf.update(config, TRAINER_MODE_KEY, GEPO_TRAINER_FOR_MODE[mode])
