"""The weight relay against a real S3-protocol server over HTTP (moto's ThreadedMotoServer, reached through s3fs)."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from outage_proxy import OutageProxy
from relay_fixtures import FAST_RETRY, Learner, s3_server, train_and_publish
from test_relay_follow import wait_for

from gepo_sampler.relay import codec
from gepo_sampler.relay.follower import RelayFollower
from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.manifest import shard_key
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.puller import RelayIntegrityError, RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.store import RelayStore, RelayStoreError

#: botocore options that make one failed request fail fast (its own retries would add tens of seconds per operation;
#: the store's retries and the outage budget are what is tested)
QUICK_FAILURE = {"config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}}


def behind_a_proxy(options: dict) -> tuple[OutageProxy, dict]:
    """A proxy in front of the S3 server, and the storage options that reach the server through it (failing fast)."""
    proxy = OutageProxy.in_front_of(options["client_kwargs"]["endpoint_url"])
    return proxy, {**options, "client_kwargs": {"endpoint_url": proxy.endpoint}, **QUICK_FAILURE}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def s3():
    with s3_server() as (url, options):
        yield url, options


def test_two_groups_pull_exact_weights_over_s3_and_the_slow_link_is_slower_by_its_bytes(s3) -> None:
    url, options = s3
    store = RelayStore(f"{url}/exact", options, retry=FAST_RETRY)
    learner = Learner(lr=1e-4, width=128)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=5, shard_mb=32 / 1024))
    publisher.hold(0)
    fast = RelayPuller(RelayStore(f"{url}/exact", options, retry=FAST_RETRY), "run")
    slow_link = Link(LinkConfig(bandwidth_mbps=4.0, latency_ms=20.0))
    slow = RelayPuller(RelayStore(f"{url}/exact", options, retry=FAST_RETRY), "run", link=slow_link)
    held = {"fast": None, "slow": None}
    for version in range(1, 9):
        train_and_publish(learner, publisher, [version])
        truth = codec.WeightBits.from_tensors(learner.weights())
        for name, puller in (("fast", fast), ("slow", slow)):
            result = puller.pull(held[name])
            held[name] = result.held
            assert result.held.version == version and result.held.weights.equal(truth)
            if name == "slow":
                requests = 1 + len(publisher.published[version].part(result.steps[0][1]))  # listing + shards
                floor = result.nbytes * 8 / 4e6 + 0.02 * requests
                assert result.seconds >= 0.95 * floor, (version, result.seconds, floor)
    assert fast.counters.get("bytes_pulled") == slow.counters.get("bytes_pulled")
    publisher.close()


def test_a_shard_corrupted_in_the_bucket_is_detected_and_the_sampler_goes_around_it(s3) -> None:
    url, options = s3
    store = RelayStore(f"{url}/corrupt", options, retry=FAST_RETRY)
    learner = Learner(lr=1e-5)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=3, shard_mb=8 / 1024))
    publisher.hold(1)
    puller = RelayPuller(RelayStore(f"{url}/corrupt", options, retry=FAST_RETRY), "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    train_and_publish(learner, publisher, range(2, 6))
    shard = publisher.published[2].delta[0]
    store.fs.pipe_file(store.path(shard_key(shard.sha256)), b"garbage")  # truncated and wrong
    result = puller.pull(held)
    assert result.steps == [(4, "full"), (5, "delta")]
    assert result.held.weights.equal(codec.WeightBits.from_tensors(learner.weights()))
    assert puller.counters.get("shards_corrupt") == puller.fetch_attempts
    publisher.close()


def test_an_unusable_bucket_or_endpoint_stops_with_the_url_and_the_fix(s3) -> None:
    url, options = s3
    with pytest.raises(RelayStoreError, match=r"s3://no-such-bucket.*Fix: check the URL"):
        RelayStore("s3://no-such-bucket/run", options, retry=FAST_RETRY).probe()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    unreachable = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{closed}"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        "skip_instance_cache": True,
    }
    with pytest.raises(RelayStoreError, match=rf"s3://relay-bucket/x.*127\.0\.0\.1:{closed}|s3://relay-bucket/x"):
        RelayStore(f"{url}/x", unreachable, retry=FAST_RETRY).probe()
    RelayStore(f"{url}/fine", options, retry=FAST_RETRY).probe()


def test_a_corrupt_object_at_an_address_a_keyframe_reuses_is_rewritten_before_the_request_is_answered(s3) -> None:
    """An unchanged tensor alone in its shard keeps its address in every keyframe: on S3 an object that exists is
    not uploaded again, so a corruption there would survive every keyframe unless the sampler's report rewrites it.
    The newest version already carries a keyframe here, and the request is still answered."""
    url, options = s3
    store = RelayStore(f"{url}/reused", options, retry=FAST_RETRY)
    frozen = torch.randn(128, 64).to(torch.bfloat16)  # 16 KiB, alone in its shard (shard_mb = 8 KiB)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=1, shard_mb=8 / 1024))
    publisher.hold(0)
    for version in (1, 2):
        publisher.publish(version, {"frozen": frozen, "moving": torch.full((16,), float(version))})
        publisher.wait()
    (address,) = [s.sha256 for s in publisher.published[2].full if s.tensors == ("frozen",)]
    assert address in {s.sha256 for s in publisher.published[1].full}  # reused
    size = store.size(shard_key(address))
    store.fs.pipe_file(store.path(shard_key(address)), b"\0" * size)  # corrupt in the bucket, same size
    sampler = RelayPuller(RelayStore(f"{url}/reused", options, retry=FAST_RETRY), "run")
    with pytest.raises(RelayIntegrityError):
        sampler.pull(None)  # both keyframes hold the corrupt object: no plan
    assert sampler.corrupt_shards == {address}
    publisher.request_keyframe(sorted(sampler.corrupt_shards))  # what the learner passes on
    publisher.wait()
    assert publisher.counters.get("keyframes_on_request") == 1 and publisher.counters.get("shards_rewritten") == 1
    assert publisher.published[2].rewritten == (address,)
    held = sampler.pull(None).held
    assert held.version == 2 and same_bits(held.weights.to_tensors()["frozen"], frozen)
    assert not sampler.corrupt_shards
    publisher.close()


def test_an_existing_object_of_the_wrong_size_is_uploaded_again(s3) -> None:
    url, options = s3
    store = RelayStore(f"{url}/sized", options, retry=FAST_RETRY)
    frozen = torch.randn(128, 64).to(torch.bfloat16)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=2, shard_mb=8 / 1024))
    publisher.publish(1, {"frozen": frozen, "moving": torch.zeros(16)})
    publisher.wait()
    (address,) = [s.sha256 for s in publisher.published[1].full if s.tensors == ("frozen",)]
    store.fs.pipe_file(store.path(shard_key(address)), b"truncated")
    for version in (2, 3):  # version 3 carries the next keyframe, which reuses the address
        publisher.publish(version, {"frozen": frozen, "moving": torch.full((16,), float(version))})
        publisher.wait()
    assert store.size(shard_key(address)) == next(s.nbytes for s in publisher.published[3].full if s.sha256 == address)
    held = RelayPuller(RelayStore(f"{url}/sized", options, retry=FAST_RETRY), "run").pull(None).held
    assert held.version == 3 and same_bits(held.weights.to_tensors()["frozen"], frozen)
    publisher.close()


def test_a_samplers_probe_fails_for_a_bucket_that_does_not_exist(s3, capsys) -> None:
    from gepo_plugin import doctor

    url, options = s3
    with pytest.raises(RelayStoreError, match=r"s3://missing-bucket/x.*bucket 'missing-bucket' does not exist.*Fix"):
        RelayStore("s3://missing-bucket/x", options, retry=FAST_RETRY).probe(write=False)
    RelayStore(f"{url}/not-published-yet", options, retry=FAST_RETRY).probe(write=False)  # an empty prefix is fine
    endpoint = json.dumps({"client_kwargs": options["client_kwargs"]})
    problems = doctor._probe_relay("s3://missing-bucket/x", endpoint, write=False)
    assert problems and "does not exist" in problems[0]
    assert doctor._probe_relay(f"{url}/x", endpoint, write=False) == []


def test_a_permanent_store_error_stops_publishing_at_once_with_the_fix(s3) -> None:
    _, options = s3
    store = RelayStore("s3://missing-bucket/run", options, retry=FAST_RETRY)
    publisher = RelayPublisher(store, "run", RelayConfig(outage_s=600))
    learner = Learner()
    learner.step()
    started = time.monotonic()
    publisher.publish(1, learner.weights())
    with pytest.raises(RuntimeError, match=r"missing-bucket.*permanent error.*not retried.*Fix: create the bucket"):
        publisher.wait(timeout=60)
    assert time.monotonic() - started < 30  # not the outage budget
    assert store.counters.get("retries") == 0 and store.counters.get("publish_failures") == 1
    with pytest.raises(RuntimeError, match="missing-bucket"):
        publisher.publish(2, learner.weights())
    publisher.close()


def test_publishing_rides_out_a_store_outage_and_the_samplers_catch_up_exactly(s3) -> None:
    """The store unreachable (every connection reset) for longer than a store operation's retries: the learner's
    publish calls go on returning, the versions it could not publish are coalesced, and when the store is back the
    newest is published and a sampler that kept polling through the outage holds it bit for bit."""
    url, options = s3
    proxy, flaky = behind_a_proxy(options)
    store = RelayStore(f"{url}/outage", flaky, retry=FAST_RETRY)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=100, outage_s=120))
    follower = RelayFollower(
        RelayPuller(RelayStore(f"{url}/outage", flaky, retry=FAST_RETRY), "run"), 0, 0, poll_s=0.05, outage_s=120
    )
    learner = Learner(lr=1e-3)
    try:
        train_and_publish(learner, publisher, [1])
        follower.start()
        wait_for(lambda: follower.status().staged == 1)
        proxy.cut()
        started = time.monotonic()
        for version in (2, 3, 4):  # the learner trains on; nothing raises
            learner.step()
            publisher.publish(version, learner.weights())
            time.sleep(2.0)
        wait_for(lambda: store.counters.get("publish_failures") >= 2, timeout_s=60)
        assert publisher.in_outage and store.counters.get("store_errors") > FAST_RETRY.attempts  # past its retries
        time.sleep(max(0.0, 8.0 - (time.monotonic() - started)))
        proxy.restore()
        publisher.wait(timeout=120)
        assert not publisher.in_outage and max(publisher.published) == 4
        # from the first failed publication (after the store's own retries) to the first that succeeded
        assert store.counters.get("versions_coalesced") >= 1 and store.counters.get("outage_s") >= 4.0
        status = wait_for(lambda: (s := follower.status()).staged == 4 and s, timeout_s=120)
        assert status.error is None and status.counters.get("pull_failures", 0) >= 1  # it met the outage too
        assert follower.take(4).equal(codec.WeightBits.from_tensors(learner.weights()))
        assert proxy.resets > 0
    finally:
        follower.stop()
        publisher.close()
        proxy.close()


def test_an_outage_longer_than_its_budget_stops_with_the_url_and_the_fix(s3) -> None:
    url, options = s3
    proxy, flaky = behind_a_proxy(options)
    store = RelayStore(f"{url}/long-outage", flaky, retry=FAST_RETRY)
    publisher = RelayPublisher(store, "run", RelayConfig(outage_s=4))
    learner = Learner()
    try:
        train_and_publish(learner, publisher, [1])
        proxy.cut()
        learner.step()
        publisher.publish(2, learner.weights())
        with pytest.raises(RuntimeError, match=r"relay-bucket/long-outage.*longer than hetero\.relay\.outage_s=4.*Fix"):
            publisher.wait(timeout=120)
        with pytest.raises(RuntimeError, match="outage_s"):
            publisher.publish(3, learner.weights())
    finally:
        publisher.close()
        proxy.close()
