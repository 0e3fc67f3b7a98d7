"""The wire protocol between the gateway and a sampler host, and the checks every response passes before training.

The sampler host dials out (it opens no port): it long-polls ``POST /v1/samplers/<name>/poll`` with its
:class:`SamplerStatus` and receives :class:`Work` (generation requests, and whether to abort what is in flight), and
it posts each finished request to ``POST /v1/samplers/<name>/results`` as :class:`Results`. ``GET
/v1/samplers/<name>/hello`` tells it the run it joins (:class:`Hello`). Every request carries ``Authorization:
Bearer <token>``; bodies are JSON.

A response that cannot be true is refused and counted, never trained (:func:`check_result`): one for a request the
gateway never sent (or already answered), generated under a version this run did not publish or newer than the
learner's, whose token and log-prob counts disagree, with non-finite or positive log-probs, with token ids outside
the vocabulary, or longer than the request allowed. The checks are vectorised (one numpy pass per response).
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from gepo_sampler import __version__

#: Bumped when a message changes incompatibly; each side refuses the other at ``hello`` when they differ
#: (:func:`protocol_mismatch`). 2: the hello names the learner's gepo-sampler, the host its own (headers).
PROTOCOL_VERSION = 2
#: headers a host sends with every call: the protocol it speaks and its gepo-sampler version
PROTOCOL_HEADER, PACKAGE_HEADER = "X-Gepo-Protocol", "X-Gepo-Sampler"


def protocol_mismatch(learner: tuple[object, object], host: tuple[object, object]) -> str | None:
    """Why a learner and a host cannot talk, given each side's (protocol, gepo-sampler version); None if they can.
    The one message both sides give: both versions and the fix."""
    (learner_protocol, learner_package), (host_protocol, host_package) = learner, host
    if learner_protocol == host_protocol:
        return None
    return (
        f"the learner's gateway speaks protocol {learner_protocol} (gepo-sampler {learner_package}) and this sampler "
        f"host protocol {host_protocol} (gepo-sampler {host_package}). Fix: install the learner's version on the "
        f"host, pip install 'gepo-sampler=={learner_package}' (or the host's on the learner)"
    )


_MESSAGE = ConfigDict(extra="forbid", frozen=True)

#: Every integer a message carries fits a signed 64-bit one (checked before anything becomes an array: a token id of
#: 2**63 would overflow numpy's int64)
WireInt = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]
#: The largest count a host may report: finite, not negative, and below what any run could count
COUNTER_MAX = 1e15
HostCounter = Annotated[float, Field(ge=0.0, le=COUNTER_MAX, allow_inf_nan=False)]

#: Why a response was refused (the counters' names, ``hetero/remote/<sampler>/refused/<reason>``).
UNKNOWN_REQUEST = "unknown_request"
VERSION_UNPUBLISHED = "version_unpublished"
VERSION_AHEAD = "version_ahead"
LENGTH_MISMATCH = "length_mismatch"
TOO_LONG = "too_long"
NON_FINITE = "non_finite_logprob"
POSITIVE = "positive_logprob"
OUT_OF_VOCAB = "token_out_of_vocab"
MALFORMED = "malformed"
#: a status whose version (held or being pulled) lies outside the run's window
STATUS_VERSION = "status_version"
#: every reason a result or a status is refused for (the metrics ``hetero/remote/<name>/refused/<reason>``)
REFUSAL_REASONS = (
    STATUS_VERSION,
    UNKNOWN_REQUEST,
    VERSION_UNPUBLISHED,
    VERSION_AHEAD,
    LENGTH_MISMATCH,
    TOO_LONG,
    NON_FINITE,
    POSITIVE,
    OUT_OF_VOCAB,
    MALFORMED,
)
#: finish reasons a host reports (vLLM's, with ``abort``: cut at a weight install or by the learner's abort)
FINISH_REASONS = ("stop", "length", "abort")


class GenerateRequest(BaseModel):
    """One generation request: token ids in, verl's sampling settings."""

    model_config = _MESSAGE

    request_id: str = Field(..., min_length=1, max_length=128)
    prompt_ids: list[StrictInt] = Field(..., min_length=1)
    max_tokens: StrictInt = Field(..., ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt = -1
    logprobs: StrictBool = True


class Work(BaseModel):
    """What a long poll returns: requests to start, and whether to abort every request in flight first."""

    model_config = _MESSAGE

    abort: StrictBool = False
    requests: list[GenerateRequest] = Field(default_factory=list)
    learner_version: StrictInt


class SamplerStatus(BaseModel):
    """What a host reports with every poll: the version it holds, what it pulls, whether its engine lives."""

    model_config = _MESSAGE

    protocol: WireInt = PROTOCOL_VERSION
    version: WireInt | None = Field(None, description="the weight version its engine holds (None: none yet)")
    pulling: WireInt | None = Field(None, description="the version it is pulling from the store, if any")
    engine_alive: StrictBool = True
    in_flight: StrictInt = Field(0, ge=0, le=1_000_000)
    error: str | None = Field(None, max_length=4000, description="why it cannot generate (a fatal store error...)")
    engine: str = Field("", max_length=200, description="the inference engine and its version, e.g. vllm 0.30.0")
    dtype: str | None = Field(None, max_length=40, description="the dtype its engine computes in, e.g. float32")
    counters: dict[Annotated[str, Field(max_length=64)], HostCounter] = Field(default_factory=dict, max_length=64)


class Result(BaseModel):
    """One finished (or cut) request: the tokens generated, their log-probs, and the version they came from."""

    model_config = _MESSAGE

    request_id: str = Field(..., min_length=1, max_length=128)
    token_ids: list[WireInt]
    log_probs: list[float] | None = None
    finish_reason: Literal["stop", "length", "abort"]
    version: WireInt
    #: why the sampler could not generate this request (its engine refused it); the request then fails
    error: str | None = Field(None, max_length=2000)


class Results(BaseModel):
    model_config = _MESSAGE

    results: list[Result] = Field(default_factory=list)


class Hello(BaseModel):
    """What the gateway tells a host that dials in: the run it joins and how to reach its weights."""

    model_config = _MESSAGE

    protocol: StrictInt = PROTOCOL_VERSION
    package: str = Field(__version__, description="the learner's gepo-sampler version")
    name: str
    run_id: str
    relay_url: str
    first_version: StrictInt
    learner_version: StrictInt
    poll_wait_s: float
    link: dict | None = None


class VersionWindow(BaseModel):
    """The versions a response may claim: published in this run (from ``first``) and not newer than the learner's."""

    model_config = _MESSAGE

    first: StrictInt
    latest: StrictInt


class RefusedResult(ValueError):
    """A response that cannot be true; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class RefusedStatus(ValueError):
    """A status that cannot be true; ``reason`` is one of :data:`REFUSAL_REASONS`. It is never stored."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def check_status(status: SamplerStatus, window: VersionWindow) -> None:
    """Raise :class:`RefusedStatus` unless the versions ``status`` names (held, being pulled) are this run's and none
    newer than the learner's: what the fleet's books, the relay's retention and the staleness floor read from it."""
    for field, version in (("version", status.version), ("pulling", status.pulling)):
        if version is not None and not window.first <= version <= window.latest:
            raise RefusedStatus(
                STATUS_VERSION, f"{field} {version} outside this run's versions [{window.first}, {window.latest}]"
            )


def check_result(result: Result, request: GenerateRequest, window: VersionWindow, vocab_size: int) -> None:
    """Raise :class:`RefusedResult` unless ``result`` could be an honest answer to ``request`` (a failed request,
    ``error`` set, carries nothing to check)."""
    if result.error is not None:
        return
    if result.version < window.first:
        raise RefusedResult(VERSION_UNPUBLISHED, f"version {result.version} precedes this run's {window.first}")
    if result.version > window.latest:
        raise RefusedResult(VERSION_AHEAD, f"version {result.version} is newer than the learner's {window.latest}")
    tokens = np.asarray(result.token_ids, dtype=np.int64)
    if tokens.size > request.max_tokens:
        raise RefusedResult(TOO_LONG, f"{tokens.size} tokens for at most {request.max_tokens}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise RefusedResult(OUT_OF_VOCAB, f"token ids in [{tokens.min()}, {tokens.max()}], vocabulary {vocab_size}")
    if request.logprobs:
        if result.log_probs is None or len(result.log_probs) != tokens.size:
            given = "none" if result.log_probs is None else len(result.log_probs)
            raise RefusedResult(LENGTH_MISMATCH, f"{tokens.size} tokens and {given} log-probs")
        logp = np.asarray(result.log_probs, dtype=np.float64)
        if not np.isfinite(logp).all():
            raise RefusedResult(NON_FINITE, "a log-prob is not finite")
        if logp.size and logp.max() > 1e-6:
            raise RefusedResult(POSITIVE, f"log-prob {logp.max():.3g} > 0 (a probability above 1)")
