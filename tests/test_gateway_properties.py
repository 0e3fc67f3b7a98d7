"""Hypothesis against the running gateway: whatever an authenticated sampler sends, the answer is 2xx or 4xx, and
nothing that cannot be true is stored or trained.

The gateway and the sampler's proxy run as Ray actors exactly as in a run (:class:`RemoteSamplers`); each example is
one call with the right token over HTTP: bytes, any JSON, or a true message (a status; a result for a request the
proxy really handed out) with one field replaced by any JSON value or removed, under a declared charset of its own.
After every call: the answer was not a server error, the status the learner's side holds names only versions of the
run's window with finite bounded counters, the metrics a step would log are finite, and a request's answer that
reached verl's side (the proxy's ``generate``, as verl's agent loop calls it) is one an honest sampler could send,
by a check written here, apart from the gateway's own.
"""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from gateway_fixtures import TOKEN_ENV, remote_samplers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_hosts import ray_with_token

from gepo_sampler.remote.protocol import COUNTER_MAX, SamplerStatus

pytestmark = pytest.mark.ray

#: the versions the learner has published in this test (the run's window)
FIRST, LATEST = 0, 2
#: the request every results example answers: verl's side asks for at most MAX_TOKENS tokens of VOCAB
PROMPT, MAX_TOKENS, VOCAB = [1, 2, 3], 4, 100

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
content_types = st.sampled_from(
    [None, "application/json", "application/json; charset=latin-1", "text/plain; charset=no-such-charset"]
)


def honest_result(request_id: str) -> dict:
    return {"request_id": request_id, "token_ids": [5, 6], "log_probs": [-0.5, -1.25], "finish_reason": "stop",
            "version": 1}  # fmt: skip


@st.composite
def mutated(draw, message: dict) -> dict:
    """``message`` with one field (one of its own, or a new one) replaced by any JSON value, or removed."""
    message = dict(message)
    key = draw(st.sampled_from(sorted(message)) | st.text(max_size=8))
    if draw(st.booleans()) and key in message:
        del message[key]
    else:
        message[key] = draw(st.integers() | st.floats() | json_values)  # numbers most: the fields are numbers most
    return message


def bodies(route: str, request_id: str):
    """What a sampler may send on ``route``: bytes, any JSON, or a true message with one field changed."""
    true = (
        {"results": [honest_result(request_id)]}
        if route == "results"
        else SamplerStatus(version=1, counters={"generated": 3.0}).model_dump()
    )
    changed = (
        mutated(true["results"][0]).map(lambda result: {"results": [result]}) if route == "results" else mutated(true)
    )
    changed_bytes = changed.map(lambda message: json.dumps(message).encode())
    # half the calls a true message with one field changed: they pass the parser and reach the checks
    return st.one_of(st.binary(max_size=64), json_values.map(lambda value: json.dumps(value).encode()), changed_bytes,
                     changed_bytes)  # fmt: skip


def could_be_honest(output) -> bool:
    """An answer verl's side may train: the check written here, from the protocol's documented contract."""
    tokens, logps = list(output.token_ids), output.log_probs
    return (
        len(tokens) <= MAX_TOKENS
        and all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens)
        and logps is not None
        and len(logps) == len(tokens)
        and all(math.isfinite(p) and p <= 1e-6 for p in logps)
        and FIRST <= output.extra_fields["global_steps"] <= LATEST
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The gateway and one sampler's proxy, in a Ray whose workers see the sampler's token."""
    monkeypatch = pytest.MonkeyPatch()
    with ray_with_token(TOKEN_ENV, num_cpus=2) as token:
        remote, _ = remote_samplers(tmp_path_factory.mktemp("fuzz"), monkeypatch, tls=False, poll_wait_s=0.05)
        remote.set_window(FIRST, LATEST)
        try:
            yield remote, token
        finally:
            import ray

            ray.get(remote.gateway.stop.remote())
            monkeypatch.undo()


async def _post(remote, token: str, route: str, body: bytes, content_type: str | None = None) -> tuple[int, bytes]:
    """One call of ``far``'s with the right token: its status and body."""
    headers = {"Authorization": f"Bearer {token}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    url = f"{remote.url}/v1/samplers/far/{route}"
    async with (
        aiohttp.ClientSession(skip_auto_headers=("Content-Type",)) as session,
        session.post(url, data=body, headers=headers) as answer,
    ):
        return answer.status, await answer.read()


def _handed_out(remote, token: str):
    """A generation request from verl's side (the proxy's ``generate``), handed to the sampler by an honest poll."""
    import ray

    proxy = remote.replicas["far"].proxy
    call = proxy.generate.remote(PROMPT, {"max_tokens": MAX_TOKENS, "logprobs": 0}, "fuzz")
    status = SamplerStatus(version=1).model_dump_json().encode()
    for _ in range(50):
        work = json.loads(asyncio.run(_post(remote, token, "poll", status))[1])
        if work["requests"]:
            break
    else:
        raise AssertionError("the request was never handed out")
    [request] = work["requests"]
    assert ray.wait([call], timeout=0)[0] == []
    return call, request["request_id"]


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,  # the same examples in every CI run: a red run is a defect, never a draw
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), route=st.sampled_from(["status", "poll", "results"]), content_type=content_types)
def test_no_call_gets_a_server_error_and_nothing_untrue_is_stored_or_trained(fleet, data, route, content_type):
    import ray

    remote, token = fleet
    proxy = remote.replicas["far"].proxy
    call, request_id = _handed_out(remote, token) if route == "results" else (None, "none")
    body = data.draw(bodies(route, request_id), label="body")

    status, _ = asyncio.run(_post(remote, token, route, body, content_type))
    assert 200 <= status < 300 or 400 <= status < 500, status

    if call is not None:  # the request is answered: by the call, or else by a failure sent now
        failure = {"results": [{**honest_result(request_id), "token_ids": [], "log_probs": [], "error": "over"}]}
        asyncio.run(_post(remote, token, "results", json.dumps(failure).encode()))
        try:
            output = ray.get(call, timeout=30)
        except ray.exceptions.RayTaskError:
            pass  # refused, or failed: verl counts the group failed and trains nothing of it
        else:
            assert could_be_honest(output), (body, output)

    report = ray.get(proxy.report.remote())
    held = report["status"]
    if held is not None:
        for version in (held["version"], held["pulling"]):
            assert version is None or FIRST <= version <= LATEST, held
        assert all(math.isfinite(v) and 0 <= v <= COUNTER_MAX for v in held["counters"].values()), held
        assert 0 <= held["in_flight"] <= 1_000_000
    assert all(math.isfinite(v) for v in remote.metrics({"far": report}).values())
