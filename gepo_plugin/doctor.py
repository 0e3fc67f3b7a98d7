"""``python -m gepo_plugin doctor``: is the plugin really active, here and in Ray workers?

verl loads plugins in every process but swallows their import errors, so "it works in my
shell" says nothing about the TaskRunner or the workers. The doctor checks the launcher
process and a freshly started Ray actor that does nothing but ``import verl``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import sys
from typing import Any

PACKAGES = ("verl", "torch", "ray", "transformers", "tensordict", "TransferQueue", "hydra-core")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "MISSING"
    return found


def probe_process() -> dict[str, Any]:
    """What a process sees after a plain ``import verl`` (nothing of the plugin imported by hand)."""
    import os

    import verl

    from gepo_plugin.names import ENTRY_POINT_MODULE, registered_names
    from gepo_plugin.patching import applied_patches

    status = {}
    plugin = sys.modules.get(ENTRY_POINT_MODULE)
    if plugin is not None:
        status = dict(plugin.STATUS)
    return {
        "pid": os.getpid(),
        "verl": verl.__version__,
        "entry_point_loaded": plugin is not None,
        "status": status,
        "registered": registered_names(),
        "patches": applied_patches(),
    }


def probe_ray_actor(timeout_s: float = 180.0) -> dict[str, Any]:
    """Run :func:`probe_process` in a fresh Ray actor (starting a local Ray if none is running)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        started = True
    try:
        remote_probe = ray.remote(num_cpus=0)(probe_process)
        return ray.get(remote_probe.remote(), timeout=timeout_s)
    finally:
        if started:
            ray.shutdown()


def _problems(report: dict[str, Any], where: str) -> list[str]:
    from gepo_plugin.names import expected_names

    problems = []
    if not report["entry_point_loaded"]:
        problems.append(
            f"{where}: verl did not load the plugin's entry point (is gepo-plugin installed in this environment, "
            "and VERL_USE_EXTERNAL_PLUGINS not 'none'?)"
        )
    if report["status"].get("error"):
        problems.append(f"{where}: registration failed: {report['status']['error']}")
    for kind, names in expected_names().items():
        missing = [n for n in names if n not in report["registered"][kind]]
        if missing:
            problems.append(f"{where}: {kind} not registered: {missing}")
    return problems


def run(check_ray: bool = True) -> int:
    """Print the report; return the process exit code (0 when everything the plugin needs is there)."""
    import gepo_plugin

    print(f"gepo-plugin {gepo_plugin.__version__} doctor")
    found = versions()
    print("  versions: " + " | ".join(f"{k} {v}" for k, v in found.items()))
    problems = [f"{name} is not installed" for name, v in found.items() if v == "MISSING"]
    if found.get("verl") != "MISSING":
        from gepo_plugin.names import verl_version_supported

        if not verl_version_supported(found["verl"]):
            problems.append(f"verl {found['verl']} is outside the supported range >=0.9.1,<0.10")
    reports = {"launcher": probe_process()}
    if check_ray:
        try:
            reports["fresh Ray actor"] = probe_ray_actor()
        except Exception as error:  # report, do not crash the doctor
            problems.append(f"could not start a Ray actor: {type(error).__name__}: {error}")
    for where, report in reports.items():
        reg = report["registered"]
        print(f"  {where} (pid {report['pid']}):")
        print(f"    policy losses:        {', '.join(reg['policy_losses']) or '-'}")
        print(f"    advantage estimators: {', '.join(reg['advantage_estimators']) or '-'}")
        print(f"    trainers:             {', '.join(reg['trainers']) or '-'}")
        patches = report["patches"]
        print(f"    patches applied:      {', '.join(patches) if patches else 'none (only public verl hooks in use)'}")
        problems.extend(_problems(report, where))
    if problems:
        print("PROBLEMS:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    where = "in the launcher and in Ray workers" if check_ray else "in this process (Ray not checked)"
    print(f"OK: the plugin is registered {where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from gepo_plugin.__main__ import main as cli_main

    return cli_main(["doctor", *(argv if argv is not None else sys.argv[1:])])
