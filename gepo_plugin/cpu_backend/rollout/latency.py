"""A modelled GPU's generation time for the CPU rollout, so that asynchronous training's speed-up can be measured.

On a 2-core machine the samplers and the learner compute on the same cores, so wall time cannot show what
running them apart buys. With ``rollout.engine_kwargs.hf.latency`` set, a server still generates every token for
real (the responses, their lengths and log-probs are the model's), but answers each request only when the
modelled GPU would have finished it, and holds its engine until the modelled batch is over. The waiting is an
``asyncio`` sleep: it uses no CPU, so the learner computes meanwhile, as it would next to a real GPU sampler.

The model, per batch of ``b`` requests decoded together: ``prefill_s``, then one decode step per token, a step
taking ``(1 + batch_slowdown * (active - 1)) / decode_tokens_per_s`` with ``active`` the rows still generating
(rows leave the batch when they finish, as in vLLM's continuous batching of one wave).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from gepo_plugin.options import STRICT_BLOCK


class LatencyOptions(BaseModel):
    """``rollout.engine_kwargs.hf.latency``: the modelled GPU (off unless the block is given)."""

    model_config = STRICT_BLOCK

    decode_tokens_per_s: float = Field(
        ..., gt=0, allow_inf_nan=False, description="decode speed of one sequence alone on the modelled GPU (tokens/s)"
    )
    prefill_s: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="seconds to prefill a batch's prompts before its first token"
    )
    batch_slowdown: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="each further sequence decoded together makes a step this much slower (0: batching is free, "
        "as on a GPU far below its compute limit; 1: no gain from batching)",
    )


def finish_offsets(lengths: np.ndarray, latency: LatencyOptions) -> np.ndarray:
    """Seconds from a batch's start until each row's last token on the modelled GPU (vectorised over rows).

    ``lengths``: generated tokens per row. Decode step ``k`` runs with the rows longer than ``k``; a row of length
    ``L`` is done after steps ``0 .. L-1``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0)
    longest = int(lengths.max())
    shorter_or_equal = np.cumsum(np.bincount(lengths, minlength=longest + 1))[:longest]
    active = lengths.size - shorter_or_equal  # rows still generating at each decode step
    step_s = (1.0 + latency.batch_slowdown * (active - 1)) / latency.decode_tokens_per_s
    elapsed = np.concatenate([[0.0], np.cumsum(step_s)])
    return latency.prefill_s + elapsed[lengths]
