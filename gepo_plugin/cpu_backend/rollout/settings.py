"""The server's settings, derived and checked once from verl's configs so each collaborator gets plain values."""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.utils import get_max_position_embeddings

from gepo_plugin.cpu_backend.rollout.options import HFRolloutOptions, parse_hf_options
from gepo_plugin.cpu_backend.rollout.sampling import LOGPROBS_MODES

#: Default key of this backend's options under ``rollout.engine_kwargs``.
ENGINE_KWARGS_KEY = "hf"


def hf_options(config: RolloutConfig) -> HFRolloutOptions:
    """This backend's options: ``rollout.engine_kwargs.hf`` (checked by the launcher already; again here)."""
    engine_kwargs = config.engine_kwargs or {}
    block = engine_kwargs.get(ENGINE_KWARGS_KEY) or {}
    return parse_hf_options(dict(block), bool(config.full_determinism))


def eos_token_ids(model_config: HFModelConfig) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer (vLLM stops on all of them)."""
    ids: set[int] = set()
    sources = (
        getattr(model_config.generation_config, "eos_token_id", None),
        getattr(model_config.hf_config, "eos_token_id", None),
        getattr(model_config.tokenizer, "eos_token_id", None),
    )
    for value in sources:
        if value is None:
            continue
        if isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
        else:
            ids.add(int(value))
    return ids


@dataclass(frozen=True)
class ServerSettings:
    """What one server needs from ``rollout.*``, ``rollout.engine_kwargs.hf`` and the model's configs."""

    options: HFRolloutOptions
    #: Prompt plus response may not exceed it (``rollout.max_model_len``, default the model's maximum).
    max_model_len: int
    #: One of :data:`~.sampling.LOGPROBS_MODES` (verl's default ``processed_logprobs``).
    logprobs_mode: str
    max_batch_size: int
    batch_wait_s: float
    eos_token_ids: set[int]
    pad_token_id: int

    @classmethod
    def from_configs(cls, config: RolloutConfig, model_config: HFModelConfig) -> ServerSettings:
        """Derive the settings; a ``max_model_len`` or ``logprobs_mode`` the server cannot honour raises."""
        options = hf_options(config)
        max_position_embeddings = get_max_position_embeddings(model_config.hf_config)
        max_model_len = int(config.max_model_len or max_position_embeddings)
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds max_position_embeddings ({max_position_embeddings})"
            )
        logprobs_mode = config.logprobs_mode or "processed_logprobs"
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        eos_ids = eos_token_ids(model_config)
        tokenizer = model_config.tokenizer
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        return cls(
            options=options,
            max_model_len=max_model_len,
            logprobs_mode=logprobs_mode,
            max_batch_size=options.batch_size(config.max_num_seqs, bool(config.full_determinism)),
            batch_wait_s=options.batch_wait_ms / 1000.0,
            eos_token_ids=eos_ids,
            pad_token_id=int(pad if pad is not None else min(eos_ids, default=0)),
        )
