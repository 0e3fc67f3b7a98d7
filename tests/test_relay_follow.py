"""A sampler's background follower and the learner's book of real arrivals (framework-free, a directory store)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from relay_fixtures import FAST_RETRY, Learner, train_and_publish

from gepo_sampler.relay import codec
from gepo_sampler.relay.arrivals import ArrivalBook
from gepo_sampler.relay.follower import Receipt, RelayFollower
from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.publisher import RelayPublisher, shard_key
from gepo_sampler.relay.puller import RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.store import RelayStore


def wait_for(condition, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@contextlib.contextmanager
def following(tmp_path: Path, group: int = 0, replica: int = 0) -> Iterator[tuple]:
    """A learner publishing to a directory store (version 0 held) and a started follower of it; ``publish(v)``
    trains a step, publishes it as version ``v`` and returns its exact bits."""
    store = RelayStore(str(tmp_path), retry=FAST_RETRY)
    learner = Learner(lr=1e-4)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=3))
    publisher.hold(0)
    follower = RelayFollower(RelayPuller(store, "run"), group=group, replica=replica, poll_s=0.01)
    follower.start()

    def publish(version: int) -> codec.WeightBits:
        learner.step()
        bits = codec.WeightBits.from_tensors(learner.weights())
        publisher.publish(version, learner.weights())
        return bits

    try:
        yield follower, publish
    finally:
        follower.stop()
        publisher.close()


def test_a_follower_stages_the_newest_version_and_reports_when_it_arrived(tmp_path: Path) -> None:
    with following(tmp_path, group=1, replica=4) as (follower, publish):
        for version in range(1, 6):
            published_at = time.time()
            truth = publish(version)
            status = wait_for(lambda v=version: (s := follower.status()).staged == v and s)
            (receipt,) = [r for r in status.receipts if r.version == version]
            assert (receipt.group, receipt.replica) == (1, 4)
            assert receipt.arrival >= published_at and receipt.nbytes > 0
            assert follower.take(version).equal(truth)  # the staged copy is exactly that version
            with pytest.raises(LookupError):
                follower.take(version)  # taken once


def test_a_hinted_follower_reads_the_store_a_constant_number_of_times_per_version_not_per_second(tmp_path) -> None:
    """Told the learner's version (a remote sampler hears it with every poll), a follower lists the store only while a
    newer version is due: idle, it reads nothing for as long as no version comes; told of one, it gets it at once."""
    store = RelayStore(str(tmp_path), retry=FAST_RETRY)
    learner = Learner(lr=1e-4)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=3))
    publisher.hold(0)
    reader = RelayStore(str(tmp_path), retry=FAST_RETRY)  # the sampler's own client, its own counters
    follower = RelayFollower(RelayPuller(reader, "run"), group=0, replica=0, poll_s=0.01, idle_s=3600.0)
    follower.hint(0)
    follower.start()
    try:
        publisher.publish(0, learner.weights())
        wait_for(lambda: follower.status().staged == 0)
        for version in range(1, 4):
            lists = reader.counters.get("lists")
            time.sleep(0.5)  # 50 listings' worth of poll_s: none happens while nothing newer is due
            assert reader.counters.get("lists") == lists
            learner.step()
            follower.hint(version)  # the learner's window opens before the version is in the store
            time.sleep(0.05)
            publisher.publish(version, learner.weights())
            wait_for(lambda v=version: follower.status().staged == v, timeout_s=5.0)
        time.sleep(0.3)
        reads_per_version = reader.counters.get("reads") / 4
        assert reads_per_version <= 3, reader.counters.metrics()  # a manifest and its shards, nothing per second
    finally:
        follower.stop()
        publisher.close()


def test_a_version_reported_as_staged_is_still_there_when_taken_however_many_arrive_meanwhile(tmp_path: Path) -> None:
    """The learner installs the version a status reported; newer versions arriving before it asks (more than the
    follower keeps staged) must not drop that one (a run stopped on "version 34 is not staged (staged: [35, 36])")."""
    with following(tmp_path) as (follower, publish):
        truth = {1: publish(1)}
        assert wait_for(lambda: follower.status().staged == 1)  # reported
        for version in range(2, 6):  # more than STAGED_KEPT newer versions arrive before the learner asks
            truth[version] = publish(version)
            wait_for(lambda v=version: v in follower._staged)
        assert follower.take(1).equal(truth[1])  # still staged, exactly
        assert sorted(follower._staged) == [4, 5]  # the reported one gone once taken; the newest two kept
        assert follower.status().staged == 5 and follower.take(5).equal(truth[5])


def test_a_slow_link_makes_a_follower_arrive_later_by_its_bytes(tmp_path: Path) -> None:
    store = RelayStore(str(tmp_path), retry=FAST_RETRY)
    learner = Learner(width=256)
    publisher = RelayPublisher(store, "run", RelayConfig())
    train_and_publish(learner, publisher, [1])
    size = publisher.published[1].nbytes("full")
    fast = RelayFollower(RelayPuller(store, "run"), 0, 0, poll_s=0.01)
    slow = RelayFollower(RelayPuller(store, "run", link=Link(LinkConfig(bandwidth_mbps=8.0))), 1, 1, poll_s=0.01)
    started = time.time()
    for follower in (fast, slow):
        follower.start()
    arrivals = {}
    for name, follower in (("fast", fast), ("slow", slow)):
        status = wait_for(lambda f=follower: (s := f.status()).receipts and s)
        arrivals[name] = status.receipts[0].arrival - started
        follower.stop()
    expected = size * 8 / 8e6  # bytes / bandwidth
    assert arrivals["slow"] >= 0.95 * expected
    assert arrivals["slow"] - arrivals["fast"] >= 0.8 * expected
    publisher.close()


def test_a_follower_whose_chain_is_gone_asks_for_a_keyframe_then_recovers(tmp_path: Path) -> None:
    store = RelayStore(str(tmp_path), retry=FAST_RETRY)
    learner = Learner()
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=100))
    publisher.hold(1)
    follower = RelayFollower(RelayPuller(store, "run"), 0, 0, poll_s=0.01)
    train_and_publish(learner, publisher, [1])
    follower.start()
    wait_for(lambda: follower.status().staged == 1)
    # stop the follower's progress while version 2's shards are removed, as a store losing objects would
    follower.stop()
    train_and_publish(learner, publisher, [2])
    for shard in publisher.published[2].delta:
        (tmp_path / shard_key(shard.sha256)).unlink()
    resumed = RelayFollower(follower.puller, 0, 0, poll_s=0.01)
    resumed._held = follower._held  # the same sampler process, holding version 1
    resumed.start()
    assert wait_for(lambda: resumed.status().keyframe_needed) == 2
    publisher.request_keyframe()
    learner.step()
    publisher.publish(3, learner.weights())
    status = wait_for(lambda: (s := resumed.status()).staged == 3 and s)
    assert status.keyframe_needed is None
    assert resumed.take(3).equal(codec.WeightBits.from_tensors(learner.weights()))
    resumed.stop()
    publisher.close()


def test_the_book_holds_each_group_at_its_oldest_replica_and_measures_arrival_lags() -> None:
    book = ArrivalBook({0: 0, 1: 0, 2: 1}, num_groups=2, start_version=0, start_time=100.0)
    book.publish(1, now=110.0)
    book.publish(2, now=120.0)
    assert book.install(Receipt(0, 0, 2, arrival=125.0, nbytes=10, seconds=1.0)) is not None
    assert book.held == [0, 0]  # replica 1 of group 0 still holds version 0
    book.install(Receipt(0, 1, 1, arrival=112.0, nbytes=5, seconds=1.0))
    book.install(Receipt(1, 2, 2, arrival=121.0, nbytes=7, seconds=1.0))
    assert book.held == [1, 2] and book.oldest_held() == 1
    assert book.install(Receipt(0, 1, 1, arrival=113.0, nbytes=5, seconds=1.0)) is None  # not newer
    metrics = book.metrics(learner_version=2)
    assert metrics[0, "weight_age"] == 1 and metrics[0, "relay_bytes"] == 15
    assert metrics[0, "arrival_lag_mean_s"] == pytest.approx((5.0 + 2.0) / 2)
    assert metrics[1, "arrival_lag_mean_s"] == pytest.approx(1.0)
    assert metrics[0, "pull_s_mean"] == pytest.approx(1.0)
    book.remove_replica(1)
    assert book.held == [2, 2]
    book.retire(1)
    assert book.oldest_held() == 2


def test_a_store_that_cannot_work_any_more_ends_in_a_clear_error_at_once_and_installs_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = RelayStore(str(root), retry=FAST_RETRY)
    learner = Learner()
    publisher = RelayPublisher(store, "run", RelayConfig())
    train_and_publish(learner, publisher, [1])
    publisher.close()
    follower = RelayFollower(RelayPuller(store, "run"), 0, 0, poll_s=0.01, outage_s=600)
    follower.start()
    wait_for(lambda: follower.status().staged == 1)
    follower.take(1)
    moved = tmp_path / "gone"
    root.rename(moved)
    root.write_text("the store's directory was replaced by a file")  # every read now fails, and always will
    status = wait_for(lambda: (s := follower.status()).error and s)
    # a permanent error: not retried by the store, nor for the outage budget (which is 10 minutes here)
    assert str(root) in status.error and "not retried" in status.error and "Fix:" in status.error
    assert status.staged is None and status.counters["store_errors"] == 1 and "retries" not in status.counters
    assert status.counters["pull_failures"] == 1
    follower.stop()
