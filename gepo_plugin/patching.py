"""Bookkeeping of patches to verl (see the repository's ``patches/``).

Every change to verl's behaviour beyond its public hooks is a named, version-checked patch
recorded here when applied, so ``python -m gepo_plugin doctor`` can say exactly what is active.
"""

from __future__ import annotations

APPLIED: list[str] = []


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in order."""
    return list(APPLIED)
