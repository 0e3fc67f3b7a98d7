"""The settings verl's Megatron engine needs on a CPU, and the start-up check that they hold.

The launcher fills in :func:`megatron_cpu_settings` where the user set nothing (like every CPU-backend setting)
and then runs :func:`check_megatron_cpu` on the config that will run, so an explicit setting that cannot work on a
CPU, a missing extra or an unverified parallel layout stops the run before Ray starts, naming the key and the fix.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import config_keys as keys
from gepo_plugin.cpu_backend.megatron import MEGATRON_ROLES, megatron_selected
from gepo_plugin.cpu_backend.megatron.engines import PATCH_NAMES
from gepo_plugin.cpu_backend.requirements import Requirement, as_settings, refuse_contradictions
from gepo_plugin.patching import first_version_problem
from gepo_plugin.verl_glue.errors import PluginConfigError

#: The pip extra that installs what the CPU Megatron engine needs.
EXTRA = "gepo-plugin[megatron-cpu]"


#: Per-role requirements (``<role>.megatron.<suffix>``), for every role on the Megatron engine.
ROLE_REQUIREMENTS = (
    Requirement("use_mbridge", True, "verl builds the Megatron model through a bridge"),
    Requirement(
        "vanilla_mbridge",
        True,
        "Megatron-Bridge needs Python >= 3.12 and megatron-core >= 0.17; the "
        "legacy mbridge path works with megatron-core 0.16.1 (verl prints a FutureWarning about it)",
    ),
    Requirement(
        "override_transformer_config.use_cpu_initialization", True, "otherwise megatron initialises the weights on CUDA"
    ),
    Requirement(
        "override_transformer_config.attention_backend",
        "local",
        "megatron's own attention; verl's default (flash) is a CUDA kernel",
    ),
    Requirement(
        "override_transformer_config.masked_softmax_fusion", False, "the fused scale-mask-softmax is a CUDA kernel"
    ),
    Requirement(
        "use_distributed_optimizer",
        True,
        "verl's weight sync reads the parameter buffers only the distributed optimizer keeps",
    ),
    Requirement("dtype", "bfloat16", "verl's Megatron engine accepts bf16 or fp16, and a CPU computes bf16"),
    Requirement(
        "use_remove_padding",
        False,
        "the packed (thd) format needs Transformer Engine's attention, which "
        "needs CUDA (verl's workers copy the model's use_remove_padding here; set so --cfg job shows it)",
    ),
)
#: Model requirements (the packed "thd" format needs Transformer Engine's attention, which needs CUDA).
MODEL_REQUIREMENTS = (
    Requirement(
        keys.MODEL_USE_REMOVE_PADDING,
        False,
        "the packed (thd) format needs Transformer Engine's attention, which needs CUDA",
    ),
)
#: Parallel sizes verified on the CPU backend (1 each: one Megatron rank per data-parallel worker, over gloo).
PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


def _roles(config: DictConfig) -> list[str]:
    return [role for role in MEGATRON_ROLES if OmegaConf.select(config, f"{role}.megatron", default=None) is not None]


def requirements(config: DictConfig) -> list[Requirement]:
    """Every requirement of a CPU Megatron run of ``config``, with full keys."""
    out = list(MODEL_REQUIREMENTS)
    for role in _roles(config):
        out += [Requirement(f"{role}.megatron.{r.key}", r.value, r.why) for r in ROLE_REQUIREMENTS]
    if OmegaConf.select(config, "critic.model", default=None) is not None and "critic" in _roles(config):
        out.append(Requirement("critic.model.use_remove_padding", False, MODEL_REQUIREMENTS[0].why))
    return out


def megatron_cpu_settings(config: DictConfig) -> dict[str, object]:
    """What a CPU Megatron run needs (empty unless the actor is on the Megatron engine)."""
    if not megatron_selected(config):
        return {}
    return as_settings(requirements(config))


def _install_problem() -> str | None:
    """Why the extra's packages cannot serve the CPU patches (absent, or another version), or None."""
    return first_version_problem(PATCH_NAMES)


def check_megatron_cpu(config: DictConfig) -> None:
    """Refuse a CPU Megatron run that cannot work: missing extra, a contradicting setting, parallel sizes above 1."""
    if not megatron_selected(config):
        return
    problem = _install_problem()
    if problem is not None:
        raise PluginConfigError(
            f"model_engine=megatron with trainer.device=cpu: {problem}. Fix: pip install '{EXTRA}' (megatron-core "
            "0.16.1 and mbridge 0.15.1, the versions the CPU patches were written for), or drop model_engine=megatron "
            "to train with FSDP2 on the CPU."
        )
    refuse_contradictions(config, requirements(config), "model_engine=megatron on trainer.device=cpu")
    for role in _roles(config):
        for size in PARALLEL_SIZES:
            key = f"{role}.megatron.{size}"
            found = OmegaConf.select(config, key, default=1)
            if found not in (1, None):
                raise PluginConfigError(
                    f"{key}={found}: the CPU backend's Megatron engine is verified with parallel size 1 only (one "
                    f"Megatron rank per data-parallel worker, over gloo). Fix: set {key}=1 on the CPU; sizes above 1 "
                    "are for GPU runs (see examples/hetero/run_qwen3_1.7b_gepo_math_megatron.sh)."
                )
