"""What every weight transport tells the rest of HeteroRL: which version each sampler group holds (framework-free).

One declared view, whatever moves the weights: the simulated schedule
(:class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule`, arrivals drawn from delay models) and the relay's
book of real arrivals (:class:`~gepo_sampler.relay.arrivals.ArrivalBook`) both implement it, and the sampler
fleet's admission control, the staleness core's version floors and the per-group metrics read only this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class SamplerVersions(Protocol):
    """Per sampler group: the weight version it holds and whether it still has a replica."""

    @property
    def num_groups(self) -> int: ...

    @property
    def latest(self) -> int:
        """The newest version the learner published."""
        ...

    @property
    def held(self) -> Sequence[int]:
        """Per group, the version its replicas sample with (the oldest of them, for a group of several)."""
        ...

    @property
    def live(self) -> Sequence[bool]:
        """Per group, False once it lost every replica (:meth:`retire`)."""
        ...

    def oldest_held(self) -> int:
        """The oldest version a live group holds: every rollout started from now on is at least this fresh."""
        ...

    def retire(self, group: int) -> None:
        """``group`` lost every replica: it no longer holds the oldest version."""
        ...

    def metrics(self, learner_version: int) -> dict[tuple[int, str], float]:
        """``(group, name) -> value`` (unprefixed: the metric table names them, :mod:`gepo_plugin.metric_names`)."""
        ...
