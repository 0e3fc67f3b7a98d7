"""What a synthetic fleet looks like: how long its samplers take, how long their answers are, who straggles or
vanishes (one typed config, its defaults defined here once)."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class FleetProfile(BaseModel):
    """The synthetic samplers' behaviour (``python -m gepo_plugin.fleet_sim --help`` lists each as an option)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation_median_s: float = Field(1.0, gt=0, description="median seconds a request takes (log-normal)")
    generation_sigma: float = Field(0.6, ge=0, description="sigma of the log-normal of a request's seconds")
    length_mean: float = Field(0.7, gt=0, le=1, description="mean answer length, as a share of its max_tokens")
    stragglers: float = Field(0.05, ge=0, le=1, description="share of samplers whose every request is slower")
    straggler_factor: float = Field(5.0, ge=1, description="how much slower a straggler is")
    vanish: float = Field(0.0, ge=0, le=1, description="share of samplers that go silent for good during the run")
    vanish_after_s: float = Field(40.0, gt=0, description="seconds after its first poll when a vanishing one goes")
    liars: int = Field(0, ge=0, description="samplers (the first ones) that report each log-prob higher than it is")
    liar_shift: float = Field(0.5, gt=0, description="how much higher a liar reports each log-prob")
    seed: int = Field(0, description="seed of every draw (a sampler's own draws are seeded by its name)")

    def rng(self, name: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def sampler_name(index: int) -> str:
    return f"s{index:04d}"


def token_env(index: int) -> str:
    """The environment variable of a synthetic sampler's token on the learner's node."""
    return f"GEPO_FLEET_TOKEN_{index:04d}"


def sampler_token(secret: str, name: str) -> str:
    """A sampler's bearer token, derived from the fleet's secret (the learner's side is given the same, by env)."""
    return hmac.new(secret.encode(), name.encode(), hashlib.sha256).hexdigest()
