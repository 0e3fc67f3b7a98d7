"""Were these tokens drawn from the claimed distribution? The randomised probability integral transform says.

Recomputing log-probs by teacher forcing checks the numbers a sampler sent, not how it chose its tokens: greedy
decoding, another model's tokens or a cherry-picked answer all get honest log-probs. The randomised PIT checks the
choice. For a distribution ``p`` over the vocabulary, order the tokens by decreasing probability (ties by token id),
let ``F(t)`` be the mass of the tokens before ``t`` in that order, and draw ``V ~ U(0, 1)`` independently of
everything the sampler saw. Then

    U = F(t) + V p(t)

is uniform on [0, 1] exactly when ``t ~ p``: the intervals ``[F(s), F(s) + p(s))`` tile [0, 1), token ``s`` is drawn
with the probability ``p(s)`` that is its interval's length, and ``V`` spreads it uniformly over the interval, so
``P(U <= x) = x``. For tokens generated one after another (``t_k ~ p(. | prefix)``) the ``U_k`` are independent
U(0, 1): each is uniform given the whole past, so it is independent of the earlier ones. A sampler that picks
tokens more likely than its distribution says (greedy decoding, a lower temperature, a tighter top-p, the best of
several answers) piles ``U`` toward 0; a hotter one toward 1; a token the distribution excludes (probability 0 after
top-k/top-p) gives ``U = 1``. :mod:`~gepo_plugin.hetero.audit.sequential` turns a stream of ``U`` into a verdict.

The distribution is the one the sampler claims to sample from: the recomputed logits divided by the temperature,
then vLLM's top-k and top-p masks (:func:`processed_logprobs`, the arithmetic of vLLM's
``apply_top_k_top_p_pytorch`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``; what its
``--logprobs-mode processed_logprobs`` reports).
"""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Log-probs of the distribution a sampler draws from: ``logits / temperature``, then top-k, then top-p.

    ``logits``: ``(tokens, vocab)``. ``top_k <= 0`` and ``top_p >= 1`` mean no mask. Greedy decoding
    (``temperature == 0``) is not a distribution to audit: refused.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: the PIT audits sampling; greedy decoding has no distribution")
    scaled = logits.double() / temperature
    if (top_k <= 0 or top_k >= scaled.shape[-1]) and top_p >= 1.0:
        return torch.log_softmax(scaled, dim=-1)
    ordered, index = scaled.sort(dim=-1, descending=False)
    if 0 < top_k < scaled.shape[-1]:  # keep the logits at least the k-th largest (ties kept, as vLLM does)
        kth = ordered[:, scaled.shape[-1] - top_k].unsqueeze(-1)
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p < 1.0:  # drop the smallest whose cumulative mass is at most 1 - p; keep the largest always
        drop = torch.cumsum(ordered.softmax(dim=-1), dim=-1) <= 1.0 - top_p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    masked = torch.empty_like(scaled).scatter_(-1, index, ordered)
    return torch.log_softmax(masked, dim=-1)


def randomised_pit(logprobs: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``U = F(t) + V p(t)`` per token (see the module docstring), in float64.

    ``logprobs``: ``(tokens, vocab)``, the claimed distribution at each position; ``tokens``: ``(tokens,)`` the
    sampled ids; ``uniforms``: ``(tokens,)`` the auditor's ``V`` (from a seed the sampler cannot know).
    """
    probs = logprobs.double().exp()
    chosen = probs.gather(-1, tokens.long().unsqueeze(-1))  # (T, 1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    ahead = (probs > chosen) | ((probs == chosen) & (ids < tokens.long().unsqueeze(-1)))
    before = (probs * ahead).sum(-1)
    return (before + uniforms.double() * chosen.squeeze(-1)).clamp(0.0, 1.0)
