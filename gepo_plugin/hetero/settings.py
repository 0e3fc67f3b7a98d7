"""The ``hetero`` config block: one typed model, its defaults written once, parsed and validated once.

:class:`HeteroConfig` is the only place a HeteroRL default is written: the Hydra node users override is built
from it (:mod:`gepo_plugin.config`), the verl sampler and trainer and the lab read it. :func:`parse_hetero`
turns a plain mapping into :class:`HeteroSettings` (the staleness policy, one delay model per sampler group, the
group sizes), so a typo fails at start-up with a message that names the key, not after minutes of Ray start-up.
Framework-free: plain mappings in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from gepo_plugin import config_keys
from gepo_plugin.hetero.audit.settings import AuditConfig
from gepo_plugin.hetero.delays import DelayConfig, DelayModel
from gepo_plugin.hetero.guard import GuardConfig, check_guard
from gepo_plugin.hetero.staleness import (
    DEFAULT_ADMISSION_MARGIN,
    DEFAULT_MAX_LAG,
    DEFAULT_REFUSE_MIXED_VERSIONS,
    DEFAULT_STRATEGY,
    StalenessConfigError,
    StalenessPolicy,
)
from gepo_plugin.options import STRICT_BLOCK, OptionsError, parse_options
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.remote.settings import GatewayConfig, RemoteSamplerConfig, duplicate_names

#: Where the block lives in the plugin's config tree.
HETERO_KEY = config_keys.HETERO
#: ``hetero.transport`` of the simulated delay on verl's own engine, and of the weight relay.
SIMULATED_TRANSPORT, RELAY_TRANSPORT = "simulated", "relay"


class HeteroConfigError(OptionsError):
    """An impossible ``hetero`` setting; the message names the key and how to fix it."""


class HealthConfig(BaseModel):
    """How dead or hung samplers are detected (``hetero.health.*``); see README "When a sampler fails"."""

    model_config = STRICT_BLOCK

    enable: StrictBool = Field(
        True,
        description="true: probe every sampler's rollout servers and retire a sampler that died or hung, so training "
        "goes on with the others; false: a lost sampler is noticed only when a call to it fails",
    )
    interval_s: float = Field(
        2.0, gt=0, allow_inf_nan=False, description="seconds between two probes of the same rollout server"
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="a server that has not answered a probe within this many seconds is hung: it is stopped and its "
        "sampler retired (make it longer than the longest pause of a healthy server, e.g. a weight install)",
    )


class HeteroConfig(BaseModel):
    """HeteroRL's options (``hetero.*``)."""

    model_config = STRICT_BLOCK

    enable: StrictBool = Field(
        False,
        description="true: samplers decoupled from the learner (needs trainer.v1.trainer_mode=separate_async); "
        "the plugin's sampler, delayed weight sync and checkpointed books",
    )
    max_lag: StrictInt | None = Field(
        DEFAULT_MAX_LAG,
        ge=0,
        description="exact bound K in weight versions: no trained group has lag > K (lag = learner version - oldest "
        "weight version of any token of the group); 0 = on-policy; null = unbounded (lags only recorded)",
    )
    strategy: Literal["drop", "wait"] = Field(
        DEFAULT_STRATEGY,
        description="wait: nothing is dropped for staleness, the learner waits for groups that would expire; "
        "drop: groups that would exceed the bound are evicted and counted (hetero/dropped/stale)",
    )
    refuse_mixed_versions: StrictBool = Field(
        DEFAULT_REFUSE_MIXED_VERSIONS,
        description="true: evict groups whose tokens come from several weight versions (partial rollouts across an "
        "update); they are always counted",
    )
    admission_margin: StrictInt = Field(
        DEFAULT_ADMISSION_MARGIN,
        ge=0,
        description="a sampler group whose weights are older than max_lag - admission_margin versions starts no new "
        "rollout until newer weights arrive (admission control)",
    )
    seed: StrictInt = Field(0, ge=0, description="seed of the delay draws (one independent stream per sampler group)")
    sampler_groups: list[StrictInt] | None = Field(
        None,
        min_length=1,
        description="rollout replicas per sampler group, e.g. [2, 1, 1]; they must add up to the number of rollout "
        "replicas; null = one group per replica",
    )
    delay: DelayConfig = Field(
        default_factory=DelayConfig, description="weight-arrival delay of every sampler group (per group and version)"
    )
    group_delays: list[DelayConfig] | None = Field(
        None, description="one delay per sampler group (groups may differ); null = `delay` for every group"
    )

    health: HealthConfig = Field(
        default_factory=HealthConfig, description="detection of samplers that died or hung (hetero.health.*)"
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="the staleness guard (hetero.guard.*): tighten the effective max lag while the importance "
        "weights' ESS/N is low",
    )
    replace_failed: StrictBool = Field(
        False,
        description="true: a retired sampler replica is replaced by a new one, which installs the learner's current "
        "weights before it takes requests; false: training goes on with the samplers left",
    )
    learner_resource: str | None = Field(
        "gepo_learner",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="custom Ray resource that marks the learner's nodes (examples/ray/start_head.sh and "
        "start_worker.sh offer it with NODE_ROLE=learner): verl's own services (TaskRunner, TransferQueue, load "
        "balancer, agent-loop and reward workers) are placed on those nodes, so any sampler node can be lost; "
        "without a node offering it (one machine, or a cluster started without it) Ray places them; null = always Ray",
    )
    transport: Literal["simulated", "relay"] = Field(
        "simulated",
        description="how weights reach the samplers: simulated = verl's in-cluster engine, with the delays above "
        "simulated on the learner; relay = the learner publishes each version once to hetero.relay.url and every "
        "sampler replica pulls exact deltas over its own link (real arrivals drive the bound)",
    )
    relay: RelayConfig = Field(
        default_factory=RelayConfig, description="the weight relay (hetero.relay.*), used with hetero.transport=relay"
    )
    remote_samplers: list[RemoteSamplerConfig] = Field(
        default_factory=list,
        description="samplers outside the learner's Ray cluster (a vLLM server anywhere, behind NAT too): each runs "
        "`python -m gepo_sampler`, follows the relay and dials hetero.gateway; one sampler group per group "
        "label, after the in-cluster groups. Needs hetero.transport=relay with an Ed25519 key pair",
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig,
        description="the endpoint remote samplers dial (hetero.gateway.*), on the node of verl's TaskRunner",
    )
    audit: AuditConfig = Field(
        default_factory=AuditConfig,
        description="auditing remote samplers (hetero.audit.*): a share of their trajectories recomputed under the "
        "claimed version, and a liar quarantined by a sequential test with a stated false-positive rate",
    )

    @model_validator(mode="after")
    def _coherent(self) -> HeteroConfig:
        if self.sampler_groups is not None and any(size < 1 for size in self.sampler_groups):
            raise ValueError(f"sampler_groups are replica counts >= 1, got {self.sampler_groups}")
        try:
            self.policy()
        except StalenessConfigError as error:
            raise ValueError(str(error)) from None
        check_guard(self.guard, self.policy())
        if self.transport == "relay":
            self._check_relay()
        if self.remote_samplers:
            self._check_remote()
        elif self.audit.enable:
            raise ValueError(
                "hetero.audit.enable=true audits remote samplers, and hetero.remote_samplers is empty: add the "
                "samplers to audit, or set hetero.audit.enable=false"
            )
        if self.sampler_groups is not None:  # else the group count is known only with the replicas (group_sizes)
            self.check_per_group(len(self.sampler_groups))
        return self

    def check_per_group(self, groups: int, detail: str = "") -> None:
        """The one check of the lists given per sampler group (``group_delays``; ``relay.links``, used with the
        relay; an empty list of links is none given): one entry for each of ``groups`` (``detail``: how that count
        arose)."""
        links = self.relay.links if self.transport == RELAY_TRANSPORT else []
        how = f" ({detail})" if detail else ""
        for key, entries in (("group_delays", self.group_delays), ("relay.links", links or None)):
            if entries is not None and len(entries) != groups:
                raise HeteroConfigError(
                    f"{HETERO_KEY}.{key} has {len(entries)} entries for {groups} sampler groups{how}; "
                    "give one per group"
                )

    def _check_relay(self) -> None:
        if not self.relay.url:
            raise ValueError("hetero.transport=relay needs hetero.relay.url (a shared directory or an fsspec URL)")
        if self.delay.distribution != "none" or self.group_delays is not None:
            raise ValueError(
                "hetero.transport=relay moves real weights, so their delay is real: remove hetero.delay and "
                "hetero.group_delays (rehearse a slow link with hetero.relay.links instead)"
            )

    def _check_remote(self) -> None:
        if self.transport != RELAY_TRANSPORT:
            raise ValueError(
                "hetero.remote_samplers follow the weight relay: set hetero.transport=relay and hetero.relay.url (a "
                "store the samplers' hosts can read)"
            )
        if self.relay.signing_key_env is None:
            raise ValueError(
                "hetero.remote_samplers verify the weights with the learner's public key and are never given a "
                "shared secret: set hetero.relay.signing_key_env and hetero.relay.public_key (`python -m gepo_plugin "
                "keygen` prints a pair)"
            )
        repeated = duplicate_names(self.remote_samplers)
        if repeated:
            raise ValueError(f"hetero.remote_samplers names {repeated} more than once; give each sampler its own name")

    def remote_groups(self) -> list[str]:
        """The remote samplers' group labels, in the order they first appear (groups after the in-cluster ones)."""
        return list(dict.fromkeys(sampler.group_label for sampler in self.remote_samplers))

    def policy(self) -> StalenessPolicy:
        return StalenessPolicy(
            max_lag=self.max_lag,
            strategy=self.strategy,
            refuse_mixed_versions=self.refuse_mixed_versions,
            admission_margin=self.admission_margin,
        )


@dataclass(frozen=True)
class HeteroSettings:
    """A parsed ``hetero`` block, with the runtime objects built from it."""

    config: HeteroConfig
    policy: StalenessPolicy
    delays: tuple[DelayModel | None, ...] | None  # one per group (group_delays); None: ``default_delay`` for all
    default_delay: DelayModel | None

    @property
    def enable(self) -> bool:
        return self.config.enable

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def sampler_groups(self) -> tuple[int, ...] | None:
        groups = self.config.sampler_groups
        return None if groups is None else tuple(groups)

    @property
    def health(self) -> HealthConfig:
        return self.config.health

    @property
    def guard(self) -> GuardConfig:
        return self.config.guard

    @property
    def transport(self) -> str:
        """How weights reach the samplers (``hetero.transport``): the one place that says which transport is active."""
        return self.config.transport

    @property
    def relay(self) -> RelayConfig | None:
        """The relay's options when weights travel through it (``hetero.transport=relay``), else None."""
        return self.config.relay if self.transport == RELAY_TRANSPORT else None

    @property
    def simulates_delay(self) -> bool:
        return self.default_delay is not None or any(d is not None for d in self.delays or ())

    def group_sizes(self, num_replicas: int, detail: str = "") -> tuple[int, ...]:
        """Replicas per sampler group for ``num_replicas`` rollout replicas (``detail``: how that count arose)."""
        how = f" ({detail})" if detail else ""
        if num_replicas < 1:
            raise HeteroConfigError(
                f"HeteroRL needs at least one standalone rollout replica (sampler), but verl would start none{how}: "
                "give the samplers enough GPUs (actor_rollout_ref.rollout.nnodes, n_gpus_per_node) or a smaller "
                "tensor_model_parallel_size"
            )
        sizes = self.sampler_groups or (1,) * num_replicas
        if sum(sizes) != num_replicas:
            raise HeteroConfigError(
                f"hetero.sampler_groups={list(sizes)} covers {sum(sizes)} replicas but verl starts {num_replicas} "
                f"rollout replicas{how}; make the sizes add up or set hetero.sampler_groups=null (one group per "
                "replica)"
            )
        self.config.check_per_group(len(sizes), detail)
        return sizes

    def delay_for(self, group: int) -> DelayModel | None:
        if self.delays is not None:
            return self.delays[group]
        return self.default_delay


def parse_hetero(block: Mapping[str, Any] | None) -> HeteroSettings:
    """Validate the ``hetero`` block (a plain mapping, or an OmegaConf node) into :class:`HeteroSettings`.

    Called once per process by the owner of the run's settings (the launcher; verl's trainer, which hands the result
    to the replay buffer), and every part of the result is immutable.
    """
    if block is not None and not isinstance(block, dict):
        from omegaconf import OmegaConf  # lazy: components import no config framework (a dict needs none)

        block = OmegaConf.to_container(block, resolve=True) if OmegaConf.is_config(block) else dict(block)
    return _parse_block(block)


def _parse_block(block: dict[str, Any] | None) -> HeteroSettings:
    config = parse_options(HeteroConfig, block, HETERO_KEY, HeteroConfigError)
    delays = None
    if config.group_delays is not None:
        delays = tuple(spec.build() for spec in config.group_delays)
    return HeteroSettings(config=config, policy=config.policy(), delays=delays, default_delay=config.delay.build())


def rollout_replica_count(rollout: Mapping[str, Any]) -> tuple[int, str]:
    """Standalone rollout replicas verl starts for ``actor_rollout_ref.rollout`` (as ``LLMServerManager``
    computes it: nnodes x n_gpus_per_node // (tensor x data x pipeline parallel size)), and the sum spelled out."""
    names = ("nnodes", "n_gpus_per_node", "tensor_model_parallel_size", "data_parallel_size")
    nodes, gpus, tensor, data = (int(rollout.get(name, 1)) for name in names)
    pipeline = int(rollout.get("pipeline_model_parallel_size", 1))
    count = nodes * gpus // (tensor * data * pipeline)
    detail = (
        f"actor_rollout_ref.rollout.nnodes={nodes} x n_gpus_per_node={gpus} / (tensor_model_parallel_size={tensor} "
        f"x data_parallel_size={data} x pipeline_model_parallel_size={pipeline}) = {count} replica(s)"
    )
    return count, detail
