"""``hetero.enable=true`` -> the verl settings that make it happen (applied by the launcher, :mod:`gepo_plugin.launch`).

* ``trainer.v1.sampler.custom_sampler`` -> the plugin's :class:`HeteroReplayBuffer` (verl's hook),
  with the ``hetero`` block as its ``sampler_kwargs``;
* every Ray process tags rollouts with their server (per-sampler-group throughput).

Which trainer runs (``hetero_separate_async`` or ``gepo_separate_async``) is decided with the loss's needs in
:mod:`gepo_plugin.verl_glue.trainer_mode`. A key the user set explicitly is never replaced; a contradiction is an
error that says what to change.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.config_keys import (
    CUSTOM_SAMPLER_NAME,
    CUSTOM_SAMPLER_PATH,
    HETERO,
    MAX_OFF_POLICY_STRATEGY,
    MAX_OFF_POLICY_THRESHOLD,
    RAY_ENV_VARS,
    SAMPLER_KWARGS,
)
from gepo_plugin.config_tree import NO_USER_KEYS, UserKeys
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.hetero.server_identity import ENV as SERVER_ID_ENV

SAMPLER_PATH = "pkg://gepo_plugin.verl_glue.hetero.replay_buffer"
SAMPLER_NAME = "HeteroReplayBuffer"
#: verl's own staleness settings, which HeteroRL's exact bound replaces.
REPLACED_SAMPLER_KEYS = (MAX_OFF_POLICY_THRESHOLD, MAX_OFF_POLICY_STRATEGY)


def apply_hetero(config: DictConfig, settings: HeteroSettings, explicit: UserKeys = NO_USER_KEYS) -> None:
    """When HeteroRL is enabled, point verl's replay buffer at the plugin's and tag rollouts with their server."""
    if not settings.enable:
        return
    for key, value in ((CUSTOM_SAMPLER_PATH, SAMPLER_PATH), (CUSTOM_SAMPLER_NAME, SAMPLER_NAME)):
        current = OmegaConf.select(config, key)
        if explicit.covers(key) and current != value:
            raise PluginConfigError(
                f"hetero.enable=true uses the plugin's sampler, but {key}={current} was set; remove that "
                "override (or set hetero.enable=false to use your own sampler)"
            )
        OmegaConf.update(config, key, value)
    given = [key for key in REPLACED_SAMPLER_KEYS if explicit.covers(key)]
    if given:
        raise PluginConfigError(
            f"hetero.enable=true replaces verl's {', '.join(given)} with the exact bound hetero.max_lag (in weight "
            "versions) and hetero.strategy: remove the former and set the latter"
        )
    # the replay buffer reads the block itself (an interpolation: `--cfg job` shows where its settings come from)
    OmegaConf.update(config, SAMPLER_KWARGS, "${" + HETERO + "}", force_add=True)
    # every Ray process tags rollouts with their server (patches/server_identity.py): per-group throughput
    OmegaConf.update(config, f"{RAY_ENV_VARS}.{SERVER_ID_ENV}", "1", force_add=True)
