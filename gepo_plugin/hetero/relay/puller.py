"""A sampler group's side of the relay: the cheapest verified chain to the newest version, never half-installed.

From the version it holds, :meth:`RelayPuller.pull` picks the plan with the fewest bytes to the newest published
version: the deltas that follow it, or a keyframe and the deltas after that (a newcomer, a sampler far behind, or
one holding another lineage has only the second kind). Each shard is checked against its manifest's size and sha256;
a corrupt or truncated one is fetched again, and one that stays corrupt takes its version's part out of every plan
(:class:`RelayIntegrityError` if no plan is left; the learner is then asked for a keyframe). A version is applied
only once all its shards are verified, so the weights held are always exactly one published version.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from gepo_plugin.hetero.relay import codec
from gepo_plugin.hetero.relay.link import Link, LinkConfig
from gepo_plugin.hetero.relay.manifest import Manifest, Part, RelayAuthError
from gepo_plugin.hetero.relay.publisher import MANIFESTS, manifest_key, parse_manifest_name, shard_key
from gepo_plugin.hetero.relay.store import RelayStore

logger = logging.getLogger(__name__)


class RelayIntegrityError(RuntimeError):
    """A stored shard stays corrupt and no other plan reaches the newest version."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


@dataclass
class Held:
    """What a sampler group holds: one published version, exactly."""

    version: int
    lineage: str
    weights: codec.WeightBits


@dataclass
class PullResult:
    """One completed pull: the version now held, what crossed the link, how long it took, the steps taken."""

    held: Held
    nbytes: int
    seconds: float
    steps: list[tuple[int, Part]] = field(default_factory=list)


class RelayPuller:
    """Pulls one run's versions from its store for one sampler group."""

    def __init__(
        self,
        store: RelayStore,
        run_id: str,
        secret: bytes | None = None,
        link: Link | None = None,
        fetch_attempts: int = 3,
    ) -> None:
        self.store, self.run_id, self.secret = store, run_id, secret
        self.link = link if link is not None else Link(LinkConfig())
        self.fetch_attempts = fetch_attempts
        self.counters = store.counters
        self._read: dict[tuple[int, str], Manifest] = {}
        self._manifests: dict[int, Manifest] = {}
        self._refused: set[tuple[int, str]] = set()
        self._bad: set[tuple[int, Part]] = set()

    def refresh(self) -> dict[int, Manifest]:
        """The versions published now, by version (new manifests read and verified; refused ones logged once).

        With two lineages in the store (a resume in progress), a version's newest publication wins.
        """
        listed = {p for p in map(parse_manifest_name, self.store.list(MANIFESTS)) if p is not None}
        for version, lineage in sorted(listed - set(self._read) - self._refused):
            try:
                manifest = Manifest.from_json(self.store.get(manifest_key(version, lineage), self.link).decode())
                manifest.verify(self.run_id, self.secret)
            except FileNotFoundError:
                continue  # deleted by retention in the meantime
            except RelayAuthError as error:
                self._refused.add((version, lineage))
                self.counters.add("manifests_refused")
                logger.error("relay: refusing weight version %d from %s: %s", version, self.store.url, error)
                continue
            self._read[version, lineage] = manifest
        for key in set(self._read) - listed:
            del self._read[key]
        self._manifests = {}
        for manifest in sorted(self._read.values(), key=lambda m: m.published_at):
            self._manifests[manifest.version] = manifest
        return self._manifests

    def latest(self) -> int | None:
        return max(self.refresh(), default=None)

    def plan(self, held: Held | None, target: int) -> list[tuple[Manifest, Part]] | None:
        """The cheapest list of (manifest, part) from ``held`` to ``target``, or None if none is complete."""
        goal = self._manifests[target]

        def chain_from(version: int, lineage: str) -> list[tuple[Manifest, Part]] | None:
            steps: list[tuple[Manifest, Part]] = []
            by_base = {
                m.base: m
                for m in self._manifests.values()
                if m.lineage == lineage and m.delta is not None and (m.version, "delta") not in self._bad
            }
            while version != target:
                step = by_base.get(version)
                if step is None or step.version > target:
                    return None
                steps.append((step, "delta"))
                version = step.version
            return steps

        candidates = []
        if held is not None and held.lineage == goal.lineage and held.version <= target:
            chain = chain_from(held.version, held.lineage)
            if chain is not None:
                candidates.append(chain)
        for manifest in self._manifests.values():
            newer = held is None or manifest.version > held.version or manifest.lineage != held.lineage
            usable = manifest.full is not None and (manifest.version, "full") not in self._bad
            if newer and usable and manifest.lineage == goal.lineage and manifest.version <= target:
                chain = chain_from(manifest.version, manifest.lineage)
                if chain is not None:
                    candidates.append([(manifest, "full"), *chain])
        if not candidates:
            return None
        return min(candidates, key=lambda steps: (sum(m.nbytes(part) for m, part in steps), len(steps)))

    def pull(self, held: Held | None, target: int | None = None) -> PullResult | None:
        """Bring ``held`` (None: nothing yet) to ``target`` (default: the newest); None if already there."""
        started = time.perf_counter()
        target = self.latest() if target is None else target
        if target is None or (
            held is not None and held.version == target and held.lineage == self._manifests[target].lineage
        ):
            return None
        nbytes, steps = 0, []
        while True:
            plan = self.plan(held, target)
            if plan is None:
                raise RelayIntegrityError(
                    f"relay: no complete chain to weight version {target} in {self.store.url} (corrupt or missing "
                    "shards); a keyframe is needed",
                    target,
                )
            try:
                for manifest, part in plan:
                    held, size = self._apply(held, manifest, part)
                    nbytes += size
                    steps.append((manifest.version, part))
                break
            except _Unusable as unusable:  # re-plan around it from what is held now
                self._bad.add((unusable.version, unusable.part))
        self.counters.add("versions_pulled")
        self.counters.add("bytes_pulled", nbytes)
        return PullResult(held=held, nbytes=nbytes, seconds=time.perf_counter() - started, steps=steps)

    def _apply(self, held: Held | None, manifest: Manifest, part: Part) -> tuple[Held, int]:
        shards = manifest.part(part)
        payloads = [self._fetch(manifest, part, shard) for shard in shards]  # every shard verified first
        if part == "full":
            arrays: dict = {}
            for shard, data in zip(shards, payloads, strict=True):
                arrays.update(codec.decode_full(codec.decompress(data, shard.compressed), manifest.specs))
            if set(arrays) != set(manifest.specs):
                raise _Unusable(manifest.version, part)
            weights = codec.WeightBits(arrays, dict(manifest.specs))
        else:
            weights = held.weights
            for shard, data in zip(shards, payloads, strict=True):
                codec.apply_delta(weights, codec.decompress(data, shard.compressed))
        return Held(manifest.version, manifest.lineage, weights), sum(len(p) for p in payloads)

    def _fetch(self, manifest: Manifest, part: Part, shard) -> bytes:
        for _ in range(self.fetch_attempts):
            try:
                data = self.store.get(shard_key(shard.sha256), self.link)
            except FileNotFoundError:
                self.counters.add("shards_missing")
                raise _Unusable(manifest.version, part) from None
            if len(data) == shard.nbytes and hashlib.sha256(data).hexdigest() == shard.sha256:
                return data
            self.counters.add("shards_corrupt")
            logger.warning(
                "relay: shard %s of weight version %d (%s) is corrupt or truncated (%d of %d bytes); fetching again",
                shard.sha256[:12],
                manifest.version,
                part,
                len(data),
                shard.nbytes,
            )
        raise _Unusable(manifest.version, part)


class _Unusable(Exception):
    def __init__(self, version: int, part: Part) -> None:
        super().__init__(f"weight version {version}'s {part} part is unusable")
        self.version, self.part = version, part
