"""Run megatron-core's and mbridge's CUDA-only tensor code on the CPU, inside a block (the CPU backend only).

megatron-core 0.16.1 and mbridge 0.15.1 write ``device="cuda"``, ``.cuda()``, ``pin_memory=True`` and
``param.type() == 'torch.cuda.FloatTensor'`` in dozens of places (``clip_grads.py``, ``optimizer.py``,
``distrib_optimizer.py``, ``pipeline_parallel/schedules.py``, ``transformer/utils.py``, mbridge's
``core/util.py`` ...). Patching each would be dozens of patches; a ``TorchFunctionMode`` answers all of them
at the level of torch calls, and only inside the block that enters it:

* ``device="cuda"`` / ``"cuda:N"`` / an int / ``torch.device("cuda")`` -> ``"cpu"``;
* ``tensor.cuda()`` and ``tensor.pin_memory()`` -> the tensor itself; ``pin_memory=True`` -> False;
* ``tensor.type()`` of a CPU tensor answers ``torch.cuda.<X>Tensor`` (megatron's optimizer and gradient clipping
  accept only those names).

A mode is per thread, so it is entered around each call that runs megatron code (the CPU Megatron engines wrap
every engine method, :func:`under_cuda_as_cpu`), never once per process. Nothing here is applied by import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_PIN = torch.Tensor.pin_memory

#: Attribute set on functions wrapped by :func:`under_cuda_as_cpu` (wrapping twice is a no-op).
MARKER = "__gepo_cuda_as_cpu__"


def is_cuda_device(device: Any) -> bool:
    """Does ``device`` (as torch accepts it: str, int, torch.device) name a CUDA device?"""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaAsCpuMode(TorchFunctionMode):
    """Maps CUDA placements to the CPU (see the module docstring for exactly which)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _TENSOR_CUDA or func is _TENSOR_PIN:
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and not name.startswith("torch.cuda."):
                name = "torch.cuda." + name[len("torch.") :]
            return name
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is _TENSOR_TO and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Run the block under :class:`CudaAsCpuMode` (in this thread; nesting is harmless)."""
    with CudaAsCpuMode():
        yield


def _iterate_under_mode(iterator: Iterator) -> Iterator:
    """Each ``next`` of ``iterator`` under the mode (the consumer's code in between runs without it)."""
    while True:
        with cuda_as_cpu():
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def under_cuda_as_cpu(method: Callable) -> Callable:
    """``method`` run under the mode; generators it returns (alone or in a tuple) also step under it.

    verl's ``get_per_tensor_param`` and its kin return generators that run later, in the weight sync.
    """
    if getattr(method, MARKER, False):
        return method

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with cuda_as_cpu():
            result = method(*args, **kwargs)
        if inspect.isgenerator(result):
            return _iterate_under_mode(result)
        if isinstance(result, tuple) and any(inspect.isgenerator(item) for item in result):
            return tuple(_iterate_under_mode(item) if inspect.isgenerator(item) else item for item in result)
        return result

    setattr(wrapper, MARKER, True)
    return wrapper
