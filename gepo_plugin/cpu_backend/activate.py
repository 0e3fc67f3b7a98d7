"""Switch a process to the CPU backend (only when ``VERL_PLATFORM=cpu``) and prepare a cpu run.

Two entry points:

* :func:`activate_cpu_backend` runs in every verl process (from the plugin's entry point) when the
  cpu platform is selected: it registers verl's own FSDP engines for the cpu device (public
  ``EngineRegistry``), the transformers rollout (``RolloutReplicaRegistry``), the Ray-mailbox
  checkpoint engine (``CheckpointEngineRegistry``), and applies the version-checked patches.
* :func:`prepare_cpu_run` runs in the launcher when ``trainer.device=cpu``: it selects the
  platform here and in every Ray process, and fills in the settings a CPU run needs (each one
  only if the user did not set it).

Without ``VERL_PLATFORM=cpu`` neither does anything: GPU hosts see no change.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.cpu_backend.platform import CPU_PLATFORM, cpu_platform_selected

logger = logging.getLogger("gepo_plugin")

#: Patch modules under ``patches/`` (installed as ``gepo_plugin.patches``), applied in this order.
PATCH_MODULES = ("gloo_process_group",)

ROLLOUT_NAME = "hf"
SEPARATE_CHECKPOINT_ENGINE = "ray_mailbox"


def _register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        registered = EngineRegistry._engines.get(model_type, {})
        if all("cpu" in registered.get(backend, {}) for backend in ("fsdp", "fsdp2")):
            continue
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)


def activate_cpu_backend() -> bool:
    """Register the CPU engines, rollout and checkpoint engine and apply the patches (idempotent)."""
    if not cpu_platform_selected():
        return False
    from gepo_plugin.patching import apply_named

    _register_engines()
    for name in PATCH_MODULES:
        apply_named(name)
    from gepo_plugin.cpu_backend.hf_rollout import register_hf_rollout
    from gepo_plugin.cpu_backend.ray_mailbox_engine import register_ray_mailbox_engine

    register_hf_rollout(ROLLOUT_NAME)
    register_ray_mailbox_engine()
    return True


def cpu_run_settings(config: DictConfig) -> dict[str, object]:
    """The verl settings a CPU run needs, derived from the config (applied where the user is silent)."""
    mode = str(OmegaConf.select(config, "trainer.v1.trainer_mode", default="sync"))
    separate = mode.endswith("separate_async")
    trainer_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    rollout_gpus = 0
    if separate:
        rollout = config.actor_rollout_ref.rollout
        rollout_gpus = int(rollout.get("nnodes", 1) or 1) * int(rollout.get("n_gpus_per_node", 1) or 1)
    settings: dict[str, object] = {
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "actor_rollout_ref.ref.strategy": "fsdp2",
        "critic.strategy": "fsdp2",
        "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "critic.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.rollout.name": ROLLOUT_NAME,
        # the transformers rollout serves a replica from one process
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": SEPARATE_CHECKPOINT_ENGINE if separate else "naive",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
        # Pool bundles, workers and TransferQueue actors each reserve logical CPUs; with only as many
        # as cores, Ray waits forever without an error. Logical CPUs are only bookkeeping.
        "ray_kwargs.ray_init.num_cpus": max(16, 4 * (trainer_gpus + rollout_gpus) + 8),
        # verl's resource pools ask for GPUs; declare fake ones (the platform's resource name is "GPU").
        "ray_kwargs.ray_init.num_gpus": trainer_gpus + rollout_gpus,
        "ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM": CPU_PLATFORM,
        "ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM": "false",
        "ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS": "1",
    }
    return settings


def prepare_cpu_run(config: DictConfig, explicit: set[str]) -> bool:
    """If ``trainer.device=cpu``: select the cpu platform everywhere and fill in CPU settings."""
    if str(OmegaConf.select(config, "trainer.device", default="cuda")) != CPU_PLATFORM:
        return False
    from verl.plugin.platform import set_platform

    from gepo_plugin.cpu_backend.platform import PlatformCPU
    from gepo_plugin.verl_glue.presets import apply_settings

    os.environ["VERL_PLATFORM"] = CPU_PLATFORM
    set_platform(PlatformCPU())
    activate_cpu_backend()
    apply_settings(config, cpu_run_settings(config), explicit)
    logger.warning(
        "trainer.device=cpu: running verl on the CPU backend (a debugging/CI backend, not for real training)"
    )
    return True
