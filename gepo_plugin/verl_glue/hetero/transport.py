"""How weights reach HeteroRL's samplers: the one protocol every transport implements, and what it may ask the fleet.

The :class:`~gepo_plugin.verl_glue.hetero.fleet.SamplerFleet` owns what every transport shares (groups and
replicas, health and retirement, replacement, admission, version floors, per-group metrics); a
:class:`WeightTransport` only moves versions to replicas and keeps the
:class:`~gepo_plugin.hetero.sampler_versions.SamplerVersions` view of who holds what. Today:
:class:`~gepo_plugin.verl_glue.hetero.simulated_transport.SimulatedTransport` (verl's in-cluster engine with
delays simulated on the learner) and :class:`~gepo_plugin.verl_glue.hetero.relay_transport.RelayTransport` (the
learner publishes to a store, samplers pull). A transport reaches the fleet only through :class:`Fleet`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from verl.checkpoint_engine import CheckpointEngineManager

from gepo_plugin.hetero.roster import SamplerRoster
from gepo_plugin.hetero.sampler_versions import SamplerVersions
from gepo_plugin.hetero.settings import HeteroSettings


class WeightTransport(Protocol):
    """One way weights travel from the learner to the sampler replicas (the fleet calls these on its thread)."""

    @property
    def versions(self) -> SamplerVersions | None:
        """Who holds which version (None before the first :meth:`start`)."""
        ...

    def start(self, version: int) -> SamplerVersions:
        """The run starts (or resumes) at ``version``: a fresh view in which every group holds ``version``."""
        ...

    def install_first(self, version: int) -> None:
        """Every live replica installs ``version`` before anything is generated."""
        ...

    def publish(self, version: int) -> None:
        """The learner holds ``version`` at a step end: send it on, and install what has arrived."""
        ...

    def collect(self) -> bool:
        """Install what has arrived since (the learner waits for data); whether anything was installed."""
        ...

    def join(self, started: list[tuple[int, Any]]) -> list[int]:
        """Bring started replacements (``(group, replica)``) to their group's weights; the roster ids that joined."""
        ...

    def forget(self, replica: int) -> None:
        """Roster id ``replica`` was retired: drop what the transport kept for it."""
        ...

    def settle(self, oldest: int) -> None:
        """After a step end: no live group holds anything older than ``oldest``."""
        ...

    def metrics(self) -> dict[str, float]:
        """The transport's own metrics, named (:mod:`gepo_plugin.metric_names`)."""
        ...


class Fleet(Protocol):
    """What a transport may ask of the sampler fleet."""

    settings: HeteroSettings
    config: Any
    actor_wg: Any
    roster: SamplerRoster
    members: Mapping[int, Any]
    #: per sampler group, its verl weight-sync manager
    groups: list[CheckpointEngineManager]
    paused: set[int]
    #: the samplers outside the cluster (None without ``hetero.remote_samplers``)
    remote: Any

    def on_group(self, group: int, call: Callable[[CheckpointEngineManager], object]) -> None:
        """Run ``call`` on ``group``'s weight-sync manager, retiring replicas lost meanwhile."""
        ...

    def check_replica(self, replica: int, error: Exception) -> None:
        """A call to ``replica`` failed: retire it if it was lost, else re-raise ``error``."""
        ...

    def retire_lost(self) -> None: ...

    def installed(self, group: int, replicas: CheckpointEngineManager) -> None:
        """``replicas`` of ``group`` installed a version: count it, and let them serve unless the group is paused."""
        ...

    def enlist(self, group: int, replica: Any, version: int, replicas: CheckpointEngineManager) -> int:
        """A replacement that holds ``version`` joins ``group``; returns its roster id."""
        ...

    def abandon(self, group: int, replica: Any) -> None:
        """A started replacement cannot join: stop it and free its devices."""
        ...
