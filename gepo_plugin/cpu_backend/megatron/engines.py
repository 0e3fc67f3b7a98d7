"""verl's own Megatron engines, registered for the ``cpu`` device, with every call run on the CPU.

verl 0.9.1 registers ``MegatronEngineWithLMHead``/``...WithValueHead`` for CUDA only. The CPU backend registers
subclasses for ``cpu`` through verl's public ``EngineRegistry``: each public engine method verl calls runs under
the CUDA-to-CPU mode (``patches/cuda_as_cpu.py``), the first engine built applies the Megatron patches (version
checked; CPU platform only), and a checkpoint load first gives a never-stepped optimizer its states. The model,
the loss path (``forward_step``, ``postprocess_micro_batch_func``, micro-batching) and the optimizer are verl's
and megatron-core's, unchanged.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from gepo_plugin import patching
from gepo_plugin.cpu_backend import cpu_platform_selected
from gepo_plugin.patches.cuda_as_cpu import cuda_as_cpu, under_cuda_as_cpu
from gepo_plugin.verl_glue import seam

#: The patches a CPU Megatron engine needs, in the order they are applied (``patches/<name>.py``).
PATCH_NAMES = (
    "megatron_rng_tracker",
    "torch_cuda_shims",
    "mbridge_local_layer_spec",
    "mbridge_local_weight_names",
    "megatron_snapshots",
)

#: The engine methods verl's workers, checkpoint engines and trainers call; each runs under the mode.
ENGINE_METHODS = (
    "initialize",
    "forward_backward_batch",
    "optimizer_zero_grad",
    "optimizer_step",
    "lr_scheduler_step",
    "to",
    "save_checkpoint",
    "get_per_tensor_param",
    "get_per_tensor_param_shard",
    "get_per_tensor_param_delta_shard",
)

_LOCK = threading.Lock()


def apply_megatron_cpu_patches() -> list[str]:
    """Apply :data:`PATCH_NAMES` once in this process (CPU platform only; versions and contacts checked first)."""
    if not cpu_platform_selected():
        raise RuntimeError("the CPU backend's Megatron patches apply only with VERL_PLATFORM=cpu")
    with _LOCK:
        newly = [name for name in PATCH_NAMES if patching.apply_named(name)]
    if newly:  # once per process: the worker's log says what runs differently from verl's own engine
        print(
            f"gepo-plugin: verl's Megatron engine on the CPU backend, patches applied: {', '.join(newly)}",
            file=sys.stderr,
            flush=True,
        )
    return [name for name in patching.applied_patches() if name in PATCH_NAMES]


def init_empty_optimizer_states(optimizer: Any) -> int:
    """Give each never-stepped inner optimizer its (dummy) states before a checkpoint is loaded into it.

    Without Apex or Transformer Engine, megatron's optimizer is ``torch.optim.AdamW``, whose states appear at the
    first step, and megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` (``assert len(steps) == 1``) fails on
    an optimizer that has none, which is what a resume loads into. megatron's own
    ``_init_optimizer_states_with_dummy_values`` (zero gradients, one inner step) creates them; the checkpoint
    then overwrites them, and the fp32 main parameters, in place. Returns how many it initialised.
    """
    if optimizer is None:
        return 0
    initialise = seam.resolve(
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._init_optimizer_states_with_dummy_values"
    )
    initialised = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if (
            torch_optimizer is not None
            and not torch_optimizer.state
            and hasattr(inner, "_init_optimizer_states_with_dummy_values")
        ):
            initialise(inner)
            initialised += 1
    return initialised


def cpu_engine_class(base: type) -> type:
    """``base`` (a verl Megatron engine) with every call of :data:`ENGINE_METHODS` run on the CPU."""

    def __init__(self, *args, **kwargs):
        apply_megatron_cpu_patches()
        with cuda_as_cpu():
            base.__init__(self, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        with cuda_as_cpu():
            init_empty_optimizer_states(getattr(self, "optimizer", None))
            return base.load_checkpoint(self, *args, **kwargs)

    namespace: dict[str, Any] = {
        "__doc__": f"verl's {base.__name__} on the CPU backend (every call under the CUDA-to-CPU mode).",
        "__init__": __init__,
        "load_checkpoint": load_checkpoint,
    }
    for name in ENGINE_METHODS:
        namespace[name] = under_cuda_as_cpu(getattr(base, name))
    return type(f"CPU{base.__name__}", (base,), namespace)


def register_megatron_engines() -> bool:
    """Register the CPU subclasses of verl's Megatron engines for device ``cpu``; False without megatron-core."""
    from verl.workers.engine.base import EngineRegistry  # lazy: called by a post-import hook of verl's registry

    try:  # optional: megatron-core
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead
    except ImportError:
        return False
    engines = seam.resolve("verl.workers.engine.base.EngineRegistry._engines")
    for model_type, base in (
        ("language_model", MegatronEngineWithLMHead),
        ("value_model", MegatronEngineWithValueHead),
    ):
        if "cpu" in engines.get(model_type, {}).get("megatron", {}):
            continue
        EngineRegistry.register(model_type=model_type, backend="megatron", device="cpu")(cpu_engine_class(base))
    return True
