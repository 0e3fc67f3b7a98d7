"""Remote samplers' options (``hetero.remote_samplers``, ``hetero.gateway``): typed models, defaults written once.

Tokens never go into the config: each entry names the environment variable that holds its sampler's bearer token
(set on the learner's node), so nothing secret is printed by ``--cfg job`` or written to a checkpoint.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, Field, StrictInt, model_validator

from gepo_sampler.blocks import STRICT_BLOCK
from gepo_sampler.relay.link import LinkConfig

#: What a sampler's name may be: it appears in URLs, metric names and logs.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
#: :data:`NAME_PATTERN` in words, for messages and ``--help``
NAME_RULE = "letters, digits, '_', '.' and '-', starting with a letter or digit, at most 63 characters"
#: The smallest token accepted: a guessable token is no authentication.
MIN_TOKEN_CHARS = 16


class RemoteSamplerConfig(BaseModel):
    """One sampler outside the learner's cluster (an entry of ``hetero.remote_samplers``)."""

    model_config = STRICT_BLOCK

    name: str = Field(
        ...,
        pattern=NAME_PATTERN,
        description="the sampler's name: the host runs `python -m gepo_sampler --name <name> ...`; letters, "
        "digits, '_', '.', '-'",
    )
    token_env: str = Field(
        ...,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of the environment variable holding this sampler's bearer token (at least "
        f"{MIN_TOKEN_CHARS} characters; the sampler host is given the same token), set on the learner's node before "
        "Ray starts there (the environment of `ray start`, or of the launcher for a local cluster)",
    )
    group: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="the sampler group it belongs to (remote samplers with one label form one group, after the "
        "in-cluster groups); null = a group of its own, named after the sampler",
    )
    link: LinkConfig | None = Field(
        None,
        description="a bandwidth limit and latency its host applies to its pulls from the store (to rehearse a WAN "
        "link); null = its real link only",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_url(cls, given: object) -> object:
        """The learner never dials a sampler (many sit behind NAT): say so instead of "unknown option"."""
        if isinstance(given, dict) and "url" in given:
            raise ValueError(
                "url: the learner does not dial remote samplers; the sampler host dials the learner's gateway "
                "(`python -m gepo_sampler --gateway https://<learner>:<hetero.gateway.port> ...`), so it "
                "needs no open port. Remove url and give the host the gateway's address"
            )
        return given

    def token(self) -> str:
        """The bearer token from the environment; raises ``RuntimeError`` naming the variable if it is unusable."""
        value = os.environ.get(self.token_env, "")
        if len(value) < MIN_TOKEN_CHARS:
            state = "is not set" if not value else f"holds {len(value)} characters"
            raise RuntimeError(
                f"remote sampler {self.name!r}: the environment variable {self.token_env} {state}; set it on the "
                f"learner's node to a random token of at least {MIN_TOKEN_CHARS} characters (e.g. "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`) and give the sampler host the same"
            )
        return value

    @property
    def group_label(self) -> str:
        return self.group or self.name


class GatewayConfig(BaseModel):
    """The one endpoint of the learner's side that remote samplers dial (``hetero.gateway.*``)."""

    model_config = STRICT_BLOCK

    host: str = Field(
        "0.0.0.0", min_length=1, description="address the gateway listens on (on the node of verl's TaskRunner)"
    )
    port: StrictInt = Field(8471, ge=1, le=65535, description="TCP port the gateway listens on")
    certfile: str | None = Field(
        None, description="PEM certificate chain: the gateway speaks HTTPS (set with keyfile); null = plain HTTP"
    )
    keyfile: str | None = Field(None, description="PEM private key of certfile")
    max_body_mb: float = Field(
        16.0, gt=0, allow_inf_nan=False, description="largest request or response body in MiB; larger ones are refused"
    )
    poll_wait_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a sampler's long poll waits for work before it returns empty (the sampler then polls "
        "again)",
    )
    sampler_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="a sampler not heard from for this long (no poll, no result) is lost: its requests fail and it is "
        "retired; when it dials again it rejoins",
    )
    idle_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="a connection that sends nothing for this long is closed: one idle between calls, one that never "
        "sends a call, and one whose call stops half sent (its headers; its body gets 408); a long poll the gateway "
        "holds is not idle. Keep it above the host's own keep-alive (15 s), which closes first",
    )
    auth_failures_per_minute: StrictInt = Field(
        10,
        ge=1,
        description="calls with a wrong or missing token (or an unknown name) answered 401 and logged, per client "
        "address and minute; beyond it they get 429 with Retry-After and no log line (counted as rate_limited). "
        "Calls with the right token are never limited",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="the longest a generation request may stay with a sampler before it fails (counted as failed)",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewayConfig:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("hetero.gateway.certfile and hetero.gateway.keyfile go together: set both for HTTPS")
        return self

    def missing_files(self) -> list[str]:
        """``certfile``/``keyfile`` that are not files on this node (checked where the gateway runs)."""
        return [
            f"hetero.gateway.{key}={path!r}: no such file on this node"
            for key in ("certfile", "keyfile")
            if (path := getattr(self, key)) is not None and not os.path.isfile(path)
        ]

    @property
    def tls(self) -> bool:
        return self.certfile is not None

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def duplicate_names(samplers: list[RemoteSamplerConfig]) -> list[str]:
    """Names given to more than one remote sampler."""
    seen: set[str] = set()
    return sorted({s.name for s in samplers if s.name in seen or seen.add(s.name)})


def is_valid_name(name: str) -> bool:
    return re.fullmatch(NAME_PATTERN, name) is not None
