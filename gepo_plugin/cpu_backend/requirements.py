"""What a CPU run must have in its config: one record per setting, and one check that refuses a contradiction.

The CPU backend's engines (verl's Megatron engine, verl's vLLM rollout) each declare their :class:`Requirement`
list; the launcher fills every one in where the user set nothing (:func:`as_settings`) and then
:func:`refuse_contradictions` stops a run whose explicit setting cannot work, naming the key and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.verl_glue.errors import PluginConfigError


@dataclass(frozen=True)
class Requirement:
    """A value a CPU run must have, and why (the launcher fills it in; an explicit other value fails)."""

    key: str
    value: object
    why: str


def as_settings(requirements: Iterable[Requirement]) -> dict[str, object]:
    """``{key: value}`` for the launcher to fill in where the user is silent."""
    return {requirement.key: requirement.value for requirement in requirements}


def refuse_contradictions(config: DictConfig, requirements: Iterable[Requirement], context: str) -> None:
    """Raise :class:`PluginConfigError` for the first requirement ``config`` contradicts (``context``: which run)."""
    for requirement in requirements:
        found = OmegaConf.select(config, requirement.key, default=None)
        if found != requirement.value:
            raise PluginConfigError(
                f"{requirement.key}={found!r} cannot work with {context}: {requirement.why}. "
                f"Fix: remove the override (the CPU backend sets {requirement.value!r})."
            )
