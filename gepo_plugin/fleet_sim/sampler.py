"""One synthetic remote sampler: the host's protocol over HTTP, the relay's manifests, answers after a drawn delay.

It does what :class:`~gepo_sampler.host.host.SamplerHost` does with its gateway, through the host's own client
(:class:`~gepo_sampler.host.gateway_client.GatewayClient`): hello, a long poll carrying its status, a status report
when it holds a new version, each result sent at once; a version "installed" cuts the requests in flight (each
returns its partial tokens, tagged with the version they began under, and verl resumes them), as a host's install
does. Generation is a sleep: a log-normal time, an answer of drawn length; its tokens are uniform with their
log-probs under a uniform distribution (well-formed, finite, negative), or, with an
:class:`~gepo_plugin.fleet_sim.honest.HonestGenerator` (the audit on), sampled from the tiny model at the version the
sampler holds, a liar's log-probs reported higher than they are. A straggler is slower on every request; a vanishing
sampler goes silent for good (the learner must retire it and count what it held).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import aiohttp

from gepo_plugin.fleet_sim.follower import ManifestFollower
from gepo_plugin.fleet_sim.honest import HonestGenerator
from gepo_plugin.fleet_sim.profile import FleetProfile
from gepo_sampler.host.gateway_client import GatewayClient, GatewayRefused, GatewayRetired
from gepo_sampler.remote.protocol import GenerateRequest, Result, Results, SamplerStatus

#: how often to list the store while a newer version is due (a host's ``--poll-s``)
LIST_S = 0.2
#: seconds between attempts after a failed call
BACKOFF_S = 1.0


@dataclass
class FleetStats:
    """What the samplers of one process saw (merged over processes by :mod:`.run`)."""

    #: seconds each call took, by kind (``status``, ``results``; a long poll's time is its wait, not the gateway's)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    calls: Counter = field(default_factory=Counter)
    #: version -> (published_at, [arrival wall-clock times])
    arrivals: dict[int, tuple[float, list[float]]] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)

    def arrived(self, version: int, published_at: float, at: float) -> None:
        self.arrivals.setdefault(version, (published_at, []))[1].append(at)


class SyntheticSampler:
    """One synthetic sampler (a coroutine of many in one process)."""

    def __init__(
        self,
        name: str,
        client: GatewayClient,
        follower: ManifestFollower,
        profile: FleetProfile,
        vocab_size: int,
        stats: FleetStats,
        honest: HonestGenerator | None = None,
        liar: bool = False,
    ) -> None:
        self.name, self.client, self.follower, self.profile = name, client, follower, profile
        self.vocab_size, self.stats = vocab_size, stats
        self.honest, self.liar = honest, liar
        self.rng = profile.rng(name)
        self.slowdown = profile.straggler_factor if self.rng.random() < profile.stragglers else 1.0
        self.vanishes = self.rng.random() < profile.vanish
        self.held: int | None = None
        self.learner_version = -1
        self._news = asyncio.Event()
        self._cut = asyncio.Event()
        self._running: set[asyncio.Task] = set()

    async def _timed(self, kind: str, call):
        started = time.perf_counter()
        answer = await call
        self.stats.latencies[kind].append(time.perf_counter() - started)
        self.stats.calls[kind] += 1
        return answer

    def status(self) -> SamplerStatus:
        return SamplerStatus(version=self.held, in_flight=len(self._running), engine="synthetic", dtype="float32")

    async def run(self) -> None:
        """Serve until cancelled (or, for a vanishing sampler, until it goes)."""
        while True:  # (as a host does: the gateway may not answer yet)
            try:
                hello = await self._timed("hello", self.client.hello())
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.stats.counters["hello_failed"] += 1
                await asyncio.sleep(BACKOFF_S)
        self.learner_version = hello.learner_version
        loops = [asyncio.create_task(self._follow()), asyncio.create_task(self._poll(hello.poll_wait_s))]
        try:
            if self.vanishes:
                await asyncio.sleep(self.profile.vanish_after_s * (0.5 + self.rng.random()))
                self.stats.counters["vanished"] += 1
            else:
                await asyncio.gather(*loops)
        finally:
            for task in [*loops, *self._running]:
                task.cancel()

    # ------------------------------------------------------------------ weights
    async def _follow(self) -> None:
        while True:
            if self.held is not None and self.learner_version <= self.held:
                await self._news.wait()
            self._news.clear()
            arrival = await asyncio.to_thread(self.follower.pull)
            if arrival is None:
                await asyncio.sleep(LIST_S)
                continue
            self.stats.arrived(arrival.version, arrival.published_at, time.time())
            self.stats.counters["bytes_fetched"] += arrival.nbytes
            self._cut.set()  # an install cuts what is in flight: each answers with its tokens so far
            self._cut = asyncio.Event()
            self.held = arrival.version
            try:
                await self._timed("status", self.client.report(self.status()))
            except (GatewayRetired, aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.stats.counters["status_failed"] += 1

    # ------------------------------------------------------------------ work
    async def _poll(self, wait_s: float) -> None:
        while True:
            try:
                work = await self.client.poll(self.status(), wait_s)
            except GatewayRetired:
                self.stats.counters["retired_answers"] += 1
                await asyncio.sleep(BACKOFF_S)
                continue
            except GatewayRefused:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.stats.counters["poll_failed"] += 1
                await asyncio.sleep(BACKOFF_S)
                continue
            self.stats.calls["poll"] += 1
            if work.learner_version > self.learner_version:
                self.learner_version = work.learner_version
                self._news.set()
            if work.abort:
                self._cut.set()
                self._cut = asyncio.Event()
            for request in work.requests:
                task = asyncio.create_task(self._generate(request))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _answer(self, request: GenerateRequest, version: int, length: int) -> tuple[list[int], list | None]:
        if self.honest is None:
            tokens = self.rng.integers(0, self.vocab_size, size=length).tolist()
            return tokens, [-math.log(self.vocab_size)] * length if request.logprobs else None
        if length == 0:
            return [], [] if request.logprobs else None
        tokens, log_probs = await self.honest.sample(
            version, request.prompt_ids, length, request.temperature, request.top_k, request.top_p
        )
        if self.liar:  # (still a log-prob: never above 0, or the gateway would refuse it before any audit)
            log_probs = [min(lp + self.profile.liar_shift, -1e-6) for lp in log_probs]
        return tokens, log_probs if request.logprobs else None

    async def _generate(self, request: GenerateRequest) -> None:
        version, cut = self.held, self._cut
        seconds = (
            self.slowdown
            * self.profile.generation_median_s
            * math.exp(self.profile.generation_sigma * self.rng.standard_normal())
        )
        length = max(
            1, min(request.max_tokens, round(self.rng.exponential(self.profile.length_mean) * request.max_tokens))
        )
        started = time.monotonic()
        try:
            await asyncio.wait_for(cut.wait(), seconds)
            done = min(1.0, (time.monotonic() - started) / seconds)
            length, finish = int(length * done), "abort"
            self.stats.counters["cut"] += 1
        except asyncio.TimeoutError:
            finish = "length" if length == request.max_tokens else "stop"
        tokens, log_probs = await self._answer(request, version, length)
        result = Result(
            request_id=request.request_id, token_ids=tokens, log_probs=log_probs, finish_reason=finish, version=version
        )
        try:
            await self._timed("results", self.client.send(Results(results=[result])))
            self.stats.counters["results"] += 1
        except (GatewayRetired, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            self.stats.counters["results_failed"] += 1
