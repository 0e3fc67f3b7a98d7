"""The weight relay against a real S3-protocol server over HTTP (moto's ThreadedMotoServer, reached through s3fs)."""

from __future__ import annotations

import socket

import pytest
from relay_fixtures import FAST_RETRY, Learner, s3_server, train_and_publish

from gepo_plugin.hetero.relay import codec
from gepo_plugin.hetero.relay.link import Link, LinkConfig
from gepo_plugin.hetero.relay.publisher import RelayPublisher, shard_key
from gepo_plugin.hetero.relay.puller import RelayPuller
from gepo_plugin.hetero.relay.settings import RelayConfig
from gepo_plugin.hetero.relay.store import RelayStore, RelayStoreError


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
