"""What one published weight version is: its shards with their sha256, tied to its run, optionally HMAC-signed.

A manifest is written after all of its shards, so a version a sampler can see is complete. Every version past the
first of a publisher carries a ``delta`` part (against ``base``, the version published before it); the first and
every K-th carry a ``full`` part (a keyframe) as well, so a sampler following the chain never downloads a keyframe
and a new or far-behind one never replays a long chain. A delta applies only to weights of its ``lineage`` (one
publisher's life): after a resume, versions are numbered again from the checkpoint, and a sampler still holding the
abandoned future must take a keyframe instead of a delta that would silently give it wrong weights. A sampler
checks the run id, and with a shared secret the HMAC-SHA256 over the manifest's canonical JSON, with the learner's
public key its Ed25519 signature (:mod:`gepo_sampler.relay.signing`), before it reads a shard.

Every manifest also carries a digest (xxHash3, 128 bits) of each tensor's bits in the version's full weights: a
sampler checks the weights it is about to install against them, so a codec or apply bug, or a shard that is
intact but of the wrong content, is caught before anything is installed, whatever path the weights took. A version
published again with a keyframe a sampler asked for names the shard addresses it rewrote (``rewritten``): a sampler
that found them corrupt may trust them again.

The store's layout is named here, for the writer and every reader: ``manifests/<version>-<lineage>.json`` (and
``<version>-<lineage>.k<n>.json`` for a version published again with a keyframe on request), ``shards/<sha256>``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from gepo_sampler.relay.codec import TensorSpec
from gepo_sampler.relay.signing import Signer, Verifier

FORMAT = 2
Part = Literal["full", "delta"]
MANIFESTS, SHARDS = "manifests", "shards"
#: The lineage suffix in the name of a version's further manifests, those that add a requested keyframe
#: (``.k1``, ``.k2``, ...: every answer to a request is a new object, which a sampler reads as new).
KEYFRAME_ON_REQUEST = ".k"


def manifest_key(version: int, lineage: str) -> str:
    """A version's manifest; the lineage in the name makes a resumed run's version a new object."""
    return f"{MANIFESTS}/{version:010d}-{lineage}.json"


def shard_key(sha256: str) -> str:
    return f"{SHARDS}/{sha256}"


def parse_manifest_name(name: str) -> tuple[int, str] | None:
    """(version, lineage as named: with its keyframe-on-request suffix) of a manifest's file name; None for
    anything else."""
    version, _, lineage = name.removesuffix(".json").partition("-")
    return (int(version), lineage) if name.endswith(".json") and version.isdigit() and lineage else None


class RelayAuthError(RuntimeError):
    """A manifest from another run, unsigned where a secret is configured, or with a signature that fails."""


class ManifestFormatError(ValueError):
    """A manifest that cannot be read as one: not JSON, truncated, fields missing or of the wrong kind, or another
    format."""


@dataclass(frozen=True)
class Shard:
    """One stored object: its content address (sha256 of the stored bytes), size, compression, tensors."""

    sha256: str
    nbytes: int
    compressed: bool
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """One weight version as published."""

    run_id: str
    version: int
    lineage: str
    specs: dict[str, TensorSpec]
    full: tuple[Shard, ...] | None = None
    delta: tuple[Shard, ...] | None = None
    base: int | None = None
    changed: int | None = None
    published_at: float = 0.0
    #: per tensor, xxHash3-128 (hex) of its bits in this version's full weights
    digests: dict[str, str] = field(default_factory=dict)
    #: shard addresses this publication wrote again because a sampler found them corrupt
    rewritten: tuple[str, ...] = ()
    signature: str | None = field(default=None, compare=False)
    #: Ed25519 signature (base64) by the learner's signing key, verified with its public key (:mod:`.signing`)
    ed25519: str | None = field(default=None, compare=False)

    def part(self, which: Part) -> tuple[Shard, ...] | None:
        return self.full if which == "full" else self.delta

    def nbytes(self, which: Part) -> int:
        shards = self.part(which)
        return sum(s.nbytes for s in shards) if shards is not None else 0

    def to_json(self) -> str:
        return json.dumps(_plain(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest; anything that is not one (not JSON, truncated, a field missing or of the wrong kind,
        another format) raises :class:`ManifestFormatError`."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ManifestFormatError(f"not valid JSON ({error})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ManifestFormatError(f"manifest format {found!r} is not {FORMAT}: written by another version")

        def shards(items: list[dict[str, Any]] | None) -> tuple[Shard, ...] | None:
            return None if items is None else tuple(Shard(**{**s, "tensors": tuple(s["tensors"])}) for s in items)

        try:
            return cls(
                run_id=str(raw["run_id"]),
                version=int(raw["version"]),
                lineage=str(raw["lineage"]),
                specs={
                    n: TensorSpec(str(s["dtype"]), tuple(int(d) for d in s["shape"])) for n, s in raw["specs"].items()
                },
                full=shards(raw["full"]),
                delta=shards(raw["delta"]),
                base=raw["base"],
                changed=raw["changed"],
                published_at=float(raw["published_at"]),
                digests={str(n): str(d) for n, d in raw["digests"].items()},
                rewritten=tuple(str(a) for a in raw["rewritten"]),
                signature=raw["signature"],
                ed25519=raw.get("ed25519"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ManifestFormatError(f"a field is missing or malformed ({type(error).__name__}: {error})") from None

    def signed(self, secret: bytes | None, signer: Signer | None = None) -> Manifest:
        """This manifest with its HMAC-SHA256 (with a secret) and its Ed25519 signature (with a signer)."""
        changes = {}
        if secret is not None:
            changes["signature"] = _mac(self, secret)
        if signer is not None:
            changes["ed25519"] = signer.sign(_canonical(self))
        return Manifest(**{**self.__dict__, **changes}) if changes else self

    def verify(self, run_id: str, secret: bytes | None, verifier: Verifier | None = None) -> None:
        """Refuse a manifest of another run, or one whose HMAC (with a secret) or Ed25519 signature (with a verifier)
        is missing or wrong."""
        if self.run_id != run_id:
            raise RelayAuthError(f"weight version {self.version} belongs to run {self.run_id!r}, not {run_id!r}")
        if secret is not None:
            if self.signature is None:
                raise RelayAuthError(f"weight version {self.version} is not signed, and hetero.relay has a secret")
            if not hmac.compare_digest(self.signature, _mac(self, secret)):
                raise RelayAuthError(f"weight version {self.version}: its signature does not verify with this secret")
        if verifier is not None:
            if self.ed25519 is None:
                raise RelayAuthError(f"weight version {self.version} has no Ed25519 signature, and one is required")
            if not verifier.verify(_canonical(self), self.ed25519):
                raise RelayAuthError(
                    f"weight version {self.version}: its Ed25519 signature does not verify with the learner's public "
                    f"key {verifier.public_key}"
                )


def _plain(manifest: Manifest, with_signature: bool = True) -> dict[str, Any]:
    out = asdict(manifest)
    out["format"] = FORMAT
    out["specs"] = {n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in manifest.specs.items()}
    if not with_signature:
        out.pop("signature")
        out.pop("ed25519")
    return out


def _canonical(manifest: Manifest) -> bytes:
    """What both signatures cover: the manifest's JSON without its signatures, keys sorted."""
    return json.dumps(_plain(manifest, with_signature=False), sort_keys=True).encode()


def _mac(manifest: Manifest, secret: bytes) -> str:
    return hmac.new(secret, _canonical(manifest), hashlib.sha256).hexdigest()
