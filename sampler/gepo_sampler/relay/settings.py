"""The relay's options (``hetero.relay.*``): one typed model, its defaults written once.

Credentials never go here: the store is reached with fsspec's and the cloud SDKs' own configuration (environment
variables, config files, instance roles), so nothing secret is printed by ``--cfg job`` or written to
``hetero.json``. The HMAC secret is read from the environment variable named by ``secret_env``.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field, StrictInt, field_validator, model_validator

from gepo_sampler.blocks import STRICT_BLOCK
from gepo_sampler.relay.link import LinkConfig
from gepo_sampler.relay.signing import Signer, SigningKeyError, Verifier

#: storage_options keys that carry credentials (refused: they would be printed and logged)
CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential", "session")


class RelayConfig(BaseModel):
    """How weights travel through the relay (``hetero.relay.*``; used with ``hetero.transport=relay``)."""

    model_config = STRICT_BLOCK

    url: str | None = Field(
        None,
        description="where the learner publishes and samplers pull: a directory shared by both, or any fsspec URL "
        "(s3://bucket/prefix, gs://..., az://...); needed with hetero.transport=relay",
    )
    run_id: str | None = Field(
        None,
        description="the run's id, under which its versions are stored and which every manifest carries (a sampler "
        "refuses another run's weights); null = trainer.project_name/trainer.experiment_name, stable across resumes",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options of the URL's protocol, e.g. {client_kwargs: {endpoint_url: http://host:9000}}; "
        "no credentials (use the protocol's environment variables or config files)",
    )
    secret_env: str | None = Field(
        None,
        description="name of an environment variable (set on the learner's and every sampler's node) holding a "
        "shared secret: manifests are then HMAC-signed and a sampler refuses one it cannot verify",
    )
    signing_key_env: str | None = Field(
        None,
        description="name of an environment variable, set on the learner's node only, holding its Ed25519 private key "
        "(hex; `python -m gepo_plugin keygen`): manifests are then signed, and samplers verify them with "
        "public_key alone (remote samplers need this: they are never given a shared secret)",
    )
    public_key: str | None = Field(
        None,
        description="the Ed25519 public key (hex) of signing_key_env: every sampler refuses a manifest without a "
        "valid signature by it; needed with signing_key_env",
    )
    keyframe_every: StrictInt = Field(
        10, ge=1, description="a full keyframe every this many versions (the others are exact sparse deltas only)"
    )
    shard_mb: float = Field(512.0, gt=0, allow_inf_nan=False, description="size of one stored shard in MiB")
    delta_zstd_level: StrictInt = Field(3, ge=1, le=22, description="zstd level of the deltas")
    keyframe_zstd_level: StrictInt = Field(
        0, ge=0, le=22, description="zstd level of keyframes; 0 = stored as is (bf16 weights compress little)"
    )
    poll_s: float = Field(0.5, gt=0, allow_inf_nan=False, description="seconds between a sampler's store checks")
    retry_attempts: StrictInt = Field(
        5, ge=1, description="attempts of one store operation (transient errors) before the outage budget takes over"
    )
    outage_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a store may stay unreachable before the run stops: meanwhile the learner keeps training "
        "and retries publishing with back-off (unpublished versions are coalesced), samplers keep retrying their "
        "pulls and lag within the staleness bound; a permanent error (no such bucket, access denied) stops at once",
    )
    links: list[LinkConfig] = Field(
        default_factory=list,
        description="per sampler group, a bandwidth limit and latency applied to its real transfers (to rehearse a "
        "deployment or test one); empty = no limit",
    )

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        def walk(value: Any, path: str) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    lowered = str(key).lower()
                    if any(word in lowered for word in CREDENTIAL_WORDS) and "endpoint" not in lowered:
                        raise ValueError(
                            f"{path}{key} looks like a credential: it would be printed by --cfg job and logged; set it "
                            "through the protocol's environment variables or config files instead"
                        )
                    walk(inner, f"{path}{key}.")

        walk(options, "")
        return options

    @model_validator(mode="after")
    def _key_pair(self) -> RelayConfig:
        if self.signing_key_env is not None and self.public_key is None:
            raise ValueError(
                "hetero.relay.signing_key_env needs hetero.relay.public_key (the samplers verify with it; "
                "`python -m gepo_plugin keygen` prints a pair)"
            )
        if self.public_key is not None:
            try:
                Verifier(self.public_key)
            except SigningKeyError as error:
                raise ValueError(f"hetero.relay.public_key: {error}") from None
        return self

    def signer(self) -> Signer | None:
        """The learner's signing key from the environment (None without ``signing_key_env``); it must match
        ``public_key``."""
        if self.signing_key_env is None:
            return None
        signer = Signer.from_env(self.signing_key_env)
        if signer.public_key != self.public_key:
            raise SigningKeyError(
                f"hetero.relay.signing_key_env={self.signing_key_env!r}: the key it holds is not the private key of "
                "hetero.relay.public_key "
                f"({self.public_key}); its public key is {signer.public_key}"
            )
        return signer

    def verifier(self) -> Verifier | None:
        """What every sampler checks manifests with (None without ``public_key``)."""
        return Verifier(self.public_key) if self.public_key is not None else None

    @property
    def shard_bytes(self) -> int:
        return max(1, int(self.shard_mb * (1 << 20)))

    def secret(self) -> bytes | None:
        """The shared secret from the environment (None without ``secret_env``)."""
        if self.secret_env is None:
            return None
        value = os.environ.get(self.secret_env)
        if not value:
            raise RuntimeError(
                f"hetero.relay.secret_env={self.secret_env!r}: that environment variable is not set on this node; "
                "set it on the learner's and every sampler's node"
            )
        return value.encode()
