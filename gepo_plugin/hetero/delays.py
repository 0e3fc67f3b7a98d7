"""Simulated network delay on the weight path (HeteroRL), framework-free and seeded.

In heterogeneous deployments a sampler keeps generating with the weights it has and applies a
new version only once it has arrived. These models draw that arrival delay (seconds). The GEPO
paper parameterises log-normal and Weibull delays by a central interval ``[low, high]`` holding
``confidence`` of the mass (60-1920 s at 0.995 for its 1.7B runs); both native parameters and
that interval form are accepted, and recorded delays can be replayed from a trace file.

Reproducibility: :func:`delay_rng` derives an independent stream per (seed, sampler group), so
adding a group does not change the delays of the others.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, StrictBool, model_validator

from gepo_plugin.options import STRICT_BLOCK, OptionsError, parse_options


class DelayConfigError(OptionsError):
    """A delay model is specified impossibly; the message says how to fix it."""


def delay_rng(seed: int, group: int = 0) -> np.random.Generator:
    """Independent, reproducible random stream for one sampler group."""
    return np.random.default_rng([int(seed), int(group)])


def _check_interval(low: float, high: float, confidence: float) -> None:
    if not (low > 0 and high > 0):
        raise DelayConfigError(f"delay interval bounds must be > 0 seconds, got low={low}, high={high}")
    if not low < high:
        raise DelayConfigError(f"delay interval needs low < high, got low={low}, high={high}")
    if not 0 < confidence < 1:
        raise DelayConfigError(f"confidence must be in (0, 1), e.g. 0.995, got {confidence}")


class DelayModel(ABC):
    """A distribution of weight-arrival delays in seconds (non-negative)."""

    @abstractmethod
    def _draw(self, rng: np.random.Generator, size: int) -> np.ndarray: ...

    def sample(self, rng: np.random.Generator, size: int = 1) -> np.ndarray:
        """``size`` delays (seconds), clipped to the model's ``[low, high]`` when it has one."""
        values = self._draw(rng, size)
        low, high = getattr(self, "clip_low", None), getattr(self, "clip_high", None)
        if low is not None or high is not None:
            values = np.clip(values, low if low is not None else 0.0, high if high is not None else np.inf)
        return values

    def describe(self) -> str:
        return repr(self)


@dataclass(frozen=True)
class ConstantDelay(DelayModel):
    seconds: float

    def __post_init__(self):
        if not self.seconds >= 0:
            raise DelayConfigError(f"constant delay must be >= 0 seconds, got {self.seconds}")

    def _draw(self, rng, size):
        return np.full(size, float(self.seconds))


@dataclass(frozen=True)
class ExponentialDelay(DelayModel):
    mean: float

    def __post_init__(self):
        if not self.mean > 0:
            raise DelayConfigError(f"exponential delay needs mean > 0 seconds, got {self.mean}")

    def _draw(self, rng, size):
        return rng.exponential(self.mean, size)


@dataclass(frozen=True)
class LogNormalDelay(DelayModel):
    """``exp(N(mu, sigma^2))`` seconds, optionally clipped to ``[clip_low, clip_high]``."""

    mu: float
    sigma: float
    clip_low: float | None = None
    clip_high: float | None = None

    def __post_init__(self):
        if not self.sigma > 0:
            raise DelayConfigError(f"log-normal delay needs sigma > 0, got {self.sigma}")

    @classmethod
    def from_interval(cls, low: float, high: float, confidence: float = 0.995, clip: bool = True) -> LogNormalDelay:
        """``[low, high]`` is the central ``confidence`` interval: ln low = mu - z sigma, ln high = mu + z sigma,
        with ``z = Phi^-1(1 - (1 - confidence) / 2)`` (the reference code's fit); clipped to it by default."""
        _check_interval(low, high, confidence)
        z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
        mu = (math.log(low) + math.log(high)) / 2
        sigma = (math.log(high) - math.log(low)) / (2 * z)
        return cls(mu, sigma, low if clip else None, high if clip else None)

    def quantile(self, p: float) -> float:
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(p))

    def _draw(self, rng, size):
        return rng.lognormal(self.mu, self.sigma, size)


@dataclass(frozen=True)
class WeibullDelay(DelayModel):
    """Weibull(shape k, scale lambda) seconds, optionally clipped to ``[clip_low, clip_high]``."""

    shape: float
    scale: float
    clip_low: float | None = None
    clip_high: float | None = None

    def __post_init__(self):
        if not (self.shape > 0 and self.scale > 0):
            raise DelayConfigError(f"Weibull delay needs shape > 0 and scale > 0, got {self.shape}, {self.scale}")

    @classmethod
    def from_interval(cls, low: float, high: float, confidence: float = 0.995, clip: bool = True) -> WeibullDelay:
        """Solve ``F(low) = (1-c)/2`` and ``F(high) = (1+c)/2`` for ``F(x) = 1 - exp(-(x/lambda)^k)``.

        The quantile is ``x_p = lambda (-ln(1-p))^(1/k)``; with ``g_p = ln(-ln(1-p))`` the two
        equations give ``k = (g_hi - g_lo) / ln(high/low)`` and ``lambda = low / exp(g_lo / k)``.
        """
        _check_interval(low, high, confidence)
        p_lo, p_hi = (1 - confidence) / 2, (1 + confidence) / 2
        g_lo, g_hi = math.log(-math.log(1 - p_lo)), math.log(-math.log(1 - p_hi))
        shape = (g_hi - g_lo) / math.log(high / low)
        scale = low / math.exp(g_lo / shape)
        return cls(shape, scale, low if clip else None, high if clip else None)

    def quantile(self, p: float) -> float:
        return self.scale * (-math.log(1 - p)) ** (1 / self.shape)

    def _draw(self, rng, size):
        return self.scale * rng.weibull(self.shape, size)


@dataclass(frozen=True)
class TraceDelay(DelayModel):
    """Replays recorded delays: in order (cycling) or drawn at random from the trace."""

    values: tuple[float, ...]
    order: str = "cycle"
    _cursor: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def __post_init__(self):
        if not self.values:
            raise DelayConfigError("a delay trace needs at least one value")
        if any(not (v >= 0 and math.isfinite(v)) for v in self.values):
            raise DelayConfigError("delay trace values must be finite and >= 0 seconds")
        if self.order not in ("cycle", "random"):
            raise DelayConfigError(f"trace order must be 'cycle' or 'random', got {self.order!r}")

    @classmethod
    def from_file(cls, path: str | Path, order: str = "cycle") -> TraceDelay:
        """One delay (seconds) per line; blank lines and ``#`` comments are ignored."""
        path = Path(path)
        if not path.is_file():
            raise DelayConfigError(f"delay trace file {str(path)!r} does not exist")
        values = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                values.append(float(text))
            except ValueError:
                raise DelayConfigError(f"{path}:{number}: {text!r} is not a number of seconds") from None
        return cls(tuple(values), order)

    def _draw(self, rng, size):
        values = np.asarray(self.values, dtype=float)
        if self.order == "random":
            return rng.choice(values, size)
        start = self._cursor[0]
        self._cursor[0] = start + size
        return values[(start + np.arange(size)) % len(values)]


#: Parameters each distribution takes (the others must stay unset).
PARAMETERS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "constant": frozenset({"seconds"}),
    "exponential": frozenset({"mean"}),
    "lognormal": frozenset({"mu", "sigma", "low", "high", "confidence", "clip"}),
    "weibull": frozenset({"shape", "scale", "low", "high", "confidence", "clip"}),
    "trace": frozenset({"path", "order"}),
}
_NATIVE = {"lognormal": ("mu", "sigma"), "weibull": ("shape", "scale")}
#: Fields with a default value, so "set by the user" cannot be told from None; they apply to some models only.
_DEFAULTED = frozenset({"confidence", "clip", "order"})


class DelayConfig(BaseModel):
    """One weight-arrival delay model as configured (``hetero.delay`` or one ``hetero.group_delays`` entry)."""

    model_config = STRICT_BLOCK

    distribution: Literal["none", "constant", "exponential", "lognormal", "weibull", "trace"] = Field(
        "none", description="none (no simulated delay) or the delay model; each takes the parameters listed below"
    )
    seconds: float | None = Field(None, ge=0, allow_inf_nan=False, description="constant: the delay in seconds")
    mean: float | None = Field(None, gt=0, allow_inf_nan=False, description="exponential: mean delay in seconds")
    mu: float | None = Field(None, allow_inf_nan=False, description="lognormal: mean of the log-delay")
    sigma: float | None = Field(None, gt=0, allow_inf_nan=False, description="lognormal: std of the log-delay")
    shape: float | None = Field(None, gt=0, allow_inf_nan=False, description="weibull: shape k")
    scale: float | None = Field(None, gt=0, allow_inf_nan=False, description="weibull: scale lambda (seconds)")
    low: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="lognormal/weibull: lower end (s) of the central interval"
    )
    high: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="lognormal/weibull: upper end (s) of the central interval"
    )
    confidence: float = Field(0.995, gt=0, lt=1, description="mass of the [low, high] interval (the paper: 0.995)")
    clip: StrictBool = Field(True, description="clip draws to [low, high] (interval form only)")
    path: str | None = Field(None, description="trace: file with one delay (seconds) per line")
    order: Literal["cycle", "random"] = Field("cycle", description="trace: replay in order, or draw at random")

    @model_validator(mode="after")
    def _parameters_fit_the_distribution(self) -> DelayConfig:
        kind = self.distribution
        given = {
            name
            for name in PARAMETERS["lognormal"]
            | PARAMETERS["weibull"]
            | PARAMETERS["constant"]
            | PARAMETERS["exponential"]
            | PARAMETERS["trace"]
            if name not in _DEFAULTED and getattr(self, name) is not None
        }
        stray = sorted(given - PARAMETERS[kind])
        if stray and kind == "none":
            raise ValueError(f"{stray} are set but distribution=none (no delay): set distribution or remove them")
        if stray:
            raise ValueError(f"{stray} do not apply to distribution={kind}; remove them")
        if kind in _NATIVE:
            native, interval = set(_NATIVE[kind]) & given, {"low", "high"} & given
            if native and interval:
                raise ValueError(f"give either the interval (low, high, confidence) or {list(_NATIVE[kind])}, not both")
            needed = ("low", "high") if interval else _NATIVE[kind]
            missing = [name for name in needed if name not in given]
            if missing:
                raise ValueError(f"{kind} needs {list(needed)}; missing {missing}")
            if interval and not self.low < self.high:
                raise ValueError(f"the interval needs low < high, got low={self.low}, high={self.high}")
        elif kind != "none":
            needed = sorted(PARAMETERS[kind] - _DEFAULTED)
            missing = [name for name in needed if name not in given]
            if missing:
                raise ValueError(f"{kind} needs {needed}; missing {missing}")
        if kind == "trace" and not Path(str(self.path)).is_file():
            raise ValueError(f"trace file {self.path!r} does not exist")
        return self

    def build(self) -> DelayModel | None:
        """The delay model (None for ``distribution=none``)."""
        kind = self.distribution
        if kind == "none":
            return None
        if kind == "constant":
            return ConstantDelay(float(self.seconds))
        if kind == "exponential":
            return ExponentialDelay(float(self.mean))
        if kind == "trace":
            return TraceDelay.from_file(str(self.path), self.order)
        model = LogNormalDelay if kind == "lognormal" else WeibullDelay
        if self.low is not None:
            return model.from_interval(self.low, self.high, self.confidence, self.clip)
        first, second = _NATIVE[kind]
        return model(float(getattr(self, first)), float(getattr(self, second)))


def build_delay_model(spec: Mapping[str, Any], key: str = "delay") -> DelayModel | None:
    """A delay model from a config mapping, e.g. ``{"distribution": "lognormal", "low": 60, "high": 1920,
    "confidence": 0.995}``, ``{"distribution": "weibull", "shape": 1.5, "scale": 300}`` or
    ``{"distribution": "trace", "path": "delays.txt"}``; errors name ``key``."""
    return parse_options(DelayConfig, spec, key, DelayConfigError).build()
