"""Config dataclasses that extend verl's, so the plugin's loss options live where verl users expect them.

Only ``config.actor_rollout_ref`` reaches verl's workers, so the loss options sit under
``actor_rollout_ref.actor.policy_loss``. verl's ``PolicyLossConfig`` rejects unknown keys; this subclass,
selected with ``policy_loss._target_``, adds the plugin's (GEPO's, GEPO+'s, M2PO's). The options themselves (names,
defaults, limits) are :class:`gepo_plugin.maths.options.PolicyLossOptions`; this class only carries them through
verl's dataclass machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from gepo_plugin.maths.options import POLICY_LOSS_DEFAULTS, policy_loss_options


@dataclass
class GEPOPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the plugin's loss options (:class:`~gepo_plugin.maths.options.
    PolicyLossOptions`)."""

    group_scope: str = POLICY_LOSS_DEFAULTS.group_scope
    sampler_kl_coef: float = POLICY_LOSS_DEFAULTS.sampler_kl_coef
    log_ratio_cap: float = POLICY_LOSS_DEFAULTS.log_ratio_cap
    gepo_plus_mode: str = POLICY_LOSS_DEFAULTS.gepo_plus_mode
    gepo_plus_kl_threshold: float = POLICY_LOSS_DEFAULTS.gepo_plus_kl_threshold
    m2_budget: float = POLICY_LOSS_DEFAULTS.m2_budget
    m2_scope: str = POLICY_LOSS_DEFAULTS.m2_scope
    m2_mask: bool = POLICY_LOSS_DEFAULTS.m2_mask

    def __post_init__(self):
        policy_loss_options(self)
