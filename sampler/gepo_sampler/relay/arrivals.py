"""Which version each sampler replica and group holds, from the relay's real arrivals (framework-free).

The relay counterpart of :class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule`: both are
:class:`~gepo_plugin.hetero.sampler_versions.SamplerVersions` (``held`` and ``live`` per group, ``latest``,
``oldest_held``, metrics), the one view the sampler fleet and the staleness core read:
nothing is drawn, a version is held once the replica's receipt says it arrived and the learner installed it. A
group holds the oldest version any of its live replicas holds, so a bound that holds for the group holds for every
token it generates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gepo_sampler.relay.follower import Receipt


@dataclass(frozen=True)
class Installed:
    """Replica ``replica`` (of ``group``) installed ``version``, which arrived at ``arrival``."""

    group: int
    replica: int
    version: int
    arrival: float


class ArrivalBook:
    """Per replica: the version installed; per group: the oldest of its live replicas'."""

    def __init__(
        self, group_of: Mapping[int, int], num_groups: int, start_version: int = 0, start_time: float = 0.0
    ) -> None:
        self.group_of = dict(group_of)  # replica id -> its sampler group
        self.num_groups = num_groups
        self.installed = {replica: int(start_version) for replica in self.group_of}
        self.live = [True] * self.num_groups
        self.published = {int(start_version): float(start_time)}
        self.latest = int(start_version)
        #: group -> arrival lags in seconds (arrival - publication) of its installs
        self.lags_s: list[list[float]] = [[] for _ in range(self.num_groups)]
        self.bytes: list[int] = [0] * self.num_groups
        #: group -> seconds each pull took (its link's share of the lag)
        self.pull_s: list[list[float]] = [[] for _ in range(self.num_groups)]

    def publish(self, version: int, now: float) -> None:
        if version <= self.latest:
            raise ValueError(f"published version {version} is not newer than {self.latest}")
        self.published[int(version)] = float(now)
        self.latest = int(version)

    def install(self, receipt: Receipt) -> Installed | None:
        """Record that ``receipt``'s version was installed on its replica (None if it is not newer)."""
        if receipt.replica not in self.installed or receipt.version <= self.installed[receipt.replica]:
            return None
        self.installed[receipt.replica] = receipt.version
        published = self.published.get(receipt.version)
        if published is not None:
            self.lags_s[receipt.group].append(receipt.arrival - published)
        self.bytes[receipt.group] += receipt.nbytes
        self.pull_s[receipt.group].append(receipt.seconds)
        return Installed(receipt.group, receipt.replica, receipt.version, receipt.arrival)

    def add_replica(self, replica: int, group: int, version: int) -> None:
        self.group_of[replica] = group
        self.installed[replica] = int(version)
        self.live[group] = True

    def remove_replica(self, replica: int) -> None:
        self.installed.pop(replica, None)
        self.group_of.pop(replica, None)

    def retire(self, group: int) -> None:
        self.live[group] = False

    @property
    def held(self) -> list[int]:
        """Per group, the oldest version its replicas hold (a retired group keeps its last value)."""
        out = [self.latest] * self.num_groups
        for replica, group in self.group_of.items():
            out[group] = min(out[group], self.installed[replica])
        return out

    def oldest_held(self) -> int:
        held = [version for version, live in zip(self.held, self.live, strict=True) if live]
        if not held:
            raise ValueError("no sampler group is live")
        return min(held)

    def metrics(self, learner_version: int) -> dict[tuple[int, str], float]:
        """``(group, name) -> value``: the version each group holds, its age, its bytes pulled and mean lags."""
        out: dict[tuple[int, str], float] = {}
        for group, held in enumerate(self.held):
            out[group, "weight_version"] = float(held)
            out[group, "weight_age"] = float(learner_version - held)
            out[group, "relay_bytes"] = float(self.bytes[group])
            if self.lags_s[group]:
                out[group, "arrival_lag_mean_s"] = float(np.mean(self.lags_s[group]))
            if self.pull_s[group]:
                out[group, "pull_s_mean"] = float(np.mean(self.pull_s[group]))
        return out
