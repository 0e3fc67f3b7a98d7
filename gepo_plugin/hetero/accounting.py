"""Nothing lost silently: a ledger of rollout groups, checked at every step.

Every produced group is exactly one of: still queued, trained, or dropped with a reason.
``produced == trained + sum(dropped) + queued`` is an invariant the ledger enforces on every
transition (by construction) and re-checks in :meth:`RolloutLedger.check`. Its state is a plain
dict, saved with the checkpoint and restored on resume, so counters continue correctly and
finished-but-untrained groups come back as queued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


class AccountingError(RuntimeError):
    """A rollout group was counted twice or disappeared."""


class RolloutLedger:
    """Counts of rollout groups produced, trained and dropped (by reason), and the ids still queued."""

    def __init__(self) -> None:
        self.produced = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self._queued: dict[str, int] = {}  # group id -> min_version

    @property
    def queued(self) -> int:
        return len(self._queued)

    def queued_groups(self) -> dict[str, int]:
        """Queued group ids and their oldest token version."""
        return dict(self._queued)

    def produce(self, group_id: str, min_version: int) -> None:
        if group_id in self._queued:
            raise AccountingError(f"group {group_id!r} was produced twice")
        self._queued[group_id] = int(min_version)
        self.produced += 1

    def _take(self, group_id: str) -> None:
        if group_id not in self._queued:
            raise AccountingError(f"group {group_id!r} is not queued (never produced, or already trained/dropped)")
        del self._queued[group_id]

    def train(self, group_ids: Iterable[str]) -> None:
        for group_id in group_ids:
            self._take(group_id)
            self.trained += 1

    def drop(self, group_ids: Iterable[str], reason: str) -> None:
        if not reason:
            raise AccountingError("a dropped group needs a reason")
        for group_id in group_ids:
            self._take(group_id)
            self.dropped[reason] += 1

    def check(self) -> None:
        """Raise :class:`AccountingError` unless every group produced is trained, dropped or still queued."""
        total = self.trained + sum(self.dropped.values()) + self.queued
        if total != self.produced:
            raise AccountingError(
                f"rollouts lost: produced {self.produced} != trained {self.trained} + dropped "
                f"{dict(self.dropped)} + queued {self.queued}"
            )

    def metrics(self) -> dict[str, float]:
        """The counters by (unprefixed) name, checked first."""
        self.check()
        out = {
            "produced": float(self.produced),
            "trained": float(self.trained),
            "queued": float(self.queued),
            "dropped": float(sum(self.dropped.values())),
        }
        out.update({f"dropped/{reason}": float(count) for reason, count in sorted(self.dropped.items())})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "produced": self.produced,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "queued": dict(self._queued),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RolloutLedger:
        ledger = cls()
        ledger.produced = int(state["produced"])
        ledger.trained = int(state["trained"])
        ledger.dropped = Counter({str(k): int(v) for k, v in state["dropped"].items()})
        ledger._queued = {str(k): int(v) for k, v in state["queued"].items()}
        ledger.check()
        return ledger
