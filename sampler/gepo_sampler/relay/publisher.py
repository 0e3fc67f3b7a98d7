"""The learner's side of the relay: each weight version published once, in the background, with bounded memory.

:meth:`RelayPublisher.publish` costs the learner one host copy of its weights; a background thread encodes and
uploads it. At most three host copies exist (the version published last, the one uploading, one waiting): when the
learner publishes faster than the store takes it, a waiting version is replaced by the newer one (counted as
``versions_coalesced``; samplers then skip it, and the next delta is against the version actually published).
Shards are content-addressed (``shards/<sha256>``), the manifest goes last, so a version a sampler can see is
complete; it carries a digest of every tensor of the version's full weights. A publisher that starts on a store
holding an earlier run's versions (a resume) discards any version newer than the one it resumes from and begins a
new lineage with a keyframe.

An outage does not end publishing. A publication that fails with a transient store error (a refused connection, a
timeout) is retried with back-off, by the background thread, for up to ``outage_s`` seconds from the first failure;
versions the learner publishes meanwhile replace the one waiting (coalesced and counted), training goes on, and the
samplers lag as they would behind a slow link (the staleness bound makes the learner wait for them). When the store
answers again, the newest version is published and the outage ends. Past the budget, or at once for a permanent
error (no such bucket, access denied), the next :meth:`RelayPublisher.publish` or :meth:`RelayPublisher.check`
raises with the URL, the operation and the fix. A keyframe a sampler asks for
(:meth:`RelayPublisher.request_keyframe`: a stored shard stays corrupt, or a result failed its digest) is published
at once: the version published last gets a full keyframe beside its delta, under a further manifest of the same
version and lineage (``<version>-<lineage>.k<n>.json``; a puller takes a version's newest manifest). The shard
addresses the sampler reported corrupt are written again even where an object exists (an object store would
otherwise keep the bad bytes for every later version that reuses the address), and the manifest names them
(``rewritten``). Waiting for the next version could wait for ever: the learner may itself be waiting for that
sampler's rollouts. The same request (version, addresses) is answered once. Retention: :meth:`RelayPublisher.hold`
tells it the oldest version a live sampler group holds. Versions no sampler can still need are deleted with the
shards only they use: those older than both the oldest held version and the newest keyframe; and, whatever a sampler
holds, those more than ``keyframe_every`` versions older than the newest keyframe (a sampler that far behind is
served that keyframe). So the store keeps at most the versions from ``newest keyframe - keyframe_every`` to the
newest, fewer than ``2 x keyframe_every``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping

import torch

from gepo_sampler.relay import codec
from gepo_sampler.relay.manifest import (
    KEYFRAME_ON_REQUEST,
    MANIFESTS,
    SHARDS,
    Manifest,
    ManifestFormatError,
    Shard,
    manifest_key,
    parse_manifest_name,
    shard_key,
)
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.signing import Signer
from gepo_sampler.relay.store import RelayStore, RelayStoreError, pieces_nbytes

logger = logging.getLogger(__name__)
#: Longest pause between two attempts to publish during an outage.
MAX_OUTAGE_BACKOFF_S = 30.0


class RelayPublisher:
    """Publishes a learner's weight versions to one run's store."""

    def __init__(
        self,
        store: RelayStore,
        run_id: str,
        settings: RelayConfig,
        secret: bytes | None = None,
        resume_from: int | None = None,
        clock=time.monotonic,
        signer: Signer | None = None,
    ) -> None:
        self.store, self.run_id, self.settings, self.secret = store, run_id, settings, secret
        #: signs every manifest with the learner's Ed25519 key (samplers verify with the public key only)
        self.signer = signer
        self.counters = store.counters
        self.clock = clock
        self.lineage = uuid.uuid4().hex
        self.published: dict[int, Manifest] = {}
        #: every manifest object of a version (its first publication, and those adding a requested keyframe)
        self._manifest_keys: dict[int, list[str]] = {}
        self._load_existing(resume_from)
        self._encoder = codec.DeltaEncoder()
        self._previous: codec.WeightBits | None = None
        self._previous_version: int | None = None
        self._previous_digests: dict[str, str] = {}
        self._last_keyframe: int | None = None
        #: a sampler's request not answered yet: the shard addresses it found corrupt
        self._requested: frozenset[str] | None = None
        self._answered: set[tuple[int, frozenset[str]]] = set()
        self._oldest_held: int | None = None
        self._pending: tuple[int, codec.WeightBits] | None = None
        self._busy = False
        self._outage_since: float | None = None
        self._outage_failures = 0
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
                if KEYFRAME_ON_REQUEST not in lineage:
                    self.counters.add("versions_discarded")
                continue
            try:
                manifest = Manifest.from_json(self.store.get(key))
            except ManifestFormatError as error:
                self.counters.add("manifests_refused")
                logger.error("relay: ignoring weight version %d (%s in %s): %s", version, key, self.store.url, error)
                continue
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
        self.check()
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

    def request_keyframe(self, corrupt: Iterable[str] = ()) -> None:
        """A sampler needs a keyframe (``corrupt``: the shard addresses it found corrupt): publish one now (the
        version published last gets one), or with the next version if none is published yet or one is queued."""
        with self._cv:
            self._requested = (self._requested or frozenset()) | frozenset(corrupt)
            self._cv.notify_all()

    def _keyframe_due_now(self) -> bool:
        """A keyframe was asked for, no newer version is queued, and this request was not answered yet."""
        if self._requested is None or self._pending is not None or self._previous_version is None:
            return False
        return (self._previous_version, self._requested) not in self._answered

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
                self._cv.wait(remaining if remaining is not None else 1.0)
        self.check()

    @property
    def in_outage(self) -> bool:
        return self._outage_since is not None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def check(self) -> None:
        """Raise the failure that ended publishing (past the outage budget, or a permanent store error)."""
        if self._error is not None:
            raise RuntimeError(f"publishing weights to {self.store.url} failed: {self._error}") from self._error

    # ------------------------------------------------------------------ the background thread
    def _next_work(self):
        """(work, version, bits) to do next, taken off the queue, or None when closed (holds the condition)."""
        while self._pending is None and not self._closed and not self._keyframe_due_now():
            self._cv.wait()
        if self._keyframe_due_now():
            return self._add_keyframe, self._previous_version, self._previous
        if self._pending is not None:
            (version, bits), self._pending = self._pending, None
            return self._publish_now, version, bits
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                work = self._next_work()
                if work is None:
                    return
                self._busy = True
            action, version, bits = work
            try:
                action(version, bits)
                self._end_outage()
                self._prune()
            except RelayStoreError as error:
                self._requeue(action, version, bits)
                if not self._ride_out(error, version):
                    return
            except BaseException as error:  # surfaced to the learner at its next publish or check
                self._fail(error, version)
                return
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _requeue(self, action, version: int, bits: codec.WeightBits) -> None:
        """A publication that failed waits for the next attempt, unless the learner queued a newer version."""
        if action != self._publish_now:
            return  # a keyframe on request: still requested, tried again
        with self._cv:
            if self._pending is None:
                self._pending = (version, bits)
            else:
                self.counters.add("versions_coalesced")

    def _end_outage(self) -> None:
        if self._outage_since is None:
            return
        lasted = self.clock() - self._outage_since
        self.counters.add("outage_s", lasted)
        logger.warning("relay: the store %s answers again after %.0f s; publishing resumed", self.store.url, lasted)
        self._outage_since, self._outage_failures = None, 0

    def _ride_out(self, error: RelayStoreError, version: int) -> bool:
        """A store error while publishing: wait and retry inside the outage budget (True), or end (False)."""
        now = self.clock()
        if self._outage_since is None:
            self._outage_since, self._outage_failures = now, 0
        self._outage_failures += 1
        self.counters.add("publish_failures")
        lasted = now - self._outage_since
        if error.permanent or lasted >= self.settings.outage_s:
            budget = f"hetero.relay.outage_s={self.settings.outage_s:g}"
            reason = (
                "a permanent error" if error.permanent else f"the store failed for {lasted:.0f} s, longer than {budget}"
            )
            self._fail(
                RelayStoreError(
                    f"{reason}: {error}. Fix: restore access to {self.store.url} (or raise hetero.relay.outage_s to "
                    "ride out longer outages), then resume the run from its last checkpoint",
                    permanent=error.permanent,
                ),
                version,
            )
            return False
        delay = min(
            self.store.retry.first_delay_s * 2**self._outage_failures,
            MAX_OUTAGE_BACKOFF_S,
            self.settings.outage_s - lasted,
        )
        logger.warning(
            "relay: publishing weight version %d to %s failed (%s); the store is out for %.0f s of the "
            "hetero.relay.outage_s=%g budget; retrying in %.1f s (training goes on, samplers wait)",
            version,
            self.store.url,
            error,
            lasted,
            self.settings.outage_s,
            delay,
        )
        with self._cv:
            self._cv.wait_for(lambda: self._closed, timeout=max(delay, 0.0))
        return not self._closed

    def _fail(self, error: BaseException, version: int) -> None:
        logger.error("relay: publishing weight version %d failed: %s", version, error)
        self._error = error

    def _publish_now(self, version: int, bits: codec.WeightBits) -> None:
        started = time.perf_counter()
        previous = self._previous
        with self._cv:
            requested = self._requested
        has_delta = previous is not None and previous.specs == bits.specs
        full = (
            not has_delta
            or requested is not None
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
        digests = bits.digests()
        rewrite = requested or frozenset()
        manifest = Manifest(
            run_id=self.run_id,
            version=version,
            lineage=self.lineage,
            specs=dict(bits.specs),
            full=self._put_keyframe(bits, groups, rewrite) if full else None,
            delta=tuple(delta_shards) if delta_shards is not None else None,
            base=self._previous_version if has_delta else None,
            changed=changed,
            published_at=time.time(),
            digests=digests,
            rewritten=tuple(sorted(rewrite)) if full else (),
        )
        self._manifest_keys[version] = []
        self._put_manifest(manifest, self.lineage)
        if full:
            self._last_keyframe = version
            with self._cv:
                if self._requested is not None and self._requested <= rewrite:
                    self._answered.add((version, self._requested))
                    self._requested = None
        self._previous, self._previous_version, self._previous_digests = bits, version, digests
        self.counters.add("versions_published")
        self.counters.add("publish_s", time.perf_counter() - started)
        self.counters.add("published_bytes", manifest.nbytes("full") + manifest.nbytes("delta"))

    def _add_keyframe(self, version: int, bits: codec.WeightBits) -> None:
        """Publish version ``version`` (the one published last, whose weights are ``bits``) again, with a keyframe
        whose shards the sampler reported corrupt are written again."""
        with self._cv:
            rewrite = self._requested or frozenset()
        full = self._put_keyframe(bits, codec.shard_names(bits.specs, self.settings.shard_bytes), rewrite)
        manifest = dataclasses.replace(
            self.published[version],
            full=full,
            published_at=time.time(),
            rewritten=tuple(sorted(rewrite)),
            signature=None,
        )
        self._last_keyframe = version
        self._put_manifest(manifest, f"{self.lineage}{KEYFRAME_ON_REQUEST}{len(self._manifest_keys[version])}")
        with self._cv:
            self._answered.add((version, rewrite))
            if self._requested is not None and self._requested <= rewrite:
                self._requested = None
        self.counters.add("keyframes_on_request")
        self.counters.add("published_bytes", manifest.nbytes("full"))
        logger.info(
            "relay: a sampler asked for a keyframe: weight version %d published again with one (%d corrupt shard "
            "address(es) rewritten)",
            version,
            len(rewrite),
        )

    def _put_keyframe(
        self, bits: codec.WeightBits, groups: list[list[str]], rewrite: frozenset[str]
    ) -> tuple[Shard, ...]:
        """Store a version's full weights, one shard per group of tensor names."""
        shards = tuple(
            self._put_shard(codec.encode_full(bits, names), names, self.settings.keyframe_zstd_level, rewrite)
            for names in groups
        )
        self.counters.add("keyframes")
        return shards

    def _put_manifest(self, manifest: Manifest, name_lineage: str) -> None:
        """Sign and store a manifest as ``manifests/<version>-<name_lineage>.json`` (after its shards), and record
        it as the version's newest publication."""
        signed = manifest.signed(self.secret, self.signer)
        key = manifest_key(manifest.version, name_lineage)
        self.store.put(key, signed.to_json().encode())
        self.published[manifest.version] = signed
        self._manifest_keys[manifest.version].append(key)

    def _put_shard(
        self, pieces: codec.Pieces, names: list[str], level: int, rewrite: frozenset[str] = frozenset()
    ) -> Shard:
        """Store a shard under its sha256, hashed and written piece by piece (a keyframe is never copied whole)."""
        if level > 0:
            pieces = [codec.compress(b"".join(pieces), level)]
        sha = self.store.put_addressed(SHARDS, pieces, rewrite)
        return Shard(sha256=sha, nbytes=pieces_nbytes(pieces), compressed=level > 0, tensors=tuple(names))

    def _prune(self) -> None:
        """Delete what no sampler can need (see the module docstring); a store error here is retried after the
        next publication (a permanent one ends publishing like any other)."""
        with self._cv:
            oldest_held = self._oldest_held
        keyframes = [v for v, m in self.published.items() if m.full is not None]
        if not keyframes:
            return
        newest_keyframe = max(keyframes)
        keep_from = newest_keyframe if oldest_held is None else min(oldest_held, newest_keyframe)
        keep_from = max(keep_from, newest_keyframe - self.settings.keyframe_every)
        doomed = [v for v in self.published if v < keep_from]
        if not doomed:
            return
        try:
            for version in doomed:  # manifests first: no reader can see a version whose shards are going
                for key in list(self._manifest_keys.get(version, [])):
                    self.store.delete(key)
                    self._manifest_keys[version].remove(key)
                del self.published[version]
                self._manifest_keys.pop(version, None)
                self.counters.add("versions_deleted")
            live = {s.sha256 for m in self.published.values() for part in (m.full, m.delta) for s in part or ()}
            for name in self.store.list(SHARDS):
                if name not in live and len(name) == 64:
                    self.store.delete(shard_key(name))
        except RelayStoreError as error:
            if error.permanent:
                raise
            logger.warning(
                "relay: deleting old weight versions from %s failed (%s); retried later", self.store.url, error
            )
