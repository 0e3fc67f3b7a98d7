"""The one endpoint of the learner's side that remote samplers dial: HTTPS, a bearer token per sampler, limits.

A Ray actor on the node of verl's TaskRunner runs an aiohttp server (``hetero.gateway.host``/``port``; TLS with
``certfile``/``keyfile``) with four routes per sampler name: ``GET /v1/samplers/<name>/hello`` (the run it joins),
``POST .../poll`` (its status in, work out: a long poll), ``POST .../status`` (a change of status while a poll is
held, such as a version installed: the fleet must not learn it a long poll later) and ``POST .../results``. It
authenticates every request (``Authorization: Bearer``, compared in constant time with :func:`hmac.compare_digest`
against the token in the environment variable the sampler's entry names, read on this node), refuses bodies over
``max_body_mb``, and hands the call to the sampler's
:class:`~gepo_plugin.verl_glue.hetero.remote.proxy.RemoteSamplerProxy`, which lives in this actor's process (its
:class:`~gepo_plugin.verl_glue.hetero.remote.pool.ProxyPool`: no Ray call between a sampler's call and its proxy;
verl and the fleet reach the proxies through the actor's pool methods). A sampler the fleet retired gets 410 and is
recorded as asking to rejoin (:meth:`RemoteGateway.rejoining`); the fleet takes it back at its next safe point.
Refusals are counted per sampler and reason (a wrong token: ``unauthorised``; a name no entry lists gets the same 401
and counts as ``unknown_sampler``); wrong tokens beyond ``auth_failures_per_minute`` from one client address get 429,
unlogged (``rate_limited``). A connection silent for ``idle_timeout_s`` is closed, whether idle between calls, never
sending one, or stopping half way through one (a body that stops arriving gets 408, counted as ``idle``). A body is
read as UTF-8 JSON whatever it declares, and anything else is a 400 (never a 500); what a sampler reports is checked
by its proxy before anything is stored (a status naming a version outside the run's window is refused with 400,
counted by reason).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import time
from collections import Counter
from typing import Any

import numpy as np
from aiohttp import web
from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

import gepo_sampler
from gepo_plugin.verl_glue.hetero.remote.loop_watch import LoopWatch
from gepo_plugin.verl_glue.hetero.remote.pool import ProxyGone, ProxyPool
from gepo_sampler.remote.protocol import PACKAGE_HEADER, PROTOCOL_HEADER, PROTOCOL_VERSION, Hello, protocol_mismatch
from gepo_sampler.remote.settings import GatewayConfig, RemoteSamplerConfig

logger = logging.getLogger(__name__)

#: what an unknown name's token is compared with (so that it costs what a known one's does)
_NO_TOKEN = b"\0" * 32


def _unless_refused(answer: dict) -> dict:
    """A proxy's answer, or 400 where it refused the sampler's message whole (a status that cannot be true, results
    that are not a list): it counted the reason and stored nothing. (Results answer counts of their own.)"""
    if isinstance(answer.get("refused"), str):
        raise web.HTTPBadRequest(text=f"refused: {answer['refused']}")
    return answer


class RemoteGateway:
    """The gateway (instantiated as a Ray actor; its methods are the fleet's control)."""

    def __init__(self, config: GatewayConfig, samplers: list[RemoteSamplerConfig], hello: dict[str, Any]) -> None:
        self.config = config
        self.samplers = {sampler.name: sampler for sampler in samplers}
        self._tokens = {sampler.name: sampler.token().encode() for sampler in samplers}
        self.hello_fields = hello
        #: every sampler's proxy; a name's calls go to the key it is attached to (none while it is retired)
        self.pool = ProxyPool()
        self.routes: dict[str, str] = {}
        self.asking: dict[str, float] = {}
        #: samplers the audit quarantined: refused (403) for the rest of the run
        self.quarantined: set[str] = set()
        self.refusals: Counter[str] = Counter()
        #: route -> seconds each call took since the last :meth:`latencies`
        self._handled: dict[str, list[float]] = {}
        #: how late the loop runs (the wait before a handler starts, which no handler's time holds)
        self._watch = LoopWatch()
        self._runner: web.AppRunner | None = None
        #: wrong tokens per client address in the last minute: beyond the limit, 429 and no log line
        self._auth_failures = MovingWindowRateLimiter(MemoryStorage())
        self._auth_limit = RateLimitItemPerMinute(config.auth_failures_per_minute)

    async def start(self) -> str:
        """Listen; returns the URL samplers dial."""
        app = web.Application(middlewares=[self._timed])  # (the body limit is _read's: every route reads it there)
        app.add_routes(
            [
                web.get("/v1/samplers/{name}/hello", self._hello, name="hello"),
                web.post("/v1/samplers/{name}/poll", self._poll, name="poll"),
                web.post("/v1/samplers/{name}/status", self._status, name="status"),
                web.post("/v1/samplers/{name}/results", self._results, name="results"),
            ]
        )
        context = None
        if self.config.tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.certfile, self.config.keyfile)
        # a connection with no call for idle_timeout_s is closed (aiohttp's keep-alive timer also runs from the
        # connection's start and through half-sent headers); a refused body's rest is read for at most as long
        idle = self.config.idle_timeout_s
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=idle, lingering_time=min(idle, 10.0))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=context)
        await site.start()
        self._watch.start()
        scheme = "https" if context is not None else "http"
        url = f"{scheme}://{self.config.host}:{self.config.port}"
        logger.info("hetero: the remote samplers' gateway listens at %s", url)
        return url

    async def stop(self) -> None:
        await self._watch.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ the pool (verl's and the fleet's calls)
    def add(self, key: str, name: str, *args: Any, **kwargs: Any) -> None:
        self.pool.add(key, name, *args, **kwargs)

    async def remove(self, key: str) -> None:
        await self.pool.remove(key)

    async def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.pool.call(key, method, *args, **kwargs)

    async def call_with(self, key: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.pool.call_with(key, function, *args, **kwargs)

    async def call_many(self, keys: list[str], method: str, **kwargs: Any) -> None:
        await self.pool.call_many(keys, method, **kwargs)

    async def probe(self, keys: list[str]) -> dict[str, str | None]:
        return await self.pool.probe(keys)

    async def reports(self, keys: list[str]) -> dict[str, dict]:
        return await self.pool.reports(keys)

    def versions(self, keys: list[str]) -> dict[str, int | None]:
        return self.pool.versions(keys)

    async def set_window(self, first: int, latest: int) -> None:
        await self.pool.set_window(first, latest)

    # ------------------------------------------------------------------ the fleet's control
    def attach_many(self, routes: dict[str, str]) -> None:
        """Route each name's calls to the proxy under its key (samplers joining, or rejoining)."""
        for name, key in routes.items():
            self.routes[name] = key
            self.asking.pop(name, None)

    def detach(self, name: str, quarantined: bool = False) -> None:
        """``name`` was retired: its calls get 410 until it is attached again; a quarantined one gets 403 for good
        (its host stops, saying why)."""
        self.routes.pop(name, None)
        if quarantined:
            self.quarantined.add(name)
            self.asking.pop(name, None)

    def set_hello(self, **fields: Any) -> None:
        self.hello_fields.update(fields)

    def rejoining(self) -> list[str]:
        """Retired samplers that have dialled in since (they ask to be taken back)."""
        return sorted(self.asking)

    def counts(self) -> dict[str, float]:
        return {key: float(value) for key, value in self.refusals.items()}

    def latencies(self) -> dict[str, float]:
        """Per route, the calls handled since the last time this was asked and the time each handler took (p50, p99,
        ms: its body read and its proxy's work; a long poll's wait is not), and how late the loop ran meanwhile (the
        wait a call had before its handler started: :class:`LoopWatch`)."""
        out = {f"gateway/{key}": value for key, value in self._watch.take().items()}
        for route, seconds in self._handled.items():
            p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
            out |= {f"gateway/{route}/calls": float(len(seconds)), f"gateway/{route}/p50_ms": float(p50)}
            out[f"gateway/{route}/p99_ms"] = float(p99)
        self._handled = {}
        return out

    # ------------------------------------------------------------------ HTTP
    @web.middleware
    async def _timed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Time every call of a route but the long poll (whose time is its wait for work)."""
        started = time.perf_counter()
        try:
            return await handler(request)
        finally:
            route = request.match_info.route.name
            if route is not None and route != "poll":
                self._handled.setdefault(route, []).append(time.perf_counter() - started)

    def _authorised(self, request: web.Request) -> str:
        """The sampler a call is for, if its token is right. An unknown name gets the same answer as a wrong token
        (names cannot be enumerated without one), after the same constant-time comparison."""
        name = request.match_info["name"]
        expected = self._tokens.get(name)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        try:
            given = token.encode("utf-8", "surrogateescape")  # header bytes that are not UTF-8 arrive escaped
        except UnicodeError:
            given = b""
        right = hmac.compare_digest(given, expected if expected is not None else _NO_TOKEN)
        if expected is None or scheme != "Bearer" or not right:
            if not self._auth_failures.hit(self._auth_limit, request.remote or "unknown"):
                self.refusals["rate_limited"] += 1  # a flood of wrong tokens costs no log line each
                raise web.HTTPTooManyRequests(
                    text="too many wrong tokens from this address", headers={"Retry-After": "60"}
                )
            self.refusals["unknown_sampler" if expected is None else f"{name}/unauthorised"] += 1
            logger.warning("hetero: a call for remote sampler %r with a wrong token, from %s", name, request.remote)
            raise web.HTTPUnauthorized(text="wrong or missing bearer token")
        if name in self.quarantined:
            raise web.HTTPForbidden(text=f"remote sampler {name!r} was quarantined by the learner's audit for this run")
        return name

    def _proxy(self, name: str) -> str:
        """The key of ``name``'s proxy; 410 while it is retired."""
        key = self.routes.get(name)
        if key is None:
            raise self._retired(name)
        return key

    def _retired(self, name: str) -> web.HTTPGone:
        """410 for a retired sampler, recorded as asking to rejoin."""
        self.asking[name] = time.monotonic()
        return web.HTTPGone(text=f"remote sampler {name!r} is retired; it rejoins when the learner takes it back")

    async def _body(self, request: web.Request, name: str) -> dict:
        """The call's JSON object (UTF-8 whatever charset it declares); 400 and counted for anything else: bytes
        that are not UTF-8, integers beyond the parser's limit, nesting beyond the interpreter's."""
        raw = await self._read(request, name)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            self.refusals[f"{name}/malformed"] += 1
            raise web.HTTPBadRequest(text="the body is not JSON") from None
        if not isinstance(body, dict):
            self.refusals[f"{name}/malformed"] += 1
            raise web.HTTPBadRequest(text="the body is not a JSON object")
        return body

    async def _read(self, request: web.Request, name: str) -> bytes:
        """The body's bytes: 413 past ``max_body_mb``, 408 (and the connection closed) where no byte of it arrives
        for ``idle_timeout_s`` (a body half sent and left)."""
        limit = self.config.max_body_bytes
        if (request.content_length or 0) > limit:  # said up front: refused before a byte of it is read
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        chunks, size, idle = [], 0, self.config.idle_timeout_s
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(idle) as silence:  # one timer, moved on by every chunk (no task per read)
                while chunk := await request.content.readany():
                    silence.reschedule(loop.time() + idle)
                    size += len(chunk)
                    if size > limit:
                        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
                    chunks.append(chunk)
        except TimeoutError:
            self.refusals[f"{name}/idle"] += 1
            answer = web.HTTPRequestTimeout(text=f"no byte of the body for {idle:g} s")
            answer.force_close()
            raise answer from None
        return b"".join(chunks)

    async def _hello(self, request: web.Request) -> web.Response:
        name = self._authorised(request)
        host = (request.headers.get(PROTOCOL_HEADER, "none"), request.headers.get(PACKAGE_HEADER, "unknown"))
        mismatch = protocol_mismatch((str(PROTOCOL_VERSION), gepo_sampler.__version__), host)
        if mismatch is not None:
            self.refusals[f"{name}/protocol"] += 1
            logger.warning("hetero: remote sampler %r refused at hello: %s", name, mismatch)
            raise web.HTTPUpgradeRequired(text=mismatch)
        link = self.samplers[name].link
        hello = Hello(name=name, link=link.model_dump() if link is not None else None, **self.hello_fields).model_dump()
        return web.json_response(hello)

    async def _poll(self, request: web.Request) -> web.Response:
        name = self._authorised(request)
        body = await self._body(request, name)
        key = self._proxy(name)
        wait_s = self.config.poll_wait_s
        answer = await self._proxy_call(name, self.pool.call(key, "poll", body, wait_s), wait_s + 30.0)
        return web.json_response(_unless_refused(answer))

    async def _status(self, request: web.Request) -> web.Response:
        name = self._authorised(request)
        body = await self._body(request, name)
        key = self._proxy(name)
        _unless_refused(await self._proxy_call(name, self.pool.call(key, "update_status", body), 30.0))
        return web.json_response({})

    async def _proxy_call(self, name: str, call: Any, timeout_s: float) -> Any:
        """A proxy's answer to the sampler's call: 410 if the proxy is gone (retired meanwhile), 400 and counted if
        it refused what was sent as malformed."""
        try:
            async with asyncio.timeout(timeout_s):  # no task of its own: an answer ready at once costs no loop turn
                return await call
        except ProxyGone:  # removed at its retirement, before the fleet detached it
            raise self._retired(name) from None
        except Exception as error:
            self.refusals[f"{name}/malformed"] += 1
            raise web.HTTPBadRequest(text=f"status refused: {type(error).__name__}") from None

    async def _results(self, request: web.Request) -> web.Response:
        name = self._authorised(request)
        body = await self._body(request, name)
        key = self._proxy(name)
        return web.json_response(
            _unless_refused(await self._proxy_call(name, self.pool.call(key, "deliver", body), 30.0))
        )
