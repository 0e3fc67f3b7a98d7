"""A sampler outside the learner's cluster: follow the relay, install into vLLM, serve the learner's gateway.

One asyncio loop, no Ray. Three activities:

* **weights**: the relay's :class:`~gepo_sampler.relay.follower.RelayFollower` (a background thread: every
  pull digest-checked and all-or-nothing, the store's outage budget, manifests verified with the learner's public
  key) stages the newest version; the host installs it into vLLM (:meth:`SamplerHost.install`);
* **work**: it long-polls the gateway with its status (the version it holds, what it has staged, whether its engine
  lives) and starts each request it receives on vLLM; each result goes back at once, tagged with the version its
  tokens were generated under;
* **exact versions**: an install closes a gate (no request starts), cuts every request in flight with vLLM's abort
  (each returns its partial tokens, tagged with the old version; verl's client resumes them) until none is left,
  installs, and opens the gate. So every token of a result comes from the one version the result names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path

import aiohttp
from safetensors.torch import save_file

from gepo_sampler.host.engine import EngineError, VLLMEngine
from gepo_sampler.host.gateway_client import GatewayClient, GatewayRetired
from gepo_sampler.relay.follower import RelayFollower
from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.puller import RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.signing import Verifier
from gepo_sampler.relay.store import open_store
from gepo_sampler.remote.protocol import PROTOCOL_VERSION, GenerateRequest, Hello, Result, Results, SamplerStatus

logger = logging.getLogger("gepo_sampler.host")

#: Without news of a newer version from the gateway (every poll's answer names the learner's), the host lists the
#: store this often: its reads of the store are then a constant number per published version.
IDLE_LIST_S = 30.0
#: Seconds between two attempts to reach the gateway after a failure (doubling up to MAX_BACKOFF_S).
BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0


class Backoff:
    """The wait before the next attempt after a failure: doubles up to :data:`MAX_BACKOFF_S`, reset on success."""

    def __init__(self) -> None:
        self.delay = BACKOFF_S

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(MAX_BACKOFF_S, self.delay * 2)

    def reset(self) -> None:
        self.delay = BACKOFF_S


class SamplerHost:
    """One remote sampler: a vLLM engine, the relay's follower and the gateway's client."""

    def __init__(
        self,
        name: str,
        gateway: GatewayClient,
        engine: VLLMEngine,
        verifier: Verifier,
        relay_url: str | None = None,
        storage_options: dict | None = None,
        poll_s: float = 0.5,
        outage_s: float = 600.0,
        staging_dir: str | None = None,
    ) -> None:
        self.name = name
        self.gateway = gateway
        self.engine = engine
        self.verifier = verifier
        self.relay_url = relay_url
        self.storage_options = storage_options or {}
        self.poll_s, self.outage_s = poll_s, outage_s
        self.staging_dir = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.held: int | None = None
        self.follower: RelayFollower | None = None
        self.error: str | None = None
        self.counters: dict[str, float] = {"installs": 0.0, "install_s": 0.0, "results": 0.0, "aborts": 0.0}
        self._gate = asyncio.Event()  # open: requests may start (closed before the first install and during one)
        self._running = 0  # requests past the gate
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ set-up
    def follow(self, hello: Hello) -> None:
        """Start pulling the run's versions from its store (read-only), verified with the learner's public key."""
        relay = RelayConfig(
            url=self.relay_url or hello.relay_url,
            run_id=hello.run_id,
            storage_options=self.storage_options,
            public_key=self.verifier.public_key,
            poll_s=self.poll_s,
            outage_s=self.outage_s,
        )
        link = Link(LinkConfig(**hello.link)) if hello.link else None
        puller = RelayPuller(open_store(relay), relay.run_id, None, link, verifier=self.verifier)
        self.follower = RelayFollower(
            puller,
            group=0,
            replica=0,
            poll_s=relay.poll_s,
            outage_s=relay.outage_s,
            outage_key="--outage-s",
            idle_s=IDLE_LIST_S,
        )
        self.follower.hint(hello.learner_version)
        self.follower.start()
        logger.info("sampler %s: following run %s at %s", self.name, relay.run_id, relay.url)

    # ------------------------------------------------------------------ status
    async def status(self) -> SamplerStatus:
        staged = None
        if self.follower is not None:
            follower = self.follower.status()
            if follower.error is not None and self.error is None:
                self.error = f"the store: {follower.error}"
                logger.error("sampler %s: %s; it takes no work until restarted", self.name, self.error)
            staged = follower.staged if follower.staged is not None and follower.staged != self.held else None
            self.counters.update({f"relay_{k}": float(v) for k, v in follower.counters.items()})
        return SamplerStatus(
            protocol=PROTOCOL_VERSION,
            version=self.held,
            pulling=staged,
            engine_alive=await self.engine.alive(),
            in_flight=self._running,
            error=self.error,
            engine=f"vllm {self.engine.version}",
            dtype=self.engine.dtype,
            counters=dict(self.counters),
        )

    # ------------------------------------------------------------------ weights
    async def install_staged(self) -> None:
        """Install the newest staged version, if newer than the one held."""
        if self.follower is None or self.error is not None:
            return
        staged = self.follower.status().staged
        if staged is not None and (self.held is None or staged > self.held):
            await self.install(staged)

    async def install(self, version: int) -> None:
        started = time.monotonic()
        weights = self.follower.take(version).to_tensors()
        path = Path(self.staging_dir) / f"gepo-sampler-{self.name}-{os.getpid()}-{version}.safetensors"
        await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in weights.items()}, str(path))
        self._gate.clear()
        try:
            while self._running:  # cut what is in flight: each returns its tokens, tagged with the old version
                await self.engine.abort_all()
                await self.engine.resume()
                self.counters["aborts"] += 1
                await asyncio.sleep(0.02)
            await self.engine.abort_all()  # the engine idle while it loads
            try:
                await self.engine.install(str(path))
            finally:
                await self.engine.resume()
            self.held = version
        finally:
            path.unlink(missing_ok=True)
            if self.held is not None:  # (a failed first install leaves the gate closed: nothing to serve with)
                self._gate.set()
        self.counters["installs"] += 1
        self.counters["install_s"] += time.monotonic() - started
        logger.info("sampler %s: installed weight version %d in %.2f s", self.name, version, time.monotonic() - started)
        await self._report_status()

    async def _report_status(self) -> None:
        """Tell the learner now (its poll may be held for seconds): best effort, the next poll carries it anyway."""
        try:
            await self.gateway.report(await self.status())
        except (GatewayRetired, aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            logger.debug("sampler %s: status report failed: %r", self.name, error)

    async def _weights_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.install_staged()
            except Exception as error:  # an install that fails leaves the sampler unable to serve: say so
                self.error = f"installing weights: {type(error).__name__}: {error}"
                logger.exception("sampler %s: %s", self.name, self.error)
                await self._report_status()
                return
            await asyncio.sleep(self.poll_s)

    # ------------------------------------------------------------------ work
    async def run_request(self, request: GenerateRequest) -> None:
        await self._gate.wait()
        self._running += 1
        version = self.held
        try:
            generated = await self.engine.generate(request)
            finish = generated.finish_reason if generated.finish_reason in ("stop", "length", "abort") else "stop"
            result = Result(
                request_id=request.request_id,
                token_ids=generated.token_ids,
                log_probs=generated.log_probs,
                finish_reason=finish,
                version=version,
            )
        except EngineError as error:  # the engine refused this request: the learner counts it failed, at once
            self.counters["failed"] = self.counters.get("failed", 0.0) + 1
            result = Result(
                request_id=request.request_id, token_ids=[], finish_reason="stop", version=version, error=str(error)
            )
        finally:
            self._running -= 1
        self.counters["results"] += 1
        await self._send(result)

    async def _send(self, result: Result) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                await self.gateway.send(Results(results=[result]))
                return
            except GatewayRetired:
                return  # the learner gave up this request with the sampler
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                logger.warning("sampler %s: sending a result failed (%s); retrying", self.name, error)
                await backoff.wait()

    async def abort_in_flight(self) -> None:
        if self._running:
            await self.engine.abort_all()
            await self.engine.resume()
            self.counters["aborts"] += 1

    async def _poll_loop(self, wait_s: float) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                work = await self.gateway.poll(await self.status(), wait_s)
            except GatewayRetired as why:
                logger.warning("sampler %s: the learner retired this sampler (%s); asking to rejoin", self.name, why)
                await backoff.wait()
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                logger.warning("sampler %s: the gateway is unreachable (%s); retrying", self.name, error)
                await backoff.wait()
                continue
            backoff.reset()
            if self.follower is not None:
                self.follower.hint(work.learner_version)
            if work.abort:
                await self.abort_in_flight()
            for request in work.requests:
                task = asyncio.create_task(self.run_request(request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def run(self, hello: Hello) -> None:
        """Serve the run ``hello`` describes until stopped (or refused for good by the gateway)."""
        self.follow(hello)
        loops = [
            asyncio.create_task(self._weights_loop()),
            asyncio.create_task(self._poll_loop(hello.poll_wait_s)),
        ]
        stopped = asyncio.create_task(self._stop.wait())
        try:
            # until stopped, or a loop raises (the gateway refusing this sampler for good), raised here; a loop that
            # returns (the weights loop after a failed install, reported with the status) leaves the host serving its
            # status until the learner retires it
            done, _ = await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in [stopped, *loops, *self._tasks]:
                task.cancel()
            if self.follower is not None:
                self.follower.stop()

    def stop(self) -> None:
        self._stop.set()
