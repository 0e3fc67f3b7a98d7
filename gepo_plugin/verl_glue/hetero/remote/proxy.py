"""A remote sampler as verl sees a rollout server: one sampler's side of verl's server interface on the learner's node.

Every proxy lives in the gateway's actor (:mod:`~gepo_plugin.verl_glue.hetero.remote.pool`), reached by verl through
a :class:`~gepo_plugin.verl_glue.hetero.remote.pool.PooledProxy`, which has an actor handle's face.

verl's agent loop reaches rollout servers through Ray handles from its load balancer and calls ``generate``; the
fleet aborts and resumes them. :class:`RemoteSamplerProxy` answers those calls for one sampler outside the cluster:
``generate`` queues a :class:`~gepo_sampler.remote.protocol.GenerateRequest` that the sampler collects when it
long-polls the gateway (:meth:`poll`), and returns verl's ``TokenOutput`` once the sampler posts the result
(:meth:`deliver`). Every result is checked (:func:`~gepo_sampler.remote.protocol.check_result`) against the
request, the versions this run published (up to the learner's, which the transport sets) and the vocabulary; a
refused one fails its request (verl counts the group failed) and is counted by reason, never trained.

The version of a result becomes ``extra_fields["global_steps"]``, as verl's vLLM server reports the version of its
weights: verl's client records the first and last version of a trajectory, so a request the sampler cut at an install
(``finish_reason: abort``) is resumed by verl on the new weights and every token's version is exact.

**Liveness.** The health monitor's probe (:mod:`gepo_plugin.verl_glue.hetero.engine_probe`) reads ``engine.errored``:
here true once the sampler has not been heard from for ``hetero.gateway.sampler_timeout_s``, reports its engine
dead, or reports an error (a store it can no longer read); the fleet then retires it like a dead in-cluster server.
A request left with the sampler longer than ``hetero.gateway.request_timeout_s`` fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from pydantic import ValidationError

from gepo_plugin.verl_glue.hetero.remote.auditor import AuditClient, SamplerQuarantined
from gepo_sampler.remote.protocol import (
    MALFORMED,
    UNKNOWN_REQUEST,
    GenerateRequest,
    RefusedResult,
    RefusedStatus,
    Result,
    SamplerStatus,
    VersionWindow,
    Work,
    check_result,
    check_status,
)
from gepo_sampler.remote.settings import GatewayConfig

logger = logging.getLogger(__name__)

#: The most requests one poll hands out.
MAX_REQUESTS_PER_POLL = 256


class SamplerSilent(RuntimeError):
    """The remote sampler has not been heard from within its timeout."""


class SamplerEngineDead(RuntimeError):
    """The remote sampler reports that its inference engine is dead."""


class SamplerFailed(RuntimeError):
    """The remote sampler reports an error that stops it from generating (e.g. its store is unreadable)."""


class RequestRefused(RuntimeError):
    """The remote sampler's answer to a request was refused (see the message); nothing of it is trained."""


class RequestFailed(RuntimeError):
    """The remote sampler could not generate a request (its engine refused it); verl counts the group failed."""


@dataclass
class _Pending:
    request: GenerateRequest
    future: asyncio.Future
    sent_at: float | None = None
    #: its result arrived (and may be held by its audit): another result for it is refused
    answered: bool = False


@dataclass
class _Engine:
    """What the health probe reads (``errored``, ``dead_error``), as on vLLM's ``AsyncLLM``."""

    proxy: RemoteSamplerProxy
    dead_error: BaseException | None = field(default=None)

    @property
    def errored(self) -> bool:
        self.dead_error = self.proxy.why_dead()
        return self.dead_error is not None


class RemoteSamplerProxy:
    """verl's rollout-server interface for one remote sampler (held by the gateway's proxy pool)."""

    def __init__(
        self,
        name: str,
        address: str,
        gateway: GatewayConfig,
        window: VersionWindow,
        vocab_size: int,
        default_max_tokens: int,
        audit: AuditClient | None = None,
    ) -> None:
        self.name = name
        #: the audit of this sampler's results (``hetero.audit``), None when off
        self.audit = audit
        #: verl's response length: a request without a budget of its own gets this one, as on verl's servers
        self.default_max_tokens = default_max_tokens
        self.address = address
        self.config = gateway
        self.window = window
        self.vocab_size = vocab_size
        self.engine = _Engine(self)
        self.status: SamplerStatus | None = None
        self.created = time.monotonic()
        self.last_heard: float | None = None
        #: long polls the sampler holds open now: a sampler waiting in one is connected, not silent
        self._open_polls = 0
        self.refused: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self._pending: dict[str, _Pending] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._gate = asyncio.Event()
        self._gate.set()
        self._abort_requested = False
        #: set when the sampler must hear something now (an abort): it ends the long poll waiting for work
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        #: why the proxy serves no more (its sampler was retired from its pool): every request fails with it
        self._gone: Exception | None = None

    # ------------------------------------------------------------------ verl's server interface
    async def generate(
        self, prompt_ids: list[int], sampling_params: dict, request_id: str, **_unused
    ) -> object:  # verl's TokenOutput (imported lazily: this module is importable without verl's rollout stack)
        from verl.workers.rollout.replica import TokenOutput

        await self._gate.wait()  # a paused sampler (admission control, an abort) parks new requests here
        if self._gone is not None:  # retired while this request waited at the gate
            raise self._gone
        params = dict(sampling_params)
        request = GenerateRequest(
            request_id=f"{request_id}-{next(self._ids)}",
            prompt_ids=[int(t) for t in prompt_ids],
            max_tokens=int(params.get("max_tokens") or params.get("max_new_tokens") or self.default_max_tokens),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1) if params.get("top_k") is not None else -1),
            logprobs=params.get("logprobs") is not None and params.get("logprobs") is not False,
        )
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = _Pending(request, future)
        self._queue.put_nowait(request.request_id)
        self.counters["requests"] += 1
        try:
            result: Result = await asyncio.wait_for(future, self.config.request_timeout_s)
        except asyncio.TimeoutError:
            self.counters["timed_out"] += 1
            raise SamplerSilent(
                f"remote sampler {self.name!r} did not answer request {request.request_id} within "
                f"{self.config.request_timeout_s:g} s (hetero.gateway.request_timeout_s)"
            ) from None
        finally:
            self._pending.pop(request.request_id, None)
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            stop_reason="aborted" if result.finish_reason == "abort" else "completed",
            extra_fields={"global_steps": result.version},
        )

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate and cut every request: those the sampler has are cut there (each returns its partial
        tokens), those not sent yet come back aborted with none; returns once all are answered (or failed), as
        verl's servers return once generation has stopped. verl resumes them behind the gate."""
        self._gate.clear()
        version = self.status.version if self.status is not None and self.status.version is not None else None
        for pending in self._pending.values():
            if pending.sent_at is None and not pending.future.done():
                cut = Result(
                    request_id=pending.request.request_id,
                    token_ids=[],
                    log_probs=[] if pending.request.logprobs else None,
                    finish_reason="abort",
                    version=version if version is not None else self.window.latest,
                )
                pending.future.set_result(cut)
        sent = [rid for rid, pending in self._pending.items() if pending.sent_at is not None]
        if sent:
            self._abort_requested = True
            self._wake.set()
            deadline = time.monotonic() + self.config.sampler_timeout_s
            while any(rid in self._pending for rid in sent) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        return {"aborted_count": len(sent), "request_ids": sent}

    async def resume_generation(self) -> None:
        self._gate.set()

    async def open_submission_gate(self) -> None:
        self._gate.set()

    async def resume_engine_generation(self) -> None:
        """Nothing to resume at the sampler (it resumes itself after an abort)."""

    async def wait_for_requests_to_drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0.01)

    async def get_server_address(self) -> str:
        return self.address

    # the server-lifecycle calls verl makes on every replica: nothing to do for a sampler that manages itself
    async def sleep(self) -> None: ...
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def start_profile(self, **kwargs) -> None: ...
    async def stop_profile(self) -> None: ...

    # ------------------------------------------------------------------ the transport's calls
    async def set_window(self, first: int, latest: int) -> None:
        """The versions a result may claim: this run's from ``first``, none newer than the learner's ``latest``. A
        newer ``latest`` ends a held long poll now: the sampler hears of the version with its answer and lists the
        store for it (it lists only when told of one, :meth:`~gepo_sampler.relay.follower.RelayFollower.hint`)."""
        newer = latest > self.window.latest
        self.window = VersionWindow(first=first, latest=latest)
        if newer:
            self._wake.set()

    async def report(self) -> dict:
        """What the learner's side knows of the sampler: its last status, when it was heard from, the counters."""
        return {
            "status": self.status.model_dump() if self.status is not None else None,
            "silent_s": self.silent_s(),
            "dead": None if (why := self.why_dead()) is None else str(why),
            "refused": dict(self.refused),
            "counters": {**self.counters, **(self.audit.counters if self.audit is not None else {})},
        }

    def silent_s(self) -> float:
        """Seconds since the sampler was last heard from: 0 while it holds a long poll open (the poll began and will
        end with its status; a sampler cut off mid-poll is heard from no more once that poll has ended)."""
        if self._open_polls:
            return 0.0
        return time.monotonic() - (self.last_heard if self.last_heard is not None else self.created)

    def why_dead(self) -> BaseException | None:
        if self.audit is not None and self.audit.quarantined is not None:
            return SamplerQuarantined(self.audit.quarantined)
        silent = self.silent_s()
        if silent > self.config.sampler_timeout_s:
            return SamplerSilent(f"not heard from for {silent:.1f} s")
        if self.status is not None and not self.status.engine_alive:
            return SamplerEngineDead("its vLLM server does not answer")
        if self.status is not None and self.status.error:
            return SamplerFailed(self.status.error)
        return None

    # ------------------------------------------------------------------ the gateway's calls
    def _accept_status(self, body: object) -> str | None:
        """Store the sampler's status if it can be true; else why not (counted by reason, nothing stored: the fleet's
        books, the relay's retention and the staleness floor read it)."""
        try:
            status = SamplerStatus.model_validate(body)
            check_status(status, self.window)
        except ValidationError as error:
            self._refuse(MALFORMED, f"a garbled status ({error.error_count()} errors)")
            return MALFORMED
        except RefusedStatus as refused:
            self._refuse(refused.reason, f"its status: {refused}")
            return refused.reason
        self.status = status
        self.last_heard = time.monotonic()
        return None

    async def update_status(self, status: dict) -> dict:
        """The sampler's status between polls (it installed a version, or failed): the fleet reads it at once.
        ``{"refused": reason}`` for one that cannot be true (the gateway answers 400)."""
        refused = self._accept_status(status)
        return {"refused": refused} if refused is not None else {}

    async def poll(self, status: dict, wait_s: float) -> dict:
        """The sampler's long poll: record its status; hand out queued requests (waiting up to ``wait_s`` for some,
        or until an abort must reach it). ``{"refused": reason}`` for a status that cannot be true."""
        refused = self._accept_status(status)
        if refused is not None:
            return {"refused": refused}
        self._open_polls += 1
        try:
            return await self._hand_out(wait_s)
        finally:
            self._open_polls -= 1
            self.last_heard = time.monotonic()

    async def _hand_out(self, wait_s: float) -> dict:
        self._fail_overdue()
        ready = self.status.version is not None and self.status.error is None  # nothing to generate with otherwise
        ids: list[str] = []
        if not self._abort_requested:
            ids = await self._next_requests(wait_s if ready else min(wait_s, 0.5), take=ready)
        now = time.monotonic()
        requests: list[GenerateRequest] = []
        for rid in ids:
            pending = self._pending.get(rid)
            if pending is not None and not pending.future.done():  # (timed out or cut by an abort meanwhile: gone)
                pending.sent_at = now
                requests.append(pending.request)
        abort, self._abort_requested = self._abort_requested, False
        self._wake.clear()
        self.last_heard = time.monotonic()
        return Work(abort=abort, requests=requests, learner_version=self.window.latest).model_dump()

    async def _next_requests(self, wait_s: float, take: bool) -> list[str]:
        """Queued request ids (``take``: at most :data:`MAX_REQUESTS_PER_POLL`), waiting up to ``wait_s`` for the
        first; an abort ends the wait at once."""
        waits = [asyncio.ensure_future(self._wake.wait())]
        if take:
            waits.append(asyncio.ensure_future(self._queue.get()))
        done, pending = await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        ids = [task.result() for task in done if task is not waits[0]]
        if take and not self._abort_requested:
            while not self._queue.empty() and len(ids) < MAX_REQUESTS_PER_POLL:
                ids.append(self._queue.get_nowait())
        return ids

    async def deliver(self, body: dict) -> dict:
        """The sampler's results: each checked, then handed to the ``generate`` call waiting for it."""
        self.last_heard = time.monotonic()
        items = body.get("results") if isinstance(body, dict) and set(body) <= {"results"} else None
        if not isinstance(items, list):  # nothing in it can be named: the gateway answers 400
            self._refuse(MALFORMED, "a results message that is not a list of results")
            return {"refused": MALFORMED}
        results = []
        for item in items:  # each on its own: a garbled one fails its request at once where it names one
            try:
                results.append(Result.model_validate(item))
            except ValidationError as error:
                self._refuse(MALFORMED, f"a garbled result ({error.error_count()} errors)")
                self._fail_named(item, RequestRefused(f"remote sampler {self.name!r}: a garbled result"))
        accepted = 0
        for result in results:
            pending = self._pending.get(result.request_id)
            if pending is None or pending.sent_at is None or pending.future.done() or pending.answered:
                self._refuse(UNKNOWN_REQUEST, f"a result for request {result.request_id!r}, which it was not sent")
                continue
            try:
                check_result(result, pending.request, self.window, self.vocab_size)
            except RefusedResult as refused:
                self._refuse(refused.reason, f"request {result.request_id}: {refused}")
                pending.future.set_exception(RequestRefused(f"remote sampler {self.name!r}: {refused}"))
                continue
            if result.error is not None:
                self.counters["failed"] += 1
                pending.future.set_exception(RequestFailed(f"remote sampler {self.name!r}: {result.error}"))
                continue
            pending.answered = True
            accepted += 1
            self.counters["results"] += 1
            self.counters["tokens"] += len(result.token_ids)
            if self.audit is not None and self.audit.quarantined is not None:
                self.audit.cut()
                pending.future.set_exception(SamplerQuarantined(self.audit.quarantined))
            elif self.audit is None or not self.audit.review(
                pending.request.model_dump(),
                result.model_dump(),
                release=lambda p=pending, r=result: p.future.done() or p.future.set_result(r),
                refuse=lambda error, p=pending: p.future.done() or p.future.set_exception(error),
                dtype=self.status.dtype if self.status is not None else None,
            ):
                pending.future.set_result(result)
        return {"accepted": accepted, "refused": len(items) - accepted}

    def _fail_named(self, item: object, error: Exception) -> None:
        """Fail the request a refused result names, if it is one this sampler was sent and still owes."""
        request_id = item.get("request_id") if isinstance(item, dict) else None
        pending = self._pending.get(request_id) if isinstance(request_id, str) else None
        if pending is not None and pending.sent_at is not None and not pending.future.done() and not pending.answered:
            pending.future.set_exception(error)

    def fail_all(self, error: Exception) -> None:
        """Every request it was asked to generate fails with ``error``, those parked at its gate too (the sampler was
        retired from its pool, as when a proxy's own process was killed); a long poll it holds ends now."""
        self._gone = error
        self._gate.set()
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(error)
        self._wake.set()

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        logger.warning("remote sampler %s: refused %s (%s): nothing of it is trained", self.name, reason, detail)

    def _fail_overdue(self) -> None:
        """Requests sent longer ago than the request timeout fail now (the sampler lost them)."""
        now = time.monotonic()
        for pending in list(self._pending.values()):
            sent = pending.sent_at
            if sent is not None and now - sent > self.config.request_timeout_s and not pending.future.done():
                pending.future.set_exception(SamplerSilent(f"remote sampler {self.name!r} lost a request"))
