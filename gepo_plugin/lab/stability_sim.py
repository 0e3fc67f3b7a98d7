"""Heterogeneous asynchronous RL in simulated time, with verl's registered policy losses as the update.

One run = one learner and several samplers (HeteroRL's star topology) in a seeded discrete-event simulation.
Time is simulated, so a run is reproducible bit for bit and costs only the compute of the rollouts and updates
it actually performs. Everything that is HeteroRL is the code a verl run uses:

* **Weights** travel as :class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule` says (the schedule
  verl's delayed weight sync follows): each sampler downloads one version at a time, the newest published when
  the download starts, which arrives after a delay drawn from its own stream of the log-normal delay model
  (:mod:`gepo_plugin.hetero.delays`), and it starts on the newest again on arrival if a newer one exists. A
  sampler generates with the version it holds; old weights are real (every version a sampler holds or is
  receiving is kept as a ``state_dict`` copy). Rewards are computed on the sampler (localized reward).
* **Staleness**: the learner's queue is :class:`~gepo_plugin.lab.rollout_queue.LabRolloutQueue`, an adapter
  over :class:`~gepo_plugin.hetero.core.StalenessCore`, which makes every decision (admission, eviction and
  its reason, waiting under ``wait``, the selection order, the books) exactly as in verl's replay buffer.
  Samplers start a batch only while the core admits their weights and fewer than ``buffer_groups`` groups are
  queued or in flight (so the learner's input is not an ever-growing backlog, which would push every lag to K
  by itself). An update takes ``learner_seconds``; its version becomes visible when that time is up.

Samplers differ in speed (``sampler_seconds``: simulated seconds per batch of ``groups_per_batch`` prompts x
``group_size`` responses). Which version generates which group depends only on the timing settings and the
seed, never on rewards, so all methods under one seed and bound see the same lag pattern (and, through shared
random streams, the same prompts): a controlled comparison.

**The update** calls verl's registered policy loss exactly as verl's ``ppo_loss`` does
(``get_policy_loss_fn(loss_mode)(old_log_prob=..., log_prob=..., ...)``, bool response mask, the actor config's
``global_batch_info`` filled in), with ``old_log_prob`` = the sampler's per-token log-probs (bypass mode). For
GEPO the per-prompt group term is computed from those sampler log-probs with
:func:`~gepo_plugin.maths.group_log_expectation_from_tokens` and handed over as the plugin's trainer does.

**Shared with the live mode** (:mod:`gepo_plugin.lab.stability_live`, real processes in wall-clock time): a
sampler batch is :func:`rollout_batch`, the learner side is :class:`Learner`, the weight path is the schedule.
Only the clock and the transport differ between the two modes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gepo_plugin import config_keys as keys
from gepo_plugin.hetero import drop_bias
from gepo_plugin.hetero.core import STALENESS_REASONS
from gepo_plugin.hetero.guard import ess_fraction
from gepo_plugin.hetero.weight_schedule import WeightArrivalSchedule
from gepo_plugin.lab.rollout_queue import LabRolloutQueue
from gepo_plugin.lab.stability_config import METHOD_PRESETS, METHODS, StabilityConfig
from gepo_plugin.lab.stability_task import (
    AdditionTask,
    rewards_for,
    sample_responses,
    sampled_accuracy,
    token_log_probs,
)
from gepo_plugin.maths import (
    GroupIndex,
    bnpo_advantages,
    group_advantages,
    group_log_expectation_from_tokens,
    k3_kl,
    sequence_log_prob,
)
from gepo_plugin.maths.gepo_plus import GEPOPlusRule
from gepo_plugin.maths.m2po import m2_cap
from gepo_plugin.maths.options import PolicyLossOptions
from gepo_plugin.verl_glue.m2po_mini_batch import cap_fields, mini_batch_budget
from gepo_plugin.verl_glue.presets import PRESETS
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, provide_response_terms
from gepo_plugin.verl_glue.rollout_correction import correct, lab_preset

#: verl's rollout-correction metrics (``rollout_corr/*``), which a corrected run's updates report
CORRECTION_PREFIX = "rollout_corr/"
#: Which importance weight each method's loss actually uses (for the weight-variance diagnostic).
OWN_WEIGHT = {
    "gepo": "gepo",
    "gspo": "seq_is",
    "grpo": "token_is",
    "dr_grpo": "token_is",
    "bnpo": "token_is",
    "gepo_plus": "gepo_plus",
    "gepo_plus_soft": "gepo_plus",
    "m2po": "token_is",
    "gepo_m2": "gepo",
}

__all__ = [
    "METHODS",
    "OWN_WEIGHT",
    "Learner",
    "MethodSpec",
    "RunRecord",
    "RunSetup",
    "rollout_batch",
    "simulate_run",
    "snapshot",
]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class MethodSpec:
    """The verl settings of one family member, read from the plugin's preset table (one source of truth)."""

    name: str
    loss_mode: str
    loss_agg_mode: str
    estimator: str
    norm_by_std: bool
    #: verl's ratio clip (None: the preset leaves it to verl, as M2PO's, whose loss does not read it)
    clip_low: float | None
    clip_high: float | None
    needs_response_terms: bool
    #: policy-loss options of a variant (``actor_rollout_ref.actor.policy_loss.<key>=<value>``)
    loss_options: tuple[tuple[str, Any], ...] = ()
    #: verl's rollout-correction preset the batches are corrected with (None: the preset's bypass mode)
    rollout_correction: str | None = None

    @classmethod
    def from_preset(cls, name: str) -> MethodSpec:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; the stability lab compares {', '.join(METHODS)}")
        preset_name, loss_options = METHOD_PRESETS[name]
        preset = PRESETS[preset_name]
        settings = preset.settings
        return cls(
            name=name,
            loss_mode=str(settings[keys.LOSS_MODE]),
            loss_agg_mode=str(settings[keys.LOSS_AGG_MODE]),
            estimator=str(settings[keys.ADV_ESTIMATOR]),
            norm_by_std=bool(settings.get(keys.NORM_ADV_BY_STD, False)),
            clip_low=_float_or_none(settings.get(keys.CLIP_RATIO_LOW)),
            clip_high=_float_or_none(settings.get(keys.CLIP_RATIO_HIGH)),
            needs_response_terms=preset.needs_response_terms,
            loss_options=tuple(sorted(loss_options.items())),
        )

    def gepo_plus_rule(self) -> GEPOPlusRule | None:
        """GEPO+'s denominator rule with this variant's options (None for other methods)."""
        if self.loss_mode != "gepo_plus":
            return None
        options = PolicyLossOptions(**dict(self.loss_options))
        return GEPOPlusRule(options.gepo_plus_mode, options.gepo_plus_kl_threshold)

    def with_clip(self, clip: float) -> MethodSpec:
        """The same method with the ratio clip ``1 - clip .. 1 + clip`` (the lab's ``--clip``)."""
        return dataclasses.replace(self, clip_low=clip, clip_high=clip)

    def with_correction(self, preset: str) -> MethodSpec:
        """The same method with verl's rollout correction ``preset`` (the lab's ``--rollout-correction``)."""
        lab_preset(preset)  # refuses a preset a verl run would ignore
        return dataclasses.replace(self, rollout_correction=preset)


@dataclass(frozen=True)
class RunSetup:
    """What one (seed, method, max_lag) run trains, and how: the policy, the method, the task, the lab config, the
    staleness bound and the seed.

    Why one object: these six always travel together, from the lab's run loop into either mode's driver
    (:func:`simulate_run`, :meth:`~gepo_plugin.lab.stability_live.LiveCluster.run`) and on into the
    :class:`Learner` both share, so one typed value keeps the two modes' signatures the same by construction and
    cannot be passed in the wrong order. Frozen because a run's setup does not change while it runs (``model`` is
    still trained in place: only which model is fixed).
    """

    model: torch.nn.Module
    spec: MethodSpec
    task: AdditionTask
    config: StabilityConfig
    max_lag: int
    seed: int


@functools.cache
def actor_config_for(spec: MethodSpec):
    """verl's ``ActorConfig`` for ``spec`` (composed once per process: Hydra composition takes ~1 s).

    ``global_batch_info`` is filled in as verl's ``ppo_loss`` does for one data-parallel rank whose
    micro-batch is the whole mini-batch (``None`` totals = this batch's own, as in bench/bench_loss.py).
    """
    # lazy: verl (seconds to import) only once a run needs its loss, so gepo-lab starts at once
    import verl  # noqa: F401  (verl's plugin entry point registers the gepo loss on import)

    import gepo_plugin.verl_glue.losses  # (and make sure, if entry points are not installed)
    import gepo_plugin.verl_glue.m2po_loss  # noqa: F401
    from gepo_plugin.verl_glue.loss_batch import compose_actor_config

    config = compose_actor_config(
        [
            "strategy=fsdp2",
            "ppo_micro_batch_size_per_gpu=1",
            f"policy_loss.loss_mode={spec.loss_mode}",
            f"loss_agg_mode={spec.loss_agg_mode}",
            *(
                f"{key}={value}"
                for key, value in (("clip_ratio_low", spec.clip_low), ("clip_ratio_high", spec.clip_high))
                if value is not None
            ),
            *(f"policy_loss.{key}={value}" for key, value in spec.loss_options),
        ]
    )
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=config.loss_scale_factor
    )
    return config


@dataclass
class Rollout:
    """One prompt group as a sampler delivers it: tokens, sampler log-probs, rewards, and its version."""

    group_id: str
    problem: int
    version: int
    submitted: int
    tokens: torch.Tensor
    log_probs: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor

    @property
    def min_version(self) -> int:
        """Oldest weight version behind any token (a sampler swaps weights only between batches, so a group
        has a single version: min == max)."""
        return self.version

    @property
    def max_version(self) -> int:
        return self.version


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    spec: MethodSpec,
    task: AdditionTask,
    groups: list[Rollout],
    temperature: float,
    grad_clip: float,
) -> dict[str, float]:
    """One optimizer step on ``groups`` with ``spec``'s advantage and verl's registered policy loss.

    Returns diagnostics computed on the same tensors the loss saw (learner log-probs before the step):
    the variance of the importance weight the method uses (``iw_var``), of the length-normalised sequence
    ratio p/q (``seq_is_var``) and of GEPO's p/E_hat_q[q] (``gepo_w_var``) for every method alike, and the
    learner-sampler k3 KL (token mean).
    """
    group_size = groups[0].tokens.shape[0]
    tokens = torch.cat([g.tokens for g in groups])
    old_log_prob = torch.cat([g.log_probs for g in groups])
    mask = torch.cat([g.mask for g in groups])
    rewards = torch.cat([g.rewards for g in groups])
    problems = torch.tensor([g.problem for g in groups], dtype=torch.int64).repeat_interleave(group_size)
    group_ids = torch.arange(len(groups)).repeat_interleave(group_size)
    index = GroupIndex.from_ids(group_ids)
    if spec.estimator == "bnpo":
        seq_adv, _ = bnpo_advantages(rewards, index)
    else:
        seq_adv = group_advantages(rewards, index, normalize_by_std=spec.norm_by_std)
    fmask = mask.to(torch.float32)
    advantages = seq_adv.unsqueeze(1) * fmask  # verl's outcome advantages are masked the same way

    from verl.trainer.ppo.core_algos import get_policy_loss_fn  # lazy, as above (the plugin's loss is in it)

    model.train()
    log_prob = token_log_probs(model, task.prompts[problems], tokens, temperature) * fmask
    sampler_log_prob, sampler_mask = old_log_prob, mask  # what the diagnostics below compare the learner with
    rollout_is_weights, correction = None, {}
    if spec.rollout_correction is not None:
        # verl's decoupled mode: the old policy is the learner's before this update (pi_old); the sampler's
        # log-probs enter only verl's truncated weights and rejection, computed by verl's own function
        old_log_prob = log_prob.detach()
        preset = lab_preset(spec.rollout_correction)
        rollout_is_weights, mask, correction = correct(old_log_prob, sampler_log_prob, sampler_mask, preset)
        mask = mask.to(sampler_mask.dtype)
        advantages = seq_adv.unsqueeze(1) * mask.to(torch.float32)
    config = actor_config_for(spec)
    loss_fn = get_policy_loss_fn(spec.loss_mode)
    kwargs: dict[str, Any] = dict(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=spec.loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    log_e = group_log_expectation_from_tokens(old_log_prob, mask, group_ids)
    # what the plugin's trainer and engine hand a verl loss beside verl's fields (the lab's batch is one mini-batch)
    terms = {LOG_GROUP_EXPECTATION: log_e}
    budget = mini_batch_budget(config)
    if budget is not None:
        terms.update(cap_fields(m2_cap(log_prob, old_log_prob, advantages, mask, budget), len(tokens)))
    with provide_response_terms(terms):
        loss, loss_metrics = loss_fn(**kwargs)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    model.eval()

    with torch.no_grad():  # the weights against the sampler (q), whatever the loss's old policy was
        logp, q = log_prob.detach(), sampler_log_prob
        log_e = group_log_expectation_from_tokens(q, sampler_mask, group_ids)
        seq_p, seq_q = sequence_log_prob(logp, fmask), sequence_log_prob(q, fmask)
        log_weights = {"gepo": seq_p - log_e, "seq_is": seq_p - seq_q, "token_is": (logp - q)[sampler_mask]}
        rule = spec.gepo_plus_rule()
        if rule is not None:  # the weight GEPO+ used: its denominator from each sequence's mean k3 KL
            seq_kl = (k3_kl(logp, q) * fmask).sum(-1) / fmask.sum(-1).clamp(min=1)
            log_weights["gepo_plus"] = seq_p - rule.log_denominator(log_e, seq_q, seq_kl)[0]
        weights = {name: torch.exp(values) for name, values in log_weights.items()}
        kl = k3_kl(logp, q)[sampler_mask].mean()
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "reward_mean": float(rewards.mean()),
        "iw_var": float(weights[OWN_WEIGHT[spec.name]].var(unbiased=False)),
        "seq_is_var": float(weights["seq_is"].var(unbiased=False)),
        "gepo_w_var": float(weights["gepo"].var(unbiased=False)),
        "ess": ess_fraction(log_weights["seq_is"]),  # p_i / q_i: 1 on-policy, as the verl losses report it
        "kl": float(kl),
        "clipfrac": float(loss_metrics.get("actor/pg_clipfrac", float("nan"))),
        **correction,
    }


@dataclass
class RunRecord:
    """Everything one (seed, method, max_lag) run measured; JSON-friendly via :meth:`to_dict`."""

    seed: int
    method: str
    max_lag: int
    eval_steps: list[int] = field(default_factory=list)
    eval_acc: list[float] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    ledger: dict[str, float] = field(default_factory=dict)
    sim_seconds: float = 0.0
    rollout_batches: int = 0
    guard_changes: list[str] = field(default_factory=list)  # the staleness guard's notes, in order
    dropped_totals: dict[str, float] = field(default_factory=dict)  # trajectories dropped for staleness
    trained_totals: dict[str, float] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)  # live mode only: wall-clock facts (empty when simulated)

    def to_dict(self) -> dict[str, Any]:
        lags = np.asarray(self.lags, dtype=np.int64)
        values, counts = np.unique(lags, return_counts=True)
        best = max(self.eval_acc)
        out = {
            "seed": self.seed,
            "method": self.method,
            "max_lag": self.max_lag,
            "warm_eval": self.eval_acc[0],
            "best_eval": best,
            "best_step": self.eval_steps[self.eval_acc.index(best)],
            "last_eval": self.eval_acc[-1],
            "best_to_last_gap": best - self.eval_acc[-1],
            "eval_steps": list(self.eval_steps),
            "eval_acc": list(self.eval_acc),
            "lag_mean": float(lags.mean()) if lags.size else 0.0,
            "lag_max": int(lags.max()) if lags.size else 0,
            "lag_histogram": {int(v): int(c) for v, c in zip(values, counts, strict=True)},
            "iw_var_mean": _mean_of(self.steps, "iw_var"),
            "seq_is_var_mean": _mean_of(self.steps, "seq_is_var"),
            "gepo_w_var_mean": _mean_of(self.steps, "gepo_w_var"),
            "kl_mean": _mean_of(self.steps, "kl"),
            "kl_max": max(s["kl"] for s in self.steps) if self.steps else 0.0,
            "clipfrac_mean": _mean_of(self.steps, "clipfrac"),
            "ess_mean": _mean_of(self.steps, "ess"),
            "ess_min": min(s["ess"] for s in self.steps) if self.steps else 1.0,
            "guard_changes": list(self.guard_changes),
            "drop_bias": drop_bias.bias_metrics(self.dropped_totals, self.trained_totals),
            "drop_totals": {"dropped": dict(self.dropped_totals), "trained": dict(self.trained_totals)},
            "ledger": dict(self.ledger),
            "sim_seconds": self.sim_seconds,
            "rollout_batches": self.rollout_batches,
        }
        correction = sorted(key for key in (self.steps[0] if self.steps else {}) if key.startswith(CORRECTION_PREFIX))
        if correction:  # verl's rollout_corr/* metrics, averaged over the updates
            out["rollout_correction"] = {key: _mean_of(self.steps, key) for key in correction}
        if self.live:
            out["live"] = dict(self.live)
        return out


def trajectory_totals(groups: list[Rollout]) -> dict[str, float]:
    """Count, response length and reward of the groups' trajectories (the drop-bias books)."""
    lengths = torch.cat([g.mask.sum(-1) for g in groups]).numpy()
    rewards = torch.cat([g.rewards.reshape(-1) for g in groups]).numpy()
    return drop_bias.totals(lengths, rewards)


def _mean_of(rows: list[dict[str, float]], key: str) -> float:
    return float(np.mean([row[key] for row in rows])) if rows else 0.0


def draw_problems(task: AdditionTask, rng: np.random.Generator, n: int) -> torch.Tensor:
    """``n`` training-problem indices drawn with replacement from ``rng`` (one rollout batch's prompts)."""
    return torch.as_tensor(rng.choice(task.train_idx.numpy(), size=n), dtype=torch.int64)


def rollout_batch(
    model: torch.nn.Module,
    task: AdditionTask,
    problems: torch.Tensor,
    group_size: int,
    temperature: float,
    format_reward: float,
    generator: torch.Generator,
    version: int,
    first_gid: int,
    submitted: int = 0,
) -> list[Rollout]:
    """One sampler batch, shared by the simulated and the live mode: ``group_size`` responses per problem,
    sampled from ``model`` (holding weights ``version``), rewarded on the sampler, split into groups
    ``g{first_gid:08d}``, ... (zero-padded: the id is the last tie-break of the selection order), each tagged with
    the learner step it was dispatched at (``submitted``, as verl tags prompts with ``global_steps``)."""
    repeated = problems.repeat_interleave(group_size)
    tokens, log_probs, mask = sample_responses(model, task, task.prompts[repeated], temperature, generator)
    rewards = rewards_for(task, repeated, tokens, format_reward)
    return [
        Rollout(
            group_id=f"g{first_gid + j:08d}",
            problem=int(problems[j]),
            version=version,
            submitted=submitted,
            tokens=tokens[j * group_size : (j + 1) * group_size],
            log_probs=log_probs[j * group_size : (j + 1) * group_size],
            mask=mask[j * group_size : (j + 1) * group_size],
            rewards=rewards[j * group_size : (j + 1) * group_size],
        )
        for j in range(len(problems))
    ]


class Learner:
    """The learner side of a run, shared by the simulated and the live mode (only the clock differs).

    Owns the model being trained, its optimizer, the rollout queue (and so the staleness core and its books) and
    the :class:`RunRecord`. A mode's driver calls, in its own notion of time: :meth:`sampler_may_start` before
    dispatching a batch, :meth:`admit` when a batch finishes, :meth:`ready` / :meth:`train` to start an update,
    and :meth:`finish_update` when the update's time is up (the new version becomes visible then; evaluation
    follows the ``eval_every`` cadence).
    """

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        model, config, max_lag, seed = setup.model, setup.config, setup.max_lag, setup.seed
        self.model, self.spec, self.task, self.config, self.seed = model, setup.spec, setup.task, config, seed
        self.queue = LabRolloutQueue(
            config.policy(max_lag), config.guard if max_lag > 0 else None, on_drop=self._count_dropped
        )
        self.ledger = self.queue.ledger
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.999), weight_decay=0.01)
        model.eval()
        self.record = RunRecord(seed=seed, method=setup.spec.name, max_lag=max_lag)
        self.version = 0
        self.busy = False  # an update is running: its version is not visible yet

    def _count_dropped(self, group: Rollout, reason: str) -> None:
        if reason in STALENESS_REASONS:
            self.record.dropped_totals = drop_bias.add(self.record.dropped_totals, trajectory_totals([group]))

    def evaluate(self) -> float:
        """Held-out pass@1 of the current model (seeded, so every eval of every method shares its samples)."""
        config = self.config
        return sampled_accuracy(
            self.model, self.task, self.task.eval_idx, config.eval_samples, config.temperature, self.seed + 1_000_000
        )

    def record_eval(self) -> None:
        self.record.eval_steps.append(self.version)
        self.record.eval_acc.append(self.evaluate())

    @property
    def step(self) -> int:
        """The learner step a batch dispatched now belongs to (verl's ``global_steps``: the version being made)."""
        return self.version + 1

    def sampler_may_start(self, sampler_version: int, in_flight_groups: int) -> bool:
        """Admission control for an idle sampler holding ``sampler_version``: the core's rule (counting the version
        being produced while an update runs) and the buffer limit (queued + in-flight groups < ``buffer_groups``)."""
        admission_version = self.version + (1 if self.busy else 0)
        if not self.queue.core.may_start(admission_version, sampler_version):
            return False
        return self.ledger.queued + in_flight_groups < self.config.buffer_limit

    def admit(self, groups: list[Rollout]) -> None:
        self.queue.admit(groups)

    def note_weights_published(self, oldest_held: int) -> None:
        """A new learner step begins: record the oldest weights any sampler holds (the in-flight bound of prompts
        dispatched during the step, exactly as verl's delayed weight sync records it)."""
        self.queue.core.record_floor(self.step, oldest_held)

    def ready(self, in_flight: dict[str, int]) -> bool:
        """May an update start now (``in_flight``: in-flight group name -> the learner step it was dispatched at)?"""
        return not self.busy and self.queue.ready(self.version, self.config.prompts_per_step, in_flight)

    def train(self, now: float) -> dict[str, float]:
        """One update at the current version on the batch the core selects; records the step's diagnostics
        (``sim_time=now``) and checks the books."""
        config, version = self.config, self.version
        groups, lags = self.queue.take(version, config.prompts_per_step)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = config.lr * min(1.0, (version + 1) / max(1, config.lr_warmup_steps))
        metrics = policy_update(
            self.model, self.optimizer, self.spec, self.task, groups, config.temperature, config.grad_clip
        )
        metrics.update(
            step=float(version + 1),
            lag_mean=float(lags.mean()),
            lag_max=float(lags.max()),
            batch_groups=float(len(groups)),
            sim_time=now,
        )
        # the bound this batch was selected under, then the staleness guard's look at its ESS/N (if enabled)
        metrics["effective_max_lag"] = float(self.queue.policy.max_lag if self.queue.policy.max_lag is not None else -1)
        note = self.queue.core.observe_ess(version + 1, metrics["ess"])
        if note is not None:
            self.record.guard_changes.append(note)
        self.record.trained_totals = drop_bias.add(self.record.trained_totals, trajectory_totals(groups))
        self.record.steps.append(metrics)
        self.record.lags.extend(int(lag) for lag in lags)
        self.ledger.check()
        self.busy = True
        return metrics

    def finish_update(self) -> None:
        """The running update's version becomes current; evaluate on the ``eval_every`` cadence and at the end."""
        self.version += 1
        self.busy = False
        if self.version % self.config.eval_every == 0 or self.version == self.config.rl_steps:
            self.record_eval()

    def finish(self, seconds: float) -> RunRecord:
        """Final ledger check; returns the record with the ledger counters and the run's duration."""
        self.ledger.check()
        self.record.ledger = self.queue.core.metrics()
        self.record.sim_seconds = seconds
        return self.record


@dataclass
class _Sampler:
    """A sampler's simulated state: the batch it is generating and with which version."""

    index: int
    seconds: float
    busy_until: float | None = None
    version_in_use: int = 0
    submitted: int = 0
    batch: list[Rollout] = field(default_factory=list)


def simulate_run(setup: RunSetup, on_step: Callable[[RunRecord], None] | None = None) -> RunRecord:
    """Train ``setup.model`` (in place) for ``config.rl_steps`` learner updates under simulated heterogeneous
    asynchrony (``on_step(record)`` after every update).

    The learning rate rises linearly over the first ``lr_warmup_steps`` updates (the paper warms up too): Adam's
    first steps are full-size whatever the gradient noise, which otherwise knocks the weak warm-started policy
    back before RL has a signal.

    Raises :class:`~gepo_plugin.hetero.core.BoundViolation` if a trained group would exceed ``setup.max_lag``,
    :class:`~gepo_plugin.hetero.accounting.AccountingError` if the books lose a rollout (both checked at every
    update), and ``RuntimeError`` if the simulation stalls.
    """
    model, task, config, seed = setup.model, setup.task, setup.config, setup.seed
    learner = Learner(setup)
    record = learner.record
    sampler_model = copy.deepcopy(model)
    loaded_version: list[int | None] = [None]
    versions: dict[int, dict[str, torch.Tensor]] = {0: snapshot(model)}
    token_rng = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7)
    prompt_rng = np.random.default_rng([int(seed), 0x5EED])
    samplers = [_Sampler(i, float(sec)) for i, sec in enumerate(config.sampler_seconds)]
    schedule = WeightArrivalSchedule([config.delay_model()] * len(samplers), seed, start_version=0, start_time=0.0)

    learner.record_eval()
    now, next_gid = 0.0, 0
    learner_done_at: float | None = None
    g = config.groups_per_batch

    def in_flight() -> dict[str, int]:
        return {f"s{s.index}/{j}": s.submitted for s in samplers if s.busy_until is not None for j in range(g)}

    def start_batch(sampler: _Sampler) -> None:
        nonlocal next_gid
        held = schedule.held[sampler.index]
        if loaded_version[0] != held:
            sampler_model.load_state_dict(versions[held])
            loaded_version[0] = held
        problems = draw_problems(task, prompt_rng, g)
        sampler.batch = rollout_batch(
            sampler_model,
            task,
            problems,
            config.group_size,
            config.temperature,
            config.format_reward,
            token_rng,
            held,
            next_gid,
            learner.step,
        )
        next_gid += g
        sampler.version_in_use, sampler.submitted = held, learner.step
        sampler.busy_until = now + sampler.seconds
        record.rollout_batches += 1

    def sampler_may_start(sampler: _Sampler) -> bool:
        if sampler.busy_until is not None:
            return False
        busy_groups = g * sum(s.busy_until is not None for s in samplers)
        return learner.sampler_may_start(schedule.held[sampler.index], busy_groups)

    while learner.version < config.rl_steps:
        acted = True
        while acted:
            acted = False
            for sampler in samplers:
                if sampler_may_start(sampler):
                    start_batch(sampler)
                    acted = True
            if learner.ready(in_flight()):
                learner.train(now)
                learner_done_at = now + config.learner_seconds
                acted = True
        events = [s.busy_until for s in samplers if s.busy_until is not None]
        events += [download[2] for download in schedule.downloading if download is not None]
        if learner_done_at is not None:
            events.append(learner_done_at)
        if not events:
            raise RuntimeError("the simulation stalled: no pending event")
        now = min(events)
        if learner_done_at is not None and learner_done_at <= now:
            learner_done_at = None
            versions[learner.version + 1] = snapshot(model)
            learner.finish_update()
            schedule.publish(learner.version, now)
            learner.note_weights_published(schedule.oldest_held())
            if on_step is not None:
                on_step(record)
        for sampler in samplers:
            if sampler.busy_until is not None and sampler.busy_until <= now:
                learner.admit(sampler.batch)
                sampler.batch, sampler.busy_until = [], None
        schedule.advance(now)
        keep = {learner.version} | set(schedule.held) | schedule.needed_versions()
        for old in [v for v in versions if v not in keep]:
            del versions[old]
    return learner.finish(now)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s weights (one published version, as both modes keep and send it)."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
