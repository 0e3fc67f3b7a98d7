"""Which sampler replicas serve, which were lost and how, and what replaced them (framework-free).

A sampler group is a set of rollout replicas that share one network path to the learner (one delay model). A
replica that died or hung is *retired*: it leaves its group, and a group with no replica left is no longer live
(its weight schedule stops, :meth:`WeightArrivalSchedule.retire`). A replacement replica *joins* a group. The
roster counts every failure and replacement, and the replacements still starting (a group whose replacement is
starting is not given up on); the counters and the log of failures are saved in ``hetero.json`` and continue across
a resume (a resumed run starts every configured replica afresh, so membership itself is not
restored).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

#: How a sampler replica was lost: its process is gone, it stopped answering within ``hetero.health.timeout_s``, or
#: (a remote sampler) the audit quarantined it.
Failure = Literal["died", "hung", "quarantined"]
FAILURES: tuple[str, ...] = ("died", "hung", "quarantined")


class NoSamplerLeft(RuntimeError):
    """Every sampler group lost its last replica: nothing can produce rollouts any more."""


@dataclass(frozen=True)
class FailureRecord:
    """One retired replica: its group, its id in the roster, how it failed and how long detection took."""

    group: int
    replica: int
    kind: str
    learner_version: int
    detect_s: float


class SamplerRoster:
    """Membership of the sampler groups, and the books of failures and replacements."""

    def __init__(self, group_sizes: Sequence[int]) -> None:
        self.groups: list[set[int]] = []
        self.group_of: dict[int, int] = {}
        for group, size in enumerate(group_sizes):
            members = set(range(len(self.group_of), len(self.group_of) + size))
            self.groups.append(members)
            self.group_of.update(dict.fromkeys(members, group))
        self.failures: list[FailureRecord] = []
        self.replacements = 0
        #: group -> replacements started for it that have neither joined nor failed yet
        self.starting: Counter[int] = Counter()

    @property
    def next_replica(self) -> int:
        """The id the next replacement gets (ids are never reused)."""
        return max(self.group_of, default=-1) + 1

    def alive(self, group: int) -> bool:
        return bool(self.groups[group])

    def live_groups(self) -> list[int]:
        return [group for group, members in enumerate(self.groups) if members]

    def retire(self, replica: int, kind: Failure, learner_version: int, detect_s: float) -> bool:
        """Record that ``replica`` was lost; returns whether its group has no replica left."""
        if kind not in FAILURES:
            raise ValueError(f"unknown failure kind {kind!r}; one of {FAILURES}")
        group = self.group_of[replica]
        if replica not in self.groups[group]:
            raise ValueError(f"replica {replica} of sampler group {group} was already retired")
        self.groups[group].discard(replica)
        self.failures.append(FailureRecord(group, replica, kind, int(learner_version), float(detect_s)))
        return not self.groups[group]

    def begin_replacement(self, group: int) -> None:
        """A replacement for ``group`` started; it joins (:meth:`join`) or fails (:meth:`abandon_replacement`)."""
        self.starting[group] += 1

    def abandon_replacement(self, group: int) -> None:
        """A replacement for ``group`` could not start."""
        self._end_replacement(group)

    def join(self, group: int) -> int:
        """A replacement replica joins ``group``; returns its id."""
        self._end_replacement(group)
        replica = self.next_replica
        self.groups[group].add(replica)
        self.group_of[replica] = group
        self.replacements += 1
        return replica

    def _end_replacement(self, group: int) -> None:
        if self.starting[group] <= 0:
            raise ValueError(f"no replacement is starting for sampler group {group}")
        self.starting[group] -= 1

    def require_any(self) -> None:
        """Raise :class:`NoSamplerLeft` (naming what was lost) when no group has a replica and no replacement is
        starting."""
        if self.live_groups() or sum(self.starting.values()):
            return
        lost = ", ".join(f"replica {f.replica} of group {f.group} {f.kind}" for f in self.failures[-8:])
        raise NoSamplerLeft(
            f"hetero: every sampler is lost ({lost}); nothing can produce rollouts, so the run stops. Resume from the "
            "last checkpoint once the samplers are back (trainer.resume_mode=auto), or set hetero.replace_failed=true "
            "to start replacements"
        )

    def metrics(self) -> dict[str, float]:
        """Failures, replacements and who is alive (unprefixed names)."""
        out = {
            "sampler_failures": float(len(self.failures)),
            "sampler_replacements": float(self.replacements),
            "sampler_replacements/starting": float(sum(self.starting.values())),
            "sampler_replicas_alive": float(sum(len(members) for members in self.groups)),
        }
        for kind in FAILURES:
            out[f"sampler_failures/{kind}"] = float(sum(f.kind == kind for f in self.failures))
        for group, members in enumerate(self.groups):
            out[f"sampler_group_{group}/alive"] = float(bool(members))
        if self.failures:
            out["sampler_detect_s/last"] = self.failures[-1].detect_s
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"failures": [asdict(record) for record in self.failures], "replacements": self.replacements}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the counters of a checkpoint (membership stays as started: every configured replica)."""
        self.failures = [FailureRecord(**record) for record in state.get("failures", [])]
        self.replacements = int(state.get("replacements", 0))
