"""``hetero.enable=true`` -> the verl settings that make it happen (applied by the launcher, :mod:`gepo_plugin.launch`).

* ``trainer.v1.sampler.custom_sampler`` -> the plugin's :class:`HeteroReplayBuffer` (verl's hook; the trainer hands
  it the ``hetero`` settings it parsed);
* every Ray process tags rollouts with their server (per-sampler-group throughput), and knows the custom resource
  of the learner's nodes (``hetero.learner_resource``), where verl's own services are kept
  (:mod:`gepo_plugin.verl_glue.hetero.placement`);
* with ``hetero.transport=relay``: verl's checkpoint engine is the relay (``checkpoint_engine.backend=relay``, its
  module imported by verl in every process that builds one, its options the ``hetero.relay`` block), and the run
  id defaults to ``trainer.project_name/trainer.experiment_name``.

Which trainer runs (``hetero_separate_async`` or ``gepo_separate_async``) is decided with the loss's needs in
:mod:`gepo_plugin.verl_glue.trainer_mode`. A key the user set explicitly is never replaced; a contradiction is an
error that says what to change.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.config_keys import (
    CHECKPOINT_ENGINE_BACKEND,
    CHECKPOINT_ENGINE_KWARGS,
    CHECKPOINT_ENGINE_MODULE,
    CUSTOM_SAMPLER_NAME,
    CUSTOM_SAMPLER_PATH,
    EXPERIMENT_NAME,
    HETERO_RELAY,
    HETERO_RELAY_RUN_ID,
    MAX_OFF_POLICY_STRATEGY,
    MAX_OFF_POLICY_THRESHOLD,
    PROJECT_NAME,
    RAY_ENV_VARS,
)
from gepo_plugin.config_tree import NO_USER_KEYS, UserKeys
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.names import RELAY_CHECKPOINT_ENGINE, RELAY_ENGINE_MODULE
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.hetero.placement import ENV as PLACEMENT_ENV
from gepo_plugin.verl_glue.hetero.server_identity import ENV as SERVER_ID_ENV

SAMPLER_PATH = "pkg://gepo_plugin.verl_glue.hetero.replay_buffer"

SAMPLER_NAME = "HeteroReplayBuffer"
#: verl's own staleness settings, which HeteroRL's exact bound replaces.
REPLACED_SAMPLER_KEYS = (MAX_OFF_POLICY_THRESHOLD, MAX_OFF_POLICY_STRATEGY)


def apply_hetero(config: DictConfig, settings: HeteroSettings, explicit: UserKeys = NO_USER_KEYS) -> HeteroSettings:
    """When HeteroRL is enabled, point verl's replay buffer at the plugin's and tag rollouts with their server.

    Returns the settings as settled (the relay's run id filled in where the user gave none)."""
    if not settings.enable:
        return settings
    _own(
        config,
        explicit,
        {CUSTOM_SAMPLER_PATH: SAMPLER_PATH, CUSTOM_SAMPLER_NAME: SAMPLER_NAME},
        why="hetero.enable=true uses the plugin's sampler",
        instead="set hetero.enable=false to use your own sampler",
    )
    given = [key for key in REPLACED_SAMPLER_KEYS if explicit.covers(key)]
    if given:
        raise PluginConfigError(
            f"hetero.enable=true replaces verl's {', '.join(given)} with the exact bound hetero.max_lag (in weight "
            "versions) and hetero.strategy: remove the former and set the latter"
        )
    # every Ray process tags rollouts with their server (patches/server_identity.py): per-group throughput
    OmegaConf.update(config, f"{RAY_ENV_VARS}.{SERVER_ID_ENV}", "1", force_add=True)
    # verl's own services stay on the learner's nodes (patches/learner_placement.py)
    # (the value itself: verl hands Ray the runtime env's variables without resolving interpolations)
    if settings.config.learner_resource is not None:
        resource = settings.config.learner_resource
        OmegaConf.update(config, f"{RAY_ENV_VARS}.{PLACEMENT_ENV}", resource, force_add=True)
    if settings.relay is not None:
        _own(
            config,
            explicit,
            {CHECKPOINT_ENGINE_BACKEND: RELAY_CHECKPOINT_ENGINE, CHECKPOINT_ENGINE_MODULE: RELAY_ENGINE_MODULE},
            why="hetero.transport=relay carries the weights through the relay's checkpoint engine",
            instead="set hetero.transport=simulated to use verl's engine",
        )
        if OmegaConf.select(config, HETERO_RELAY_RUN_ID) is None:
            OmegaConf.update(config, HETERO_RELAY_RUN_ID, "${" + PROJECT_NAME + "}/${" + EXPERIMENT_NAME + "}")
            run_id = OmegaConf.select(config, HETERO_RELAY_RUN_ID)  # resolved
            relay = settings.config.relay.model_copy(update={"run_id": run_id})
            settings = dataclasses.replace(settings, config=settings.config.model_copy(update={"relay": relay}))
        # the engine reads the block itself, in every learner rank and sampler worker
        relay_kwargs = f"{CHECKPOINT_ENGINE_KWARGS}.{RELAY_CHECKPOINT_ENGINE}"
        OmegaConf.update(config, relay_kwargs, "${" + HETERO_RELAY + "}", force_add=True)
    return settings


def _own(config: DictConfig, explicit: UserKeys, values: dict[str, str], why: str, instead: str) -> None:
    """Set verl keys HeteroRL needs; a user's different value for one of them is an error that says what to do."""
    for key, value in values.items():
        current = OmegaConf.select(config, key)
        if explicit.covers(key) and current != value:
            raise PluginConfigError(f"{why}, but {key}={current} was set; remove that override (or {instead})")
        OmegaConf.update(config, key, value, force_add=True)
