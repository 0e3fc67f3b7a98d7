"""Detect sampler replicas that died or hung, by probing their rollout servers (``hetero.health.*``).

verl's load balancer has no health check: a dead server looks idle and keeps receiving requests, and a hung one
holds its requests forever. The probe is the rollout server's ``get_server_address`` (every verl server has it:
vLLM, SGLang, TensorRT-LLM and the plugin's CPU server). It runs on the server's event loop, so a server whose
loop is blocked does not answer it (Ray's own ``__ray_ready__`` would, from another thread). A probe that raises
``RayActorError`` means the server's process is gone (*died*); one unanswered for ``timeout_s`` means *hung*.
A server whose process lives but whose inference engine died (vLLM's engine-core process killed: verl's
``vLLMHttpServer`` keeps answering while every request on it waits for ever) is *died* too: beside the address, each
probe asks the server, on its own event loop, whether its engine reports itself dead
(:func:`~gepo_plugin.verl_glue.hetero.engine_probe.engine_error`: vLLM's ``AsyncLLM.errored``); the cause is logged.
Remote samplers' proxies share pool processes: each pool is asked once per round for all of its samplers.

:class:`HealthMonitor` probes from a background thread every ``interval_s``, so a death is seen within about
``2 x interval_s`` and a hang within ``timeout_s + interval_s``, whatever the learner is doing. It only reports
(``on_lost``); what a loss means is decided by the caller (:class:`~gepo_plugin.verl_glue.hetero.weight_sync.
DelayedWeightSync`). :func:`probe` is the same check, run once and synchronously, for a caller that saw a call
fail and must know whether a replica was lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.verl_glue.hetero.engine_probe import ENGINE_DIED, QUARANTINED, engine_error
from gepo_plugin.verl_glue.hetero.remote.pool import PooledProxy

logger = logging.getLogger(__name__)

#: The server method used as the probe (present on every verl rollout server).
PROBE_METHOD = "get_server_address"


@dataclass(frozen=True)
class _Ask:
    """One probe's answer to read: ``ref``'s, or, for a pooled remote sampler, its entry ``key`` in its pool's answer
    (one call per pool and round, however many samplers it holds)."""

    ref: Any
    key: str | None = None


def send_probes(replicas: Mapping[int, Sequence[Any]]) -> dict[int, list[_Ask]]:
    """One probe of each replica's servers: the address (answered on the server's event loop) and the engine's state;
    the remote samplers of one pool are probed together (:meth:`~gepo_plugin.verl_glue.hetero.remote.pool.ProxyPool.
    probe`, on the pool's loop)."""
    asks: dict[int, list[_Ask]] = {replica: [] for replica in replicas}
    pooled: dict[Any, list[tuple[int, str]]] = defaultdict(list)
    for replica, servers in replicas.items():
        for server in servers:
            if isinstance(server, PooledProxy):
                pooled[server.pool].append((replica, server.key))
                continue
            asks[replica].append(_Ask(getattr(server, PROBE_METHOD).remote()))
            asks[replica].append(_Ask(server.__ray_call__.remote(engine_error)))
    for pool, members in pooled.items():
        ref = pool.probe.remote([key for _, key in members])
        for replica, key in members:
            asks[replica].append(_Ask(ref, key))
    return asks


def _unique_refs(asks: Iterable[list[_Ask]]) -> list:
    return list({ask.ref: None for group in asks for ask in group})


def _answers(ready: Iterable) -> dict:
    """Each answered probe read once (a pool's answer serves all its samplers): ``ref -> (value, error)``."""
    answers = {}
    for ref in ready:
        try:
            answers[ref] = (ray.get(ref), None)
        except Exception as error:
            answers[ref] = (None, error)
    return answers


@dataclass
class _Probe:
    asks: list[_Ask]
    sent: float


def probe(
    servers: Mapping[int, Sequence[Any]], timeout_s: float, causes: dict[int, str] | None = None
) -> dict[int, str]:
    """Probe each replica's servers once; returns ``replica -> "died" | "hung"`` for those that failed (and writes
    why into ``causes``, when given)."""
    probes = send_probes(servers)
    refs = _unique_refs(probes.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answers = _answers(ready)
    lost: dict[int, str] = {}
    for replica, asks in probes.items():
        verdict, cause = _verdict(asks, answers)
        if verdict is None and not all(ask.ref in answers for ask in asks):
            verdict, cause = "hung", f"no answer to a probe within {timeout_s:g} s"
        if verdict is not None:
            if cause:
                logger.warning("hetero: sampler replica %d: %s", replica, cause)
                if causes is not None:
                    causes[replica] = cause
            lost[replica] = verdict
    return lost


def _verdict(asks: list[_Ask], answers: dict) -> tuple[str | None, str | None]:
    """(``died``, its cause) if an answered probe raised ``RayActorError`` or reported a dead engine; else (None,
    None): other errors are not a loss."""
    for ask in asks:
        if ask.ref not in answers:
            continue
        answer, error = answers[ask.ref]
        if isinstance(error, RayActorError):
            return "died", f"its process is gone ({type(error).__name__})"
        if error is not None:  # a server that answers with an error is alive
            logger.debug("hetero: probe answered with %r", error)
            continue
        if ask.key is not None:
            answer = answer.get(ask.key)
        if isinstance(answer, str) and answer.startswith(ENGINE_DIED):
            return "died", answer
        if isinstance(answer, str) and answer.startswith(QUARANTINED):
            return "quarantined", answer
    return None, None


class HealthMonitor:
    """Probes the watched replicas from a daemon thread; calls ``on_lost(replica, kind, detect_s)`` once each."""

    def __init__(
        self,
        config: HealthConfig,
        on_lost: Callable[[int, str, float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.on_lost = on_lost
        self.clock = clock
        self._servers: dict[int, list[ActorHandle]] = {}
        self._last_ok: dict[int, float] = {}
        self._probes: dict[int, _Probe] = {}
        #: replica -> why it was declared lost (for the log and the error that stops a run without samplers)
        self.causes: dict[int, str] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, replica: int, servers: Sequence[ActorHandle]) -> None:
        with self._lock:
            self._servers[replica] = list(servers)
            self._last_ok[replica] = self.clock()

    def since_answer(self, replica: int) -> float:
        """Seconds since ``replica`` last answered a probe (an upper bound on how long it has been lost)."""
        with self._lock:
            return self.clock() - self._last_ok.get(replica, self.clock())

    def forget(self, replica: int) -> None:
        with self._lock:
            self._servers.pop(replica, None)
            self._probes.pop(replica, None)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gepo-hetero-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.check()
            except Exception:  # the monitor must outlive any one probe round
                logger.exception("hetero: a health-probe round failed")

    def check(self) -> list[tuple[int, str, float]]:
        """One round: collect answered probes, declare losses, send new probes. Returns the losses found."""
        with self._lock:
            now = self.clock()
            refs = _unique_refs(p.asks for p in self._probes.values())
            answers = _answers(ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else [])
            lost: list[tuple[int, str, float]] = []
            for replica, pending in list(self._probes.items()):
                verdict, cause = _verdict(pending.asks, answers)
                if verdict in ("died", "quarantined"):
                    self.causes[replica] = cause
                    lost.append((replica, verdict, now - self._last_ok.get(replica, pending.sent)))
                elif all(ask.ref in answers for ask in pending.asks):
                    self._last_ok[replica] = now
                    del self._probes[replica]
                elif now - pending.sent > self.config.timeout_s:
                    self.causes[replica] = f"no answer to a probe within {self.config.timeout_s:g} s"
                    lost.append((replica, "hung", now - pending.sent))
            for replica, _, _ in lost:
                self.forget(replica)
            due = {replica: servers for replica, servers in self._servers.items() if replica not in self._probes}
            for replica, asks in send_probes(due).items():
                self._probes[replica] = _Probe(asks, now)
        for replica, kind, detect_s in lost:
            cause = self.causes[replica]
            logger.warning("hetero: sampler replica %d %s (detected after %.1f s): %s", replica, kind, detect_s, cause)
            self.on_lost(replica, kind, detect_s)
        return lost
