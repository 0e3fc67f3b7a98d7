"""Config dataclasses that extend verl's, so GEPO's options live where verl users expect them.

Only ``config.actor_rollout_ref`` reaches verl's workers, so the loss options sit under
``actor_rollout_ref.actor.policy_loss``. verl's ``PolicyLossConfig`` rejects unknown keys;
this subclass, selected with ``policy_loss._target_``, adds GEPO's.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

GROUP_SCOPES = ("prompt", "batch")


@dataclass
class GEPOPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus GEPO's options.

    Args:
        group_scope: ``prompt`` (default, the paper's definition): the group expectation runs
            over the responses of one prompt, computed by the trainer. ``batch``: over the
            micro-batch the loss sees, as the reference code does; only for reproducing it.
        sampler_kl_coef: weight of the per-token k3 KL toward the sampler policy (the paper's
            asynchronous runs used 0.005). 0 disables it.
        log_ratio_cap: upper cap on log w for numerical safety (verl's GSPO uses 10).
    """

    group_scope: str = "prompt"
    sampler_kl_coef: float = 0.0
    log_ratio_cap: float = 10.0

    def __post_init__(self):
        if self.group_scope not in GROUP_SCOPES:
            raise ValueError(
                f"policy_loss.group_scope={self.group_scope!r} is not one of {GROUP_SCOPES}: "
                "use 'prompt' (the paper's per-prompt group) or 'batch' (the reference code's micro-batch scope)"
            )
        if self.sampler_kl_coef < 0:
            raise ValueError(f"policy_loss.sampler_kl_coef must be >= 0, got {self.sampler_kl_coef}")
        if not self.log_ratio_cap > 0:
            raise ValueError(f"policy_loss.log_ratio_cap must be > 0, got {self.log_ratio_cap}")
