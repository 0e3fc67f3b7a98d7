"""Switch a process to the CPU backend (only when ``VERL_PLATFORM=cpu``) and derive a CPU run's settings.

Two entry points:

* :func:`install` runs in every verl process where the cpu platform is selected (the plugin's entry point calls
  :func:`install_if_selected`; the launcher calls :func:`install` after it selects the platform). It registers
  the ``cpu`` platform and then, as each of verl's registries is imported, verl's own FSDP engines for the cpu
  device (public ``EngineRegistry``; verl's Megatron engines too, wrapped by
  :mod:`~gepo_plugin.cpu_backend.megatron.engines`, where megatron-core is installed), the transformers rollout
  (``RolloutReplicaRegistry``), the Ray-mailbox checkpoint engine (``CheckpointEngineRegistry``) and the
  version-checked gloo patch. Nothing is imported before verl imports it itself, so a process pays only for what
  it uses.
* :func:`fill_cpu_run` fills in what a ``trainer.device=cpu`` run needs (:func:`cpu_run_settings`; with the actor
  on verl's Megatron engine, ``model_engine=megatron``, the Megatron settings instead of FSDP2; with verl's vLLM
  rollout, ``rollout.name=vllm``, vLLM's CPU settings), each only where the user set nothing; the launcher then
  refuses what cannot work (:func:`check_cpu_run`).

Without ``VERL_PLATFORM=cpu`` nothing here runs: GPU hosts see no change.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import config_keys as keys
from gepo_plugin.config_tree import UserKeys
from gepo_plugin.cpu_backend import CPU_PLATFORM, ROLLOUT_NAME, cpu_platform_selected
from gepo_plugin.names import RELAY_CHECKPOINT_ENGINE
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.registration import install_hooks

SEPARATE_CHECKPOINT_ENGINE = "ray_mailbox"

_INSTALLED: list[bool] = []

# The post-import hooks (HOOKS) import what they register only once verl imports the module they wait for.


def _register_platform() -> None:
    import gepo_plugin.cpu_backend.platform  # noqa: F401  (its class decorator registers the platform)


def _register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    engines = seam.resolve("verl.workers.engine.base.EngineRegistry._engines")
    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        registered = engines.get(model_type, {})
        if all("cpu" in registered.get(backend, {}) for backend in ("fsdp", "fsdp2")):
            continue
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)
    from gepo_plugin.cpu_backend.megatron.engines import register_megatron_engines

    register_megatron_engines()  # only registers classes: megatron is patched when a CPU Megatron engine is built


def _apply_gloo_patch() -> None:
    from gepo_plugin.patching import apply_named

    apply_named("gloo_process_group")


#: verl module -> (what to register once verl imports it, the step's name for errors).
HOOKS = (
    ("verl.plugin.platform", _register_platform, "register the cpu platform"),
    ("verl.workers.engine", _register_engines, "register verl's FSDP and Megatron engines for the cpu device"),
    ("verl.workers.engine_workers", _apply_gloo_patch, "apply the gloo process-group patch"),
)


def install() -> bool:
    """Register the cpu platform and arrange the CPU registrations as verl's registries load (idempotent)."""
    if _INSTALLED:
        return False
    _INSTALLED.append(True)
    install_hooks(HOOKS)
    # lazy: only where VERL_PLATFORM=cpu (this module is imported on every import verl)
    from gepo_plugin.cpu_backend.rollout import registration
    from gepo_plugin.cpu_backend.vllm import install as vllm_cpu

    registration.install()
    vllm_cpu.install()  # verl's vLLM rollout, where vllm-cpu is installed
    return True


def install_if_selected() -> bool:
    """:func:`install` when this process runs with ``VERL_PLATFORM=cpu`` (the entry point's call)."""
    return install() if cpu_platform_selected() else False


def select_cpu_platform() -> None:
    """Select the cpu platform in this process (the launcher of a ``trainer.device=cpu`` run)."""
    from verl.plugin.platform import set_platform  # lazy: this module is imported while verl initialises

    os.environ["VERL_PLATFORM"] = CPU_PLATFORM
    install()
    from gepo_plugin.cpu_backend.platform import PlatformCPU  # after install(): importing it registers the platform

    set_platform(PlatformCPU())


def _checkpoint_engine(config: DictConfig, separate: bool) -> str:
    """The CPU mailbox for separate samplers, unless the weights go through HeteroRL's relay (it needs no NCCL)."""
    if OmegaConf.select(config, keys.CHECKPOINT_ENGINE_BACKEND) == RELAY_CHECKPOINT_ENGINE:
        return RELAY_CHECKPOINT_ENGINE
    return SEPARATE_CHECKPOINT_ENGINE if separate else "naive"


def cpu_run_settings(config: DictConfig) -> dict[str, object]:
    """The verl settings a CPU run needs, derived from the config (the launcher applies them where the user is
    silent)."""
    mode = str(OmegaConf.select(config, keys.TRAINER_MODE, default="sync"))
    separate = mode.endswith("separate_async")
    trainer_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    rollout_gpus = 0
    if separate:
        rollout = config.actor_rollout_ref.rollout
        rollout_gpus = int(rollout.get("nnodes", 1) or 1) * int(rollout.get("n_gpus_per_node", 1) or 1)
    # lazy, as below: the launcher's code, kept out of import verl
    from gepo_plugin.cpu_backend.megatron import megatron_selected
    from gepo_plugin.cpu_backend.megatron.settings import megatron_cpu_settings

    if megatron_selected(config):
        engine_settings = megatron_cpu_settings(config)
    else:  # verl's FSDP1 demands GPU parameters with sync_module_states
        engine_settings = {f"{role}.strategy": "fsdp2" for role in keys.ENGINE_ROLES}
    return engine_settings | {
        keys.MODEL_ATTN_IMPLEMENTATION: "sdpa",
        keys.CRITIC_ATTN_IMPLEMENTATION: "sdpa",
        keys.ROLLOUT_NAME: ROLLOUT_NAME,
        # the transformers rollout serves a replica from one process
        keys.ROLLOUT_TENSOR_PARALLEL: 1,
        keys.CHECKPOINT_ENGINE_BACKEND: _checkpoint_engine(config, separate),
        keys.TRANSFER_QUEUE_STORAGE_UNITS: 1,
        # Pool bundles, workers and TransferQueue actors each reserve logical CPUs; with only as many
        # as cores, Ray waits forever without an error. Logical CPUs are only bookkeeping.
        keys.RAY_NUM_CPUS: max(16, 4 * (trainer_gpus + rollout_gpus) + 8),
        # verl's resource pools ask for GPUs; declare fake ones (the platform's resource name is "GPU").
        keys.RAY_NUM_GPUS: trainer_gpus + rollout_gpus,
        f"{keys.RAY_ENV_VARS}.VERL_PLATFORM": CPU_PLATFORM,
        f"{keys.RAY_ENV_VARS}.TOKENIZERS_PARALLELISM": "false",
        f"{keys.RAY_ENV_VARS}.OMP_NUM_THREADS": "1",
    }


def fill_cpu_run(config: DictConfig, explicit: UserKeys) -> None:
    """Fill in what a CPU run needs where the user set nothing (the launcher then runs :func:`check_cpu_run`)."""
    # lazy: the launcher's code, kept out of import verl
    from gepo_plugin.cpu_backend.vllm.settings import vllm_cpu_settings
    from gepo_plugin.verl_glue.presets import apply_settings

    apply_settings(config, cpu_run_settings(config), explicit)
    # second: the rollout that runs is known only now (verl's YAML says vllm, the CPU backend's default is hf)
    apply_settings(config, vllm_cpu_settings(config), explicit)


def check_cpu_run(config: DictConfig) -> None:
    """Start-up checks of a CPU run's own settings (the transformers rollout's options, the Megatron engine's,
    vLLM's)."""
    # lazy: the launcher's code, kept out of import verl
    from gepo_plugin.cpu_backend.megatron.settings import check_megatron_cpu
    from gepo_plugin.cpu_backend.rollout.options import HF_OPTIONS_KEY, parse_hf_options
    from gepo_plugin.cpu_backend.vllm.settings import check_vllm_cpu

    block = OmegaConf.select(config, HF_OPTIONS_KEY, default=None)
    full_determinism = OmegaConf.select(config, keys.FULL_DETERMINISM, default=False)
    parse_hf_options(OmegaConf.to_container(block, resolve=True) if block is not None else None, full_determinism)
    check_megatron_cpu(config)
    check_vllm_cpu(config)
