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
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

APPLIED: list[str] = []
#: Patches this process was told to leave out (``GEPO_SKIP_PATCHES=name,name``): to check whether a newer dependency
#: still needs one, or to show what breaks without it. The doctor lists them.
SKIPPED: list[str] = []
SKIP_ENV = "GEPO_SKIP_PATCHES"


class PatchVersionError(RuntimeError):
    """A patch was asked to apply to a package version it was not written for."""


@dataclass(frozen=True)
class Patch:
    """A change to a dependency's behaviour: every private name it touches is a contact of ``feature`` in the seam.

    ``versions`` maps each package whose code the patch changes or relies on (``"verl"``, ``"megatron-core"``,
    ``"mbridge"``) to the version specifier it was written for. ``check_contacts(feature)`` raises unless every
    private name of ``feature`` has the shape the patch relies on; it runs before ``apply`` changes anything.
    """

    name: str
    versions: Mapping[str, str]
    reason: str
    apply: Callable[[], None]
    feature: str
    check_contacts: Callable[[str], None]


def version_problem(patch: Patch) -> str | None:
    """Why ``patch`` must not be applied here (a package absent or at another version), or None."""
    from packaging.specifiers import SpecifierSet

    from gepo_plugin import versions

    for package, specifier in patch.versions.items():
        installed = versions.installed_version(package)
        if installed is None:
            return f"it was written for {package}{specifier}, which is not installed"
        if installed not in SpecifierSet(specifier):
            return f"it was written for {package} {specifier} but {package} {installed} is installed"
    return None


def first_version_problem(names) -> str | None:
    """The first of the named patches (``patches/<name>.py``) the installed packages cannot take, and why; or None."""
    import importlib

    for name in names:
        problem = version_problem(importlib.import_module(f"gepo_plugin.patches.{name}").PATCH)
        if problem is not None:
            return f"the patch {name!r}: {problem}"
    return None


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in order."""
    return list(APPLIED)


def skipped_by_request(name: str) -> bool:
    """Is ``name`` listed in ``GEPO_SKIP_PATCHES`` (comma-separated)?"""
    import os

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
            "this version still needs it and update patches/ (or install a supported version)."
        )
    patch.check_contacts(patch.feature)
    patch.apply()
    APPLIED.append(patch.name)
    return True


def apply_named(name: str) -> bool:
    """Apply the ``PATCH`` of ``gepo_plugin.patches.<name>`` (the repository's ``patches/<name>.py``)."""
    return apply(importlib.import_module(f"gepo_plugin.patches.{name}").PATCH)


def apply_optional(name: str, consequence: str, log: logging.Logger) -> bool:
    """:func:`apply_named` for a patch a run can do without: on another version, warn with ``consequence`` instead."""
    try:
        return apply_named(name)
    except PatchVersionError as error:
        log.warning("gepo-plugin: not patching (%s); %s", error, consequence)
        return False
