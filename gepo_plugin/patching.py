"""Version-checked patches to verl (their code lives in the repository's ``patches/``).

Every change to verl's behaviour beyond its public hooks is a :class:`Patch`: a name, the verl
versions it was written for, what it fixes and why, the seam feature whose contacts it touches
(:mod:`gepo_plugin.verl_glue.seam`), and an ``apply`` function. :func:`apply` refuses (raises) on any
other verl version, or when a contact it needs is missing, instead of guessing, and records what it
applied in :data:`APPLIED`, so ``python -m gepo_plugin doctor`` can say exactly what is active. Each patch is
applied only where it is needed: ``gloo_process_group`` by the CPU backend (``VERL_PLATFORM=cpu``),
``hybrid_engine_off`` by HeteroRL runs with ``hybrid_engine=False``, ``server_identity`` by HeteroRL
runs (``hetero.enable=true``). A plain GEPO run on GPUs applies none.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

APPLIED: list[str] = []


class PatchVersionError(RuntimeError):
    """A patch was asked to apply to a verl version it was not written for."""


@dataclass(frozen=True)
class Patch:
    """A change to verl's behaviour: every private name it touches is a contact of ``feature`` in the seam."""

    name: str
    verl_versions: str
    reason: str
    apply: Callable[[], None]
    feature: str


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in order."""
    return list(APPLIED)


def apply(patch: Patch) -> bool:
    """Apply ``patch`` once per process; raise :class:`PatchVersionError` on an unsupported verl."""
    if patch.name in APPLIED:
        return False
    import verl
    from packaging.specifiers import SpecifierSet

    if verl.__version__ not in SpecifierSet(patch.verl_versions):
        raise PatchVersionError(
            f"patch {patch.name!r} was written for verl {patch.verl_versions} but verl {verl.__version__} is "
            f"installed; refusing to patch blindly. It fixes: {patch.reason}. Check whether this verl still "
            "needs it and update patches/ (or use a supported verl)."
        )
    from gepo_plugin.verl_glue import seam

    seam.require(patch.feature)
    patch.apply()
    APPLIED.append(patch.name)
    return True


def apply_named(name: str) -> bool:
    """Apply the ``PATCH`` of ``gepo_plugin.patches.<name>`` (the repository's ``patches/<name>.py``)."""
    return apply(importlib.import_module(f"gepo_plugin.patches.{name}").PATCH)


def apply_optional(name: str, consequence: str, log: logging.Logger) -> bool:
    """:func:`apply_named` for a patch a run can do without: on another verl, warn with ``consequence`` instead."""
    try:
        return apply_named(name)
    except PatchVersionError as error:
        log.warning("gepo-plugin: not patching (%s); %s", error, consequence)
        return False
