"""Sampling for the transformers rollout: vLLM's v1 sampler algorithms as pure tensor functions.

Repetition penalty, temperature, min-p, top-k and top-p in vLLM's order, on a batch of logits with one setting per
row, plus the validated per-request parameters (:class:`SamplingSpec`) and their per-batch tensor form
(:class:`BatchParams`), and the draw of one token per row (:func:`sample_tokens`). No server, no Ray: the batched
decoding loop (:mod:`.batch_generation`) calls these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Temperatures below this are greedy (the threshold vLLM uses).
SAMPLING_EPS = 1e-5
#: vLLM's ``logprobs_mode`` values, all supported.
LOGPROBS_MODES = ("processed_logprobs", "processed_logits", "raw_logprobs", "raw_logits")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """vLLM/CTRL repetition penalty on tokens already in the prompt or output (``seen`` is [B, V] bool)."""
    penalties = penalties.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / penalties, logits * penalties)
    return torch.where(seen, penalized, logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the most likely token's (vLLM's min-p)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Per-row top-k then top-p (nucleus) masking, vLLM's ``apply_top_k_top_p`` algorithm.

    ``top_k`` holds the number of tokens to keep per row (the vocabulary size disables it), ``top_p``
    the nucleus mass per row (1.0 disables it). At least one token always survives.
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.size(1) - top_k.to(torch.long)
        threshold = logits_sort.gather(1, kth.unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, float("-inf"))
    if top_p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cumulative <= 1 - top_p.unsqueeze(1)
        mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


@dataclass
class SamplingSpec:
    """One request's validated sampling parameters (vLLM ``SamplingParams`` semantics)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    want_logprobs: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class BatchParams:
    """Per-row sampling parameters of a running batch as tensors, pruned together with the batch."""

    def __init__(self, specs: list[SamplingSpec], vocab_size: int) -> None:
        greedy = [spec.greedy for spec in specs]
        self.greedy = torch.tensor(greedy, dtype=torch.bool)
        self.temperature = torch.tensor(
            [1.0 if g else spec.temperature for g, spec in zip(greedy, specs, strict=True)], dtype=torch.float32
        )
        # greedy rows are never truncated (vLLM resets top-k/top-p/min-p for temperature 0)
        top_k = [
            vocab_size if g or spec.top_k <= 0 else min(spec.top_k, vocab_size)
            for g, spec in zip(greedy, specs, strict=True)
        ]
        top_p = [1.0 if g else spec.top_p for g, spec in zip(greedy, specs, strict=True)]
        min_p = [0.0 if g else spec.min_p for g, spec in zip(greedy, specs, strict=True)]
        self.top_k = torch.tensor(top_k, dtype=torch.long) if any(k < vocab_size for k in top_k) else None
        self.top_p = torch.tensor(top_p, dtype=torch.float32) if any(p < 1.0 for p in top_p) else None
        self.min_p = torch.tensor(min_p, dtype=torch.float32) if any(m > 0.0 for m in min_p) else None
        penalties = [spec.repetition_penalty for spec in specs]
        self.repetition_penalty = (
            torch.tensor(penalties, dtype=torch.float32) if any(p != 1.0 for p in penalties) else None
        )

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows in ``index`` (finished rows leave the batch)."""
        for name in ("greedy", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[index])


def sample_tokens(
    logits: torch.Tensor,
    params: BatchParams,
    seen: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
    logprobs_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its log-prob under ``logprobs_mode`` (vLLM's sampler order).

    Log-probabilities follow vLLM's ``logprobs_mode`` (verl's default ``processed_logprobs``): the log-softmax of
    the distribution the sampler actually drew from, i.e. after repetition penalty, temperature, min-p, top-k and
    top-p; greedy requests use temperature 1. With verl's default ``top_k=-1, top_p=1`` this is exactly
    ``log_softmax(logits / temperature)``, what the actor computes, so bypass mode and rollout-vs-actor log-prob
    checks work as with vLLM. Rows with their own generator (a seeded request) draw from it, so their tokens do
    not depend on the rest of the batch; the others share ``shared_generator`` in one draw. Greedy rows take the
    argmax.
    """
    raw = logits
    if params.repetition_penalty is not None and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    processed = logits / params.temperature.unsqueeze(1)
    if params.min_p is not None:
        processed = apply_min_p(processed, params.min_p)
    processed = apply_top_k_top_p(processed, params.top_k, params.top_p)

    tokens = processed.argmax(dim=-1)
    sampled = (~params.greedy).nonzero().flatten().tolist()
    if sampled:
        probs = processed.softmax(dim=-1)
        shared = [i for i in sampled if generators[i] is None]
        if shared:
            index = torch.tensor(shared, dtype=torch.long)
            tokens[index] = torch.multinomial(probs[index], 1, generator=shared_generator).squeeze(1)
        for i in sampled:
            generator = generators[i]
            if generator is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=generator).squeeze(0)

    source = {
        "processed_logprobs": lambda: processed.log_softmax(dim=-1),
        "processed_logits": lambda: processed,
        "raw_logprobs": lambda: raw.log_softmax(dim=-1),
        "raw_logits": lambda: raw,
    }[logprobs_mode]()
    return tokens, source.gather(1, tokens.unsqueeze(1)).squeeze(1)
