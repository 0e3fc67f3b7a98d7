"""Many samplers' proxies in one Ray actor (:class:`ProxyPool`): verl's call path through a pooled handle, one call
per pool for what the learner asks of all, and a retirement failing what the sampler was asked."""

from __future__ import annotations

import pickle

import pytest
import ray

from gepo_plugin.verl_glue.hetero.health import probe
from gepo_plugin.verl_glue.hetero.remote.pool import PooledProxy, ProxyGone, ProxyPool
from gepo_sampler.remote.protocol import SamplerStatus, VersionWindow
from gepo_sampler.remote.settings import GatewayConfig

pytestmark = pytest.mark.ray

SAMPLERS = 200


@pytest.fixture(scope="module")
def pool():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(ProxyPool).options(max_concurrency=10_000).remote()
        window = VersionWindow(first=0, latest=0)
        ray.get(
            [
                actor.add.remote(f"s{i}#{i}", f"s{i}", f"remote/s{i}", GatewayConfig(), window, 100, 8)
                for i in range(SAMPLERS)
            ]
        )
        yield actor
    finally:
        ray.shutdown()


def handle(pool, i: int) -> PooledProxy:
    return PooledProxy(pool, f"s{i}#{i}")


def test_two_hundred_samplers_share_one_process_and_each_answers_as_its_own(pool):
    handles = [handle(pool, i) for i in range(SAMPLERS)]
    assert ray.get(pool.size.remote()) == SAMPLERS
    for i, one in enumerate(handles[:20]):
        assert ray.get(one.update_status.remote(SamplerStatus(version=0, in_flight=i).model_dump())) == {}
    reports = ray.get([one.report.remote() for one in handles[:20]])
    assert [report["status"]["in_flight"] for report in reports] == list(range(20))
    bulk = ray.get(pool.reports.remote([one.key for one in handles[:20]]))
    assert [bulk[one.key]["status"]["in_flight"] for one in handles[:20]] == list(range(20))
    assert ray.get(handles[7].get_server_address.remote()) == "remote/s7"
    assert pickle.loads(pickle.dumps(handles[3])).key == "s3#3"  # travels like an actor handle


def test_the_window_reaches_every_proxy_in_one_call(pool):
    ray.get(pool.set_window.remote(0, 5))
    one = handle(pool, 11)
    assert ray.get(one.update_status.remote(SamplerStatus(version=5).model_dump())) == {}
    assert ray.get(one.update_status.remote(SamplerStatus(version=6).model_dump())) == {"refused": "status_version"}


def test_a_retired_samplers_requests_fail_its_calls_are_refused_and_the_probe_calls_it_died(pool):
    one, other, paused = handle(pool, SAMPLERS - 1), handle(pool, SAMPLERS - 2), handle(pool, SAMPLERS - 3)
    ray.get(other.update_status.remote(SamplerStatus(version=0).model_dump()))
    assert probe({1: [one], 2: [other]}, timeout_s=30) == {}  # both alive, through one call to their pool
    queued = one.generate.remote([1, 2, 3], {"max_tokens": 4}, "r")
    ray.get(paused.abort_all_requests.remote())  # its gate closed (paused): a new request parks there
    parked = paused.generate.remote([1, 2, 3], {"max_tokens": 4}, "p")
    ray.get([one.retire(), paused.retire()])
    for request in (queued, parked):  # both fail now, as when a proxy's process was killed (not after a timeout)
        with pytest.raises(ProxyGone, match="retired"):
            ray.get(request, timeout=30)
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(one.report.remote())
    assert isinstance(refused.value.cause, ProxyGone)
    causes: dict[int, str] = {}
    assert probe({1: [one], 2: [other]}, timeout_s=30, causes=causes) == {1: "died"}
    assert "retired" in causes[1]
