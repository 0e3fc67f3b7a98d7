"""The remote samplers' wire protocol and the learner's proxy, without a network: what is refused, what is trained.

The proxy (:class:`RemoteSamplerProxy`) is driven directly on an event loop exactly as the gateway and verl's agent
loop call it: ``generate`` (verl) waits for the result a ``poll`` (the sampler's long poll) handed out and a
``deliver`` (its results) answered. Every kind of impossible answer must fail its request and be counted by reason;
an honest one must come back as verl's ``TokenOutput`` with the version it was generated under.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gepo_sampler.remote.protocol import (
    LENGTH_MISMATCH,
    MALFORMED,
    NON_FINITE,
    OUT_OF_VOCAB,
    POSITIVE,
    STATUS_VERSION,
    TOO_LONG,
    UNKNOWN_REQUEST,
    VERSION_AHEAD,
    VERSION_UNPUBLISHED,
    GenerateRequest,
    RefusedResult,
    Result,
    SamplerStatus,
    VersionWindow,
    check_result,
)
from gepo_sampler.remote.settings import GatewayConfig, RemoteSamplerConfig, duplicate_names

VOCAB = 50
WINDOW = VersionWindow(first=3, latest=7)
REQUEST = GenerateRequest(request_id="r", prompt_ids=[1, 2], max_tokens=4)


def result(**changes) -> Result:
    fields = {"request_id": "r", "token_ids": [3, 4, 5], "log_probs": [-0.1, -2.0, -0.5], "finish_reason": "stop"}
    return Result(**{**fields, "version": 5, **changes})


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"version": 2}, VERSION_UNPUBLISHED),
        ({"version": 8}, VERSION_AHEAD),
        ({"log_probs": [-0.1, -0.2]}, LENGTH_MISMATCH),
        ({"log_probs": None}, LENGTH_MISMATCH),
        ({"token_ids": [1, 2, 3, 4, 5], "log_probs": [-1.0] * 5}, TOO_LONG),
        ({"log_probs": [-0.1, math.nan, -0.5]}, NON_FINITE),
        ({"log_probs": [-0.1, -math.inf, -0.5]}, NON_FINITE),
        ({"log_probs": [-0.1, 0.3, -0.5]}, POSITIVE),
        ({"token_ids": [3, VOCAB, 5]}, OUT_OF_VOCAB),
        ({"token_ids": [3, -1, 5]}, OUT_OF_VOCAB),
    ],
)
def test_an_answer_that_cannot_be_true_is_refused_by_reason(changes, reason):
    with pytest.raises(RefusedResult) as refused:
        check_result(result(**changes), REQUEST, WINDOW, VOCAB)
    assert refused.value.reason == reason


def test_an_honest_answer_passes_at_every_edge_of_the_window():
    for version in (WINDOW.first, WINDOW.latest):
        check_result(result(version=version), REQUEST, WINDOW, VOCAB)
    check_result(result(token_ids=[], log_probs=[], finish_reason="abort"), REQUEST, WINDOW, VOCAB)  # cut at once
    check_result(result(token_ids=[0, VOCAB - 1], log_probs=[0.0, -30.0]), REQUEST, WINDOW, VOCAB)
    no_logprobs = GenerateRequest(request_id="r", prompt_ids=[1], max_tokens=4, logprobs=False)
    check_result(result(log_probs=None), no_logprobs, WINDOW, VOCAB)


def test_remote_sampler_entries_are_checked_and_tokens_come_from_the_environment(monkeypatch):
    entry = RemoteSamplerConfig(name="dc-west.1", token_env="GEPO_TEST_TOKEN")
    assert entry.group_label == "dc-west.1"
    with pytest.raises(RuntimeError, match="GEPO_TEST_TOKEN is not set"):
        entry.token()
    monkeypatch.setenv("GEPO_TEST_TOKEN", "short")
    with pytest.raises(RuntimeError, match="holds 5 characters"):
        entry.token()
    monkeypatch.setenv("GEPO_TEST_TOKEN", "x" * 32)
    assert entry.token() == "x" * 32
    for bad in ({"name": "a b", "token_env": "T"}, {"name": "a", "token_env": "1T"}):
        with pytest.raises(ValueError):
            RemoteSamplerConfig(**bad)
    assert duplicate_names([entry, entry, RemoteSamplerConfig(name="b", token_env="T")]) == ["dc-west.1"]
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(certfile="/etc/hostname")
    with pytest.raises(ValueError, match="the learner does not dial remote samplers"):  # the host dials out
        RemoteSamplerConfig(name="a", token_env="T", url="http://sampler:8000")


# ------------------------------------------------------------------------------------------------- the proxy


def make_proxy(**gateway):
    from gepo_plugin.verl_glue.hetero.remote.proxy import RemoteSamplerProxy

    config = GatewayConfig(**{"sampler_timeout_s": 5.0, "request_timeout_s": 5.0, **gateway})
    return RemoteSamplerProxy("s1", "remote/s1", config, WINDOW, VOCAB, default_max_tokens=4)


def status(version: int | None = 5, **changes) -> dict:
    return SamplerStatus(version=version, **changes).model_dump()


async def exchange(proxy, answer):
    """verl calls generate; the sampler polls, and answers with ``answer(request)`` (a Result or a raw dict)."""
    call = asyncio.ensure_future(proxy.generate([1, 2], {"temperature": 1.0, "logprobs": True}, request_id="v"))
    work = await proxy.poll(status(), wait_s=1.0)
    (request,) = work["requests"]
    body = answer(GenerateRequest(**request))
    delivered = await proxy.deliver({"results": [body.model_dump() if isinstance(body, Result) else body]})
    return call, delivered


def test_the_proxy_returns_an_honest_answer_as_verls_token_output_with_its_version():
    async def run():
        proxy = make_proxy()
        call, delivered = await exchange(proxy, lambda r: result(request_id=r.request_id, version=6))
        output = await call
        assert delivered == {"accepted": 1, "refused": 0}
        assert output.token_ids == [3, 4, 5] and output.log_probs == [-0.1, -2.0, -0.5]
        assert output.stop_reason == "completed" and output.extra_fields == {"global_steps": 6}
        # a request the sampler cut at an install comes back "aborted": verl's client resumes it on new weights
        call, _ = await exchange(proxy, lambda r: result(request_id=r.request_id, finish_reason="abort"))
        assert (await call).stop_reason == "aborted"

    asyncio.run(run())


def test_the_proxy_fails_a_refused_answer_and_counts_forged_and_garbled_ones():
    from gepo_plugin.verl_glue.hetero.remote.proxy import RequestRefused

    async def run():
        proxy = make_proxy()
        call, delivered = await exchange(proxy, lambda r: result(request_id=r.request_id, version=99))
        assert delivered == {"accepted": 0, "refused": 1}
        with pytest.raises(RequestRefused, match="version_ahead"):
            await call
        # a result for a request never sent, and a garbled message: refused, nothing waits on them
        assert (await proxy.deliver({"results": [result(request_id="never-sent").model_dump()]}))["refused"] == 1
        assert (await proxy.deliver({"results": [{"request_id": "x", "token_ids": "abc"}]}))["refused"] == 1
        assert proxy.refused == {VERSION_AHEAD: 1, UNKNOWN_REQUEST: 1, MALFORMED: 1}

    asyncio.run(run())


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"version": -1}, STATUS_VERSION),
        ({"version": WINDOW.first - 1}, STATUS_VERSION),  # before this run's first version
        ({"version": WINDOW.latest + 1}, STATUS_VERSION),  # a version the learner never published
        ({"pulling": WINDOW.latest + 5}, STATUS_VERSION),
        ({"version": 10**4000}, MALFORMED),  # beyond any 64-bit integer
        ({"counters": {"results": math.nan}}, MALFORMED),
        ({"counters": {"results": math.inf}}, MALFORMED),
        ({"counters": {"results": 1e300}}, MALFORMED),
        ({"counters": {"results": -1.0}}, MALFORMED),
        ({"in_flight": 10**9}, MALFORMED),
    ],
)
def test_a_status_that_cannot_be_true_is_refused_by_reason_and_never_stored(change, reason):
    """Statuses are what the fleet's books, the relay's retention and the staleness floor read: one outside the
    run's window or with counters no run could count is refused (the gateway answers 400), counted, not stored;
    by the poll and by a report between polls alike."""

    async def run():
        proxy = make_proxy()
        honest = status(version=WINDOW.first, counters={"results": 2.0})
        assert "refused" not in await proxy.poll(honest, wait_s=0.01)
        heard = proxy.last_heard
        bad = {**honest, **change}
        assert await proxy.poll(bad, wait_s=0.01) == {"refused": reason}
        assert await proxy.update_status(bad) == {"refused": reason}
        assert proxy.status.model_dump() == honest and proxy.last_heard == heard  # nothing of it kept
        assert proxy.refused == {reason: 2}
        report = await proxy.report()
        assert all(math.isfinite(value) for value in report["status"]["counters"].values())

    asyncio.run(run())


def test_a_garbled_result_fails_the_request_it_names_at_once():
    """A result that does not parse (a token id beyond 64 bits, a string for the tokens) but names a request the
    sampler was sent fails that request at once, rather than at the request timeout; the others of the message are
    still taken."""
    from gepo_plugin.verl_glue.hetero.remote.proxy import RequestRefused

    async def run():
        proxy = make_proxy(request_timeout_s=600.0)
        for garbled in ({"token_ids": [3, 2**63, 5]}, {"token_ids": "abc"}, {"version": "5"}):
            call, delivered = await exchange(
                proxy, lambda r, g=garbled: {**result(request_id=r.request_id).model_dump(), **g}
            )
            assert delivered == {"accepted": 0, "refused": 1}
            with pytest.raises(RequestRefused, match="garbled"):
                await asyncio.wait_for(call, 1.0)  # at once, not after request_timeout_s
        assert proxy.refused == {MALFORMED: 3}
        # one garbled and one honest answer in one message: the honest one is trained
        calls = [asyncio.ensure_future(proxy.generate([1, 2], {"logprobs": True}, request_id=i)) for i in "ab"]
        first, second = (await proxy.poll(status(), wait_s=1.0))["requests"]
        body = {"results": [{**result(request_id=first["request_id"]).model_dump(), "token_ids": [2**64]},
                            result(request_id=second["request_id"]).model_dump()]}  # fmt: skip
        assert await proxy.deliver(body) == {"accepted": 1, "refused": 1}
        with pytest.raises(RequestRefused):
            await calls[0]
        assert (await calls[1]).token_ids == [3, 4, 5]

    asyncio.run(run())


def test_a_sampler_without_weights_gets_no_work_and_a_silent_one_is_dead():
    async def run():
        proxy = make_proxy(sampler_timeout_s=0.2)
        call = asyncio.ensure_future(proxy.generate([1], {}, request_id="v"))
        await asyncio.sleep(0)
        assert (await proxy.poll(status(version=None), wait_s=0.1))["requests"] == []  # holds nothing yet
        assert proxy.why_dead() is None
        await asyncio.sleep(0.3)
        assert "not heard from" in str(proxy.why_dead()) and proxy.engine.errored
        await proxy.poll(status(engine_alive=False), wait_s=0.01)
        assert "does not answer" in str(proxy.why_dead())
        await proxy.poll(status(error="the store: access denied"), wait_s=0.01)
        assert "access denied" in str(proxy.why_dead())
        call.cancel()

    asyncio.run(run())


def test_abort_cuts_what_the_sampler_generates_and_parks_new_requests_until_resumed():
    async def run():
        proxy = make_proxy()
        first = asyncio.ensure_future(proxy.generate([1], {}, request_id="a"))
        work = await proxy.poll(status(), wait_s=1.0)
        (request,) = work["requests"]
        abort = asyncio.ensure_future(proxy.abort_all_requests())
        await asyncio.sleep(0.01)
        assert (await proxy.poll(status(), wait_s=0.1))["abort"] is True  # the sampler is told to cut
        partial = result(request_id=request["request_id"], token_ids=[7], log_probs=[-1.0], finish_reason="abort")
        await proxy.deliver({"results": [partial.model_dump()]})
        assert (await abort)["aborted_count"] == 1
        assert (await first).stop_reason == "aborted"
        parked = asyncio.ensure_future(proxy.generate([1], {}, request_id="b"))
        await asyncio.sleep(0.05)
        assert (await proxy.poll(status(), wait_s=0.05))["requests"] == []  # behind the closed gate
        await proxy.resume_generation()
        assert len((await proxy.poll(status(), wait_s=1.0))["requests"]) == 1
        parked.cancel()

    asyncio.run(run())


def test_a_request_the_sampler_could_not_generate_fails_at_once_and_is_counted():
    from gepo_plugin.verl_glue.hetero.remote.proxy import RequestFailed

    async def run():
        proxy = make_proxy()
        failed = {"token_ids": [], "finish_reason": "stop", "version": 5, "error": "HTTP 400: prompt too long"}
        call, delivered = await exchange(proxy, lambda r: {"request_id": r.request_id, **failed})
        with pytest.raises(RequestFailed, match="prompt too long"):
            await call
        assert proxy.counters["failed"] == 1 and not proxy.refused and delivered["accepted"] == 0

    asyncio.run(run())


def test_an_abort_reaches_a_waiting_long_poll_at_once():
    async def run():
        proxy = make_proxy()
        sent = asyncio.ensure_future(proxy.generate([1], {}, request_id="a"))
        (request,) = (await proxy.poll(status(), wait_s=1.0))["requests"]
        waiting = asyncio.ensure_future(proxy.poll(status(), wait_s=30.0))  # the sampler's next long poll
        await asyncio.sleep(0.05)
        started = time.monotonic()
        abort = asyncio.ensure_future(proxy.abort_all_requests())
        assert (await waiting)["abort"] is True and time.monotonic() - started < 1.0  # not after its 30 s
        partial = result(request_id=request["request_id"], token_ids=[4], log_probs=[-1.0], finish_reason="abort")
        await proxy.deliver({"results": [partial.model_dump()]})
        assert (await abort)["aborted_count"] == 1 and (await sent).token_ids == [4]

    asyncio.run(run())


def test_a_new_learner_version_reaches_a_waiting_long_poll_at_once_and_an_unchanged_one_does_not():
    """The sampler lists the store only when told of a newer version: the learner's publication must not wait for
    the end of a long poll to reach it."""

    async def run():
        proxy = make_proxy()
        first, latest = WINDOW.first, WINDOW.latest
        waiting = asyncio.ensure_future(proxy.poll(status(), wait_s=30.0))
        await asyncio.sleep(0.05)
        await proxy.set_window(first, latest)  # the same window: the poll stays held
        await asyncio.sleep(0.2)
        assert not waiting.done()
        started = time.monotonic()
        await proxy.set_window(first, latest + 1)
        work = await waiting
        assert work["learner_version"] == latest + 1 and work["requests"] == [] and not work["abort"]
        assert time.monotonic() - started < 1.0  # not after its 30 s

    asyncio.run(run())


def test_an_abort_answers_requests_the_sampler_never_got_at_once_with_no_tokens():
    async def run():
        proxy = make_proxy()
        await proxy.poll(status(version=5), wait_s=0.01)  # the sampler holds version 5
        unsent = asyncio.ensure_future(proxy.generate([2], {}, request_id="b"))
        await asyncio.sleep(0.01)
        assert (await proxy.abort_all_requests())["aborted_count"] == 0  # nothing was with the sampler
        cut = await unsent
        assert cut.stop_reason == "aborted" and cut.token_ids == [] and cut.extra_fields == {"global_steps": 5}

    asyncio.run(run())
