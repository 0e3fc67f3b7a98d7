"""The learner's gateway over real HTTPS, dialled by the sampler host's own client: TLS, tokens, limits, rejoining.

The gateway and a proxy run as Ray actors exactly as in a run (:class:`RemoteSamplers`); the sampler's side is the
host's :class:`~gepo_sampler.host.gateway_client.GatewayClient` (aiohttp), with a self-signed certificate
(``tests/gateway_fixtures.py``) and given to the client as its CA. No vLLM: what is checked is the wire.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from free_ports import free_port
from gateway_fixtures import TOKEN_ENV, remote_samplers
from remote_hosts import ray_with_token

from gepo_plugin.hetero.settings import parse_hetero
from gepo_sampler.host.gateway_client import GatewayClient, GatewayRefused, GatewayRetired, ssl_context
from gepo_sampler.relay.signing import generate_pair
from gepo_sampler.remote.protocol import Results, SamplerStatus, VersionWindow

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    """A local Ray whose workers see the token (as on the learner's node: set before Ray starts)."""
    with ray_with_token(TOKEN_ENV, num_cpus=2) as token:
        yield token


@pytest.fixture
def gateway(cluster, tmp_path, monkeypatch):
    remote, cert = remote_samplers(tmp_path, monkeypatch, max_body_mb=0.01, poll_wait_s=0.2)
    yield remote, cluster, cert
    import ray

    ray.get(remote.gateway.stop.remote())


def test_the_gateway_speaks_tls_and_answers_only_the_right_token(gateway):
    remote, token, cert = gateway
    assert remote.url.startswith("https://127.0.0.1:")

    async def run():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            hello = await client.hello()
            assert (hello.run_id, hello.name, hello.first_version) == ("r", "far", 0)
            work = await client.poll(SamplerStatus(version=0), wait_s=0.2)
            assert work.requests == [] and not work.abort
        async with GatewayClient(remote.url, "far", "wrong" + token, ca_cert=cert) as client:
            with pytest.raises(GatewayRefused, match="HTTP 401"):
                await client.hello()
        async with GatewayClient(remote.url, "nobody", token, ca_cert=cert) as client:
            with pytest.raises(GatewayRefused, match="HTTP 401"):  # as a wrong token: names are not enumerable
                await client.hello()
        async with GatewayClient(remote.url, "far", token, ca_cert=None) as client:  # not its CA: refused by TLS
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await client.hello()
        http = remote.url.replace("https://", "http://")
        async with GatewayClient(http, "far", token) as client:  # plain HTTP to a TLS port: no answer
            with pytest.raises((aiohttp.ClientError, asyncio.TimeoutError)):
                await client.hello()

    asyncio.run(run())
    import ray

    counts = ray.get(remote.gateway.counts.remote())
    assert counts == {"far/unauthorised": 1.0, "unknown_sampler": 1.0}


def test_a_host_of_another_protocol_is_refused_at_hello_naming_both_versions_and_the_fix(gateway, monkeypatch):
    """The host's client with the protocol of another release (what an older or newer gepo-sampler sends), and a
    host that names none (an older one): 426, both sides' protocol and gepo-sampler versions and the fix, counted;
    the same client with this release's protocol is welcome."""
    import gepo_sampler
    from gepo_sampler.host import gateway_client
    from gepo_sampler.remote.protocol import PROTOCOL_VERSION

    remote, token, cert = gateway
    learner = f"protocol {PROTOCOL_VERSION} (gepo-sampler {gepo_sampler.__version__})"
    fix = f"pip install 'gepo-sampler=={gepo_sampler.__version__}'"

    async def hello() -> None:
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            await client.hello()

    monkeypatch.setattr(gateway_client, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    monkeypatch.setattr(gateway_client, "__version__", "9.9.9")
    with pytest.raises(GatewayRefused, match="HTTP 426") as refused:
        asyncio.run(hello())
    assert learner in str(refused.value) and f"protocol {PROTOCOL_VERSION + 1} (gepo-sampler 9.9.9)" in str(
        refused.value
    )
    assert fix in str(refused.value)

    async def bare_hello() -> tuple[int, str]:  # a host that sends no protocol header
        url, tls = f"{remote.url}/v1/samplers/far/hello", ssl_context(remote.url, cert)
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session,
            session.get(url, ssl=tls) as answer,
        ):
            return answer.status, await answer.text()

    status, text = asyncio.run(bare_hello())
    assert status == 426 and learner in text and "protocol none (gepo-sampler unknown)" in text and fix in text
    monkeypatch.undo()
    asyncio.run(hello())
    import ray

    assert ray.get(remote.gateway.counts.remote()) == {"far/protocol": 2.0}


def test_the_protocol_message_names_both_sides_and_the_learners_version_as_the_fix():
    """The one message both sides give (the host when a gateway's hello names another protocol, the gateway at a
    host's hello): both protocols and gepo-sampler versions, and the learner's version to install."""
    from gepo_sampler.remote.protocol import PROTOCOL_VERSION, protocol_mismatch

    message = protocol_mismatch((1, "0.0.1"), (PROTOCOL_VERSION, "0.1.0"))
    assert message is not None and "protocol 1 (gepo-sampler 0.0.1)" in message
    assert f"protocol {PROTOCOL_VERSION} (gepo-sampler 0.1.0)" in message and "gepo-sampler==0.0.1" in message
    assert protocol_mismatch((PROTOCOL_VERSION, "0.1.0"), (PROTOCOL_VERSION, "0.2.0")) is None


def test_bodies_over_the_limit_and_garbled_ones_are_refused(gateway):
    remote, token, cert = gateway

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
            import ssl

            context = ssl.create_default_context(cafile=cert)
            url = f"{remote.url}/v1/samplers/far/results"
            async with session.post(url, data=b"x" * 20_000, ssl=context) as response:
                assert response.status == 413  # over hetero.gateway.max_body_mb
            async with session.post(url, data=b"not json", ssl=context) as response:
                assert response.status == 400

    asyncio.run(run())


async def _raw(remote, cert, path: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    """One call with exactly these bytes and headers (a client that is not the host's)."""
    async with aiohttp.ClientSession(skip_auto_headers=("Content-Type",)) as session:
        method = session.post if data is not None else session.get
        async with method(f"{remote.url}{path}", data=data, headers=headers, ssl=ssl_context(remote.url, cert)) as r:
            return r.status, await r.text()


async def _raw_bytes(remote, cert, header: bytes) -> int:
    """A hello with one header line as raw bytes, over TLS on a plain socket; the status code answered."""
    host, port = remote.url.removeprefix("https://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ssl_context(remote.url, cert))
    writer.write(b"GET /v1/samplers/far/hello HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\n")
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


def test_an_unknown_name_gets_the_answer_a_wrong_token_gets(gateway):
    """Names cannot be enumerated without a token: the same status and body for a name no entry lists and for a
    known name with a wrong token, each counted under its own reason."""
    remote, _, cert = gateway
    wrong = {"Authorization": "Bearer not-the-token"}
    unknown = asyncio.run(_raw(remote, cert, "/v1/samplers/nobody/hello", headers=wrong))
    known = asyncio.run(_raw(remote, cert, "/v1/samplers/far/hello", headers=wrong))
    assert unknown == known and unknown[0] == 401, (unknown, known)
    import ray

    assert ray.get(remote.gateway.counts.remote()) == {"unknown_sampler": 1.0, "far/unauthorised": 1.0}


def test_no_input_gets_a_server_error(gateway):
    """Bytes, sizes, nesting and encodings the JSON parser or the header decoder cannot take: each a 4xx, none a
    500, and an honest call answered after them."""
    remote, token, cert = gateway
    auth = {"Authorization": f"Bearer {token}"}
    status_path = "/v1/samplers/far/status"
    calls = [
        (status_path, b"\xff\xfe not utf-8", auth),
        (status_path, b'{"version": ' + b"9" * 5000 + b"}", auth),  # beyond the parser's integer digits
        (status_path, b"[" * 100_000 + b"]" * 100_000, auth),  # beyond the interpreter's recursion
        (status_path, b'{"version": 5}', {**auth, "Content-Type": "application/json; charset=no-such-charset"}),
        (status_path, b'{"version": NaN}', auth),
        ("/v1/samplers/far/results", b'{"results": {"not": "a list"}}', auth),
    ]
    answers = [asyncio.run(_raw(remote, cert, path, data, headers)) for path, data, headers in calls]
    # an Authorization header whose bytes are not UTF-8, written on the socket (a client library would encode it)
    answers.append((asyncio.run(_raw_bytes(remote, cert, b"Authorization: Bearer \xff\xfe\xfd")), ""))
    assert all(400 <= status < 500 for status, _ in answers), answers
    honest = asyncio.run(_raw(remote, cert, status_path, SamplerStatus(version=0).model_dump_json().encode(), auth))
    assert honest[0] == 200, honest


def test_a_status_outside_the_runs_window_is_refused_over_the_wire_and_not_stored(gateway):
    """The host's own client reporting a version the learner never published: 400, counted by reason, and the
    learner's side still holds the last true status."""
    import ray

    from gepo_sampler.remote.protocol import STATUS_VERSION

    remote, token, cert = gateway
    proxy = remote.replicas["far"].proxy

    async def run():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            await client.report(SamplerStatus(version=0))
            for bad in (SamplerStatus(version=7), SamplerStatus(version=-1), SamplerStatus(version=0, pulling=3)):
                with pytest.raises(aiohttp.ClientResponseError, match=STATUS_VERSION):
                    await client.report(bad)
                with pytest.raises(aiohttp.ClientResponseError, match=STATUS_VERSION):
                    await client.poll(bad, wait_s=0.2)

    asyncio.run(run())
    report = ray.get(proxy.report.remote())
    assert report["status"]["version"] == 0 and report["status"]["pulling"] is None
    assert report["refused"] == {STATUS_VERSION: 6}


def test_a_retired_sampler_is_told_so_and_rejoins_with_a_new_proxy(gateway):
    remote, token, cert = gateway
    replica = remote.replicas["far"]
    remote.retired(replica)

    async def run():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            with pytest.raises(GatewayRetired):
                await client.poll(SamplerStatus(version=0), wait_s=0.2)
            with pytest.raises(GatewayRetired):
                await client.send(Results())

    asyncio.run(run())
    assert remote.rejoin() == ["far"] and remote.replicas["far"] is not replica  # a new proxy
    assert remote.rejoin() == []  # once

    async def back():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            return await client.poll(SamplerStatus(version=0), wait_s=0.2)

    assert asyncio.run(back()).requests == []


def test_a_quarantined_sampler_is_refused_for_the_rest_of_the_run_and_never_rejoins(gateway):
    remote, token, cert = gateway
    replica = remote.replicas["far"]
    remote.retired(replica, quarantined=True)

    async def run():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            for call in (client.hello(), client.poll(SamplerStatus(version=0), wait_s=0.2), client.send(Results())):
                with pytest.raises(GatewayRefused, match=r"403.*quarantined by the learner's audit"):
                    await call

    asyncio.run(run())
    assert remote.rejoin() == [] and "far" not in remote.replicas  # it asked, and is not taken back


def test_a_sampler_in_a_held_poll_is_not_silent_and_its_status_reports_reach_the_learner_at_once(
    cluster, tmp_path, monkeypatch
):
    """A long poll longer than the sampler timeout keeps the sampler alive (it is connected); silence counts from the
    end of its last call; a status it reports between polls (a version installed) is what the learner reads next."""
    import ray

    remote, _ = remote_samplers(tmp_path, monkeypatch, tls=False, poll_wait_s=2.0, sampler_timeout_s=1.0)
    remote.set_window(0, 1)  # version 1 published: the status reported below may name it
    proxy = remote.replicas["far"].proxy

    async def run():
        async with GatewayClient(remote.url, "far", cluster) as client:
            started = time.monotonic()  # a version published since its last poll: the next one answers at once
            assert (await client.poll(SamplerStatus(version=0), wait_s=2.0)).learner_version == 1
            assert time.monotonic() - started < 1.0
            held = asyncio.ensure_future(client.poll(SamplerStatus(version=0), wait_s=2.0))
            await asyncio.sleep(1.5)  # past the timeout, inside the poll
            during = ray.get(proxy.report.remote())
            await client.report(SamplerStatus(version=1))  # (published: the window below is opened to it)
            reported = ray.get(proxy.report.remote())
            await held
            await asyncio.sleep(1.3)  # silent past the timeout since the poll ended
            return during, reported, ray.get(proxy.report.remote())

    try:
        during, reported, after = asyncio.run(run())
    finally:
        ray.get(remote.gateway.stop.remote())
    assert during["dead"] is None and during["silent_s"] == 0.0 and during["status"]["version"] == 0
    assert reported["status"]["version"] == 1
    assert after["dead"] is not None and "not heard from" in after["dead"] and after["silent_s"] > 1.0


def test_a_sampler_whose_proxy_was_removed_before_the_fleet_detached_it_is_told_it_is_retired(gateway):
    """The fleet takes a retired sampler's proxy out of its pool, then detaches it: a call in between gets 410
    (rejoin), not an error counted against the sampler."""
    import ray

    remote, token, cert = gateway
    ray.get(remote.replicas["far"].proxy.retire())

    async def run():
        async with GatewayClient(remote.url, "far", token, ca_cert=cert) as client:
            for call in (client.poll(SamplerStatus(version=0), wait_s=0.2), client.send(Results())):
                with pytest.raises(GatewayRetired):
                    await call

    asyncio.run(run())
    assert ray.get(remote.gateway.rejoining.remote()) == ["far"]
    assert ray.get(remote.gateway.counts.remote()) == {}


def test_a_resumed_run_keeps_a_quarantined_sampler_out_and_its_audit_books_continue(cluster, tmp_path, monkeypatch):
    """What ``hetero.json`` carried (a sampler's audits, its verdict) restored into a new run's remote samplers: the
    books are the auditor's again, and the quarantined sampler is refused before it can join."""
    from gepo_plugin.hetero.audit.book import LOG_PROBS, SamplerAudits, Verdict
    from gepo_plugin.tiny import write_all
    from gepo_plugin.verl_glue.hetero.remote.auditor import TRUSTED
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers

    private, public = generate_pair()
    monkeypatch.setenv("GEPO_TEST_KEY", private)
    tiny = write_all(tmp_path / "tiny")
    hetero = parse_hetero(
        {
            "enable": True,
            "transport": "relay",
            "relay": {"url": str(tmp_path), "run_id": "r", "signing_key_env": "GEPO_TEST_KEY", "public_key": public},
            "remote_samplers": [{"name": "far", "token_env": TOKEN_ENV}],
            "gateway": {"host": "127.0.0.1", "port": free_port()},
            "audit": {"enable": True},
        }
    )
    hello = {"run_id": "r", "relay_url": str(tmp_path), "first_version": 0, "learner_version": 0}
    window = VersionWindow(first=0, latest=0)
    remote = RemoteSamplers(hetero, 0, window, 100, 8, hello, 100_000, model_path=tiny["model"])
    saved = SamplerAudits("far", 1e-3, 0.01)
    saved.audits, saved.failures, saved.largest_gap = 2, 2, 0.01
    saved.verdict = Verdict("far", LOG_PROBS, 3, "r9", 7.2, 6.9, 2)
    try:
        assert "far" in remote.replicas
        remote.restore_audits({"far": saved.state()})
        # the books as saved, beside the bf16 calibration's (nothing calibrated: a float32 run)
        assert "far" not in remote.replicas and remote.audit_state() == {"far": saved.state(), TRUSTED: {}}

        async def run():
            async with GatewayClient(remote.url, "far", cluster) as client:
                with pytest.raises(GatewayRefused, match=r"403.*quarantined"):
                    await client.hello()

        asyncio.run(run())
        assert remote.rejoin() == []
    finally:
        import ray

        ray.get(remote.gateway.stop.remote())


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the gateway closed the connection (read to its end), and what it sent before."""
    start = time.monotonic()
    sent = await asyncio.wait_for(reader.read(), limit_s)
    return time.monotonic() - start, sent


def test_idle_and_half_sent_connections_are_closed_and_a_held_poll_is_not(cluster, tmp_path, monkeypatch):
    """With ``idle_timeout_s=1``: a connection that never sends a call, one whose headers stop half way, one whose
    body stops half way (408, counted) and one idle after an answered call are each closed within about a second
    (plus the second a refused body's rest is read for); meanwhile the host's own client holds a 3 s long poll on
    another connection and gets its answer."""
    import ray

    remote, _ = remote_samplers(tmp_path, monkeypatch, tls=False, idle_timeout_s=1.0, poll_wait_s=3.0)
    host, port = remote.url.removeprefix("http://").rsplit(":", 1)
    auth = f"Authorization: Bearer {cluster}\r\n".encode()
    status = SamplerStatus(version=0).model_dump_json().encode()
    openings = {
        "silent": b"",
        "half headers": b"POST /v1/samplers/far/status HTTP/1.1\r\nHost: x\r\n",
        "half body": b"POST /v1/samplers/far/status HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100\r\n\r\n{",
        "idle after a call": b"POST /v1/samplers/far/status HTTP/1.1\r\nHost: x\r\n"
        + auth
        + f"Content-Length: {len(status)}\r\n\r\n".encode()
        + status,
    }

    async def run():
        async with GatewayClient(remote.url, "far", cluster) as client:
            held = asyncio.ensure_future(client.poll(SamplerStatus(version=0), wait_s=3.0))
            connections = [await asyncio.open_connection(host, int(port)) for _ in openings]
            for (_, writer), opening in zip(connections, openings.values(), strict=True):
                writer.write(opening)
                await writer.drain()
            closed = await asyncio.gather(*(_closed_after(reader, 10.0) for reader, _ in connections))
            work = await held
            for _, writer in connections:
                writer.close()
            return dict(zip(openings, closed, strict=True)), work

    try:
        closed, work = asyncio.run(run())
        counts = ray.get(remote.gateway.counts.remote())
    finally:
        ray.get(remote.gateway.stop.remote())
    assert all(0.5 < seconds < 3.5 for seconds, _ in closed.values()), closed
    assert closed["silent"][1] == b"" and closed["half headers"][1] == b"", closed
    assert closed["half body"][1].startswith(b"HTTP/1.1 408"), closed
    assert closed["idle after a call"][1].startswith(b"HTTP/1.1 200"), closed
    assert work.requests == [] and not work.abort  # the held poll, longer than the timeout, was answered
    assert counts == {"far/idle": 1.0}


def test_wrong_tokens_beyond_the_limit_get_429_unlogged_per_address_and_the_right_token_is_never_limited(
    cluster, tmp_path, monkeypatch
):
    """``auth_failures_per_minute=3``: from 127.0.0.1, eight wrong tokens get 401 three times (each logged) and 429
    with Retry-After after; from 127.0.0.2 (another address) a wrong token still gets 401; the right token from the
    first address is answered."""
    import ray

    remote, _ = remote_samplers(tmp_path, monkeypatch, tls=False, auth_failures_per_minute=3)
    gateway_log = "gepo_plugin.verl_glue.hetero.remote.gateway"

    def count_warnings(gateway) -> None:  # runs in the gateway's actor: its log lines, counted
        import logging

        class Count(logging.Handler):
            lines = 0

            def emit(self, record: logging.LogRecord) -> None:
                Count.lines += 1

        gateway.log_lines = Count
        logging.getLogger(gateway_log).addHandler(Count())

    async def call(token: str, local: str = "127.0.0.1") -> tuple[int, str | None]:
        connector = aiohttp.TCPConnector(local_addr=(local, 0))
        async with aiohttp.ClientSession(connector=connector) as session:
            headers = {"Authorization": f"Bearer {token}"}
            status = SamplerStatus(version=0).model_dump_json()
            async with session.post(f"{remote.url}/v1/samplers/far/status", data=status, headers=headers) as answer:
                return answer.status, answer.headers.get("Retry-After")

    async def run():
        flood = [await call("wrong-" + cluster) for _ in range(8)]
        return flood, await call("wrong-" + cluster, local="127.0.0.2"), await call(cluster)

    try:
        ray.get(remote.gateway.__ray_call__.remote(count_warnings))
        flood, elsewhere, right = asyncio.run(run())
        lines = ray.get(remote.gateway.__ray_call__.remote(lambda gateway: gateway.log_lines.lines))
        counts = ray.get(remote.gateway.counts.remote())
    finally:
        ray.get(remote.gateway.stop.remote())
    assert flood == [(401, None)] * 3 + [(429, "60")] * 5, flood
    assert elsewhere == (401, None) and right == (200, None)
    assert lines == 4  # one per 401, none per 429
    assert counts == {"far/unauthorised": 4.0, "rate_limited": 5.0}
