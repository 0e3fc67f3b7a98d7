"""Every transport's view of who holds which weight version obeys one contract (``SamplerVersions``).

Each implementation gets a driver that makes versions arrive the way its transport does (the simulated schedule draws
constant delays; the relay's book installs receipts that arrive after the same delays). The same tests then run
against every implementation: a new transport's view joins the suite with one entry in ``DRIVERS``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gepo_plugin.hetero.delays import ConstantDelay
from gepo_plugin.hetero.sampler_versions import SamplerVersions
from gepo_plugin.hetero.weight_schedule import WeightArrivalSchedule
from gepo_sampler.relay.arrivals import ArrivalBook
from gepo_sampler.relay.follower import Receipt

#: seconds from publication to arrival, per group; publications are further apart than the slowest arrival
DELAYS_S = (0.0, 10.0, 20.0)
START = 3


class ScheduleDriver:
    """The simulated transport's view: arrivals drawn from (constant) delay models."""

    def __init__(self) -> None:
        self.versions = WeightArrivalSchedule([ConstantDelay(d) for d in DELAYS_S], start_version=START)

    def publish(self, version: int, now: float) -> None:
        self.versions.publish(version, now)

    def arrive(self, now: float) -> None:
        self.versions.advance(now)


class BookDriver:
    """The relay transport's view: one replica per group, whose receipts arrive after the same delays."""

    def __init__(self) -> None:
        self.versions = ArrivalBook({g: g for g in range(len(DELAYS_S))}, len(DELAYS_S), start_version=START)
        self.pending: list[Receipt] = []

    def publish(self, version: int, now: float) -> None:
        self.versions.publish(version, now)
        self.pending += [Receipt(g, g, version, now + d, 1, d) for g, d in enumerate(DELAYS_S) if self.versions.live[g]]

    def arrive(self, now: float) -> None:
        for receipt in [r for r in self.pending if r.arrival <= now]:
            self.pending.remove(receipt)
            self.versions.install(receipt)


DRIVERS: dict[str, Callable[[], ScheduleDriver | BookDriver]] = {"simulated": ScheduleDriver, "relay": BookDriver}


@pytest.fixture(params=sorted(DRIVERS))
def driver(request):
    return DRIVERS[request.param]()


def test_it_is_the_declared_protocol_and_starts_with_every_group_at_the_start_version(driver):
    versions = driver.versions
    assert isinstance(versions, SamplerVersions)
    assert versions.num_groups == len(DELAYS_S) and versions.latest == START
    assert list(versions.held) == [START] * len(DELAYS_S) and versions.oldest_held() == START


def test_groups_hold_what_has_arrived_and_the_floor_is_the_slowest_live_group(driver):
    driver.publish(START + 1, now=100.0)
    driver.arrive(105.0)
    assert list(driver.versions.held) == [START + 1, START, START]
    assert driver.versions.latest == START + 1 and driver.versions.oldest_held() == START
    driver.arrive(125.0)
    assert list(driver.versions.held) == [START + 1] * 3 and driver.versions.oldest_held() == START + 1


def test_a_retired_group_no_longer_holds_the_floor_and_the_last_one_cannot_be_retired_silently(driver):
    driver.publish(START + 1, now=100.0)
    driver.arrive(111.0)  # groups 0 and 1 have it, group 2 not yet
    driver.versions.retire(2)
    assert not driver.versions.live[2] and driver.versions.oldest_held() == START + 1
    driver.versions.retire(0)
    driver.versions.retire(1)
    with pytest.raises(ValueError, match="no sampler group is live"):
        driver.versions.oldest_held()


def test_metrics_give_each_groups_version_and_its_age_against_the_learner(driver):
    driver.publish(START + 1, now=100.0)
    driver.arrive(105.0)
    driver.publish(START + 2, now=200.0)
    driver.arrive(215.0)
    metrics = driver.versions.metrics(learner_version=START + 2)
    held = list(driver.versions.held)
    assert held == [START + 2, START + 2, START + 1]
    for group, version in enumerate(held):
        assert metrics[group, "weight_version"] == version
        assert metrics[group, "weight_age"] == START + 2 - version
    assert all(isinstance(name, str) and "/" not in name for _, name in metrics)  # unprefixed: named by the glue
