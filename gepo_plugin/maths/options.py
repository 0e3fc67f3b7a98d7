"""The options of the plugin's policy losses (GEPO, GEPO+, M2PO) and of the BNPO and ΔL estimators: each default is
written here and only here.

verl users set them as ``actor_rollout_ref.actor.policy_loss.<option>`` (the losses) and ``algorithm.bnpo.<option>``
/ ``algorithm.delta_l.<option>``; the Hydra nodes, the verl config dataclass
(:class:`gepo_plugin.verl_glue.config.GEPOPolicyLossConfig`), the loss and the estimators all read these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator

from gepo_plugin import config_keys
from gepo_plugin.options import STRICT_BLOCK, parse_options

#: Largest accepted cap on ``log w``: exp(80) is close to float32's limit (exp(88.7) overflows), so the
#: weight the loss uses and every statistic of it stay finite.
MAX_LOG_RATIO_CAP = 80.0

#: Where each block lives in verl's config tree (for error messages and the Hydra nodes).
GEPO_OPTIONS_KEY = config_keys.POLICY_LOSS
BNPO_OPTIONS_KEY = config_keys.BNPO_OPTIONS
DELTA_L_OPTIONS_KEY = config_keys.DELTA_L_OPTIONS


class PolicyLossOptions(BaseModel):
    """The plugin's policy-loss options (GEPO, GEPO+, M2PO), beside verl's own policy-loss keys."""

    model_config = STRICT_BLOCK

    group_scope: Literal["prompt", "batch"] = Field(
        "prompt",
        description="prompt: the group expectation runs over the responses of one prompt (the paper's definition, "
        "computed by the plugin's trainer); batch: over the micro-batch the loss sees, as the reference code does "
        "(only to reproduce its numbers)",
    )
    sampler_kl_coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="weight of the per-token k3 KL toward the sampler, exp(q-p)-(q-p)-1 (the paper's asynchronous "
        "runs: 0.005); 0 switches it off",
    )
    log_ratio_cap: float = Field(
        10.0,
        gt=0,
        le=MAX_LOG_RATIO_CAP,
        allow_inf_nan=False,
        description="upper cap on log w for numerical safety, as verl's GSPO (exp(10) ~ 2.2e4); the fraction of "
        "sequences where it binds is reported as actor/gepo/log_ratio_cap_frac",
    )
    gepo_plus_mode: Literal["hard", "soft"] = Field(
        "hard",
        description="loss_mode=gepo_plus only. hard: a sequence whose mean k3 KL to the sampler is below "
        "gepo_plus_kl_threshold uses its own q_i as the denominator (GSPO's weight), any other uses E_hat_q[q] "
        "(GEPO's), as the authors' code does; soft: the mixture (1-g) E_hat_q[q] + g q_i with "
        "g = exp(-KL_i / gepo_plus_kl_threshold). The share on q_i is reported as actor/gepo/own_denominator_frac",
    )
    gepo_plus_kl_threshold: float = Field(
        0.002,
        gt=0,
        allow_inf_nan=False,
        description="loss_mode=gepo_plus only: the sequence-mean k3 KL between learner and sampler where the "
        "denominator switches (hard) or its temperature (soft); the authors' kl_temp, default 0.002",
    )
    m2_budget: float = Field(
        0.04,
        ge=0,
        allow_inf_nan=False,
        description="loss_mode=m2po (or gepo with m2_mask): the bound on the mean squared log-ratio of the harmful "
        "tokens (positive advantage with p > q, negative with p < q); above it the clip bounds become exp(-tau) "
        "and exp(tau) with the cap tau that brings it within (M2PO, arXiv 2510.01161; the authors' scripts: 0.04). "
        "0 clips every harmful token",
    )
    m2_mask: StrictBool = Field(
        False,
        description="loss_mode=gepo or gepo_plus only: also apply M2PO's second-moment mask to GEPO's weights, so "
        "the harmful tokens that M2PO's cap would clip (log-ratio to the sampler beyond tau in the harmful "
        "direction, tau from m2_budget over m2_scope) get no gradient; the zeroed share is reported as "
        "actor/m2po/masked_frac",
    )
    m2_scope: Literal["mini_batch", "micro_batch"] = Field(
        "mini_batch",
        description="loss_mode=m2po (or gepo with m2_mask). mini_batch: the second moment runs over the whole "
        "mini-batch on every data-parallel rank, measured by a forward pass before the update (one more forward "
        "per mini-batch), so the result does not depend on how verl splits it; micro_batch: over the micro-batch the "
        "loss is handed, as the authors' code does (to reproduce their numbers)",
    )


class BNPOOptions(BaseModel):
    """BNPO's options (``algorithm.adv_estimator=bnpo``)."""

    model_config = STRICT_BLOCK

    reward_min: float = Field(0.0, allow_inf_nan=False, description="lower end of the reward's range")
    reward_max: float = Field(
        1.0,
        allow_inf_nan=False,
        description="upper end of the reward's range (rewards are rescaled to [0, 1]: BNPO models a success "
        "probability)",
    )
    weight_cap: float = Field(
        1e6, gt=0, allow_inf_nan=False, description="cap on the inverse Beta density that scales the advantage"
    )

    @model_validator(mode="after")
    def _range_is_not_empty(self) -> BNPOOptions:
        if not self.reward_max > self.reward_min:
            raise ValueError(f"reward_max ({self.reward_max}) must exceed reward_min ({self.reward_min})")
        return self


class DeltaLOptions(BaseModel):
    """ΔL normalisation's options (``algorithm.adv_estimator=delta_l``)."""

    model_config = STRICT_BLOCK

    alpha: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="exponent of the length weights L_i^-alpha (1: minimum variance; the paper used 0.75 for math)",
    )


#: The options only ``loss_mode=gepo_plus`` reads.
GEPO_PLUS_FIELDS: tuple[str, ...] = ("gepo_plus_mode", "gepo_plus_kl_threshold")
#: M2PO's cap options: ``loss_mode=m2po`` reads them, and the GEPO losses with ``m2_mask=true``.
M2PO_FIELDS: tuple[str, ...] = ("m2_budget", "m2_scope")

POLICY_LOSS_DEFAULTS = PolicyLossOptions()
BNPO_DEFAULTS = BNPOOptions()
DELTA_L_DEFAULTS = DeltaLOptions()


def policy_loss_options(policy_loss: Any) -> PolicyLossOptions:
    """The plugin's loss options from a policy-loss config: the plugin's dataclass, verl's plain one (defaults), or a
    config node (read by attribute; what it lacks keeps its default)."""
    values = {name: getattr(policy_loss, name) for name in PolicyLossOptions.model_fields if hasattr(policy_loss, name)}
    return parse_options(PolicyLossOptions, values, GEPO_OPTIONS_KEY)
