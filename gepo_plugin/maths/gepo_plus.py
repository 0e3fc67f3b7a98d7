"""GEPO+: the GEPO authors' adaptive denominator, chosen per sequence by how far the learner is from the sampler.

Below a KL of about 0.08 between learner and sampler, GEPO's group-expectation weight ``p_i / E_hat_q[q]`` has
*more* variance than the per-sequence weight ``p_i / q_i`` (GSPO's); above it, less (the paper's Figure 2, and
``gepo-lab variance``). The authors' code (github.com/HanlardResearch/Hetero-RL,
``src/hetero_rl/learner_script_checkpoint.py``, loss type ``gepo+``) therefore picks the denominator per sequence
from the sequence-mean k3 KL between learner and sampler, ``KL_i = mean_t [exp(q_t - p_t) - (q_t - p_t) - 1]``:

* ``hard`` (their active code): ``D_i = q_i`` if ``KL_i < kl_threshold``, else ``E_hat_q[q]``;
* ``soft`` (commented out there): ``D_i = (1 - g_i) E_hat_q[q] + g_i q_i`` with ``g_i = clip(exp(-KL_i / T), 0, 1)``.

``q_i = exp(mean_t log q_t)`` as in GEPO, and the weight is ``w_i = p_i / D_i``. Here the gate carries no gradient
(the weight's gradient is GSPO's straight-through one, ``w_i d log p_t``); in the authors' commented-out soft form
it would also flow through ``g_i``. ``E_hat_q[q]`` is the prompt group's (the paper's definition), where the
authors' code takes it over a shuffled micro-batch; ``group_scope=batch`` reproduces theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GEPOPlusRule:
    """Which denominator each sequence gets: ``hard`` switches at ``kl_threshold``, ``soft`` mixes."""

    mode: Literal["hard", "soft"]
    kl_threshold: float

    def __post_init__(self) -> None:
        if self.mode not in ("hard", "soft"):
            raise ValueError(f"GEPO+ mode must be 'hard' or 'soft', got {self.mode!r}")
        if not self.kl_threshold > 0:
            raise ValueError(f"GEPO+ kl_threshold must be > 0, got {self.kl_threshold}")

    def own_share(self, seq_kl: torch.Tensor) -> torch.Tensor:
        """``g_i``: the weight of the sequence's own ``q_i`` in its denominator (0 or 1 when hard)."""
        if self.mode == "hard":
            return (seq_kl < self.kl_threshold).to(seq_kl.dtype)
        return torch.exp(-seq_kl / self.kl_threshold).clamp(0.0, 1.0)

    def log_denominator(
        self, log_group_expectation: torch.Tensor, seq_log_q: torch.Tensor, seq_kl: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log D_i = log((1 - g_i) E_hat_q[q] + g_i q_i)`` in log space, and ``g_i`` (all ``[B]``, no grad)."""
        share = self.own_share(seq_kl)
        # log(0) = -inf is the exact limit on either side; logaddexp(-inf, x) = x
        log_denominator = torch.logaddexp(torch.log1p(-share) + log_group_expectation, torch.log(share) + seq_log_q)
        return log_denominator, share
