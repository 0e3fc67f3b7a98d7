"""Start-up checks of the plugin's options, so a wrong setting fails before Ray starts."""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.verl_glue.config import GROUP_SCOPES
from gepo_plugin.verl_glue.presets import TRAINER_MODE_KEY, get_preset

logger = logging.getLogger(__name__)


class PluginConfigError(ValueError):
    """A gepo-plugin setting is impossible; the message says how to fix it."""


def _select(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def uses_group_term_trainer(mode: str) -> bool:
    """Is ``trainer.v1.trainer_mode`` a trainer that ships the per-prompt group term?"""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from gepo_plugin.verl_glue.trainers import SampleTermsMixin

    cls = TRAINER_REGISTRY.get(mode)
    return cls is not None and issubclass(cls, SampleTermsMixin)


def validate_plugin_config(config: DictConfig) -> None:
    """Raise :class:`PluginConfigError` for settings that cannot work."""
    loss = _select(config, "algorithm.loss")
    if loss is not None:
        get_preset(str(loss))
    actor = "actor_rollout_ref.actor"
    loss_mode = _select(config, f"{actor}.policy_loss.loss_mode", "vanilla")
    estimator = _select(config, "algorithm.adv_estimator")
    n = int(_select(config, "actor_rollout_ref.rollout.n", 1))
    if loss_mode == "gepo":
        scope = _select(config, f"{actor}.policy_loss.group_scope", "prompt")
        if scope not in GROUP_SCOPES:
            raise PluginConfigError(f"policy_loss.group_scope={scope!r}: use one of {GROUP_SCOPES}")
        mode = _select(config, TRAINER_MODE_KEY)
        if scope == "prompt" and not uses_group_term_trainer(mode):
            raise PluginConfigError(
                f"loss_mode=gepo needs the per-prompt group term, but {TRAINER_MODE_KEY}={mode} does not compute "
                f"it. Set {TRAINER_MODE_KEY}=gepo_{mode} (or use algorithm.loss=gepo, which does), or "
                "policy_loss.group_scope=batch to reproduce the reference code's micro-batch scope."
            )
        if n < 2:
            raise PluginConfigError(
                "GEPO's group expectation runs over several responses to one prompt: set "
                f"actor_rollout_ref.rollout.n >= 2 (got {n}; the paper used 8)"
            )
        low = _select(config, f"{actor}.clip_ratio_low")
        high = _select(config, f"{actor}.clip_ratio_high")
        for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
            if value is not None and float(value) < 0:
                raise PluginConfigError(f"{actor}.{name} must be >= 0, got {value}")
        if low is not None and float(low) >= 1:
            raise PluginConfigError(f"{actor}.clip_ratio_low must be < 1 (the bound is 1 - low), got {low}")
        kl = _select(config, f"{actor}.policy_loss.sampler_kl_coef", 0.0)
        if float(kl) < 0:
            raise PluginConfigError(f"{actor}.policy_loss.sampler_kl_coef must be >= 0, got {kl}")
        if not _select(config, "algorithm.rollout_correction.bypass_mode", False):
            logger.warning(
                "loss_mode=gepo without algorithm.rollout_correction.bypass_mode=true: q is the recomputed old "
                "policy, not the sampler's log-probs the paper's weight is defined with"
            )
    if estimator in ("bnpo", "delta_l") and n < 2:
        raise PluginConfigError(f"adv_estimator={estimator} needs actor_rollout_ref.rollout.n >= 2, got {n}")
    if estimator == "delta_l":
        alpha = float(_select(config, "algorithm.delta_l.alpha", 1.0))
        if alpha < 0:
            raise PluginConfigError(f"algorithm.delta_l.alpha must be >= 0, got {alpha}")
    if estimator == "bnpo":
        low = float(_select(config, "algorithm.bnpo.reward_min", 0.0))
        high = float(_select(config, "algorithm.bnpo.reward_max", 1.0))
        if not high > low:
            raise PluginConfigError(f"algorithm.bnpo.reward_max ({high}) must exceed reward_min ({low})")
