"""The learner's side of the relay: each weight version published once, in the background, with bounded memory.

:meth:`RelayPublisher.publish` costs the learner one host copy of its weights; a background thread encodes and
uploads it. At most three host copies exist (the version published last, the one uploading, one waiting): when the
learner publishes faster than the store takes it, a waiting version is replaced by the newer one (counted as
``versions_coalesced``; samplers then skip it, and the next delta is against the version actually published).
Shards are content-addressed (``shards/<sha256>``), the manifest goes last, so a version a sampler can see is
complete. A publisher that starts on a store holding an earlier run's versions (a resume) discards any version
newer than the one it resumes from and begins a new lineage with a keyframe.

A keyframe a sampler asks for (:meth:`RelayPublisher.request_keyframe`: a stored shard stays corrupt) is published
at once: the version published last gets a full keyframe beside its delta, under a second manifest of the same
version and lineage (``<version>-<lineage>.k.json``; a puller takes a version's newest manifest). Waiting for the
next version could wait for ever: the learner may itself be waiting for that sampler's rollouts. (A sampler asks
until it has pulled the keyframe, so the next version usually carries one as well: one extra keyframe per
corruption, against a hang.)

Retention: :meth:`RelayPublisher.hold` tells it the oldest version a live sampler group holds; versions no sampler
can still need (older than that and than the newest keyframe) and the shards only they use are deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Mapping

import torch

from gepo_plugin.hetero.relay import codec
from gepo_plugin.hetero.relay.manifest import Manifest, Shard
from gepo_plugin.hetero.relay.settings import RelayConfig
from gepo_plugin.hetero.relay.store import RelayStore, pieces_nbytes

logger = logging.getLogger(__name__)
MANIFESTS, SHARDS = "manifests", "shards"
#: The lineage suffix in the name of a version's second manifest, the one that adds a requested keyframe.
KEYFRAME_ON_REQUEST = ".k"


def manifest_key(version: int, lineage: str) -> str:
    """A version's manifest; the lineage in the name makes a resumed run's version a new object."""
    return f"{MANIFESTS}/{version:010d}-{lineage}.json"


def shard_key(sha256: str) -> str:
    return f"{SHARDS}/{sha256}"


def parse_manifest_name(name: str) -> tuple[int, str] | None:
    """(version, lineage) of a manifest's file name, None for anything else."""
    version, _, lineage = name.removesuffix(".json").partition("-")
    return (int(version), lineage) if name.endswith(".json") and version.isdigit() and lineage else None


class RelayPublisher:
    """Publishes a learner's weight versions to one run's store."""

    def __init__(
        self,
        store: RelayStore,
        run_id: str,
        settings: RelayConfig,
        secret: bytes | None = None,
        resume_from: int | None = None,
    ) -> None:
        self.store, self.run_id, self.settings, self.secret = store, run_id, settings, secret
        self.counters = store.counters
        self.lineage = uuid.uuid4().hex
        self.published: dict[int, Manifest] = {}
        #: every manifest object of a version (its first publication, and the one adding a requested keyframe)
        self._manifest_keys: dict[int, list[str]] = {}
        self._load_existing(resume_from)
        self._encoder = codec.DeltaEncoder()
        self._previous: codec.WeightBits | None = None
        self._previous_version: int | None = None
        self._last_keyframe: int | None = None
        self._keyframe_requested = False
        self._oldest_held: int | None = None
        self._pending: tuple[int, codec.WeightBits] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="relay-publisher", daemon=True)
        self._thread.start()

    def _load_existing(self, resume_from: int | None) -> None:
        for name in self.store.list(MANIFESTS):
            parsed = parse_manifest_name(name)
            if parsed is None:
                continue
            version, lineage = parsed
            key = manifest_key(version, lineage)
            if resume_from is not None and version > resume_from:
                self.store.delete(key)  # a future the resumed run discards
                if not lineage.endswith(KEYFRAME_ON_REQUEST):
                    self.counters.add("versions_discarded")
                continue
            manifest = Manifest.from_json(self.store.get(key).decode())
            if manifest.run_id != self.run_id:
                continue
            self._manifest_keys.setdefault(version, []).append(key)
            if version not in self.published or manifest.published_at > self.published[version].published_at:
                self.published[version] = manifest

    @property
    def latest(self) -> int | None:
        return max(self.published, default=None)

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> float:
        """Queue ``version`` for publishing; returns the seconds the learner spent (the host copy)."""
        started = time.perf_counter()
        self._raise_background_error()
        with self._cv:
            newest = max([v for v in (self.latest, self._previous_version) if v is not None], default=None)
            if self._pending is not None:
                newest = max(newest if newest is not None else -1, self._pending[0])
            if newest is not None and version <= newest:
                raise ValueError(f"weight version {version} was published already (newest: {newest})")
        bits = codec.WeightBits.from_tensors(tensors)
        with self._cv:
            if self._pending is not None:
                self.counters.add("versions_coalesced")
            self._pending = (version, bits)
            self._cv.notify_all()
        seconds = time.perf_counter() - started
        self.counters.add("publish_host_copy_s", seconds)
        return seconds

    def request_keyframe(self) -> None:
        """A sampler found a stored shard corrupt: publish a keyframe now (the version published last gets one), or
        with the next version if none is published yet or one is queued."""
        with self._cv:
            self._keyframe_requested = True
            self._cv.notify_all()

    def _keyframe_due_now(self) -> bool:
        """A keyframe was asked for, no newer version is queued, and the version published last has none."""
        latest = self.published.get(self._previous_version) if self._previous_version is not None else None
        return self._keyframe_requested and self._pending is None and latest is not None and latest.full is None

    def hold(self, oldest_held: int | None) -> None:
        """The oldest version any live sampler group holds (None: none holds any): older ones may be deleted."""
        with self._cv:
            self._oldest_held = oldest_held

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued version (and a requested keyframe) is published; re-raise a background failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._pending is not None or self._busy or self._keyframe_due_now()) and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("the relay publisher did not finish in time")
                self._cv.wait(remaining)
        self._raise_background_error()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing weights to {self.store.url} failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed and not self._keyframe_due_now():
                    self._cv.wait()
                if self._keyframe_due_now():
                    work, version, bits = self._add_keyframe, self._previous_version, self._previous
                    self._keyframe_requested = False
                elif self._pending is not None:
                    work, (version, bits) = self._publish_now, self._pending
                    self._pending = None
                else:
                    return
                self._busy = True
            try:
                work(version, bits)
                self._prune()
            except BaseException as error:  # surfaced to the learner at its next publish or wait
                logger.error("relay: publishing weight version %d failed: %s", version, error)
                self._error = error
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            if self._error is not None:
                return

    def _publish_now(self, version: int, bits: codec.WeightBits) -> None:
        started = time.perf_counter()
        previous = self._previous
        with self._cv:
            forced, self._keyframe_requested = self._keyframe_requested, False
        has_delta = previous is not None and previous.specs == bits.specs
        full = (
            not has_delta
            or forced
            or self._last_keyframe is None
            or version - self._last_keyframe >= self.settings.keyframe_every
        )
        groups = codec.shard_names(bits.specs, self.settings.shard_bytes)
        delta_shards, changed = None, None
        if has_delta:
            delta_shards, changed = [], 0
            for names in groups:
                raw, count = self._encoder.encode(previous, bits, names)
                changed += count
                delta_shards.append(self._put_shard([raw], names, self.settings.delta_zstd_level))
        manifest = Manifest(
            run_id=self.run_id,
            version=version,
            lineage=self.lineage,
            specs=dict(bits.specs),
            full=self._put_keyframe(version, bits, groups) if full else None,
            delta=tuple(delta_shards) if delta_shards is not None else None,
            base=self._previous_version if has_delta else None,
            changed=changed,
            published_at=time.time(),
        )
        self._manifest_keys[version] = []
        self._put_manifest(manifest, self.lineage)
        self._previous, self._previous_version = bits, version
        self.counters.add("versions_published")
        self.counters.add("publish_s", time.perf_counter() - started)
        self.counters.add("published_bytes", manifest.nbytes("full") + manifest.nbytes("delta"))

    def _add_keyframe(self, version: int, bits: codec.WeightBits) -> None:
        """Publish version ``version`` (the one published last, whose weights are ``bits``) again, with a keyframe."""
        full = self._put_keyframe(version, bits, codec.shard_names(bits.specs, self.settings.shard_bytes))
        manifest = dataclasses.replace(self.published[version], full=full, published_at=time.time(), signature=None)
        self._put_manifest(manifest, self.lineage + KEYFRAME_ON_REQUEST)
        self.counters.add("keyframes_on_request")
        self.counters.add("published_bytes", manifest.nbytes("full"))
        logger.info("relay: a sampler asked for a keyframe: weight version %d published again with one", version)

    def _put_keyframe(self, version: int, bits: codec.WeightBits, groups: list[list[str]]) -> tuple[Shard, ...]:
        """Store ``version``'s full weights, one shard per group of tensor names."""
        shards = tuple(
            self._put_shard(codec.encode_full(bits, names), names, self.settings.keyframe_zstd_level)
            for names in groups
        )
        self._last_keyframe = version
        self.counters.add("keyframes")
        return shards

    def _put_manifest(self, manifest: Manifest, name_lineage: str) -> None:
        """Sign and store a manifest as ``manifests/<version>-<name_lineage>.json`` (after its shards), and record
        it as the version's newest publication."""
        signed = manifest.signed(self.secret)
        key = manifest_key(manifest.version, name_lineage)
        self.store.put(key, signed.to_json().encode())
        self.published[manifest.version] = signed
        self._manifest_keys[manifest.version].append(key)

    def _put_shard(self, pieces: codec.Pieces, names: list[str], level: int) -> Shard:
        """Store a shard under its sha256, hashed and written piece by piece (a keyframe is never copied whole)."""
        if level > 0:
            pieces = [codec.compress(b"".join(pieces), level)]
        sha = self.store.put_addressed(SHARDS, pieces)
        return Shard(sha256=sha, nbytes=pieces_nbytes(pieces), compressed=level > 0, tensors=tuple(names))

    def _prune(self) -> None:
        with self._cv:
            oldest_held = self._oldest_held
        keyframes = [v for v, m in self.published.items() if m.full is not None]
        if not keyframes:
            return
        keep_from = max(keyframes) if oldest_held is None else min(oldest_held, max(keyframes))
        doomed = [v for v in self.published if v < keep_from]
        if not doomed:
            return
        for version in doomed:  # manifests first: no reader can see a version whose shards are going
            del self.published[version]
            for key in self._manifest_keys.pop(version, []):
                self.store.delete(key)
            self.counters.add("versions_deleted")
        live = {s.sha256 for m in self.published.values() for part in (m.full, m.delta) for s in part or ()}
        for name in self.store.list(SHARDS):
            if name not in live and len(name) == 64:
                self.store.delete(shard_key(name))
