"""``hetero.enable=true`` -> the verl settings that make it happen (applied by the launcher, :mod:`gepo_plugin.launch`).

* ``trainer.v1.sampler.custom_sampler`` -> the plugin's :class:`HeteroReplayBuffer` (verl's hook),
  with the ``hetero`` block as its ``sampler_kwargs``;
* ``trainer.v1.trainer_mode=separate_async`` -> ``hetero_separate_async`` (or ``gepo_separate_async``
  when the loss preset already chose GEPO's trainer), which adds the delayed weight sync and the
  checkpointed accounting.

A key the user set explicitly is never replaced; a contradiction is an error that says what to change.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.hetero.settings import HETERO_KEY, HeteroSettings, parse_hetero
from gepo_plugin.names import GEPO_TRAINER_FOR_MODE, HETERO_TRAINER
from gepo_plugin.patches.server_identity import ENV as SERVER_ID_ENV
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.presets import TRAINER_MODE_KEY

SAMPLER_PATH = "pkg://gepo_plugin.verl_glue.hetero.replay_buffer"
SAMPLER_NAME = "HeteroReplayBuffer"
HETERO_TRAINERS = (HETERO_TRAINER, GEPO_TRAINER_FOR_MODE["separate_async"])
SAMPLER = "trainer.v1.sampler"
#: verl's own staleness settings, which HeteroRL's exact bound replaces.
REPLACED_SAMPLER_KEYS = (f"{SAMPLER}.max_off_policy_threshold", f"{SAMPLER}.max_off_policy_strategy")


def apply_hetero(config: DictConfig, explicit: set[str] | None = None) -> HeteroSettings:
    """Validate ``hetero`` and, when enabled, point verl's replay buffer and trainer at the plugin's."""
    explicit = explicit or set()
    settings = parse_hetero(config.get(HETERO_KEY))
    if not settings.enable:
        return settings
    mode = OmegaConf.select(config, TRAINER_MODE_KEY)
    if mode == "separate_async":
        OmegaConf.update(config, TRAINER_MODE_KEY, HETERO_TRAINER)
    elif mode not in HETERO_TRAINERS:
        raise PluginConfigError(
            f"hetero.enable=true needs samplers on their own devices, but {TRAINER_MODE_KEY}={mode}: set "
            f"{TRAINER_MODE_KEY}=separate_async (with actor_rollout_ref.rollout.nnodes / n_gpus_per_node for the "
            "samplers), or hetero.enable=false"
        )
    for key, value in (("custom_sampler.path", SAMPLER_PATH), ("custom_sampler.name", SAMPLER_NAME)):
        current = OmegaConf.select(config, f"{SAMPLER}.{key}")
        if f"{SAMPLER}.{key}" in explicit and current != value:
            raise PluginConfigError(
                f"hetero.enable=true uses the plugin's sampler, but {SAMPLER}.{key}={current} was set; remove that "
                "override (or set hetero.enable=false to use your own sampler)"
            )
        OmegaConf.update(config, f"{SAMPLER}.{key}", value)
    given = [key for key in REPLACED_SAMPLER_KEYS if key in explicit]
    if given:
        raise PluginConfigError(
            f"hetero.enable=true replaces verl's {', '.join(given)} with the exact bound hetero.max_lag (in weight "
            "versions) and hetero.strategy: remove the former and set the latter"
        )
    # the replay buffer reads the block itself (an interpolation: `--cfg job` shows where its settings come from)
    OmegaConf.update(config, f"{SAMPLER}.sampler_kwargs", "${" + HETERO_KEY + "}", force_add=True)
    # every Ray process tags rollouts with their server (patches/server_identity.py): per-group throughput
    OmegaConf.update(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{SERVER_ID_ENV}", "1", force_add=True)
    return settings
