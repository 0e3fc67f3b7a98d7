"""A sampler replica's background puller: it follows the newest version and stages it until it is installed.

The follower pulls in its own thread, so a sampler keeps generating with the weights it has while the next version
crosses its link. A completed pull is *staged*: the pulled version, verified against its digests, which nothing
writes afterwards (a pull never writes the weights it starts from; it stages the tensors it changes), until the
learner installs it at a safe point, and a :class:`Receipt` saying when it arrived and what it cost. The two newest
staged versions are kept, so the version the learner saw in a status is still there when it asks to install it,
even if a newer one landed in between; installing one drops it and every older one.

A follower given the learner's newest version (:meth:`RelayFollower.hint`: a remote sampler hears it with every poll
of the gateway) lists the store only while a newer version than it holds is due, and otherwise every ``idle_s``: its
reads are then a constant number per published version, not per second, however long a step takes (a fleet of a
thousand samplers listing every ``poll_s`` would read the store thousands of times a second for nothing).

Store errors are retried with back-off and counted for up to ``outage_s`` seconds of failing in a row (the store's
outage budget, ``hetero.relay.outage_s``); past it, or at once for a permanent error, the follower reports a fatal
error and the learner stops the run with it. A chain that no longer exists in the store (corrupt shards, a result
that failed its digest) is reported as ``keyframe_needed``, with the corrupt shard addresses, and the learner
publishes one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gepo_sampler.relay.codec import WeightBits
from gepo_sampler.relay.puller import Held, RelayIntegrityError, RelayPuller
from gepo_sampler.relay.store import RelayStoreError

logger = logging.getLogger(__name__)
#: staged versions kept for installation (the newest two, and the one last reported until it is taken or passed)
STAGED_KEPT = 2


@dataclass(frozen=True)
class Receipt:
    """Replica ``replica`` of group ``group`` holds ``version`` since ``arrival`` (wall clock, seconds)."""

    group: int
    replica: int
    version: int
    arrival: float
    nbytes: int
    seconds: float


@dataclass
class FollowerStatus:
    """What the learner collects at a safe point: new receipts, a keyframe request, counters, a fatal error."""

    receipts: list[Receipt]
    staged: int | None
    keyframe_needed: int | None
    counters: dict[str, float]
    error: str | None
    #: shard addresses this replica found corrupt (the publisher writes them again when it answers)
    corrupt_shards: tuple[str, ...] = ()


class RelayFollower:
    """Follows one run's newest version for one sampler replica."""

    def __init__(
        self,
        puller: RelayPuller,
        group: int,
        replica: int,
        poll_s: float = 0.5,
        outage_s: float = 600.0,
        clock=time.time,
        outage_key: str = "hetero.relay.outage_s",
        idle_s: float | None = None,
    ) -> None:
        self.puller, self.group, self.replica = puller, group, replica
        self.poll_s, self.outage_s, self.clock = poll_s, outage_s, clock
        #: with hints: how long to wait for one before listing anyway (None: no hints, list every poll_s)
        self.idle_s = idle_s
        self._hint: int | None = None
        self._wake = threading.Event()
        self.outage_key = outage_key  # the setting a message names (a sampler host's is its --outage-s)
        self._held: Held | None = None
        self._staged: dict[int, WeightBits] = {}
        #: the version the last :meth:`status` reported as staged: kept until taken or passed by a take, however many
        #: newer ones arrive meanwhile (the learner installs what it was told is staged)
        self._reported: int | None = None
        self._receipts: list[Receipt] = []
        self._keyframe_needed: int | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"relay-follower-{group}-{replica}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def hint(self, version: int) -> None:
        """The learner holds ``version`` (it publishes it now, if it has not yet): list the store again while it is
        newer than the version held."""
        with self._lock:
            if self._hint is None or version > self._hint:
                self._hint = version
                self._wake.set()

    def _idle(self) -> None:
        """Wait before listing the store again: ``poll_s`` without hints or while a newer version is due, else until a
        hint names a newer one (or ``idle_s`` passes)."""
        with self._lock:
            held = self._held.version if self._held is not None else None
            due = self.idle_s is None or self._hint is None or held is None or self._hint > held
        self._wake.wait(self.poll_s if due else self.idle_s)
        self._wake.clear()

    def status(self) -> FollowerStatus:
        """Drain the receipts (each is reported once)."""
        with self._lock:
            receipts, self._receipts = self._receipts, []
            staged = max(self._staged, default=None)
            self._reported = staged
            return FollowerStatus(
                receipts,
                staged,
                self._keyframe_needed,
                self.puller.counters.metrics(),
                self._error,
                tuple(sorted(self.puller.corrupt_shards)),
            )

    def take(self, version: int) -> WeightBits:
        """The staged weights of ``version``, for installation (it and older staged versions are then dropped)."""
        with self._lock:
            if version not in self._staged:
                have = sorted(self._staged)
                raise LookupError(f"relay: version {version} is not staged on this replica (staged: {have})")
            weights = self._staged[version]
            self._staged = {v: w for v, w in self._staged.items() if v > version}
            return weights

    def _run(self) -> None:
        failing_since: float | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                result = self.puller.pull(self._held)
                failing_since, failures = None, 0
            except RelayIntegrityError as error:
                with self._lock:
                    self._keyframe_needed = error.version
                self._stop.wait(self.poll_s)
                continue
            except Exception as error:  # the store: retried by the store first; here counted, then fatal
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                failures += 1
                self.puller.counters.add("pull_failures")
                logger.warning("relay: replica %d of group %d could not pull: %s", self.replica, self.group, error)
                permanent = isinstance(error, RelayStoreError) and error.permanent
                if permanent or now - failing_since >= self.outage_s:
                    why = "" if permanent else f" (failing for {now - failing_since:.0f} s, {self.outage_key})"
                    with self._lock:
                        self._error = f"{type(error).__name__}: {error}{why}"
                    return
                self._stop.wait(min(self.poll_s * 2 ** min(failures, 10), 30.0, self.outage_s))
                continue
            if result is None:
                self._idle()
                continue
            self._held = result.held  # a new object: the next pull stages its own copies, so this one stays as is
            with self._lock:
                if self._keyframe_needed is not None and result.held.version >= self._keyframe_needed:
                    self._keyframe_needed = None
                self._staged[result.held.version] = result.held.weights
                for old in sorted(self._staged)[:-STAGED_KEPT]:
                    if old != self._reported:
                        del self._staged[old]
                self._receipts.append(
                    Receipt(self.group, self.replica, result.held.version, self.clock(), result.nbytes, result.seconds)
                )
