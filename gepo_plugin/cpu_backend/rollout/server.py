"""The transformers generation server: a Ray actor with vLLM's server interface, generating on a CPU.

:class:`HFGenerationServer` loads the model with ``AutoModelForCausalLM`` and samples for real: token-in/token-out
``generate`` returning verl's ``TokenOutput``, plus every control method verl calls on servers (sleep/wake,
abort/resume for partial rollout, weight updates, ...). Requests that arrive together are generated as one
left-padded batch with a KV cache (one forward per token for the whole batch), which on a CPU is ~50x cheaper than
one request at a time. Under ``rollout.full_determinism`` each request is generated alone, seeded from the rollout
seed, its request id, prompt and occurrence (:func:`deterministic_seed`), so each prompt's group of responses
repeats exactly given the same weights.
The server's options are ``rollout.engine_kwargs.hf`` (:mod:`~gepo_plugin.cpu_backend.rollout.options`).

Log-probabilities follow vLLM's ``logprobs_mode`` (verl's default ``processed_logprobs``): the log-softmax of the
distribution the sampler actually drew from, i.e. after repetition penalty, temperature, min-p, top-k and top-p;
greedy requests use temperature 1. With verl's default ``top_k=-1, top_p=1`` this is exactly
``log_softmax(logits / temperature)``, what the actor computes, so bypass mode and rollout-vs-actor log-prob checks
work as with vLLM. No CUDA is used anywhere.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import inspect
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from gepo_plugin.cpu_backend.rollout.options import HFRolloutOptions, parse_hf_options
from gepo_plugin.cpu_backend.rollout.sampling import (
    LOGPROBS_MODES,
    BatchParams,
    SamplingSpec,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
)
from gepo_plugin.cpu_backend.rollout.weights import full_tensor

logger = logging.getLogger(__name__)

#: Default key of this backend's options under ``rollout.engine_kwargs``.
ENGINE_KWARGS_KEY = "hf"
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


@dataclass(eq=False)
class _Request:
    """A request between admission and its answer; the generation thread fills it token by token."""

    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    #: Set from the event loop (abort); read by the generation thread at every token boundary.
    abort_requested: bool = False
    #: Set once the outcome is decided (by the thread or the event loop); never reset.
    done: bool = False


def hf_options(config: RolloutConfig) -> HFRolloutOptions:
    """This backend's options: ``rollout.engine_kwargs.hf`` (checked by the launcher already; again here)."""
    engine_kwargs = config.engine_kwargs or {}
    block = engine_kwargs.get(ENGINE_KWARGS_KEY) or {}
    return parse_hf_options(dict(block), bool(config.full_determinism))


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


def _eos_token_ids(model_config: HFModelConfig) -> set[int]:
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


class HFGenerationServer:
    """Token-in/token-out generation server over a transformers causal LM (one per rollout replica).

    An async Ray actor: ``generate`` calls are admitted on the actor's event loop, grouped into a
    batch, and generated in a worker thread so that control calls (abort, drain, sleep) are served
    while tokens are being produced. Aborts take effect at the next token boundary.

    Args:
        config: the rollout config (``RolloutConfig`` or its DictConfig).
        model_config: the model config (``HFModelConfig`` or ``actor_rollout_ref.model``).
        rollout_mode: HYBRID, COLOCATED or STANDALONE (only sleep/wake behave differently).
        replica_rank: the replica this server serves (seeds sampling, names traces).
        node_rank: always 0 (a replica spans one node).
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        rollout_mode: RolloutMode,
        replica_rank: int = 0,
        node_rank: int = 0,
    ) -> None:
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.options = hf_options(self.config)
        #: Under full_determinism: how many identical requests (id and prompt) this server has seen.
        self._identical_requests: Counter[str] = Counter()
        #: Version of the weights being served, set by the adapter after each update (TokenOutput.extra_fields).
        self.global_steps: int | None = None

        from verl.workers.rollout.utils import get_max_position_embeddings

        max_position_embeddings = get_max_position_embeddings(self.model_config.hf_config)
        self.max_model_len = int(self.config.max_model_len or max_position_embeddings)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds max_position_embeddings ({max_position_embeddings})"
            )
        self.logprobs_mode = self.config.logprobs_mode or "processed_logprobs"
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {self.logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        self.max_batch_size = self.options.batch_size(self.config.max_num_seqs, bool(self.config.full_determinism))
        self.batch_wait_s = self.options.batch_wait_ms / 1000.0
        self.eos_token_ids = _eos_token_ids(self.model_config)
        tokenizer = self.model_config.tokenizer
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids, default=0))

        self.model: torch.nn.Module | None = None
        self.vocab_size = 0
        self._logits_kwargs: dict[str, Any] = {}
        self._tensor_index: dict[str, torch.Tensor] = {}
        self._generator = torch.Generator().manual_seed(int(self.config.seed) + replica_rank)
        self._sleeping = False

        # admission gate (same protocol as vLLMHttpServer): closed by abort_all_requests, opened by
        # resume_generation; while closed, new requests wait, or are answered "aborted" when rejecting
        self._submission_paused = False
        self._rejecting = False
        self._resume_event = asyncio.Event()
        self._resume_event.set()

        self._pending: list[_Request] = []
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._work = asyncio.Event()
        self._engine_lock = asyncio.Lock()
        self._scheduler_task: asyncio.Task | None = None
        self._batches = self._largest_batch = 0
        self._profiler: torch.profiler.profile | None = None

        # a unique host:port identity for the load balancer (no HTTP endpoint is served); holding the
        # socket reserves the port so two replicas on one node never share an address
        from verl.utils.net_utils import get_free_port

        self._server_address = ray.util.get_node_ip_address().strip("[]")
        self._server_port, self._port_reservation = get_free_port(self._server_address, with_alive_sock=True)

    # ---------------------------------------------------------------- lifecycle

    async def launch_server(self) -> None:
        """Load the model (``engine_kwargs.hf.dtype``, SDPA attention by default) and start the batch scheduler."""
        if self.model is not None:
            return
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        self.model = await asyncio.to_thread(self._load_model)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        # compute logits for the last position only, where the model supports it (prefill of long prompts)
        self._logits_kwargs = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        )
        self._tensor_index = {
            **dict(self.model.named_parameters(remove_duplicate=False)),
            **dict(self.model.named_buffers(remove_duplicate=False)),
        }
        self._scheduler_task = asyncio.create_task(self._scheduler())
        logger.info(
            "HFGenerationServer replica %d: %s loaded (%d parameters), max_model_len %d, torch threads %d",
            self.replica_rank,
            self.model_config.local_path,
            sum(p.numel() for p in self.model.parameters()),
            self.max_model_len,
            torch.get_num_threads(),
        )

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.options.dtype)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path,
            config=self.model_config.hf_config,
            dtype=dtype,
            attn_implementation=self.options.attn_implementation,
            trust_remote_code=self.model_config.trust_remote_code,
        )
        model.eval()
        model.requires_grad_(False)
        return model

    def get_server_address(self) -> tuple[str, int]:
        """Host and (reserved) port identifying this server in verl's load balancer."""
        return self._server_address, self._server_port

    def get_rollout_config(self) -> RolloutConfig:
        """The server-side rollout config (vLLMHttpServer offers the same to external routers)."""
        return self.config

    def get_status(self) -> dict[str, Any]:
        """Queue, batching and state counters, for tests and debugging."""
        return {
            "pending": len(self._pending),
            "running": len(self._running),
            "sleeping": self._sleeping,
            "paused": self._submission_paused,
            "global_steps": self.global_steps,
            "batches": self._batches,
            "largest_batch": self._largest_batch,
        }

    # ---------------------------------------------------------------- generation

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids`` (same signature and contract as vLLM's server).

        Returns ``TokenOutput`` with the generated ids (EOS included when it stopped there), their
        log-probs when ``sampling_params['logprobs']`` is truthy, ``stop_reason`` ``completed`` (EOS,
        stop token or ``max_tokens``) or ``aborted`` (partial output kept, for partial rollout), and
        ``extra_fields['global_steps']`` (the weights' version). ``priority`` is accepted and ignored
        (admission is first come, first served); multi-modal inputs and PD transfer are unsupported.
        """
        if image_data or video_data or audio_data or mm_processor_kwargs:
            raise NotImplementedError("the transformers rollout backend is text-only (no multi-modal inputs)")
        if kv_transfer_params is not None:
            raise NotImplementedError("the transformers rollout backend has no prefill/decode disaggregation")
        if kwargs:
            logger.debug("ignoring generate() arguments %s", sorted(kwargs))
        from verl.utils import normalize_token_ids

        prompt_ids = normalize_token_ids(prompt_ids)
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            # checked per request: a bad id inside a shared batch would fail every request in it
            raise ValueError(f"prompt ids must be a non-empty list of ids in [0, {self.vocab_size})")
        occurrence = 0
        if self.config.full_determinism:  # identical requests (one prompt's n responses) numbered 0, 1, ...
            key = hashlib.sha256(f"{request_id}:{prompt_ids}".encode()).hexdigest()
            occurrence = self._identical_requests[key]
            self._identical_requests[key] += 1
        spec = self.parse_sampling_params(len(prompt_ids), dict(sampling_params), request_id, prompt_ids, occurrence)

        rejected = await self._park_until_admitted(request_id)
        if rejected is not None:
            return rejected
        if self._scheduler_task is None:
            raise RuntimeError("launch_server() must be called before generate()")

        request = _Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            spec=spec,
            future=asyncio.get_running_loop().create_future(),
            generator=torch.Generator().manual_seed(spec.seed) if spec.seed is not None else None,
        )
        self._requests[request_id] = request
        self._pending.append(request)
        self._work.set()
        try:
            return await request.future
        finally:
            request.abort_requested = True  # a cancelled caller must not keep a batch row busy
            if self._requests.get(request_id) is request:
                del self._requests[request_id]

    def parse_sampling_params(
        self,
        prompt_len: int,
        params: dict[str, Any],
        request_id: str = "",
        prompt_ids: Iterable[int] = (),
        occurrence: int = 0,
    ) -> SamplingSpec:
        """Validate one request's sampling parameters, with vLLM's defaults and max_tokens rule.

        Under ``full_determinism`` a request without its own ``seed`` gets :func:`deterministic_seed`'s.
        """
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
            max_tokens = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        max_tokens = max(1, min(int(max_tokens), max_possible))

        stop_ids = set(int(t) for t in (params.pop("stop_token_ids", None) or []))
        if not params.pop("ignore_eos", self.config.ignore_eos):
            stop_ids |= self.eos_token_ids
        seed = params.pop("seed", None)
        if seed is None and self.config.full_determinism:
            seed = deterministic_seed(int(self.config.seed), request_id, prompt_ids, occurrence)
        spec = SamplingSpec(
            max_tokens=max_tokens,
            temperature=float(params.pop("temperature", self.config.temperature)),
            top_k=int(params.pop("top_k", self.config.top_k)),
            top_p=float(params.pop("top_p", self.config.top_p)),
            min_p=float(params.pop("min_p", 0.0)),
            repetition_penalty=float(params.pop("repetition_penalty", self.config.repetition_penalty)),
            stop_token_ids=frozenset(stop_ids),
            want_logprobs=bool(params.pop("logprobs", False)),
            seed=None if seed is None else int(seed),
        )
        if not 0.0 < spec.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {spec.top_p}")
        if spec.temperature < 0 or spec.repetition_penalty <= 0 or not 0.0 <= spec.min_p <= 1.0:
            raise ValueError(f"invalid sampling parameters: {spec}")
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
        return spec

    async def _park_until_admitted(self, request_id: str) -> TokenOutput | None:
        """Wait while the gate is closed, or answer "aborted" at once when it rejects late arrivals."""
        while self._submission_paused:
            if self._rejecting:
                return self._output(None, "aborted")
            logger.debug("parking request %s until generation resumes", request_id)
            await self._resume_event.wait()
        return None

    def _output(self, request: _Request | None, stop_reason: str) -> TokenOutput:
        token_ids = list(request.token_ids) if request is not None else []
        want = request is not None and request.spec.want_logprobs
        return TokenOutput(
            token_ids=token_ids,
            log_probs=list(request.log_probs) if want else None,
            stop_reason=stop_reason,
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "num_cached_tokens": 0},
        )

    def _resolve(self, request: _Request, output: TokenOutput | BaseException) -> None:
        """Answer a request (on the event loop)."""
        request.done = True
        if request.future.done():
            return
        if isinstance(output, BaseException):
            request.future.set_exception(output)
        else:
            request.future.set_result(output)

    async def _scheduler(self) -> None:
        """Take the waiting requests as one batch, generate it in a thread, repeat (never dies on an error)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            batch: list[_Request] = []
            try:
                # let requests sent together (an agent-loop step) arrive, so that they share a batch
                deadline = loop.time() + 10 * self.batch_wait_s
                seen = -1
                while len(self._pending) != seen and loop.time() < deadline:
                    seen = len(self._pending)
                    await asyncio.sleep(self.batch_wait_s)
                batch = [r for r in self._pending[: self.max_batch_size] if not r.done]
                del self._pending[: self.max_batch_size]
                if not self._pending:
                    self._work.clear()
                if not batch:
                    continue
                self._running = batch
                self._batches += 1
                self._largest_batch = max(self._largest_batch, len(batch))
                async with self._engine_lock:
                    await asyncio.to_thread(self._generate_batch, batch, loop)
            except Exception as error:
                logger.exception("generation failed for %d requests", len(batch))
                for request in batch:
                    if not request.done:
                        self._resolve(request, error)
            finally:
                self._running = []

    @torch.no_grad()
    def _generate_batch(self, requests: list[_Request], loop: asyncio.AbstractEventLoop) -> None:
        """Generate a batch to completion (worker thread): left-padded prefill, then one step per token.

        Rows leave the batch (and the KV cache) as soon as they finish, are aborted, or reach
        ``max_tokens``; their answers are posted to the event loop immediately.
        """
        from transformers import DynamicCache

        model = self.model

        def finish(request: _Request, stop_reason: str) -> None:
            request.done = True
            loop.call_soon_threadsafe(self._resolve, request, self._output(request, stop_reason))

        rows = [r for r in requests if not r.abort_requested]
        for request in requests:
            if request.abort_requested:
                finish(request, "aborted")
        if not rows:
            return
        lengths = [len(r.prompt_ids) for r in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, request in enumerate(rows):
            input_ids[i, width - lengths[i] :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            attention_mask[i, width - lengths[i] :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        next_position = position_ids[:, -1] + 1
        cache = DynamicCache(config=model.config)
        params: BatchParams | None = None
        seen: torch.Tensor | None = None

        while rows:
            output = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                **self._logits_kwargs,
            )
            cache = output.past_key_values
            logits = output.logits[:, -1, :].float()
            if params is None:
                params = BatchParams([r.spec for r in rows], logits.shape[-1])
                if params.repetition_penalty is not None:
                    seen = torch.zeros(logits.shape, dtype=torch.bool)
                    for i, request in enumerate(rows):
                        seen[i, torch.tensor(request.prompt_ids, dtype=torch.long)] = True
            tokens, log_probs = self._sample(logits, params, seen, rows)

            keep: list[int] = []
            for i, request in enumerate(rows):
                token = int(tokens[i])
                request.token_ids.append(token)
                if request.spec.want_logprobs:
                    request.log_probs.append(float(log_probs[i]))
                if seen is not None:
                    seen[i, token] = True
                if token in request.spec.stop_token_ids or len(request.token_ids) >= request.spec.max_tokens:
                    finish(request, "completed")
                elif request.abort_requested:
                    finish(request, "aborted")
                else:
                    keep.append(i)
            if len(keep) < len(rows):
                if not keep:
                    break
                index = torch.tensor(keep, dtype=torch.long)
                rows = [rows[i] for i in keep]
                cache.batch_select_indices(index)
                attention_mask, next_position, tokens = attention_mask[index], next_position[index], tokens[index]
                params.select(index)
                seen = seen[index] if seen is not None else None
            input_ids = tokens.unsqueeze(1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            position_ids = next_position.unsqueeze(1)
            next_position = next_position + 1

    def _sample(
        self, logits: torch.Tensor, params: BatchParams, seen: torch.Tensor | None, rows: list[_Request]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row and its log-prob under ``logprobs_mode`` (vLLM's sampler order)."""
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
            shared = [i for i in sampled if rows[i].generator is None]
            if shared:
                index = torch.tensor(shared, dtype=torch.long)
                tokens[index] = torch.multinomial(probs[index], 1, generator=self._generator).squeeze(1)
            for i in sampled:
                if rows[i].generator is not None:
                    tokens[i] = torch.multinomial(probs[i], 1, generator=rows[i].generator).squeeze(0)

        source = {
            "processed_logprobs": lambda: processed.log_softmax(dim=-1),
            "processed_logits": lambda: processed,
            "raw_logprobs": lambda: raw.log_softmax(dim=-1),
            "raw_logits": lambda: raw,
        }[self.logprobs_mode]()
        return tokens, source.gather(1, tokens.unsqueeze(1)).squeeze(1)

    # ---------------------------------------------------------------- partial rollout / control

    async def _wait_idle(self, poll_s: float = 0.005) -> None:
        while self._pending or self._running:
            await asyncio.sleep(poll_s)

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is waiting or being generated."""
        await self._wait_idle()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close the gate and abort every request; each answers "aborted" with what it generated so far.

        Returns once generation has stopped, so weights can be updated safely. The gate stays closed
        until :meth:`resume_generation`: later requests wait for it, or are answered "aborted" at once
        when ``reject_request`` (a hybrid replica going back to training).
        """
        self._submission_paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        waiting, self._pending = self._pending, []
        self._work.clear()
        aborted = [r.request_id for r in waiting + self._running if not r.done]
        for request in waiting:
            request.abort_requested = True
            if not request.done:
                self._resolve(request, self._output(request, "aborted"))
        for request in self._running:
            request.abort_requested = True
        await self._wait_idle()
        logger.info("aborted %d requests", len(aborted))
        return {"aborted_count": len(aborted), "request_ids": aborted}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Abort one request (answered "aborted" with its partial output)."""
        request = self._requests.get(request_id)
        if request is None or request.done:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        request.abort_requested = True
        if request in self._pending:
            self._pending.remove(request)
            self._resolve(request, self._output(request, "aborted"))
        while not request.done:
            await asyncio.sleep(0.005)
        return {"aborted": True, "request_id": request_id}

    async def resume_engine_generation(self) -> None:
        """Nothing to resume in the engine itself (vLLM API parity; the gate is what pauses)."""

    async def open_submission_gate(self) -> None:
        """Admit requests again (parked ones proceed)."""
        self._rejecting = False
        self._submission_paused = False
        self._resume_event.set()

    async def resume_generation(self) -> None:
        """Resume after :meth:`abort_all_requests`."""
        await self.resume_engine_generation()
        await self.open_submission_gate()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Leave sleep (HYBRID/COLOCATED). Weights stay resident on the host, so nothing is reloaded."""
        if self.rollout_mode != RolloutMode.STANDALONE:
            self._sleeping = False

    async def sleep(self) -> None:
        """Enter sleep (HYBRID/COLOCATED, with ``free_cache_engine``): return freed host memory.

        There is no device memory to give back: KV caches only live while a batch is generated, and
        the weights stay in host memory so a wake-up without a weight sync still serves correct ones.
        """
        if self.rollout_mode == RolloutMode.STANDALONE or not self.config.free_cache_engine:
            return
        await self._wait_idle()
        self._sleeping = True
        gc.collect()

    async def clear_kv_cache(self) -> None:
        """No-op: KV caches are per batch and dropped when it ends (no prefix cache survives a sync)."""

    async def release_kv_cache(self) -> None:
        """Before a weight sync: make sure no batch holds a KV cache computed with the old weights."""
        await self._wait_idle()

    async def resume_kv_cache(self) -> None:
        """No-op counterpart of :meth:`release_kv_cache` (caches are allocated per batch)."""

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the version of the weights now served (reported in every ``TokenOutput``)."""
        self.global_steps = global_steps

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
        """Copy named tensors (HF parameter/buffer names, full tensors) into the model; returns the count.

        Runs under the engine lock, so never in the middle of a forward pass. Callers send buckets
        of a full state dict; names the model does not have, or shape mismatches, raise.
        """
        if self.model is None:
            raise RuntimeError("launch_server() must be called before update_weights()")
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        async with self._engine_lock:
            return await asyncio.to_thread(self._load_tensors, items)

    @torch.no_grad()
    def _load_tensors(self, items: list[tuple[str, torch.Tensor]]) -> int:
        for name, tensor in items:
            tensor = full_tensor(tensor)
            target = self._tensor_index.get(name)
            if target is None:
                known = ", ".join(list(self._tensor_index)[:5])
                raise KeyError(f"update_weights: the rollout model has no tensor {name!r} (it has e.g. {known})")
            if target.shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {target.shape}")
            target.copy_(tensor)
        return len(items)

    def _should_profile(self) -> bool:
        profiler = self.config.profiler
        if profiler is None or not profiler.enable or profiler.tool != "torch":
            return False
        ranks = list(profiler.ranks or [])
        return bool(profiler.all_ranks) or (self.replica_rank in ranks if ranks else self.replica_rank == 0)

    async def start_profile(self, **kwargs: Any) -> None:
        """Start a torch (CPU) profiler when the rollout profiler is configured with ``tool=torch``."""
        if self._profiler is None and self._should_profile():
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.start()

    async def stop_profile(self) -> None:
        """Stop the profiler and write a Chrome trace under the profiler's ``save_path``."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        save_path = self.config.profiler.save_path or "."
        os.makedirs(save_path, exist_ok=True)
        trace = os.path.join(save_path, f"rollout-hf-replica{self.replica_rank}-{int(time.time() * 1000)}.json")
        profiler.export_chrome_trace(trace)
