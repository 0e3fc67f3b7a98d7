"""The plugin's trainers report whether the rollout engine holds the learner's weights (``rollout/fresh_logprob_gap``).

With verl's decoupled mode (``algorithm.rollout_correction.bypass_mode=false``) the learner recomputes every
response's log-probs before the update; for the responses its own current version generated, the rollout's
log-probs must agree with them up to the two engines' arithmetic (:mod:`gepo_plugin.maths.rollout_agreement`).
The mixin adds the three fields to the plugin's one TransferQueue read after the advantage step
(:mod:`gepo_plugin.verl_glue.advantage_fields`) and reports the gap; in bypass mode there is nothing recomputed to
compare with, and nothing is read.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from gepo_plugin import metric_names
from gepo_plugin.config_keys import BYPASS_MODE, CALCULATE_LOG_PROBS
from gepo_plugin.maths.rollout_agreement import fresh_logprob_gap, fresh_responses
from gepo_plugin.verl_glue.advantage_fields import AdvantageFieldsMixin
from gepo_plugin.verl_glue.weight_versions import learner_version

#: The sampler's log-probs, the learner's (decoupled mode) and the response mask.
AGREEMENT_FIELDS = frozenset({"rollout_log_probs", "old_log_probs", "response_mask"})


class RolloutAgreementMixin(AdvantageFieldsMixin):
    """Reports ``rollout/fresh_logprob_gap/{max,mean,tokens}`` at every step of a decoupled-mode run."""

    def _reports_agreement(self) -> bool:
        return not OmegaConf.select(self.config, BYPASS_MODE, default=False) and bool(
            OmegaConf.select(self.config, CALCULATE_LOG_PROBS, default=False)
        )

    def _advantage_reads(self) -> frozenset[str]:
        reads = super()._advantage_reads()
        return reads | AGREEMENT_FIELDS if self._reports_agreement() else reads

    def _advantage_writes(self, batch, data, metrics: dict) -> dict[str, torch.Tensor]:
        writes = super()._advantage_writes(batch, data, metrics)
        if self._reports_agreement():
            # during step s the learner holds version s - 1, the one it sent the rollout at the end of step s - 1
            fresh = fresh_responses(batch.tags, learner_version=learner_version(self.global_steps))
            gap = fresh_logprob_gap(fresh, data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
            metrics.update(metric_names.under(metric_names.FRESH_GAP, gap))
        return writes
