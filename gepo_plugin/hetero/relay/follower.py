"""A sampler replica's background puller: it follows the newest version and stages it until it is installed.

The follower pulls in its own thread, so a sampler keeps generating with the weights it has while the next version
crosses its link. A completed pull is *staged*: a copy that stays unchanged until the learner installs it at a safe
point (the pull goes on into the follower's working copy meanwhile), and a :class:`Receipt` saying when it arrived
and what it cost. The two newest staged versions are kept, so the version the learner saw in a status is still there
when it asks to install it, even if a newer one landed in between; installing one drops it and every older one.
Store errors are retried with back-off and counted; a chain that no longer exists in the store (corrupt shards) is
reported as ``keyframe_needed``, and the learner publishes one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gepo_plugin.hetero.relay.codec import WeightBits
from gepo_plugin.hetero.relay.puller import Held, RelayIntegrityError, RelayPuller

logger = logging.getLogger(__name__)
#: staged versions kept for installation (the newest two)
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


class RelayFollower:
    """Follows one run's newest version for one sampler replica."""

    def __init__(
        self,
        puller: RelayPuller,
        group: int,
        replica: int,
        poll_s: float = 0.5,
        max_consecutive_errors: int = 20,
        clock=time.time,
    ) -> None:
        self.puller, self.group, self.replica = puller, group, replica
        self.poll_s, self.max_consecutive_errors, self.clock = poll_s, max_consecutive_errors, clock
        self._held: Held | None = None
        self._staged: dict[int, WeightBits] = {}
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
        self._thread.join(timeout=30)

    def status(self) -> FollowerStatus:
        """Drain the receipts (each is reported once)."""
        with self._lock:
            receipts, self._receipts = self._receipts, []
            staged = max(self._staged, default=None)
            return FollowerStatus(
                receipts, staged, self._keyframe_needed, self.puller.counters.metrics(""), self._error
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
        failures = 0
        while not self._stop.is_set():
            try:
                result = self.puller.pull(self._held)
                failures = 0
            except RelayIntegrityError as error:
                with self._lock:
                    self._keyframe_needed = error.version
                self._stop.wait(self.poll_s)
                continue
            except Exception as error:  # the store: retried by the store first; here counted, then fatal
                failures += 1
                self.puller.counters.add("pull_failures")
                logger.warning("relay: replica %d of group %d could not pull: %s", self.replica, self.group, error)
                if failures >= self.max_consecutive_errors:
                    with self._lock:
                        self._error = f"{type(error).__name__}: {error}"
                    return
                self._stop.wait(min(self.poll_s * 2**failures, 30.0))
                continue
            if result is None:
                self._stop.wait(self.poll_s)
                continue
            self._held = result.held
            staged = result.held.weights.copy()  # the working copy goes on changing with the next pull
            with self._lock:
                if self._keyframe_needed is not None and result.held.version >= self._keyframe_needed:
                    self._keyframe_needed = None
                self._staged[result.held.version] = staged
                for old in sorted(self._staged)[:-STAGED_KEPT]:
                    del self._staged[old]
                self._receipts.append(
                    Receipt(self.group, self.replica, result.held.version, self.clock(), result.nbytes, result.seconds)
                )
