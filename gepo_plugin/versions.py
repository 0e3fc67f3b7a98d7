"""Installed package versions, read from their metadata (nothing is imported): the seam and the patches check them.

One reader for both, so a test that pretends another version (``tests/conftest.py::installed_versions``) reaches
every check at once.
"""

from __future__ import annotations

import importlib.metadata as metadata


def installed_version(package: str) -> str | None:
    """Installed version of a distribution (None when absent); cheap, imports nothing."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
