"""A ``cpu`` platform for verl's platform registry: the debugging/CI backend, not a production one.

verl resolves its device through ``verl.plugin.platform.get_platform()``. A platform that is
never available is never auto-detected, so registering this class changes nothing on a GPU
host: it is selected only explicitly, with ``VERL_PLATFORM=cpu`` (which the plugin's launcher
sets, and forwards to every Ray process, when ``trainer.device=cpu``).

verl calls CUDA-style functions on ``platform.device_module`` (``empty_cache``, ``mem_get_info``,
memory statistics, RNG state, streams...). ``torch.cpu`` has only some of them, so the module
is a facade that answers every such call sensibly for host memory.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from gepo_plugin.cpu_backend import CPU_PLATFORM, cpu_platform_selected


class _CPUDeviceModule(ModuleType):
    """``torch.cuda``-shaped facade over the host (falls back to ``torch.cpu`` for anything else)."""

    def __init__(self) -> None:
        super().__init__("gepo_plugin_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    # device identity: FSDP2 places tensors on `current_device()`; an int would mean cuda:N
    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    # memory: host memory as the "device" memory
    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return int(psutil.Process().memory_info().rss)

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    # RNG: the CPU generator is the device generator
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    # streams/events: CPU work is synchronous
    @staticmethod
    def stream(stream: Any = None):
        return nullcontext()


CPU_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform=CPU_PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform backed by the host CPU, gloo and fake Ray ``GPU`` resources."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: selected only with VERL_PLATFORM=cpu.
        return cpu_platform_selected()

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets this for actors that hold (fake) GPU resources; harmless on CPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's resource pools ask Ray for "GPU"s; the launcher declares fake ones on the CPU host.
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    def cudart(self) -> Any:
        return None
