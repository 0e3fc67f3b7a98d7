"""What a synthetic sampler reads from the relay's store: what a host's follower reads, nothing installed.

The real :class:`~gepo_sampler.relay.puller.RelayPuller` lists and verifies the manifests (Ed25519, the run's id) and
plans the cheapest chain from the version held; every shard of the plan is fetched and checked against its size and
sha256, as a host fetches it; nothing is decoded or applied (a synthetic sampler has no weights). Like a host, it
lists the store only while the learner's newest version (the gateway's answer to every poll) is newer than the one
it holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gepo_sampler.relay.manifest import shard_key
from gepo_sampler.relay.puller import Held, RelayPuller


class ShardCorrupt(RuntimeError):
    """A fetched shard failed its size or digest check."""


@dataclass(frozen=True)
class Arrival:
    """A version fetched whole: when it was published (the manifest's wall clock) and what crossed the link."""

    version: int
    published_at: float
    nbytes: int


class ManifestFollower:
    """One synthetic sampler's view of the store (blocking calls: run them off the event loop)."""

    def __init__(self, puller: RelayPuller) -> None:
        self.puller = puller
        self.held: Held | None = None

    def pull(self) -> Arrival | None:
        """Fetch the newest published version if it is newer than the one held; None if there is none."""
        manifests = self.puller.refresh()
        target = max(manifests, default=None)
        if target is None or (self.held is not None and target <= self.held.version):
            return None
        plan = self.puller.plan(self.held, target)
        if plan is None:
            return None
        nbytes = 0
        for manifest, part in plan:
            for shard in manifest.part(part):
                data = self.puller.store.get(shard_key(shard.sha256))
                if len(data) != shard.nbytes or hashlib.sha256(data).hexdigest() != shard.sha256:
                    raise ShardCorrupt(f"shard {shard.sha256[:12]} of version {manifest.version}")
                nbytes += len(data)
        goal = manifests[target]
        self.held = Held(goal.version, goal.lineage, weights=None)
        return Arrival(goal.version, goal.published_at, nbytes)
