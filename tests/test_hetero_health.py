"""The health monitor against real Ray actors: a killed server is reported as died, one whose event loop is
blocked as hung within the timeout, a healthy one never."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _server_class(ray):
    @ray.remote
    class Server:
        """Like a verl rollout server: an async actor whose get_server_address runs on its event loop."""

        async def start(self) -> None:
            self.loop = asyncio.get_running_loop()

        def get_server_address(self):
            return ("127.0.0.1", 1)

    return Server


def test_a_dead_and_a_hung_server_are_reported_and_a_healthy_one_is_not(ray_local):
    from gepo_plugin.hetero.settings import HealthConfig
    from gepo_plugin.verl_glue.hetero.health import HealthMonitor, probe

    ray = ray_local
    server = _server_class(ray)
    healthy, dying, hanging = (server.remote() for _ in range(3))
    ray.get([s.start.remote() for s in (healthy, dying, hanging)])
    lost: list[tuple[int, str, float]] = []
    interval, timeout = 0.3, 1.5
    monitor = HealthMonitor(HealthConfig(interval_s=interval, timeout_s=timeout), lambda *x: lost.append(x))
    for replica, handle in enumerate((healthy, dying, hanging)):
        monitor.watch(replica, [handle])
    monitor.start()
    time.sleep(3 * interval)
    assert lost == []
    ray.kill(dying)
    hang = lambda s: s.loop.call_soon_threadsafe(time.sleep, 60) and None  # noqa: E731
    ray.get(hanging.__ray_call__.remote(hang))
    deadline = time.monotonic() + timeout + 5 * interval
    while len(lost) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.stop()
    assert sorted((replica, kind) for replica, kind, _ in lost) == [(1, "died"), (2, "hung")]
    detect = {replica: seconds for replica, _, seconds in lost}
    assert detect[1] <= 3 * interval and timeout <= detect[2] <= timeout + 2 * interval
    # the synchronous check used after a failed call agrees, and leaves the healthy server alone
    assert probe({0: [healthy], 1: [dying]}, timeout_s=1.0) == {1: "died"}
