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
(:meth:`RolloutWatchdog.confirm`). A death found while the trainer is blocked somewhere else (a weight update into
the dead engine, which never returns) is ended the blunt way, after :data:`INTERRUPT_AFTER_S` without a stop: the
trainer's thread is interrupted (``_thread.interrupt_main``, the way Ray itself cancels a task) until ``fit`` has
stopped. So a death is detected within about ``2 x hetero.health.interval_s`` (4 s by default), and the trainer
stops within 0.5 s after that when it waits for rollouts, within :data:`INTERRUPT_AFTER_S` when it is blocked
elsewhere; it logs the moment (``gepo-plugin: the run stops``).
"""

from __future__ import annotations

import _thread
import logging
import threading
from typing import Any

import ray

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.verl_glue.hetero.health import HealthMonitor, probe

logger = logging.getLogger(__name__)
#: Seconds a confirming probe (:meth:`RolloutWatchdog.confirm`) waits for each replica's answer.
CONFIRM_TIMEOUT_S = 10.0
#: Seconds after a death before the trainer's thread is interrupted, if its own waits have not stopped it by then:
#: a trainer waiting for rollouts raises within one paced interval (at most 0.5 s) plus a poll, so a trainer still
#: running after this is blocked elsewhere (a weight update into the dead engine, which never returns).
INTERRUPT_AFTER_S = 2.0
#: Seconds between interrupts of the trainer's thread after that, until the run has stopped: a trainer blocked in
#: verl's weight update waits inside ``asyncio.run``, whose handler turns the first interrupt into a cancellation of
#: the waiting task (which a Ray wait may not heed) and only the second into ``KeyboardInterrupt``.
INTERRUPT_EVERY_S = 1.0


class RolloutReplicaLost(RuntimeError):
    """A rollout replica died in a run that has no other sampler to go on with."""


class RolloutWatchdog:
    """Watches verl's rollout replicas; a death stops the replica's servers and is raised by :meth:`raise_if_lost`."""

    def __init__(self, replicas: list[Any], config: HealthConfig | None = None) -> None:
        self.replicas = dict(enumerate(replicas))
        self.lost: dict[int, str] = {}
        #: the trainer's loop runs on the thread that builds the watchdog; only the main thread can be interrupted
        self._interruptible = threading.current_thread() is threading.main_thread()
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
        for server in replica.servers:  # (its workers may be the learner's own, in a colocated run: left alone)
            try:
                ray.kill(server, no_restart=True)
            except Exception as error:
                logger.debug("gepo-plugin: kill of a dead rollout server: %r", error)
        if self._interruptible:
            threading.Thread(
                target=self._interrupt_until_stopped, name="rollout-watchdog-interrupt", daemon=True
            ).start()

    def _interrupt_until_stopped(self) -> None:
        """After :data:`INTERRUPT_AFTER_S` without a stop, interrupt the trainer's thread until ``fit`` has turned it
        into the error and stopped the watchdog: code that catches the interrupt on its way (Ray's and asyncio's
        internals) must not let the wait go on."""
        if self._stopped.wait(INTERRUPT_AFTER_S):
            return
        logger.warning("gepo-plugin: the trainer did not stop at its next wait for rollouts; interrupting it")
        while not self._stopped.is_set():
            _thread.interrupt_main()  # the trainer's wait ends with KeyboardInterrupt; fit turns it into the error
            self._stopped.wait(INTERRUPT_EVERY_S)

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
