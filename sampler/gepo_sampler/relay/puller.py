"""A sampler group's side of the relay: the cheapest verified chain to the newest version, never half-installed.

From the version it holds, :meth:`RelayPuller.pull` picks the plan with the fewest bytes to the newest published
version: the deltas that follow it, or a keyframe and the deltas after that (a newcomer, a sampler far behind, or
one holding another lineage has only the second kind).

All or nothing. The weights a sampler holds are never written: a pull applies its plan into a staging copy of the
tensors the plan changes (the others are shared with the held version, which nothing writes), so a store error, a
corrupt shard or an apply failure at any step leaves the held version exactly as it was. Before the staged version
is returned, every tensor is checked against the manifest's digest of the version's full weights (tensors the plan
changed are hashed; the others carry the held version's verified digest): a mismatch is never installed, it is
counted (``digest_mismatches``), logged with the version, and the plan's parts are not used again; with no plan
left the learner is asked for a keyframe (:class:`RelayIntegrityError`).

Each shard is checked against its manifest's size and sha256; a corrupt or truncated one is fetched again, and one
that stays corrupt takes every part that holds it out of every plan and is reported by address
(:attr:`RelayPuller.corrupt_shards`), so the publisher rewrites it before it answers. A manifest that cannot be read
or parsed is refused like a forged one (logged with the version and object, ``manifests_refused``) and left out of
every plan; the other versions stay usable.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from gepo_sampler.relay import codec
from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.manifest import (
    MANIFESTS,
    Manifest,
    ManifestFormatError,
    Part,
    RelayAuthError,
    Shard,
    manifest_key,
    parse_manifest_name,
    shard_key,
)
from gepo_sampler.relay.signing import Verifier
from gepo_sampler.relay.store import RelayStore

logger = logging.getLogger(__name__)


class RelayIntegrityError(RuntimeError):
    """A stored shard stays corrupt, or a plan's result failed its digest, and no other plan reaches the newest
    version: a keyframe is needed."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


@dataclass
class Held:
    """What a sampler group holds: one published version, exactly, and the verified digest of each tensor."""

    version: int
    lineage: str
    weights: codec.WeightBits
    digests: dict[str, str] = field(default_factory=dict)


@dataclass
class PullResult:
    """One completed pull: the version now held, what crossed the link, how long it took, the steps taken."""

    held: Held
    nbytes: int
    seconds: float
    steps: list[tuple[int, Part]] = field(default_factory=list)


#: One publication's part: (version, when it was published, which part). A version published again with a keyframe
#: on request is another publication, so a part found unusable in one does not rule out the other.
PartId = tuple[int, float, Part]


class RelayPuller:
    """Pulls one run's versions from its store for one sampler group."""

    def __init__(
        self,
        store: RelayStore,
        run_id: str,
        secret: bytes | None = None,
        link: Link | None = None,
        fetch_attempts: int = 3,
        verifier: Verifier | None = None,
    ) -> None:
        self.store, self.run_id, self.secret = store, run_id, secret
        #: the learner's public key: a manifest without a valid Ed25519 signature is refused
        self.verifier = verifier
        self.link = link if link is not None else Link(LinkConfig())
        self.fetch_attempts = fetch_attempts
        self.counters = store.counters
        self._read: dict[tuple[int, str], Manifest] = {}
        self._manifests: dict[int, Manifest] = {}
        self._refused: set[tuple[int, str]] = set()
        self._bad: set[PartId] = set()
        #: shard addresses that stayed corrupt (reported to the learner; trusted again once a publication rewrote them)
        self.corrupt_shards: set[str] = set()

    def refresh(self) -> dict[int, Manifest]:
        """The versions published now, by version (new manifests read and verified; refused ones logged once).

        With two lineages in the store (a resume in progress), a version's newest publication wins.
        """
        listed = {p for p in map(parse_manifest_name, self.store.list(MANIFESTS)) if p is not None}
        for version, lineage in sorted(listed - set(self._read) - self._refused):
            key = manifest_key(version, lineage)
            try:
                manifest = Manifest.from_json(self.store.get(key, self.link))
                manifest.verify(self.run_id, self.secret, self.verifier)
            except FileNotFoundError:
                continue  # deleted by retention in the meantime
            except (RelayAuthError, ManifestFormatError) as error:
                self._refused.add((version, lineage))
                self.counters.add("manifests_refused")
                logger.error("relay: refusing weight version %d (%s in %s): %s", version, key, self.store.url, error)
                continue
            self._read[version, lineage] = manifest
            self.corrupt_shards -= set(manifest.rewritten)
        for key in set(self._read) - listed:
            del self._read[key]
        self._manifests = {}
        for manifest in sorted(self._read.values(), key=lambda m: m.published_at):
            self._manifests[manifest.version] = manifest
        return self._manifests

    def latest(self) -> int | None:
        return max(self.refresh(), default=None)

    def _usable(self, manifest: Manifest, part: Part) -> bool:
        shards = manifest.part(part)
        return (
            shards is not None
            and (manifest.version, manifest.published_at, part) not in self._bad
            and not any(shard.sha256 in self.corrupt_shards for shard in shards)
        )

    def plan(self, held: Held | None, target: int) -> list[tuple[Manifest, Part]] | None:
        """The cheapest list of (manifest, part) from ``held`` to ``target``, or None if none is complete."""
        goal = self._manifests[target]

        def chain_from(version: int, lineage: str) -> list[tuple[Manifest, Part]] | None:
            steps: list[tuple[Manifest, Part]] = []
            by_base = {m.base: m for m in self._manifests.values() if m.lineage == lineage and self._usable(m, "delta")}
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
            if (
                newer
                and self._usable(manifest, "full")
                and manifest.lineage == goal.lineage
                and manifest.version <= target
            ):
                chain = chain_from(manifest.version, manifest.lineage)
                if chain is not None:
                    candidates.append([(manifest, "full"), *chain])
        if not candidates:
            return None
        return min(candidates, key=lambda steps: (sum(m.nbytes(part) for m, part in steps), len(steps)))

    def pull(self, held: Held | None, target: int | None = None) -> PullResult | None:
        """Bring ``held`` (None: nothing yet) to ``target`` (default: the newest); None if already there.

        ``held`` is never changed: the result is a new :class:`Held`, whatever fails on the way."""
        started = time.perf_counter()
        target = self.latest() if target is None else target
        if target is None or (
            held is not None and held.version == target and held.lineage == self._manifests[target].lineage
        ):
            return None
        fetched = [0]
        while True:
            plan = self.plan(held, target)
            if plan is None:
                raise RelayIntegrityError(
                    f"relay: no complete chain to weight version {target} in {self.store.url} (corrupt or missing "
                    "shards, or a result that failed its digest); a keyframe is needed",
                    target,
                )
            try:
                staged = self._stage(held, plan, fetched)
                break
            except _Unusable as unusable:  # re-plan around it
                self._bad.update(unusable.parts)
        self.counters.add("versions_pulled")
        self.counters.add("bytes_pulled", fetched[0])
        return PullResult(
            held=staged,
            nbytes=fetched[0],
            seconds=time.perf_counter() - started,
            steps=[(m.version, part) for m, part in plan],
        )

    def _stage(self, held: Held | None, plan: list[tuple[Manifest, Part]], fetched: list[int]) -> Held:
        """Apply ``plan`` into a staging copy (``held`` is only read) and verify the result's digests."""
        bits = dict(held.weights.bits) if held is not None else {}
        digests = dict(held.digests) if held is not None else {}
        owned: set[str] = set()  # tensors this pull wrote: copies, never the held version's arrays
        specs = plan[0][0].specs
        for manifest, part in plan:
            payloads = [self._fetch(manifest, part, shard, fetched) for shard in manifest.part(part)]
            if part == "full":
                arrays: dict[str, np.ndarray] = {}
                for shard, data in zip(manifest.part(part), payloads, strict=True):
                    arrays.update(codec.decode_full(codec.decompress(data, shard.compressed), manifest.specs))
                if set(arrays) != set(manifest.specs):
                    raise _Unusable((manifest, part))
                bits, owned = arrays, set(arrays)
            else:
                staging = codec.WeightBits(bits, dict(manifest.specs))
                for shard, data in zip(manifest.part(part), payloads, strict=True):
                    delta = codec.read_delta(codec.decompress(data, shard.compressed))
                    for name in set(delta.tensors) - owned:
                        bits[name] = bits[name].copy()
                        owned.add(name)
                    codec.apply_delta(staging, delta)
            specs = manifest.specs
        goal = plan[-1][0]
        digests = {name: digests.get(name) for name in specs}
        digests.update(
            codec.WeightBits(bits, dict(specs)).digests(owned | {n for n, d in digests.items() if d is None})
        )
        wrong = sorted(name for name in specs if digests[name] != goal.digests.get(name))
        if wrong or set(goal.digests) != set(specs):
            self.counters.add("digest_mismatches")
            logger.error(
                "relay: weight version %d from %s failed its digest check (%d tensor(s), first %s; plan %s): not "
                "installed, a keyframe will be asked for",
                goal.version,
                self.store.url,
                len(wrong),
                wrong[:3],
                [(m.version, part) for m, part in plan],
            )
            raise _Unusable(*plan)
        return Held(goal.version, goal.lineage, codec.WeightBits(bits, dict(specs)), digests)

    def _fetch(self, manifest: Manifest, part: Part, shard: Shard, fetched: list[int]) -> bytes:
        for _ in range(self.fetch_attempts):
            try:
                data = self.store.get(shard_key(shard.sha256), self.link)
            except FileNotFoundError:
                self.counters.add("shards_missing")
                raise _Unusable((manifest, part)) from None
            fetched[0] += len(data)
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
        self.corrupt_shards.add(shard.sha256)
        raise _Unusable((manifest, part))


class _Unusable(Exception):
    """These parts cannot give the version they promise: plan around them."""

    def __init__(self, *steps: tuple[Manifest, Part]) -> None:
        super().__init__(f"weight version parts {[(m.version, part) for m, part in steps]} are unusable")
        self.parts: list[PartId] = [(m.version, m.published_at, part) for m, part in steps]
