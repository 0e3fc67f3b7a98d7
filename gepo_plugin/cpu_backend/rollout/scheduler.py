"""The request queue between ``generate`` calls and the model: batching, the admission gate, abort and drain.

All of it runs on the server actor's event loop, while a batch is decoded in a worker thread, so control calls
(abort, drain, sleep) are served in the middle of generation. The decoding itself is handed in as a callable
(:class:`~.batch_generation.BatchGenerator`), so this module knows nothing of models or tensors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from verl.workers.rollout.replica import TokenOutput

from gepo_plugin.cpu_backend.rollout.latency import LatencyOptions, finish_offsets
from gepo_plugin.cpu_backend.rollout.sampling import SamplingSpec

logger = logging.getLogger(__name__)

#: How often a request held back for the modelled GPU looks for an abort (seconds).
ABORT_POLL_S = 0.05


@dataclass(eq=False)
class GenerationRequest:
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


#: Answers a request with what it generated so far (``None``: a request rejected before it was queued).
MakeOutput = Callable[[GenerationRequest | None, str], TokenOutput]
#: Called by the generation thread when a row ends, with its stop reason (``completed`` or ``aborted``).
Finish = Callable[[GenerationRequest, str], None]
#: Decodes a batch to completion in a worker thread, calling ``Finish`` once per request.
GenerateBatch = Callable[[list[GenerationRequest], Finish], None]


def token_output(request: GenerationRequest | None, stop_reason: str, global_steps: int | None) -> TokenOutput:
    """verl's answer to ``generate``: the tokens so far, their log-probs if asked for, and the weights' version."""
    token_ids = list(request.token_ids) if request is not None else []
    want = request is not None and request.spec.want_logprobs
    return TokenOutput(
        token_ids=token_ids,
        log_probs=list(request.log_probs) if want else None,
        stop_reason=stop_reason,
        num_preempted=0,
        extra_fields={"global_steps": global_steps, "num_cached_tokens": 0},
    )


class RequestScheduler:
    """First come, first served batches of waiting requests, behind a gate that partial rollout closes.

    The gate follows vLLMHttpServer's protocol: closed by :meth:`abort_all`, opened by :meth:`open_gate`; while
    closed, new requests wait, or are answered "aborted" at once when rejecting.

    Args:
        max_batch_size: the most requests decoded together.
        batch_wait_s: how long to wait for more requests once one arrived (requests sent together share a batch).
        make_output: builds a request's answer (the server stamps its weights' version on it).
        latency: a modelled GPU (:mod:`.latency`): answers wait until it would have finished them; None: at once.
    """

    def __init__(
        self,
        max_batch_size: int,
        batch_wait_s: float,
        make_output: MakeOutput,
        latency: LatencyOptions | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.latency = latency
        #: Seconds answers were held back for the modelled GPU (0 without a latency model).
        self.modelled_wait_s = 0.0
        self.batch_wait_s = batch_wait_s
        self._make_output = make_output
        self.submission_paused = False
        self._rejecting = False
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self.pending: list[GenerationRequest] = []
        self.running: list[GenerationRequest] = []
        self._requests: dict[str, GenerationRequest] = {}
        self._work = asyncio.Event()
        #: Held while a batch is decoded; weight updates take it too, so never in the middle of a forward.
        self.engine_lock = asyncio.Lock()
        self.task: asyncio.Task | None = None
        self.batches = self.largest_batch = 0

    def start(self, generate_batch: GenerateBatch) -> None:
        """Start the batching loop on the running event loop (once the model is loaded)."""
        self.task = asyncio.create_task(self._run(generate_batch))

    async def park_until_admitted(self, request_id: str) -> TokenOutput | None:
        """Wait while the gate is closed, or answer "aborted" at once when it rejects late arrivals."""
        while self.submission_paused:
            if self._rejecting:
                return self._make_output(None, "aborted")
            logger.debug("parking request %s until generation resumes", request_id)
            await self._resume_event.wait()
        return None

    async def submit(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec) -> TokenOutput:
        """Queue a request and wait for its answer; a cancelled caller's request leaves its batch."""
        request = GenerationRequest(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            spec=spec,
            future=asyncio.get_running_loop().create_future(),
            generator=torch.Generator().manual_seed(spec.seed) if spec.seed is not None else None,
        )
        self._requests[request_id] = request
        self.pending.append(request)
        self._work.set()
        try:
            return await request.future
        finally:
            request.abort_requested = True  # a cancelled caller must not keep a batch row busy
            if self._requests.get(request_id) is request:
                del self._requests[request_id]

    def resolve(self, request: GenerationRequest, output: TokenOutput | BaseException) -> None:
        """Answer a request (on the event loop)."""
        request.done = True
        if request.future.done():
            return
        if isinstance(output, BaseException):
            request.future.set_exception(output)
        else:
            request.future.set_result(output)

    async def _run(self, generate_batch: GenerateBatch) -> None:
        """Take the waiting requests as one batch, generate it in a thread, repeat (never dies on an error)."""
        loop = asyncio.get_running_loop()

        def finish(request: GenerationRequest, stop_reason: str) -> None:
            request.done = True
            loop.call_soon_threadsafe(self.resolve, request, self._make_output(request, stop_reason))

        while True:
            await self._work.wait()
            batch: list[GenerationRequest] = []
            try:
                # let requests sent together (an agent-loop step) arrive, so that they share a batch
                deadline = loop.time() + 10 * self.batch_wait_s
                seen = -1
                while len(self.pending) != seen and loop.time() < deadline:
                    seen = len(self.pending)
                    await asyncio.sleep(self.batch_wait_s)
                batch = [r for r in self.pending[: self.max_batch_size] if not r.done]
                del self.pending[: self.max_batch_size]
                if not self.pending:
                    self._work.clear()
                if not batch:
                    continue
                self.running = batch
                self.batches += 1
                self.largest_batch = max(self.largest_batch, len(batch))
                async with self.engine_lock:
                    if self.latency is None:
                        await asyncio.to_thread(generate_batch, batch, finish)
                    else:
                        await self._generate_at_modelled_speed(generate_batch, batch)
            except Exception as error:
                logger.exception("generation failed for %d requests", len(batch))
                for request in batch:
                    if not request.done:
                        self.resolve(request, error)
            finally:
                self.running = []

    async def _generate_at_modelled_speed(self, generate_batch: GenerateBatch, batch: list[GenerationRequest]) -> None:
        """Generate for real, then answer each request at its modelled finish time and hold the engine until the
        modelled batch is over. An abort answers at once (with the tokens generated for real)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        ended: list[tuple[GenerationRequest, str]] = []
        await asyncio.to_thread(generate_batch, batch, lambda request, reason: ended.append((request, reason)))
        offsets = finish_offsets(np.array([len(request.token_ids) for request, _ in ended]), self.latency)
        for index in np.argsort(offsets, kind="stable"):
            request, reason = ended[index]
            while not request.abort_requested and (left := started + offsets[index] - loop.time()) > 0:
                await asyncio.sleep(min(left, ABORT_POLL_S))
            self.resolve(request, self._make_output(request, reason))
        self.modelled_wait_s += max(0.0, loop.time() - started)

    async def wait_idle(self, poll_s: float = 0.005) -> None:
        """Return once no request is waiting or being generated."""
        while self.pending or self.running:
            await asyncio.sleep(poll_s)

    async def abort_all(self, reject_request: bool) -> list[str]:
        """Close the gate, abort every request and wait until generation stopped; returns the aborted ids.

        Waiting requests are answered "aborted" at once, running ones at their next token boundary, each with
        what it generated so far.
        """
        self.submission_paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        waiting, self.pending = self.pending, []
        self._work.clear()
        aborted = [r.request_id for r in waiting + self.running if not r.done]
        for request in waiting:
            request.abort_requested = True
            if not request.done:
                self.resolve(request, self._make_output(request, "aborted"))
        for request in self.running:
            request.abort_requested = True
        await self.wait_idle()
        return aborted

    async def abort_one(self, request_id: str) -> bool:
        """Abort one request and wait for its ("aborted") answer; False when no such request is in flight."""
        request = self._requests.get(request_id)
        if request is None or request.done:
            return False
        request.abort_requested = True
        if request in self.pending:
            self.pending.remove(request)
            self.resolve(request, self._make_output(request, "aborted"))
        while not request.done:
            await asyncio.sleep(0.005)
        return True

    def open_gate(self) -> None:
        """Admit requests again (parked ones proceed)."""
        self._rejecting = False
        self.submission_paused = False
        self._resume_event.set()
