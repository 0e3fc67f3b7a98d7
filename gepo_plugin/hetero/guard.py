"""A staleness guard: when the trained batches' importance weights degenerate, the effective max lag tightens.

Stale samples hurt through their importance weights: as the learner moves away from the samplers' weights, a few
sequences carry most of the weight and the rest contribute little. The effective sample size of a batch's
sequence ratios ``w_i = p_i / q_i`` (length-normalised, as GSPO's and GEPO's), ``ESS/N = (sum w)^2 / (N sum w^2)``
(exactly 1 on-policy, 1/N when one sequence dominates), measures that whatever the loss. No framework watches it;
this guard does, and acts before the run collapses:

* after ``patience`` consecutive trained steps with ``ESS/N < min_ess`` the effective max lag halves (not below
  ``floor``);
* after ``patience`` consecutive steps with ``ESS/N >= relax_ess`` it doubles again (never above the configured
  ``max_lag``, which stays the hard ceiling).

Every change is a decision of the shared :class:`~gepo_plugin.hetero.core.StalenessCore` (verl's replay buffer and
the lab's queue both consult it), logged once, counted and saved with the core's books. Framework-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from gepo_plugin.hetero.staleness import StalenessPolicy
from gepo_plugin.options import STRICT_BLOCK


class GuardConfig(BaseModel):
    """``hetero.guard.*`` (and the lab's ``guard``): off by default."""

    model_config = STRICT_BLOCK

    enable: StrictBool = Field(
        False,
        description="true: tighten the effective max lag while the trained batches' importance weights degenerate "
        "(ESS/N below min_ess) and relax it when they recover; max_lag stays the hard ceiling",
    )
    min_ess: float = Field(
        0.5,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="tighten (halve the effective max lag) after `patience` steps in a row with ESS/N below this",
    )
    relax_ess: float = Field(
        0.8,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="relax (double it, up to max_lag) after `patience` steps in a row with ESS/N at least this",
    )
    patience: StrictInt = Field(2, ge=1, description="consecutive steps a condition must hold before the bound moves")
    floor: StrictInt = Field(1, ge=0, description="the effective max lag never goes below this")

    @model_validator(mode="after")
    def _ordered(self) -> GuardConfig:
        if self.relax_ess < self.min_ess:
            raise ValueError(f"relax_ess ({self.relax_ess}) must be >= min_ess ({self.min_ess})")
        return self


def guard_ceiling(policy: StalenessPolicy) -> int:
    """The guard's hard ceiling, ``policy``'s ``max_lag``: the one check that it is bounded (the guard tightens it)."""
    if policy.max_lag is None:
        raise ValueError("guard.enable=true tightens max_lag, so max_lag must be a number (it is null: unbounded)")
    return policy.max_lag


def check_guard(guard: GuardConfig, policy: StalenessPolicy) -> None:
    """Refuse a guard that could not work with ``policy`` (a ``ValueError`` naming the keys and the fix)."""
    if not guard.enable:
        return
    if guard.floor > guard_ceiling(policy):
        raise ValueError(f"guard.floor ({guard.floor}) > max_lag ({policy.max_lag}); the floor is at most the bound")
    if policy.strategy == "wait" and guard.floor < policy.admission_margin:
        raise ValueError(
            f"guard.floor ({guard.floor}) < admission_margin ({policy.admission_margin}) under the wait strategy: a "
            "bound tightened below the margin would let no sampler start; raise guard.floor or lower the margin"
        )


def ess_fraction(log_weights: torch.Tensor) -> float:
    """``ESS/N`` of ``exp(log_weights)``, in log space: ``exp(2 LSE(x) - LSE(2x) - log N)`` (finite for any x)."""
    x = log_weights.detach().reshape(-1).double()
    if x.numel() == 0:
        return math.nan
    return float(torch.exp(2 * torch.logsumexp(x, 0) - torch.logsumexp(2 * x, 0) - math.log(x.numel())))


def ess_fraction_from_sums(count: float, total: float, total_sq: float) -> float:
    """``ESS/N`` from a batch's additive totals ``N``, ``sum w``, ``sum w^2`` (they add up over micro-batches)."""
    if count <= 0 or total_sq <= 0:
        return math.nan
    return total * total / (count * total_sq)


@dataclass
class StalenessGuard:
    """The guard's state: the effective bound, the current streaks and every change made."""

    config: GuardConfig
    ceiling: int
    effective: int = -1
    low_streak: int = 0
    high_streak: int = 0
    changes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.effective < 0:
            self.effective = self.ceiling

    @classmethod
    def for_policy(cls, config: GuardConfig, policy: StalenessPolicy) -> StalenessGuard:
        """The guard of ``policy``'s bound, its ceiling (refused when unbounded: :func:`guard_ceiling`)."""
        return cls(config, guard_ceiling(policy))

    def observe(self, step: int, ess: float) -> tuple[int, int] | None:
        """The trained batch of ``step`` had ``ESS/N = ess``; returns ``(old, new)`` if the bound moved."""
        if not math.isfinite(ess):
            return None
        config = self.config
        if ess < config.min_ess:
            self.low_streak, self.high_streak = self.low_streak + 1, 0
            if self.low_streak >= config.patience and self.effective > config.floor:
                return self._move(step, ess, max(config.floor, self.effective // 2), "tighten")
        elif ess >= config.relax_ess:
            self.high_streak, self.low_streak = self.high_streak + 1, 0
            if self.high_streak >= config.patience and self.effective < self.ceiling:
                return self._move(step, ess, min(self.ceiling, max(1, 2 * self.effective)), "relax")
        else:
            self.low_streak = self.high_streak = 0
        return None

    def _move(self, step: int, ess: float, new: int, kind: str) -> tuple[int, int]:
        old, self.effective = self.effective, new
        self.low_streak = self.high_streak = 0
        self.changes.append({"step": int(step), "kind": kind, "from": old, "to": new, "ess": float(ess)})
        return old, new

    def metrics(self) -> dict[str, float]:
        """The effective bound and how often it moved (unprefixed names)."""
        return {
            "guard/max_lag": float(self.effective),
            "guard/tightened": float(sum(c["kind"] == "tighten" for c in self.changes)),
            "guard/relaxed": float(sum(c["kind"] == "relax" for c in self.changes)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "effective": self.effective,
            "low_streak": self.low_streak,
            "high_streak": self.high_streak,
            "changes": list(self.changes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.effective = min(int(state["effective"]), self.ceiling)
        self.low_streak, self.high_streak = int(state["low_streak"]), int(state["high_streak"])
        self.changes = list(state["changes"])
