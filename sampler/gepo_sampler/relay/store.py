"""The relay's store behind a URL (a directory, ``s3://``, ``gs://``, any fsspec protocol), retried and counted.

Credentials come only from fsspec's and the cloud SDKs' own configuration (environment, config files, instance
roles) or the ``storage_options`` handed in; nothing here logs them. A transient error (a refused or dropped
connection, a timeout, a throttled request) is retried with exponential back-off and counted; one that keeps failing
raises :class:`RelayStoreError` naming the URL, the operation and the object. A permanent error (no such bucket,
access denied, a file where a directory must be) is not retried: it raises at once with the fix
(``RelayStoreError.permanent``). Riding out a longer outage is the caller's decision (the publisher's and the
follower's outage budget, ``hetero.relay.outage_s``). Writes are atomic where the protocol is not (a local or
shared directory: write, then rename), so a reader never sees half an object. Reads go through a
:class:`~gepo_sampler.relay.link.Link` in chunks and resume from the last chunk received after an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec

from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.settings import RelayConfig

T = TypeVar("T")
logger = logging.getLogger(__name__)
_CHUNK = 4 << 20


class RelayStoreError(RuntimeError):
    """The store failed an operation after every retry (or cannot be used at all); says which and how to fix it.

    ``permanent``: retrying cannot help (no such bucket, access denied, a file where a directory must be), so the
    operation was tried once and the message says what to change.
    """

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


#: Errors no retry can cure: the store refuses this caller or the path cannot exist as asked.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
)
#: The fix of a permanent error, by the error's kind.
_PERMANENT_FIX = {
    PermissionError: "give this node's credentials the right to read, write, list and delete under the URL",
    NotADirectoryError: "a file stands where the store needs a directory: move it or correct the URL",
    IsADirectoryError: "a directory stands where the store needs an object: remove it or correct the URL",
    FileExistsError: "a file stands where the store needs a directory: move it or correct the URL",
    FileNotFoundError: "create the bucket (or directory) first, or correct the URL",
}


def is_permanent(error: BaseException, operation: str) -> bool:
    """No retry can cure ``error`` of ``operation``: refused access, a path of the wrong kind, or a write to a
    bucket or directory that does not exist (a missing object on a read is the caller's business, not an error)."""
    return isinstance(error, PERMANENT_ERRORS) or (operation == "write" and isinstance(error, FileNotFoundError))


@dataclass
class RelayCounters:
    """What the relay did and what went wrong (named ``hetero/relay/*`` by the verl glue). Thread-safe increments."""

    counts: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + amount

    def get(self, name: str) -> float:
        with self._lock:
            return self.counts.get(name, 0)

    def metrics(self) -> dict[str, float]:
        """The counters by (unprefixed) name."""
        with self._lock:
            return {name: float(value) for name, value in sorted(self.counts.items())}


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and exponential back-off of one store operation."""

    attempts: int = 5
    first_delay_s: float = 0.2
    max_delay_s: float = 10.0


class RelayStore:
    """One run's objects under ``url``; thread-safe (fsspec filesystems are)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy = RetryPolicy(),
        counters: RelayCounters | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ImportError, ValueError) as error:
            raise RelayStoreError(
                f"hetero.relay.url={url!r} cannot be opened: {error}. Fix: install the fsspec driver of its protocol "
                "(s3fs for s3://, gcsfs for gs://, adlfs for az://) or correct the URL"
            ) from error
        self.root = self.root.rstrip("/")
        self.retry = retry
        self.counters = counters if counters is not None else RelayCounters()
        self._local = "file" in _protocols(self.fs)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _retried(self, operation: str, key: str, call: Callable[[], T]) -> T:
        delay = self.retry.first_delay_s
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return call()
            except Exception as error:  # a transient error is retried, then reported with the URL
                if is_permanent(error, operation):
                    self.counters.add("store_errors")
                    fix = next(fix for kind, fix in _PERMANENT_FIX.items() if isinstance(error, kind))
                    raise RelayStoreError(
                        f"relay store {self.url}: {operation} {key!r} failed ({type(error).__name__}: {error}); not "
                        f"retried, it cannot succeed as things stand. Fix: {fix}",
                        permanent=True,
                    ) from error
                if isinstance(error, FileNotFoundError):
                    raise  # a missing object: the caller decides (deleted by retention, a version not there yet)
                self.counters.add("store_errors")
                if attempt == self.retry.attempts:
                    raise RelayStoreError(
                        f"relay store {self.url}: {operation} {key!r} failed {attempt} times, last: "
                        f"{type(error).__name__}: {error}"
                    ) from error
                self.counters.add("retries")
                logger.warning(
                    "relay store %s: %s %s failed (%s), retrying in %.1f s", self.url, operation, key, error, delay
                )
                time.sleep(delay)
                delay = min(delay * 2, self.retry.max_delay_s)
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` so that no reader sees it half-written."""
        self.put_pieces(key, [data])

    def put_pieces(self, key: str, pieces: Sequence[bytes | memoryview]) -> None:
        """Write the concatenation of ``pieces`` at ``key`` without assembling it in memory; no reader sees it
        half-written (a directory: a partial file renamed; an object store: an upload that completes on close)."""

        def write() -> None:
            target = self.path(key)
            if self._local:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                partial = f"{target}.partial-{uuid.uuid4().hex}"
                _write_pieces(self.fs, partial, pieces)
                self.fs.mv(partial, target)
            else:
                _write_pieces(self.fs, target, pieces)

        self._retried("write", key, write)
        self.counters.add("bytes_written", pieces_nbytes(pieces))

    def put_addressed(
        self, directory: str, pieces: Sequence[bytes | memoryview], rewrite: frozenset[str] = frozenset()
    ) -> str:
        """Store the concatenation of ``pieces`` as ``directory/<its sha256>``; returns the sha256.

        On a directory the file is written while another thread hashes the same memory (both release the GIL), then
        renamed to its hash, replacing what was there: a keyframe costs about one pass of the slower of the two, not
        their sum. Elsewhere the hash comes first (an object's name is fixed when its upload starts), and an object
        already at that address is trusted, and not uploaded again, only when its size matches and its address is not
        in ``rewrite`` (addresses a sampler found corrupt: an object store would otherwise keep the bad bytes for
        every later version that reuses the address)."""
        if not self._local:
            sha = _sha256(pieces)
            key = f"{directory}/{sha}"
            if sha in rewrite or self.size(key) != pieces_nbytes(pieces):
                self.put_pieces(key, pieces)
                if sha in rewrite:
                    self.counters.add("shards_rewritten")
            return sha
        folder = self.path(directory)
        partial = f"{folder}/.partial-{uuid.uuid4().hex}"
        hashed: list[str] = []
        hasher = threading.Thread(target=lambda: hashed.append(_sha256(pieces)), name="relay-hash", daemon=True)
        hasher.start()
        try:

            def write() -> None:
                self.fs.makedirs(folder, exist_ok=True)
                _write_pieces(self.fs, partial, pieces)

            self._retried("write", directory, write)
        finally:
            hasher.join()
        sha = hashed[0]
        self._retried("write", f"{directory}/{sha}", lambda: self.fs.mv(partial, f"{folder}/{sha}"))
        self.counters.add("bytes_written", pieces_nbytes(pieces))
        return sha

    def get(self, key: str, link: Link | None = None) -> bytes:
        """Read ``key`` through ``link``, resuming after an error from the bytes already received."""
        link = link if link is not None else Link(LinkConfig())
        received = bytearray()

        def read() -> bytes:
            link.request()
            with self.fs.open(self.path(key), "rb") as handle:
                if received:
                    handle.seek(len(received))
                while chunk := handle.read(_CHUNK):
                    link.transfer(len(chunk))
                    received.extend(chunk)
            return bytes(received)

        data = self._retried("read", key, read)
        self.counters.add("reads")
        self.counters.add("bytes_read", len(data))
        return data

    def exists(self, key: str) -> bool:
        return self._retried("stat", key, lambda: self.fs.exists(self.path(key)))

    def size(self, key: str) -> int | None:
        """The stored object's size in bytes (None: there is none)."""

        def stat() -> int | None:
            try:
                return int(self.fs.info(self.path(key))["size"])
            except FileNotFoundError:
                return None

        return self._retried("stat", key, stat)

    def list(self, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (empty if there is none)."""

        def listing() -> list[str]:
            self.fs.invalidate_cache(self.path(prefix))
            try:
                names = self.fs.ls(self.path(prefix), detail=False)
            except FileNotFoundError:
                return []
            return sorted(name.rstrip("/").rsplit("/", 1)[-1] for name in names)

        self.counters.add("lists")
        return self._retried("list", prefix, listing)

    def delete(self, key: str) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(key))

        self._retried("delete", key, remove)
        self.counters.add("objects_deleted")

    def probe(self, write: bool = True) -> None:
        """Write, read back and delete one object (``write``), or list the store (a sampler, which only reads): a
        store that cannot do it stops the run now, with the URL and the fix.

        The read-only probe lists the run's prefix (empty is fine: the learner may not have published yet) and
        requires the bucket, or on a directory store the directory itself, to exist: listing a bucket that does not
        exist reads as empty on some protocols, and a sampler would then wait for ever for a first version."""
        key = f"_probe/{uuid.uuid4().hex}"
        payload = b"gepo-plugin relay probe"
        back = payload
        try:
            if write:
                self.put(key, payload)
                back = self.get(key)
                self.delete(key)
            else:
                self._retried("list", "", self._list_root_and_check_container)
        except Exception as error:
            raise RelayStoreError(
                f"hetero.relay.url={self.url!r} is not usable{'' if write else ' from a sampler'}: {error}. Fix: check "
                "the URL, that the bucket or directory exists and is "
                f"{'writable' if write else 'readable'} from here, and the credentials of its protocol (for s3:// the "
                "usual AWS environment or config files; an endpoint through hetero.relay.storage_options)",
                permanent=not isinstance(error, RelayStoreError) or error.permanent,
            ) from error
        if back != payload:
            raise RelayStoreError(f"hetero.relay.url={self.url!r} returned different bytes than were written to it")

    def _list_root_and_check_container(self) -> None:
        try:
            self.fs.ls(self.root, detail=False)
            return
        except FileNotFoundError:
            pass
        if self._local:
            raise FileNotFoundError(f"the directory {self.root} does not exist on this node (is the share mounted?)")
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.info(bucket)  # a bucket's HEAD: missing -> FileNotFoundError, refused -> PermissionError
        except FileNotFoundError:
            raise FileNotFoundError(f"the bucket {bucket!r} does not exist") from None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def pieces_nbytes(pieces: Sequence[bytes | memoryview]) -> int:
    """The size of the object the pieces make."""
    return sum(memoryview(piece).nbytes for piece in pieces)


def _sha256(pieces: Sequence[bytes | memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def _write_pieces(fs: fsspec.AbstractFileSystem, path: str, pieces: Sequence[bytes | memoryview]) -> None:
    with fs.open(path, "wb") as handle:
        for piece in pieces:
            handle.write(piece)


def open_store(config: RelayConfig) -> RelayStore:
    """The run's store as ``hetero.relay`` names it: ``url/run_id``, with its storage options and retries."""
    return RelayStore(
        f"{config.url.rstrip('/')}/{config.run_id}",
        dict(config.storage_options),
        retry=RetryPolicy(attempts=config.retry_attempts),
    )
