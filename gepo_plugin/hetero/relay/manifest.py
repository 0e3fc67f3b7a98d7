"""What one published weight version is: its shards with their sha256, tied to its run, optionally HMAC-signed.

A manifest is written after all of its shards, so a version a sampler can see is complete. Every version past the
first of a publisher carries a ``delta`` part (against ``base``, the version published before it); the first and
every K-th carry a ``full`` part (a keyframe) as well, so a sampler following the chain never downloads a keyframe
and a new or far-behind one never replays a long chain. A delta applies only to weights of its ``lineage`` (one
publisher's life): after a resume, versions are numbered again from the checkpoint, and a sampler still holding the
abandoned future must take a keyframe instead of a delta that would silently give it wrong weights. A sampler
checks the run id, and with a shared secret the HMAC-SHA256 over the manifest's canonical JSON, before it reads a
shard.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from gepo_plugin.hetero.relay.codec import TensorSpec

FORMAT = 1
Part = Literal["full", "delta"]


class RelayAuthError(RuntimeError):
    """A manifest from another run, unsigned where a secret is configured, or with a signature that fails."""


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
    signature: str | None = field(default=None, compare=False)

    def part(self, which: Part) -> tuple[Shard, ...] | None:
        return self.full if which == "full" else self.delta

    def nbytes(self, which: Part) -> int:
        shards = self.part(which)
        return sum(s.nbytes for s in shards) if shards is not None else 0

    def to_json(self) -> str:
        return json.dumps(_plain(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") != FORMAT:
            raise ValueError(f"manifest format {raw.get('format')!r} is not {FORMAT}: written by another version")

        def shards(items: list[dict[str, Any]] | None) -> tuple[Shard, ...] | None:
            return None if items is None else tuple(Shard(**{**s, "tensors": tuple(s["tensors"])}) for s in items)

        return cls(
            run_id=raw["run_id"],
            version=int(raw["version"]),
            lineage=raw["lineage"],
            specs={n: TensorSpec(s["dtype"], tuple(s["shape"])) for n, s in raw["specs"].items()},
            full=shards(raw["full"]),
            delta=shards(raw["delta"]),
            base=raw["base"],
            changed=raw["changed"],
            published_at=float(raw["published_at"]),
            signature=raw["signature"],
        )

    def signed(self, secret: bytes | None) -> Manifest:
        """This manifest with its HMAC-SHA256 (unchanged without a secret)."""
        if secret is None:
            return self
        return Manifest(**{**self.__dict__, "signature": _mac(self, secret)})

    def verify(self, run_id: str, secret: bytes | None) -> None:
        """Refuse a manifest of another run, or (with a secret) one whose signature is missing or wrong."""
        if self.run_id != run_id:
            raise RelayAuthError(f"weight version {self.version} belongs to run {self.run_id!r}, not {run_id!r}")
        if secret is None:
            return
        if self.signature is None:
            raise RelayAuthError(f"weight version {self.version} is not signed, and hetero.relay has a secret")
        if not hmac.compare_digest(self.signature, _mac(self, secret)):
            raise RelayAuthError(f"weight version {self.version}: its signature does not verify with this secret")


def _plain(manifest: Manifest, with_signature: bool = True) -> dict[str, Any]:
    out = asdict(manifest)
    out["format"] = FORMAT
    out["specs"] = {n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in manifest.specs.items()}
    if not with_signature:
        out.pop("signature")
    return out


def _mac(manifest: Manifest, secret: bytes) -> str:
    canonical = json.dumps(_plain(manifest, with_signature=False), sort_keys=True).encode()
    return hmac.new(secret, canonical, hashlib.sha256).hexdigest()
