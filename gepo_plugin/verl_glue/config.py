"""Config dataclasses that extend verl's, so GEPO's options live where verl users expect them.

Only ``config.actor_rollout_ref`` reaches verl's workers, so the loss options sit under
``actor_rollout_ref.actor.policy_loss``. verl's ``PolicyLossConfig`` rejects unknown keys; this subclass,
selected with ``policy_loss._target_``, adds GEPO's. The options themselves (names, defaults, limits) are
:class:`gepo_plugin.maths.options.GEPOOptions`; this class only carries them through verl's dataclass machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig

from gepo_plugin.maths.options import GEPO_DEFAULTS, GEPO_OPTIONS_KEY, GEPOOptions
from gepo_plugin.options import parse_options

#: The fields GEPO adds to verl's policy-loss config.
GEPO_FIELDS: tuple[str, ...] = tuple(GEPOOptions.model_fields)


@dataclass
class GEPOPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus GEPO's options (see :class:`~gepo_plugin.maths.options.GEPOOptions`)."""

    group_scope: str = GEPO_DEFAULTS.group_scope
    sampler_kl_coef: float = GEPO_DEFAULTS.sampler_kl_coef
    log_ratio_cap: float = GEPO_DEFAULTS.log_ratio_cap
    gepo_plus_mode: str = GEPO_DEFAULTS.gepo_plus_mode
    gepo_plus_kl_threshold: float = GEPO_DEFAULTS.gepo_plus_kl_threshold

    def __post_init__(self):
        gepo_options(self)


def gepo_options(policy_loss: Any) -> GEPOOptions:
    """GEPO's options from a policy-loss config: the plugin's dataclass, verl's plain one (defaults), or a node."""
    values = {name: getattr(policy_loss, name) for name in GEPO_FIELDS if hasattr(policy_loss, name)}
    return parse_options(GEPOOptions, values, GEPO_OPTIONS_KEY)
