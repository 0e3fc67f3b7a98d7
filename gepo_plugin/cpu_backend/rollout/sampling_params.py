"""A request's vLLM-style ``sampling_params`` dict, validated into a :class:`SamplingSpec` before it is queued.

Kept apart from the tensor algorithms (:mod:`.sampling`) because it is about the request contract: valid prompt
ids, vLLM's defaults and ``max_tokens`` rule, loud failures for features this backend lacks, and the per-request
seeds of ``rollout.full_determinism``: each request is then generated alone, seeded from the rollout seed, its
request id, prompt and occurrence (:func:`deterministic_seed`), so each prompt's group of responses repeats
exactly given the same weights.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

from verl.utils import normalize_token_ids
from verl.workers.config import RolloutConfig

from gepo_plugin.cpu_backend.rollout.sampling import SamplingSpec

#: Sampling keys that carry no meaning for token-in/token-out generation and are ignored.
_IGNORED_SAMPLING_KEYS = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output"}
)
#: Sampling features this backend does not implement, with their neutral values: a request asking
#: for anything else fails loudly instead of being sampled with silently different semantics.
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "stop": None,
    "logit_bias": None,
    "bad_words": None,
    "prompt_logprobs": None,
    "extra_args": None,
}


def deterministic_seed(rollout_seed: int, request_id: str, prompt_ids: Iterable[int] = (), occurrence: int = 0) -> int:
    """A request's sampling seed under ``full_determinism``: from the rollout seed, the request and its occurrence.

    verl's agent loop names requests ``det-<priority>`` under full determinism, but its V1 trainers' streaming
    path passes no per-sample priority, so all requests are ``det-0`` and verl's router sends them all to one
    server (sticky by id). Identical requests (same id and prompt: one prompt's ``n`` responses) are told apart by
    their ``occurrence`` on that server (0, 1, ...): which of them gets which seed depends on arrival order, but
    they are interchangeable, so each group's set of responses is the same in every run with the same weights,
    and the responses of one prompt still differ from each other.
    """
    key = f"{rollout_seed}:{request_id}:{occurrence}:" + ",".join(str(int(t)) for t in prompt_ids)
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def check_prompt_ids(prompt_ids: Any, vocab_size: int) -> list[int]:
    """The prompt as a list of ids, checked per request: a bad id inside a shared batch would fail all of it."""
    prompt_ids = normalize_token_ids(prompt_ids)
    if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt ids must be a non-empty list of ids in [0, {vocab_size})")
    return prompt_ids


class SamplingParamsParser:
    """Validates requests against one server's config; numbers identical requests for their deterministic seeds.

    Args:
        config: the server's rollout config (defaults, ``ignore_eos``, ``seed``, ``full_determinism``).
        max_model_len: prompt plus response may not exceed it.
        eos_token_ids: the ids a request stops on unless it sets ``ignore_eos``.
    """

    def __init__(self, config: RolloutConfig, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        #: Under full_determinism: how many identical requests (id and prompt) this server has seen.
        self._identical_requests: Counter[str] = Counter()

    def occurrence(self, request_id: str, prompt_ids: list[int]) -> int:
        """Under full_determinism, number identical requests (one prompt's n responses) 0, 1, ...; else 0."""
        if not self.config.full_determinism:
            return 0
        key = hashlib.sha256(f"{request_id}:{prompt_ids}".encode()).hexdigest()
        occurrence = self._identical_requests[key]
        self._identical_requests[key] += 1
        return occurrence

    def parse(
        self,
        prompt_len: int,
        params: dict[str, Any],
        request_id: str = "",
        prompt_ids: Iterable[int] = (),
        occurrence: int = 0,
    ) -> SamplingSpec:
        """Validate one request's sampling parameters (consumes ``params``), with vLLM's defaults and max_tokens rule.

        Under ``full_determinism`` a request without its own ``seed`` gets :func:`deterministic_seed`'s.
        """
        config = self.config
        max_possible = self.max_model_len - prompt_len
        if max_possible < 1:
            raise ValueError(
                f"Prompt length ({prompt_len}) leaves no room to generate within max_model_len ({self.max_model_len})"
            )
        max_tokens = params.pop("max_tokens", None)
        max_new_tokens = params.pop("max_new_tokens", None)  # SGLang's spelling
        if max_tokens is None:
            max_tokens = max_new_tokens
        if max_tokens is None:
            # vLLM's server default: the response budget, minus what a multi-turn prompt already used
            max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
        max_tokens = max(1, min(int(max_tokens), max_possible))

        stop_ids = set(int(t) for t in (params.pop("stop_token_ids", None) or []))
        if not params.pop("ignore_eos", config.ignore_eos):
            stop_ids |= self.eos_token_ids
        seed = params.pop("seed", None)
        if seed is None and config.full_determinism:
            seed = deterministic_seed(int(config.seed), request_id, prompt_ids, occurrence)
        spec = SamplingSpec(
            max_tokens=max_tokens,
            temperature=float(params.pop("temperature", config.temperature)),
            top_k=int(params.pop("top_k", config.top_k)),
            top_p=float(params.pop("top_p", config.top_p)),
            min_p=float(params.pop("min_p", 0.0)),
            repetition_penalty=float(params.pop("repetition_penalty", config.repetition_penalty)),
            stop_token_ids=frozenset(stop_ids),
            want_logprobs=bool(params.pop("logprobs", False)),
            seed=None if seed is None else int(seed),
        )
        if not 0.0 < spec.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {spec.top_p}")
        if spec.temperature < 0 or spec.repetition_penalty <= 0 or not 0.0 <= spec.min_p <= 1.0:
            raise ValueError(f"invalid sampling parameters: {spec}")
        _reject_unsupported(params)
        return spec


def _reject_unsupported(params: dict[str, Any]) -> None:
    """Fail on leftover keys, unless ignorable or at their neutral value (silently different sampling is worse)."""
    for key, value in params.items():
        if key in _IGNORED_SAMPLING_KEYS:
            continue
        if key in _UNSUPPORTED_SAMPLING_DEFAULTS:
            if value not in (_UNSUPPORTED_SAMPLING_DEFAULTS[key], None, [], {}):
                raise NotImplementedError(
                    f"sampling parameter {key}={value!r} is not supported by the transformers rollout backend"
                )
            continue
        raise NotImplementedError(f"unknown sampling parameter {key}={value!r}")
