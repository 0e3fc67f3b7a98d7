"""One audited trajectory: how far its log-probs are from the recomputed ones, and its tokens' PITs.

The auditor hands in the logits it recomputed by teacher forcing under the claimed version's weights (one forward
pass over prompt and response, as verl's trainer computes log-probs) and the sampling settings the request carried;
both checks read the same distribution: the logits over the temperature, then vLLM's top-k and top-p
(:func:`~gepo_plugin.hetero.audit.pit.processed_logprobs`), which is what a sampler started with processed
log-probs reports and draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gepo_plugin.hetero.audit.pit import processed_logprobs, randomised_pit


@dataclass(frozen=True)
class Examination:
    """What one audited trajectory showed."""

    request_id: str
    version: int
    #: the largest ``|claimed - recomputed|`` log-prob over its tokens (inf where a claimed one is not finite)
    max_gap: float
    #: the randomised PIT of each token
    pits: np.ndarray


def examine(
    request_id: str,
    version: int,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    claimed: torch.Tensor,
    uniforms: np.ndarray,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
) -> Examination:
    """``logits``: ``(tokens, vocab)``, the recomputed logits at each response position; ``tokens`` and ``claimed``:
    ``(tokens,)``, the sampled ids and the log-probs the sampler sent; ``uniforms``: the auditor's ``V``."""
    logprobs = processed_logprobs(logits, temperature, top_k, top_p)
    recomputed = logprobs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    gap = (claimed.double() - recomputed).abs()
    gap = torch.where(torch.isfinite(claimed.double()), gap, torch.full_like(gap, float("inf")))
    # a claimed token the distribution excludes has recomputed -inf: the gap is inf, and its PIT is 1
    pits = randomised_pit(logprobs, tokens, torch.as_tensor(uniforms, dtype=torch.float64))
    return Examination(request_id, version, float(gap.max()) if gap.numel() else 0.0, pits.numpy())
