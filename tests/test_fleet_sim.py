"""A fleet of 64 synthetic remote samplers against verl's real trainer (``gepo_plugin.fleet_sim``): the learner's
side holds it in pooled proxy processes, every rollout is accounted for, the lag bound holds, samplers that vanish
are retired, and each sampler reads the store a constant number of times per version.

The samplers speak the real protocol over HTTP to the real gateway (many per asyncio process), follow the real
relay's signed manifests in a directory store (every shard fetched and checked), and answer after log-normal delays;
a few straggle and three vanish mid-run. The large sizes, and the audit at scale (``--audit``), are
``bench/bench_fleet.py``'s; the audit's catching liars through verl's trainer is ``tests/test_remote_e2e.py``'s.
"""

from __future__ import annotations

import math

import pytest
from chaos import check_every_step

from gepo_plugin.fleet_sim.profile import FleetProfile
from gepo_plugin.fleet_sim.run import FleetRun, run_fleet

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

SAMPLERS, MAX_LAG = 64, 2
RUN = FleetRun(
    samplers=SAMPLERS,
    groups=4,
    steps=8,
    learners=1,  # the fleet's side is under test: one learner process starts sooner
    max_lag=MAX_LAG,
    sampler_timeout_s=8.0,
    profile=FleetProfile(generation_median_s=0.5, stragglers=0.1, vanish=0.05, vanish_after_s=8.0, seed=3),
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return run_fleet(RUN, tmp_path_factory.mktemp("fleet"))


def test_every_rollout_is_accounted_for_and_the_lag_bound_holds_at_every_step(fleet):
    metrics = fleet["metrics"]
    assert len(metrics) == RUN.steps
    check_every_step(metrics, MAX_LAG)  # produced = trained + dropped + queued; lag <= max_lag; every name declared
    assert all(math.isfinite(v) for m in metrics.values() for v in m.values() if isinstance(v, float))


def test_the_fleet_joins_is_trained_and_every_vanished_sampler_is_retired(fleet):
    summary, last = fleet["summary"], fleet["metrics"][RUN.steps]
    vanished = summary["vanished"]
    assert 1 <= vanished < SAMPLERS // 4
    assert last["hetero/sampler_failures/died"] == vanished  # each silent one retired, no live one
    assert last["hetero/sampler_replicas_alive"] == 1 + SAMPLERS - vanished  # the in-cluster one and every other
    remote = sum(m.get(f"hetero/sampler_group_{g}/trained_trajectories", 0) for m in fleet["metrics"].values()
                 for g in range(1, 1 + RUN.groups))  # fmt: skip
    assert remote > 0 and summary["results"] > 0


def test_the_learner_side_holds_the_fleet_in_a_few_processes(fleet):
    """One proxy process per sampler (the design before pools) would put more processes under the launcher than
    there are samplers."""
    assert fleet["summary"]["processes"] < SAMPLERS


def test_each_sampler_reads_the_store_a_constant_number_of_times_per_version(fleet):
    """Listings only while a newer version is due (the gateway says so with every poll), a manifest and its shards
    per version: not a listing every poll interval for as long as a step takes."""
    summary = fleet["summary"]
    assert summary["store_lists_per_version_per_sampler"] <= 4, summary
    assert summary["store_reads_per_version_per_sampler"] <= 4, summary
    assert summary["publish_to_all_s"] is not None and summary["publish_to_all_s"]["max"] < 10.0, summary
