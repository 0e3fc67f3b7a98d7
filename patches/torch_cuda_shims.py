"""``torch.cuda.current_device`` and ``torch.cuda.synchronize`` on a CPU build of torch (the CPU Megatron engine).

megatron-core 0.16.1 (``param_and_grad_buffer.py``, ``distrib_optimizer.py``, ``optimizer.py``,
``dist_checkpointing``) and mbridge 0.15.1 (``core/util.py``, ``core/bridge.py``) call ``torch.cuda.current_device()``
to place buffers, and ``dist_checkpointing/strategies/filesystem_async.py`` calls ``torch.cuda.synchronize()``;
both raise on a CPU build. Answer ``"cpu"`` (what the cpu platform's device module answers) and do nothing. The
patch refuses to run where CUDA is available, so a GPU host can never see it.
"""

from __future__ import annotations

from typing import Any

import torch

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam


def current_device() -> str:
    """The CPU build's only device."""
    return "cpu"


def synchronize(device: Any = None) -> None:
    """Nothing to wait for: CPU kernels run synchronously."""
    return None


def _apply() -> None:
    if torch.cuda.is_available():
        raise RuntimeError("the CPU backend's torch.cuda shims must not be applied on a machine with CUDA")
    seam.replace("torch.cuda.current_device", current_device)
    seam.replace("torch.cuda.synchronize", synchronize)


PATCH = Patch(
    name="torch_cuda_shims",
    versions={"megatron-core": "==0.16.1", "mbridge": "==0.15.1"},
    reason="megatron-core and mbridge place buffers on torch.cuda.current_device(), which raises on a CPU build",
    apply=_apply,
    feature="megatron_cpu",
    check_contacts=seam.require,
)
