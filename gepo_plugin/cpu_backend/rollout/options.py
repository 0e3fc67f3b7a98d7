"""The transformers rollout's own options: ``actor_rollout_ref.rollout.engine_kwargs.hf`` (one typed block).

verl passes ``rollout.engine_kwargs.<rollout name>`` to its servers as a free-form dict. The CPU backend reads its
block through :class:`HFRolloutOptions`, in the launcher (a mistake stops the run before Ray starts, naming the key)
and in each server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gepo_plugin import config_keys
from gepo_plugin.cpu_backend.rollout.latency import LatencyOptions
from gepo_plugin.options import STRICT_BLOCK, OptionsError, parse_options

#: Where the block lives in verl's config (``+actor_rollout_ref.rollout.engine_kwargs.hf.<option>=...``).
HF_OPTIONS_KEY = config_keys.HF_ROLLOUT_OPTIONS


class HFRolloutOptions(BaseModel):
    """Options of the transformers rollout server (one per rollout replica)."""

    model_config = STRICT_BLOCK

    num_threads: int | None = Field(None, ge=1, description="torch threads of each server (default: torch's own)")
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="requests generated together as one padded batch (default: rollout.max_num_seqs); with "
        "rollout.full_determinism=true it must be 1 or unset, because a request's numerics then may not depend on "
        "which requests share its batch",
    )
    batch_wait_ms: float = Field(
        10.0, ge=0, allow_inf_nan=False, description="how long a batch waits for requests sent together to arrive"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the served model's dtype")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="transformers attention")
    latency: LatencyOptions | None = Field(
        None,
        description="answer each request when a modelled GPU would have finished it (decode_tokens_per_s, "
        "prefill_s, batch_slowdown); off by default. Tokens are still generated for real; the wait uses no CPU",
    )

    def batch_size(self, max_num_seqs: int, full_determinism: bool) -> int:
        """The batch size a server uses: 1 under full determinism, else the option or verl's ``max_num_seqs``."""
        if full_determinism:
            return 1
        return self.max_batch_size or int(max_num_seqs)


def parse_hf_options(block: Any, full_determinism: bool = False) -> HFRolloutOptions:
    """The options of ``block`` (a plain mapping; None means defaults), or an :class:`OptionsError` naming the key."""
    options = parse_options(HFRolloutOptions, block, HF_OPTIONS_KEY)
    if full_determinism and options.max_batch_size not in (None, 1):
        raise OptionsError(
            f"{HF_OPTIONS_KEY}.max_batch_size={options.max_batch_size} contradicts "
            f"{config_keys.FULL_DETERMINISM}=true: a deterministic rollout generates one request at a "
            "time. Fix: drop max_batch_size, or set full_determinism=false."
        )
    return options
