"""Which trajectories are audited, and the auditor's private randomness, from a secret the samplers never see.

A sampler that knew which of its trajectories would be audited could lie on the others, and one that knew the PIT's
``V`` could choose tokens whose transforms look uniform. Both come from a keyed hash (HMAC-SHA256) of the sampler's
name and the request id under a per-run secret held by the learner's side only: for the sampler they are
independent fair coins and uniforms, and for the auditor they are reproducible (the same request gets the same
decision after a restart, given the same secret).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np

_SCALE = float(2**64)


class AuditSelection:
    """Audit decisions and PIT uniforms, keyed by a secret (a fresh random one unless given)."""

    def __init__(self, fraction: float, secret: bytes | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction}: the audited share of trajectories must be in [0, 1]")
        self.fraction = fraction
        self.secret = secret if secret is not None else secrets.token_bytes(32)

    def _digest(self, purpose: str, sampler: str, request_id: str) -> bytes:
        message = f"{purpose}\0{sampler}\0{request_id}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def audited(self, sampler: str, request_id: str) -> bool:
        """Whether this trajectory is audited: a keyed coin with probability ``fraction``."""
        draw = int.from_bytes(self._digest("audit", sampler, request_id)[:8], "big") / _SCALE
        return draw < self.fraction

    def uniforms(self, sampler: str, request_id: str, count: int) -> np.ndarray:
        """The PIT's ``V`` for this trajectory's ``count`` tokens."""
        seed = int.from_bytes(self._digest("pit", sampler, request_id), "big")
        return np.random.default_rng(seed).random(count)
