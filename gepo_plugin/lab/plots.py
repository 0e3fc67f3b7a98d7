"""Whether the lab can draw its PNGs (matplotlib is the optional ``[lab]`` extra), decided before any work starts."""

from __future__ import annotations

import sys

INSTALL_HINT = "pip install 'gepo-plugin[lab]'"


def plots_available() -> bool:
    """True when matplotlib is installed; otherwise say once, up front, that the PNGs will be skipped and how to
    get them (results are written either way: CSV, JSON and the markdown table need no extra)."""
    try:
        import matplotlib  # noqa: F401  (optional: the [lab] extra; this is the probe)
    except ImportError:
        pass
    else:
        return True
    print(
        f"gepo-lab: matplotlib is not installed, so the PNG plots are skipped; the CSV, JSON and markdown results are "
        f"written as usual. For the plots: {INSTALL_HINT}",
        file=sys.stderr,
        flush=True,
    )
    return False
