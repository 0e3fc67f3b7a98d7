"""verl's Megatron weight snapshots under the CUDA-to-CPU mode (the CPU Megatron engine with HeteroRL).

verl 0.9.1 ``utils/megatron_utils.py`` ``copy_megatron_model_to_cpu`` (the snapshot a delayed sampler group's weights
come from, through ``DetachActorWorker.save_model_to_cpu`` in ``experimental/separation/engine_workers.py``) pins
its copies with ``.pin_memory()``, which needs an accelerator, and runs outside any engine call, so the CPU
engines' per-call mode (``patches/cuda_as_cpu.py``) does not cover it. Run it, and
``restore_megatron_model_from_cpu``, under the mode (pinning becomes a no-op). The worker imports both by name at
call time, so replacing the module's attributes reaches it.
"""

from __future__ import annotations

from gepo_plugin.patches.cuda_as_cpu import under_cuda_as_cpu
from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

HANDLERS = (
    "verl.utils.megatron_utils.copy_megatron_model_to_cpu",
    "verl.utils.megatron_utils.restore_megatron_model_from_cpu",
)


def _apply() -> None:
    for name in HANDLERS:
        seam.replace(name, under_cuda_as_cpu(seam.resolve(name)))


PATCH = Patch(
    name="megatron_snapshots",
    versions={"verl": "==0.9.1", "megatron-core": "==0.16.1"},
    reason="verl's Megatron weight snapshot pins memory (an accelerator call) outside any engine call",
    apply=_apply,
    feature="megatron_cpu",
    check_contacts=seam.require,
)
