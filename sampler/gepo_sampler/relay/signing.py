"""Manifests signed with Ed25519: samplers verify with the learner's public key and never hold its signing key.

An HMAC secret (``hetero.relay.secret_env``) is shared: whoever verifies can also sign, which is right inside the
learner's cluster and wrong for a sampler rented from a stranger. With ``hetero.relay.signing_key_env`` the learner
signs every manifest with its Ed25519 private key (``cryptography``'s implementation) and every sampler verifies
with the public key alone (``hetero.relay.public_key``, or the sampler host's ``--public-key``). Keys are written as
the hex of their 32 raw bytes (no character a command line or Hydra reads specially); ``python -m gepo_plugin keygen``
makes a pair.
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat


class SigningKeyError(ValueError):
    """A key that cannot be read, or a private key that does not match the configured public key."""


def _raw(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(str(text).strip())
    except ValueError:
        raise SigningKeyError(f"{what} is not hexadecimal (the 32 raw bytes of an Ed25519 key, as hex)") from None
    if len(raw) != 32:
        raise SigningKeyError(f"{what} holds {len(raw)} bytes; an Ed25519 key is 32 (64 hex digits)")
    return raw


def public_key_text(key: Ed25519PublicKey) -> str:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


class Signer:
    """The learner's side: signs canonical manifest bytes."""

    def __init__(self, private_key: str) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(_raw(private_key, "the signing key"))
        self.public_key = public_key_text(self._key.public_key())

    @classmethod
    def from_env(cls, name: str) -> Signer:
        value = os.environ.get(name)
        if not value:
            raise SigningKeyError(
                f"hetero.relay.signing_key_env={name!r}: that environment variable is not set on this node; set it on "
                "the learner's node only (`python -m gepo_plugin keygen` makes a pair)"
            )
        return cls(value)

    def sign(self, payload: bytes) -> str:
        return base64.b64encode(self._key.sign(payload)).decode()


class Verifier:
    """A sampler's side: checks a signature with the public key."""

    def __init__(self, public_key: str) -> None:
        self.public_key = public_key.strip()
        self._key = Ed25519PublicKey.from_public_bytes(_raw(public_key, "the public key"))

    def verify(self, payload: bytes, signature: str) -> bool:
        try:
            self._key.verify(base64.b64decode(signature, validate=True), payload)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True


def generate_pair() -> tuple[str, str]:
    """A fresh ``(private key, public key)``, each the hex of its 32 raw bytes."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return private.hex(), public_key_text(key.public_key())
