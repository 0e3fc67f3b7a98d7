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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.verl_glue.hetero.engine_probe import ENGINE_DIED, QUARANTINED, engine_error

logger = logging.getLogger(__name__)

#: The server method used as the probe (present on every verl rollout server).
PROBE_METHOD = "get_server_address"


def send_probes(servers: Sequence[ActorHandle]) -> list:
    """One probe of each server: its address (answered on its event loop), and its engine's state."""
    refs = []
    for server in servers:
        refs.append(getattr(server, PROBE_METHOD).remote())
        refs.append(server.__ray_call__.remote(engine_error))
    return refs


@dataclass
class _Probe:
    refs: list
    sent: float


def probe(
    servers: Mapping[int, Sequence[ActorHandle]], timeout_s: float, causes: dict[int, str] | None = None
) -> dict[int, str]:
    """Probe each replica's servers once; returns ``replica -> "died" | "hung"`` for those that failed (and writes
    why into ``causes``, when given)."""
    probes = {replica: send_probes(handles) for replica, handles in servers.items()}
    refs = [ref for group in probes.values() for ref in group]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    ready = set(ready)
    lost: dict[int, str] = {}
    for replica, group in probes.items():
        verdict, cause = _verdict(group, ready)
        if verdict is None and not all(ref in ready for ref in group):
            verdict, cause = "hung", f"no answer to a probe within {timeout_s:g} s"
        if verdict is not None:
            if cause:
                logger.warning("hetero: sampler replica %d: %s", replica, cause)
                if causes is not None:
                    causes[replica] = cause
            lost[replica] = verdict
    return lost


def _verdict(refs: list, ready: set) -> tuple[str | None, str | None]:
    """(``died``, its cause) if an answered probe raised ``RayActorError`` or reported a dead engine; else (None,
    None): other errors are not a loss."""
    for ref in refs:
        if ref in ready:
            try:
                answer = ray.get(ref)
            except RayActorError as error:
                return "died", f"its process is gone ({type(error).__name__})"
            except Exception as error:  # a server that answers with an error is alive
                logger.debug("hetero: probe answered with %r", error)
                continue
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
            refs = [ref for p in self._probes.values() for ref in p.refs]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
            lost: list[tuple[int, str, float]] = []
            for replica, pending in list(self._probes.items()):
                verdict, cause = _verdict(pending.refs, ready)
                if verdict in ("died", "quarantined"):
                    self.causes[replica] = cause
                    lost.append((replica, verdict, now - self._last_ok.get(replica, pending.sent)))
                elif all(ref in ready for ref in pending.refs):
                    self._last_ok[replica] = now
                    del self._probes[replica]
                elif now - pending.sent > self.config.timeout_s:
                    self.causes[replica] = f"no answer to a probe within {self.config.timeout_s:g} s"
                    lost.append((replica, "hung", now - pending.sent))
            for replica, _, _ in lost:
                self.forget(replica)
            for replica, servers in self._servers.items():
                if replica not in self._probes:
                    self._probes[replica] = _Probe(send_probes(servers), now)
        for replica, kind, detect_s in lost:
            cause = self.causes[replica]
            logger.warning("hetero: sampler replica %d %s (detected after %.1f s): %s", replica, kind, detect_s, cause)
            self.on_lost(replica, kind, detect_s)
        return lost
