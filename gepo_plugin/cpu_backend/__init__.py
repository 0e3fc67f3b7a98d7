"""CPU backend for running verl's real trainer without a GPU (a debugging/CI backend).

Modules are imported on demand: ``activate`` (what a CPU process registers, and a CPU run's settings),
``platform`` (the ``cpu`` platform), ``rollout`` (a transformers rollout server behind verl's rollout
interface) and ``ray_mailbox_engine`` (a checkpoint engine for standalone rollout
replicas). Nothing heavy is imported here, so ``import gepo_plugin`` stays cheap on GPU hosts.
"""

import os

from gepo_plugin.names import CPU_PLATFORM
from gepo_plugin.names import CPU_ROLLOUT as ROLLOUT_NAME

__all__ = ["CPU_PLATFORM", "ROLLOUT_NAME", "cpu_platform_selected"]


def cpu_platform_selected() -> bool:
    """Is the cpu platform requested for this process (``VERL_PLATFORM=cpu``)?"""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM
