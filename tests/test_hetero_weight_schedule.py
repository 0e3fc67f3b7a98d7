"""The weight-arrival schedule: who installs which version when, under simulated delay."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gepo_plugin.hetero.delays import ConstantDelay, ExponentialDelay, LogNormalDelay
from gepo_plugin.hetero.weight_schedule import WeightArrivalSchedule


def run(schedule: WeightArrivalSchedule, publish_times: list[float], poll_times: list[float]):
    """Publish versions 1..n at ``publish_times`` with polls in between; return all deliveries in order."""
    events = sorted([(t, 1, i + 1) for i, t in enumerate(publish_times)] + [(t, 0, None) for t in poll_times])
    deliveries = []
    for time, kind, version in events:
        deliveries += schedule.publish(version, time) if kind else schedule.advance(time)
    return deliveries


def test_no_delay_installs_every_version_at_once():
    schedule = WeightArrivalSchedule([None, None], seed=0)
    for version in range(1, 5):
        deliveries = schedule.publish(version, float(version))
        assert {(d.group, d.version, d.arrival) for d in deliveries} == {(0, version, version), (1, version, version)}
    assert schedule.held == [4, 4] and schedule.needed_versions() == {4}


def test_constant_delay_follows_the_download_one_version_at_a_time_rule():
    """Delay 2.5 s, a version per second: the group installs 1 at 3.5, then 3 (newest at 3.5) at 6, then 5 at 8.5."""
    schedule = WeightArrivalSchedule([ConstantDelay(2.5)], seed=0)
    deliveries = run(schedule, [1.0, 2.0, 3.0, 4.0, 5.0], [100.0])
    assert [(d.version, d.started, d.arrival) for d in deliveries] == [(1, 1.0, 3.5), (3, 3.5, 6.0), (5, 6.0, 8.5)]


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=25),
    polls=st.lists(st.floats(0.0, 80.0), max_size=30),
    seed=st.integers(0, 2**16),
    groups=st.integers(1, 4),
)
def test_invariants_under_random_publication_and_polling(gaps, polls, seed, groups):
    delays = [None, ConstantDelay(1.7), ExponentialDelay(3.0), LogNormalDelay.from_interval(0.5, 20.0)][:groups]
    times = list(np.cumsum(gaps))
    schedule = WeightArrivalSchedule(delays, seed=seed)
    deliveries = run(schedule, times, polls)
    published_at = {0: 0.0, **{i + 1: t for i, t in enumerate(times)}}
    last = {}
    for d in deliveries:
        # the installed version is the newest one published when its download started; a download that starts at the
        # very moment of a publication (an arrival then) starts the version published before it (arrivals first)
        newest_then = max(v for v, t in published_at.items() if t <= d.started)
        newest_before = max((v for v, t in published_at.items() if t < d.started), default=newest_then)
        assert d.version in (newest_then, newest_before), (d, newest_then)
        if d.version != newest_then:
            assert published_at[newest_then] == d.started
        assert d.arrival >= d.started
        assert d.version > last.get(d.group, 0), "a group's versions only increase"
        last[d.group] = d.version
    assert all(0 <= held <= schedule.latest for held in schedule.held)
    assert len(schedule.needed_versions()) <= groups + 1
    # lazy replay: one late poll gives exactly the deliveries of frequent polling
    eager = WeightArrivalSchedule(delays, seed=seed)
    lazy = WeightArrivalSchedule(delays, seed=seed)
    horizon = times[-1] + 1000.0
    eager_all = run(eager, times, [*np.linspace(0, horizon, 400).tolist()])
    lazy_all = run(lazy, times, [horizon])
    assert eager_all == lazy_all
    assert eager.held == lazy.held == [schedule.latest] * groups


def test_same_seed_same_draws_and_groups_are_independent_streams():
    a = WeightArrivalSchedule([ExponentialDelay(2.0), ExponentialDelay(2.0)], seed=3)
    b = WeightArrivalSchedule([ExponentialDelay(2.0), ExponentialDelay(2.0), ExponentialDelay(2.0)], seed=3)
    run(a, [1.0, 2.0, 3.0], [50.0])
    run(b, [1.0, 2.0, 3.0], [50.0])
    assert a.drawn[0] == b.drawn[0] and a.drawn[1] == b.drawn[1]
    c = WeightArrivalSchedule([ExponentialDelay(2.0), ExponentialDelay(2.0)], seed=4)
    run(c, [1.0, 2.0, 3.0], [50.0])
    assert c.drawn[0] != a.drawn[0]


def test_bad_publications_are_refused():
    schedule = WeightArrivalSchedule([None], seed=0, start_version=5, start_time=10.0)
    with pytest.raises(ValueError, match="not newer"):
        schedule.publish(5, 11.0)
    with pytest.raises(ValueError, match="backwards"):
        schedule.publish(6, 9.0)
    with pytest.raises(ValueError, match="at least one"):
        WeightArrivalSchedule([], seed=0)


def test_a_retired_group_downloads_nothing_and_no_longer_holds_the_oldest_version():
    schedule = WeightArrivalSchedule([ConstantDelay(1.0), ConstantDelay(100.0)], seed=0)
    schedule.publish(1, 0.0)
    assert schedule.oldest_held() == 0 and schedule.needed_versions() == {1}  # both download version 1
    schedule.retire(1)
    assert schedule.needed_versions() == {1} and schedule.downloading[1] is None
    deliveries = schedule.publish(2, 5.0)  # group 0 got 1 at t=1, then started on 2 at t=5
    assert [(d.group, d.version) for d in deliveries] == [(0, 1)]
    assert schedule.oldest_held() == 1  # group 1's version 0 no longer pins the floor
    assert schedule.downloading[1] is None  # nothing started for the retired group
    assert schedule.advance(1000.0)[-1].group == 0


def test_a_group_rejoins_with_the_newest_version():
    schedule = WeightArrivalSchedule([None, ConstantDelay(50.0)], seed=0)
    for version in (1, 2, 3):
        schedule.publish(version, float(version))
    schedule.retire(1)
    assert schedule.rejoin(1) == 3 and schedule.held == [3, 3] and schedule.oldest_held() == 3
    schedule.publish(4, 4.0)  # the rejoined group downloads again
    assert schedule.downloading[1] is not None and schedule.downloading[1][0] == 4


def test_with_every_group_retired_there_is_no_oldest_version():
    schedule = WeightArrivalSchedule([None], seed=0)
    schedule.retire(0)
    with pytest.raises(ValueError, match="no sampler group is live"):
        schedule.oldest_held()
