"""``hetero.enable=true`` -> the verl settings that make it happen (applied by ``prepare_config``).

* ``trainer.v1.sampler.custom_sampler`` -> the plugin's :class:`HeteroReplayBuffer` (verl's hook),
  with the ``hetero`` block as its ``sampler_kwargs``;
* ``trainer.v1.trainer_mode=separate_async`` -> ``hetero_separate_async`` (or ``gepo_separate_async``
  when the loss preset already chose GEPO's trainer), which adds the delayed weight sync and the
  checkpointed accounting.

A key the user set explicitly is never replaced; a contradiction is an error that says what to change.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf, open_dict

from gepo_plugin.hetero.settings import HeteroSettings, parse_hetero
from gepo_plugin.verl_glue.presets import TRAINER_MODE_KEY

logger = logging.getLogger(__name__)

SAMPLER_PATH = "pkg://gepo_plugin.verl_glue.hetero_sampler"
SAMPLER_NAME = "HeteroReplayBuffer"
HETERO_TRAINERS = ("hetero_separate_async", "gepo_separate_async")


def apply_hetero(config: DictConfig, explicit: set[str] | None = None) -> HeteroSettings:
    """Validate ``hetero`` and, when enabled, point verl's sampler and trainer at the plugin's."""
    explicit = explicit or set()
    settings = parse_hetero(OmegaConf.to_container(config.hetero, resolve=True) if "hetero" in config else None)
    if not settings.enable:
        return settings
    mode = OmegaConf.select(config, TRAINER_MODE_KEY)
    if mode == "separate_async":
        OmegaConf.update(config, TRAINER_MODE_KEY, "hetero_separate_async")
    elif mode not in HETERO_TRAINERS:
        raise ValueError(
            f"hetero.enable=true needs samplers on their own devices: set {TRAINER_MODE_KEY}=separate_async "
            f"(got {mode}) with actor_rollout_ref.rollout.nnodes / n_gpus_per_node for the samplers"
        )
    sampler = "trainer.v1.sampler"
    for key, value in (("custom_sampler.path", SAMPLER_PATH), ("custom_sampler.name", SAMPLER_NAME)):
        current = OmegaConf.select(config, f"{sampler}.{key}")
        if f"{sampler}.{key}" in explicit and current != value:
            raise ValueError(
                f"hetero.enable=true uses the plugin's sampler, but {sampler}.{key}={current} was set; remove that "
                "override (or set hetero.enable=false to use your own sampler)"
            )
        OmegaConf.update(config, f"{sampler}.{key}", value)
    if f"{sampler}.max_off_policy_threshold" in explicit or f"{sampler}.max_off_policy_strategy" in explicit:
        logger.warning(
            "hetero.enable=true: %s.max_off_policy_threshold/strategy are ignored; the bound is hetero.max_lag "
            "(exact, in weight versions) with hetero.strategy",
            sampler,
        )
    with open_dict(config):
        config.trainer.v1.sampler.sampler_kwargs = OmegaConf.create(OmegaConf.to_container(config.hetero, resolve=True))
    # every Ray process tags rollouts with their server (patches/server_identity.py): per-group throughput
    OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env.env_vars.GEPO_HETERO_SERVER_ID", "1", force_add=True)
    return settings
