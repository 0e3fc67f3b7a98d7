"""The ``hetero`` config block, parsed and validated once (framework-free: plain mappings in).

Everything a HeteroRL run needs from the config is turned into objects here, so a typo fails at
start-up with a message that says what to change, not after minutes of Ray start-up:
the :class:`~gepo_plugin.hetero.staleness.StalenessPolicy`, one delay model per sampler group
(:mod:`gepo_plugin.hetero.delays`) and the sampler-group sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gepo_plugin.hetero.delays import DelayConfigError, DelayModel, build_delay_model
from gepo_plugin.hetero.staleness import StalenessConfigError, StalenessPolicy

#: ``delay.distribution`` value that switches the delay simulation off.
NO_DELAY = "none"


class HeteroConfigError(ValueError):
    """An impossible ``hetero`` setting; the message names the key and how to fix it."""


def _delay_spec(spec: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
    """Drop unset keys; ``None`` when the delay is switched off."""
    if spec is None:
        return None
    spec = {str(k): v for k, v in dict(spec).items() if v is not None}
    distribution = str(spec.get("distribution", NO_DELAY)).lower()
    if distribution in (NO_DELAY, "null", ""):
        return None
    spec["distribution"] = distribution
    unused_for = {
        "constant": {"mean", "mu", "sigma", "shape", "scale", "low", "high", "path"},
        "exponential": {"seconds", "mu", "sigma", "shape", "scale", "low", "high", "path"},
        "lognormal": {"seconds", "mean", "shape", "scale", "path"},
        "weibull": {"seconds", "mean", "mu", "sigma", "path"},
        "trace": {"seconds", "mean", "mu", "sigma", "shape", "scale", "low", "high"},
    }.get(distribution, set())
    stray = sorted(unused_for & spec.keys())
    if stray:
        raise HeteroConfigError(f"{where}: {stray} do not apply to distribution={distribution}; remove them")
    # Interval parameters exclude native ones (and vice versa): say which was meant.
    if distribution in ("lognormal", "weibull"):
        native = {"mu", "sigma"} if distribution == "lognormal" else {"shape", "scale"}
        if {"low", "high"} & spec.keys() and native & spec.keys():
            raise HeteroConfigError(
                f"{where}: give either the interval (low, high, confidence) or {sorted(native)}, not both"
            )
        if not ({"low", "high"} & spec.keys()):
            spec.pop("confidence", None)
            spec.pop("clip", None)
    return spec


@dataclass(frozen=True)
class HeteroSettings:
    """Parsed ``hetero`` block."""

    enable: bool
    policy: StalenessPolicy
    seed: int
    sampler_groups: tuple[int, ...] | None
    delays: tuple[DelayModel, ...] | None  # one per group; None: no delay simulation
    default_delay: DelayModel | None

    @property
    def simulates_delay(self) -> bool:
        return self.default_delay is not None or any(d is not None for d in self.delays or ())

    def group_sizes(self, num_replicas: int) -> tuple[int, ...]:
        """Replicas per sampler group for ``num_replicas`` rollout replicas (checked against the config)."""
        if num_replicas < 1:
            raise HeteroConfigError("HeteroRL needs at least one standalone rollout replica (sampler)")
        if self.sampler_groups is None:
            sizes = (1,) * num_replicas
        else:
            sizes = self.sampler_groups
            if sum(sizes) != num_replicas:
                raise HeteroConfigError(
                    f"hetero.sampler_groups={list(sizes)} covers {sum(sizes)} replicas but verl started "
                    f"{num_replicas} rollout replicas (rollout.nnodes * n_gpus_per_node / tensor parallel size); "
                    "make the sizes add up or set hetero.sampler_groups=null (one group per replica)"
                )
        if self.delays is not None and len(self.delays) != len(sizes):
            raise HeteroConfigError(
                f"hetero.group_delays has {len(self.delays)} entries for {len(sizes)} sampler groups; one per group"
            )
        return sizes

    def delay_for(self, group: int) -> DelayModel | None:
        if self.delays is not None:
            return self.delays[group]
        return self.default_delay


def parse_hetero(block: Mapping[str, Any] | None) -> HeteroSettings:
    """Validate the ``hetero`` block (an OmegaConf node or a dict) into :class:`HeteroSettings`."""
    block = dict(block or {})
    known = {
        "enable",
        "max_lag",
        "strategy",
        "refuse_mixed_versions",
        "seed",
        "sampler_groups",
        "delay",
        "group_delays",
        "admission_margin",
    }
    unknown = sorted(set(block) - known)
    if unknown:
        raise HeteroConfigError(f"unknown hetero option(s) {unknown}; valid: {sorted(known)}")
    max_lag = block.get("max_lag", 8)
    if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int)):
        raise HeteroConfigError(f"hetero.max_lag must be an integer >= 0 or null, got {max_lag!r}")
    try:
        policy = StalenessPolicy(
            max_lag=max_lag,
            strategy=str(block.get("strategy", "wait")),
            refuse_mixed_versions=bool(block.get("refuse_mixed_versions", False)),
            admission_margin=int(block.get("admission_margin", 0) or 0),
        )
    except StalenessConfigError as error:
        raise HeteroConfigError(f"hetero: {error}") from None
    seed = block.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise HeteroConfigError(f"hetero.seed must be an integer >= 0, got {seed!r}")
    groups = block.get("sampler_groups")
    sizes = None
    if groups is not None:
        sizes = tuple(groups) if isinstance(groups, Sequence) or hasattr(groups, "__iter__") else (groups,)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise HeteroConfigError(
                f"hetero.sampler_groups must be a non-empty list of replica counts >= 1, got {groups!r}"
            )
    try:
        default_spec = _delay_spec(block.get("delay"), "hetero.delay")
        default_delay = build_delay_model(default_spec) if default_spec else None
        delays = None
        if block.get("group_delays") is not None:
            specs = list(block["group_delays"])
            if sizes is not None and len(specs) != len(sizes):
                raise HeteroConfigError(
                    f"hetero.group_delays has {len(specs)} entries but hetero.sampler_groups has {len(sizes)} groups"
                )
            built = []
            for i, spec in enumerate(specs):
                parsed = _delay_spec(spec, f"hetero.group_delays[{i}]")
                built.append(build_delay_model(parsed) if parsed else None)
            delays = tuple(built)
    except DelayConfigError as error:
        raise HeteroConfigError(f"hetero delay: {error}") from None
    return HeteroSettings(
        enable=bool(block.get("enable", False)),
        policy=policy,
        seed=int(seed),
        sampler_groups=sizes,
        delays=delays,
        default_delay=default_delay,
    )
