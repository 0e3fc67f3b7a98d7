"""A rollout engine that dies ends a run without HeteroRL at once, with an error naming the replica and the cause.

verl 0.9.1 has no health check of its rollout servers. When a vLLM engine dies (its engine-core process killed, an
illegal instruction, out of memory), verl's ``vLLMHttpServer`` actor lives on and every request on it waits for
ever: a synchronous trainer hangs. Without HeteroRL there is no other sampler to go on with, so the plugin's trainers
watch their rollout replicas with the same probes as HeteroRL's health monitor
(:mod:`gepo_plugin.verl_glue.hetero.health`: the server's process, and its engine), and on a death stop the
replica's servers, so that the requests waiting on them fail, and raise :class:`RolloutReplicaLost`, naming the
replica and what was found. A server that is only slow is left alone (no hang verdict here: a long pause of a
healthy server must not end a run).

**Where the run stops.** The trainer waits for rollouts in verl's replay buffer, which polls TransferQueue and
refills failed groups: :meth:`RolloutWatchdog.raise_if_lost` is registered as a check of both
(:func:`gepo_plugin.verl_glue.replay_wait.add_check`), so the trainer's own thread raises the error at its next poll
(at most one paced interval, 0.5 s, after the verdict) or refill, deterministically; an error of verl's that comes
first (a sync trainer whose groups all failed at once) is attributed by one confirming probe
(:meth:`RolloutWatchdog.confirm`). A death found while the trainer is blocked in a call to the replica's workers (a
weight update into the dead engine, which never returns) is ended by stopping those workers,
:data:`STOP_WORKERS_AFTER_S` after the verdict: the call fails, and ``fit`` raises the error. (Interrupting the
trainer's thread instead, as this module once did, was not reliable: a wait inside ``asyncio.run`` and Ray's
``get`` swallowed the interrupts of one run in CI for three minutes.) So a death is detected within about
``2 x hetero.health.interval_s`` (4 s by default), and the trainer stops within 0.5 s after that when it waits for
rollouts, within :data:`STOP_WORKERS_AFTER_S` and the failure of its call when it is blocked; it logs the moment
(``gepo-plugin: the run stops``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.verl_glue.hetero.health import HealthMonitor, probe
from gepo_plugin.verl_glue.hetero.replicas import kill_actors

logger = logging.getLogger(__name__)
#: Seconds a confirming probe (:meth:`RolloutWatchdog.confirm`) waits for each replica's answer.
CONFIRM_TIMEOUT_S = 10.0
#: Seconds after a death before the replica's workers are stopped, if the trainer's own waits have not stopped the
#: run by then: a trainer waiting for rollouts raises within one paced interval (at most 0.5 s) plus a poll, so a
#: trainer still running after this is blocked in a call to those workers (a weight update into the dead engine,
#: which never returns).
STOP_WORKERS_AFTER_S = 2.0


class RolloutReplicaLost(RuntimeError):
    """A rollout replica died in a run that has no other sampler to go on with."""


class RolloutWatchdog:
    """Watches verl's rollout replicas; a death stops the replica's servers and is raised by :meth:`raise_if_lost`."""

    def __init__(self, replicas: list[Any], config: HealthConfig | None = None) -> None:
        self.replicas = dict(enumerate(replicas))
        self.lost: dict[int, str] = {}
        self._stopped = threading.Event()
        self.monitor = HealthMonitor(config or HealthConfig(), self._on_lost)
        for index, replica in self.replicas.items():
            self.monitor.watch(index, replica.servers)
        self.monitor.start()

    def _on_lost(self, index: int, kind: str, detect_s: float) -> None:
        if kind != "died":
            self.monitor.watch(index, self.replicas[index].servers)  # slow is not dead here: keep watching
            return
        replica = self.replicas[index]
        cause = self.monitor.causes.get(index, kind)
        self.lost[index] = (
            f"rollout replica {replica.replica_rank} (server {replica.server_address}) died, detected after "
            f"{detect_s:.1f} s: {cause}"
        )
        logger.error("gepo-plugin: %s; stopping its servers so the requests waiting on it fail", self.lost[index])
        kill_actors(replica.servers, "a dead rollout server")
        threading.Thread(
            target=self._stop_workers_if_blocked, args=(replica,), name="rollout-watchdog-stop", daemon=True
        ).start()

    def _stop_workers_if_blocked(self, replica: Any) -> None:
        """After :data:`STOP_WORKERS_AFTER_S` without a stop, stop the replica's workers: the trainer is blocked in a
        call to them that the dead engine never answers (in a colocated run they are the learner's own, whose state
        the run cannot go on with anyway; the last checkpoint is untouched, and a save cut short is not marked
        latest by verl). The trainer's call then fails, and ``fit`` raises the watchdog's error."""
        if self._stopped.wait(STOP_WORKERS_AFTER_S):
            return
        logger.warning(
            "gepo-plugin: the trainer did not stop at its next wait for rollouts (blocked in a call to the dead "
            "replica's workers); stopping those workers"
        )
        kill_actors(replica.workers, "a dead replica's worker")

    def confirm(self) -> None:
        """Probe every replica not yet lost once, now: an error reached the trainer before the monitor's next round
        (a sync trainer whose groups all failed at once raises verl's own error first)."""
        watched = {index: replica.servers for index, replica in self.replicas.items() if index not in self.lost}
        for index, kind in probe(watched, CONFIRM_TIMEOUT_S, self.monitor.causes).items():
            if kind == "died":
                self._on_lost(index, kind, self.monitor.since_answer(index))

    def raise_if_lost(self, error: BaseException | None = None) -> None:
        """Raise :class:`RolloutReplicaLost` (from ``error``) if a replica died; with ``error`` (what ended the run),
        probe first, so that an engine's death is named even when verl's own error came before the monitor's."""
        if error is not None and not self.lost:
            self.confirm()
        if self.lost:
            logger.error("gepo-plugin: the run stops: %d rollout replica(s) lost", len(self.lost))
            message = "; ".join(self.lost.values())
            raise RolloutReplicaLost(
                f"{message}. The run cannot go on without it (no other sampler without HeteroRL): fix the cause "
                "(for vLLM on a CPU see the engine's log above) and resume from the last checkpoint "
                "(trainer.resume_mode=auto)"
            ) from error

    def stop(self) -> None:
        self._stopped.set()
        self.monitor.stop()
