"""verl 0.9.1 ``initialize_global_process_group_ray`` on the cpu device.

``verl/utils/distributed.py::initialize_global_process_group_ray`` builds the default backend
as ``f"cpu:gloo,{device}:{backend}"``. With the cpu platform this is ``"cpu:gloo,cpu:gloo"``,
which torch rejects (duplicate device type). ``engine_workers.py`` imports the function by
name, so the fix replaces it there too: when no backend is given and the device is cpu, use
``"cpu:gloo"``; otherwise call verl's original unchanged.
"""

from __future__ import annotations

from verl.utils.device import get_device_name

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam


def _apply() -> None:
    original = seam.resolve("verl.utils.distributed.initialize_global_process_group_ray")

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and get_device_name() == "cpu":
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray.__wrapped__ = original
    seam.replace("verl.utils.distributed.initialize_global_process_group_ray", initialize_global_process_group_ray)
    seam.replace("verl.workers.engine_workers.initialize_global_process_group_ray", initialize_global_process_group_ray)


PATCH = Patch(
    name="gloo_process_group",
    versions={"verl": "==0.9.1"},
    reason="verl builds the process-group backend 'cpu:gloo,cpu:gloo' on the cpu device (duplicate device type)",
    apply=_apply,
    feature="cpu_backend",
    check_contacts=seam.require,
)
