"""Weights over verl's in-cluster checkpoint engine, each sampler group getting a version only when it "arrives".

:class:`SimulatedTransport` follows :class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule` for who
installs which version when, pushing with each group's own verl ``CheckpointEngineManager`` (same backend: NCCL, the
CPU mailbox, ...). Without a configured delay every delay is 0: each version reaches every group at once, as in
verl, and no snapshot is taken.

Exact versions, with verl's own machinery: a group must install the version it started downloading, not whatever
the learner holds when the download lands. The learner keeps a host-memory snapshot of every version still being
downloaded with verl's ``DetachActorWorker.save_model_to_cpu`` (separate_async's own worker; sharded, so each
learner rank holds its shard). Installing version ``u`` restores ``u`` into the actor, pushes it to the group with
``global_steps=u`` (so every token the group generates is tagged ``u``) and restores the current weights. At most
one snapshot per group plus the newest are kept (with replacements on, also every live group's version: a
replacement installs it).

When arrivals are installed: at every step end, and while the learner waits for data. A download that lands while
the learner is mid-update is installed at the step end; its arrival time, not the install time, drives the
schedule.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayError
from verl.checkpoint_engine import CheckpointEngineManager

from gepo_plugin import metric_names
from gepo_plugin.hetero.weight_schedule import Delivery, WeightArrivalSchedule
from gepo_plugin.verl_glue.hetero.transport import Fleet

logger = logging.getLogger(__name__)


def snapshot_key(version: int) -> str:
    """Key of a weight snapshot in ``DetachActorWorker.cpu_saved_models`` (verl's own keys are ints)."""
    return f"gepo_hetero_v{version}"


class SimulatedTransport:
    """The simulated-delay transport (see the module docstring)."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.settings = fleet.settings
        self.actor_wg = fleet.actor_wg
        self.clock = clock
        self.schedule: WeightArrivalSchedule | None = None
        self.snapshots: set[int] = set()
        kind = "simulated weight delay" if self.settings.simulates_delay else "no weight delay"
        logger.info("hetero: weights through verl's checkpoint engine, %s", kind)

    @property
    def versions(self) -> WeightArrivalSchedule | None:
        return self.schedule

    # --------------------------------------------------------------- the transport protocol
    def start(self, version: int) -> WeightArrivalSchedule:
        delays = [self.settings.delay_for(group) for group in range(len(self.fleet.roster.groups))]
        self.schedule = WeightArrivalSchedule(
            delays, self.settings.seed, start_version=version, start_time=self.clock()
        )
        self._clear_snapshots()
        return self.schedule

    def install_first(self, version: int) -> None:
        for group in self.fleet.roster.live_groups():
            self._push(group, version)
        self._save(version)

    def publish(self, version: int) -> None:
        due = self.schedule.publish(version, self.clock())
        self._save(version)  # the actor holds `version` now
        self._install(due)

    def collect(self) -> bool:
        due = self.schedule.advance(self.clock())
        if due:
            self._install(due)
        return bool(due)

    def join(self, started: list[tuple[int, Any]]) -> list[int]:
        return [member for member in (self._admit(group, replica) for group, replica in started) if member is not None]

    def forget(self, replica: int) -> None:
        """Nothing is kept per replica: a group's weights are its manager's."""

    def settle(self, oldest: int) -> None:
        """Snapshots are pruned as versions are installed (:meth:`_install`)."""

    def metrics(self) -> dict[str, float]:
        return {metric_names.HETERO + "weight_snapshots": float(len(self.snapshots))}

    # --------------------------------------------------------------- internals
    def _push(self, group: int, version: int) -> None:
        """Install ``version`` on ``group``'s replicas (verl's manager resumes them too)."""
        self.fleet.on_group(group, lambda manager: manager.update_weights(version))

    def _save(self, version: int) -> None:
        if not self.settings.simulates_delay:
            return  # every group installs the newest version: no older one is ever restored
        self.actor_wg.save_model_to_cpu(snapshot_key(version))
        self.snapshots.add(version)

    def _install(self, due: list[Delivery]) -> None:
        current = self.schedule.latest
        by_version: dict[int, list[int]] = defaultdict(list)
        for delivery in due:
            by_version[delivery.version].append(delivery.group)
        swapped = False
        for version in sorted(by_version):
            if version != current:
                if version not in self.snapshots:
                    raise RuntimeError(f"hetero: no snapshot of version {version} (have {sorted(self.snapshots)})")
                self.actor_wg.restore_model_from_cpu(snapshot_key(version))
                swapped = True
            for group in dict.fromkeys(by_version[version]):
                self._push(group, version)
                if self.fleet.roster.alive(group):
                    self.fleet.installed(group, self.fleet.groups[group])
        if swapped:
            self.actor_wg.restore_model_from_cpu(snapshot_key(current))
        for version in sorted(self.snapshots - self._kept_versions()):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
            self.snapshots.discard(version)

    def _kept_versions(self) -> set[int]:
        """Snapshots to keep: versions being downloaded and the newest; with replacements on, also every live
        group's version (a replacement installs it)."""
        kept = self.schedule.needed_versions()
        if self.settings.config.replace_failed:
            kept |= {held for held, live in zip(self.schedule.held, self.schedule.live, strict=True) if live}
        return kept

    def _clear_snapshots(self) -> None:
        for version in sorted(self.snapshots):
            self.actor_wg.clear_cpu_model(snapshot_key(version))
        self.snapshots.clear()

    def _admit(self, group: int, replica: Any) -> int | None:
        """Install sampler ``group``'s weights on a started ``replica`` from the learner's host snapshots and enlist
        it; None (the replica stopped and freed) when it was lost before it could take its weights.

        The actor holds the schedule's newest version here (after a step's publish, or while the learner waits for
        data). A group that had no replica left rejoins with the newest version; else the replacement takes the
        group's version, so every replica of a group samples with the same weights."""
        schedule = self.schedule
        rejoining = not self.fleet.roster.alive(group)
        version = schedule.latest if rejoining else schedule.held[group]
        installer = CheckpointEngineManager(self.fleet.config, self.actor_wg, [replica])
        if version != schedule.latest:
            self.actor_wg.restore_model_from_cpu(snapshot_key(version))
        try:
            installer.update_weights(version)
        except RayError:
            logger.exception("hetero: a replacement for sampler group %d was lost before it took its weights", group)
            self.fleet.abandon(group, replica)
            return None
        finally:
            if version != schedule.latest:
                self.actor_wg.restore_model_from_cpu(snapshot_key(schedule.latest))
        member = self.fleet.enlist(group, replica, version, installer)
        if rejoining:
            schedule.rejoin(group)
        return member
