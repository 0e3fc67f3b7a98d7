"""The stability lab's one typed config: every knob, its default, its limits and its help, written once.

``gepo-lab stability`` generates its command line from :class:`StabilityConfig` (:mod:`gepo_plugin.options_cli`),
presets are partial configs, and the simulation, the live mode and the outputs read the same object. The
staleness defaults (strategy, admission margin) are HeteroRL's own (:mod:`gepo_plugin.hetero.staleness`), so the
lab runs the policy a verl run with the same ``hetero.*`` settings runs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator

from gepo_plugin.hetero.delays import LogNormalDelay
from gepo_plugin.hetero.guard import GuardConfig, check_guard
from gepo_plugin.hetero.staleness import (
    DEFAULT_ADMISSION_MARGIN,
    DEFAULT_STRATEGY,
    StalenessConfigError,
    StalenessPolicy,
)
from gepo_plugin.options import STRICT_BLOCK, OptionsError, parse_options
from gepo_plugin.verl_glue.rollout_correction import lab_preset

#: Methods the stability lab compares: each a preset of :data:`gepo_plugin.verl_glue.presets.PRESETS`, with the
#: policy-loss options (``actor_rollout_ref.actor.policy_loss.<key>``) that make a variant of it.
METHOD_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gepo": ("gepo", {}),
    "gspo": ("gspo", {}),
    "grpo": ("grpo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "bnpo": ("bnpo", {}),
    "gepo_plus": ("gepo_plus", {"gepo_plus_mode": "hard"}),
    "gepo_plus_soft": ("gepo_plus", {"gepo_plus_mode": "soft"}),
    "m2po": ("m2po", {}),
    "gepo_m2": ("gepo", {"m2_mask": True}),
}
METHODS: tuple[str, ...] = tuple(METHOD_PRESETS)
Method = Literal["gepo", "gspo", "grpo", "dr_grpo", "bnpo", "gepo_plus", "gepo_plus_soft", "m2po", "gepo_m2"]


class StabilityConfigError(OptionsError):
    """An impossible or unknown stability-lab option; the message says what is valid."""


def _positive(description: str, default: float) -> Any:
    return Field(default, gt=0, allow_inf_nan=False, description=description)


class StabilityConfig(BaseModel):
    """Every knob of ``gepo-lab stability`` (a preset sets some of them; the command line overrides any)."""

    model_config = STRICT_BLOCK

    # which runs
    methods: list[Method] = Field(["gepo", "gspo", "grpo"], min_length=1, description="methods to compare")
    lags: list[int] = Field([0, 64], min_length=1, description="max_lag settings (0 = on-policy)")
    seeds: list[int] = Field([0, 1], min_length=1, description="seeds; every (method, lag) runs on each")
    # task
    max_a: int = Field(50, ge=1, description="problems are ab+c= with a in [0, max_a)")
    max_b: int = Field(10, ge=1, description="and c in [0, max_b)")
    eval_fraction: float = Field(0.25, gt=0, lt=1, description="share of the problems held out for evaluation")
    task_seed: int = Field(0, ge=0, description="seed of the problem split")
    format_reward: float = Field(
        0.0, ge=0, lt=1, description="reward for 'digits then <eos>' answers (below the exact answer's 1)"
    )
    # policy
    hidden: int = Field(64, ge=1, description="hidden size of the tiny Llama-style policy")
    layers: int = Field(2, ge=1, description="transformer layers")
    heads: int = Field(4, ge=1, description="attention heads")
    threads: int = Field(1, ge=1, description="torch CPU threads (1 is fastest for this tiny model)")
    # supervised warm start
    warm_lr: float = _positive("learning rate of the supervised warm start", 3e-3)
    warm_batch: int = Field(32, ge=1, description="batch size of the warm start")
    warm_target: float = Field(0.35, ge=0, le=1, description="train accuracy at which the warm start stops")
    warm_max_steps: int = Field(1500, ge=0, description="longest warm start (steps)")
    warm_check_every: int = Field(10, ge=1, description="warm-start steps between accuracy checks")
    # RL
    rl_steps: int = Field(150, ge=1, description="learner updates per run")
    lr: float = Field(1e-3, ge=0, allow_inf_nan=False, description="RL learning rate of AdamW")
    lr_warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up over the first updates")
    group_size: int = Field(8, ge=2, description="responses per prompt G (a group needs a baseline: >= 2)")
    prompts_per_step: int = Field(16, ge=1, description="prompt groups per learner update")
    groups_per_batch: int = Field(4, ge=1, description="prompt groups per sampler batch (divides prompts_per_step)")
    buffer_groups: int = Field(
        0, ge=0, description="samplers start a batch only while fewer groups are queued or in flight (0: one step)"
    )
    temperature: float = _positive("sampling temperature", 1.0)
    grad_clip: float = _positive("gradient-norm clip", 1.0)
    rollout_correction: str | None = Field(
        None,
        description="verl's rollout correction for every method: a preset of verl's RolloutCorrectionConfig "
        "(decoupled_seq_is, decoupled_token_is, decoupled_seq_is_rs, ...), applied with verl's own function as verl's "
        "decoupled mode does (the old policy is the learner's before the update; the sampler's log-probs enter the "
        "truncated weights and the rejection). Runs are paired as METHOD+PRESET. None: the presets' bypass mode",
    )
    clip: float | None = Field(
        None, gt=0, lt=1, description="ratio clip eps for every method, both sides (None: the presets' 0.2/0.2)"
    )
    eval_every: int = Field(10, ge=1, description="evaluate on the held-out problems every N updates")
    eval_samples: int = Field(8, ge=0, description="sampled answers per held-out problem for pass@1 (0 = greedy)")
    # heterogeneous samplers and the weight path (simulated seconds)
    sampler_seconds: list[float] = Field(
        [1.0, 1.5, 2.0, 4.0], min_length=1, description="simulated seconds per rollout batch, one per sampler"
    )
    learner_seconds: float = _positive("simulated seconds one learner update takes at least", 0.5)
    delay_low: float = _positive("lower end of the log-normal weight-delay interval (simulated s)", 4.0)
    delay_high: float = _positive("upper end of the log-normal weight-delay interval (simulated s)", 256.0)
    delay_confidence: float = Field(0.995, gt=0, lt=1, description="mass of the delay interval")
    # staleness: HeteroRL's own rule and defaults
    strategy: Literal["wait", "drop"] = Field(
        DEFAULT_STRATEGY, description="staleness strategy: wait (the paper's, nothing dropped) or drop"
    )
    admission_margin: int = Field(
        DEFAULT_ADMISSION_MARGIN, ge=0, description="samplers pause when their weights are older than max_lag - this"
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="HeteroRL's staleness guard (verl's hetero.guard.*), on the ESS/N of each update's p_i/q_i",
    )
    # live mode
    live: StrictBool = Field(
        False,
        description="run the samplers as Ray actor processes in wall-clock time instead of the seeded simulation: "
        'same learner, staleness rule and outputs, with "mode": "live" in the summary JSON. NOT bit-reproducible: '
        "the schedule depends on OS scheduling",
    )
    time_scale: float | None = Field(
        None, gt=0, description="live only: wall-clock seconds per simulated second (None: 0.05)"
    )
    ray_cpus: int | None = Field(None, ge=1, description="live only: Ray's logical CPUs (None: one per sampler)")

    @model_validator(mode="after")
    def _coherent(self) -> StabilityConfig:
        if any(s <= 0 for s in self.sampler_seconds):
            raise ValueError(f"sampler_seconds must be positive, got {self.sampler_seconds}")
        if any(k < 0 for k in self.lags):
            raise ValueError(f"lags are max_lag settings >= 0, got {self.lags}")
        if self.prompts_per_step % self.groups_per_batch:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of groups_per_batch "
                f"({self.groups_per_batch}), so an on-policy (max_lag 0) step has exactly prompts_per_step groups"
            )
        if self.buffer_groups and self.buffer_groups < self.prompts_per_step:
            raise ValueError(
                f"buffer_groups ({self.buffer_groups}) < prompts_per_step ({self.prompts_per_step}): the learner "
                "could never fill a batch"
            )
        if not self.delay_low < self.delay_high:
            raise ValueError(f"delay_low ({self.delay_low}) must be below delay_high ({self.delay_high})")
        if self.rollout_correction is not None:
            lab_preset(self.rollout_correction)  # verl's name, and not one a verl run would ignore
        if not self.live and (self.time_scale is not None or self.ray_cpus is not None):
            raise ValueError("time_scale and ray_cpus only apply with live=true (--live)")
        for lag in self.lags:
            policy = self.policy(lag)  # the margin must fit every bound (wait)
            if lag > 0:  # a guard has nothing to tighten on-policy
                check_guard(self.guard, policy)
        return self

    @property
    def buffer_limit(self) -> int:
        return self.buffer_groups or self.prompts_per_step

    def policy(self, max_lag: int) -> StalenessPolicy:
        """The staleness policy of runs with ``max_lag``: HeteroRL's rule, the lab's strategy and margin."""
        try:
            return StalenessPolicy(max_lag=max_lag, strategy=self.strategy, admission_margin=self.admission_margin)
        except StalenessConfigError as error:
            raise ValueError(str(error)) from None

    def delay_model(self):
        return LogNormalDelay.from_interval(self.delay_low, self.delay_high, self.delay_confidence)


#: Presets: partial configs (what is not named keeps the model's default).
PRESETS: dict[str, dict[str, Any]] = {
    "ci": {"methods": ["gepo", "grpo"], "lags": [0, 8], "seeds": [0], "rl_steps": 60, "eval_every": 20},
    "quick": {"methods": ["gepo", "gspo", "grpo"], "lags": [0, 64], "seeds": [0, 1], "rl_steps": 150},
    "paper": {
        "methods": ["gepo", "gspo", "grpo", "dr_grpo", "bnpo"],
        "lags": [0, 8, 64],
        "seeds": [0, 1, 2, 3, 4],
        "rl_steps": 200,
    },
}
PRESET_SUMMARIES = {
    "ci": "gepo and grpo at lags 0/8, seed 0, 60 updates (tests: ~40 s)",
    "quick": "gepo/gspo/grpo at lags 0/64, seeds 0-1, 150 updates (~3.5 min)",
    "paper": "all five methods at lags 0/8/64, seeds 0-4, 200 updates (~25 min)",
}


def resolve(preset: str, overrides: dict[str, Any] | None = None) -> StabilityConfig:
    """The config of ``preset`` with ``overrides`` (validated as a whole; errors name the option)."""
    if preset not in PRESETS:
        raise StabilityConfigError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    return parse_options(StabilityConfig, {**PRESETS[preset], **(overrides or {})}, "", StabilityConfigError)
