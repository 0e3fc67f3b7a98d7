"""When each sampler group gets which weight version, under simulated network delay (framework-free).

The model (HeteroRL's): a sampler group downloads **one** weight version at a time. The learner
publishes version ``v`` at time ``t``; an idle group starts downloading ``v`` at ``t``, which
arrives after a delay ``d`` drawn from the group's delay model. On arrival the group applies
``v`` and at once starts downloading the newest version published by then, if it is newer than
``v``; otherwise it idles until the next publication. A group therefore holds versions that
only increase, and the weights it samples with are exactly a version the learner published,
never a fresher one than the network would have delivered.

The schedule is event-driven and lazy: :meth:`WeightArrivalSchedule.advance` replays every
arrival up to ``now`` in time order, so it gives the same answer whether it is called every
second or once per learner step (only the wall-clock moment the weights are *installed* differs,
which the verl glue keeps small by polling while the learner waits for data).

A group that lost every sampler is *retired*: it downloads nothing and no longer holds the oldest version (else
its last version would pin :meth:`oldest_held` down forever). A replacement *rejoins* with the learner's newest
version installed before it serves. Delays come from
:func:`gepo_plugin.hetero.delays.delay_rng` streams per group: reproducible for a seed, and
adding a group does not change the others' draws.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gepo_plugin.hetero.delays import DelayModel, delay_rng


@dataclass(frozen=True)
class Delivery:
    """Group ``group`` installs ``version`` (published at ``started``) at time ``arrival``."""

    group: int
    version: int
    started: float
    arrival: float


class WeightArrivalSchedule:
    def __init__(
        self, delays: Sequence[DelayModel | None], seed: int = 0, start_version: int = 0, start_time: float = 0.0
    ) -> None:
        if not delays:
            raise ValueError("a weight schedule needs at least one sampler group")
        self.delays = list(delays)
        self._rngs = [delay_rng(seed, g) for g in range(len(delays))]
        self.held = [int(start_version)] * len(delays)
        #: group -> (version, started, arrival) of its download in progress, or None.
        self.downloading: list[tuple[int, float, float] | None] = [None] * len(delays)
        self._pub_times: list[float] = [float(start_time)]
        self._pub_versions: list[int] = [int(start_version)]
        self.drawn: list[list[float]] = [[] for _ in delays]
        #: False for a group that lost every sampler (see :meth:`retire`).
        self.live: list[bool] = [True] * len(delays)

    @property
    def num_groups(self) -> int:
        return len(self.delays)

    @property
    def latest(self) -> int:
        return self._pub_versions[-1]

    def _latest_at(self, time: float) -> int:
        index = bisect.bisect_right(self._pub_times, time) - 1
        return self._pub_versions[max(index, 0)]

    def _start(self, group: int, version: int, now: float) -> None:
        model = self.delays[group]
        delay = 0.0 if model is None else float(model.sample(self._rngs[group], 1)[0])
        self.drawn[group].append(delay)
        self.downloading[group] = (version, now, now + delay)

    def publish(self, version: int, now: float) -> list[Delivery]:
        """The learner publishes ``version`` at ``now``; returns the deliveries due up to ``now``."""
        if version <= self.latest:
            raise ValueError(f"published version {version} is not newer than {self.latest}")
        if now < self._pub_times[-1]:
            raise ValueError(f"time went backwards: {now} < {self._pub_times[-1]}")
        deliveries = self.advance(now)  # arrivals before `now` start downloads of the then-newest version
        self._pub_times.append(float(now))
        self._pub_versions.append(int(version))
        for group in range(self.num_groups):
            if self.live[group] and self.downloading[group] is None and self.held[group] < version:
                self._start(group, version, now)
        return deliveries + self.advance(now)

    def advance(self, now: float) -> list[Delivery]:
        """Install every download that has arrived by ``now``, in arrival order."""
        deliveries: list[Delivery] = []
        while True:
            due = [
                (d[2], g) for g, d in enumerate(self.downloading) if d is not None and d[2] <= now
            ]  # (arrival, group)
            if not due:
                return deliveries
            arrival, group = min(due)
            version, started, _ = self.downloading[group]
            self.downloading[group] = None
            self.held[group] = version
            deliveries.append(Delivery(group, version, started, arrival))
            newest = self._latest_at(arrival)
            if newest > version:
                self._start(group, newest, arrival)

    def retire(self, group: int) -> None:
        """``group`` lost every sampler: its download in progress is abandoned and it no longer counts."""
        self.live[group] = False
        self.downloading[group] = None

    def rejoin(self, group: int) -> int:
        """A replacement serves ``group``: it installs the newest published version at once (returned)."""
        self.live[group] = True
        self.downloading[group] = None
        self.held[group] = self.latest
        return self.latest

    def oldest_held(self) -> int:
        """The oldest version a live group holds (every newly started rollout is at least this fresh)."""
        held = [version for version, live in zip(self.held, self.live, strict=True) if live]
        if not held:
            raise ValueError("no sampler group is live")
        return min(held)

    def needed_versions(self) -> set[int]:
        """Versions whose weights must be kept: being downloaded, or the newest (the next download's source)."""
        return {d[0] for d in self.downloading if d is not None} | {self.latest}

    def metrics(self, learner_version: int) -> dict[tuple[int, str], float]:
        """``(group, name) -> value``: the version each group holds, its age, and its mean drawn delay."""
        out: dict[tuple[int, str], float] = {}
        for group, held in enumerate(self.held):
            out[group, "weight_version"] = float(held)
            out[group, "weight_age"] = float(learner_version - held)
            if self.drawn[group]:
                out[group, "delay_mean_s"] = float(np.mean(self.drawn[group]))
        return out
