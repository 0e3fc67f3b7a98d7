"""Framework-free maths of GEPO and its family: plain torch, no verl, no Ray.

The same functions serve the verl plugin (:mod:`gepo_plugin.verl_glue`), the CPU lab and the
tests, so there is one implementation of each formula.
"""

from gepo_plugin.maths.advantages import (
    AdvantageInputError,
    bnpo_advantages,
    delta_l_aggregate,
    delta_l_weights,
    group_advantages,
)
from gepo_plugin.maths.gepo import (
    GEPOInputError,
    GEPOLossTerms,
    gepo_token_losses,
    group_log_expectation,
    group_log_expectation_from_tokens,
    k3_kl,
    sequence_log_prob,
)
from gepo_plugin.maths.groups import GroupIdError, GroupIndex, segment_logsumexp, segment_mean, segment_sum

__all__ = [
    "AdvantageInputError",
    "GEPOInputError",
    "GEPOLossTerms",
    "GroupIdError",
    "GroupIndex",
    "bnpo_advantages",
    "delta_l_aggregate",
    "delta_l_weights",
    "gepo_token_losses",
    "group_advantages",
    "group_log_expectation",
    "group_log_expectation_from_tokens",
    "k3_kl",
    "segment_logsumexp",
    "segment_mean",
    "segment_sum",
    "sequence_log_prob",
]
