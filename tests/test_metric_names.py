"""The metric table names every metric the plugin's components produce, once (real runs are checked by the e2e
tests: ``undeclared`` over every step they log)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gepo_plugin import metric_names
from gepo_plugin.hetero.core import REASONS, StalenessCore
from gepo_plugin.hetero.guard import GuardConfig
from gepo_plugin.hetero.roster import FAILURES, SamplerRoster
from gepo_plugin.hetero.staleness import StalenessPolicy
from gepo_plugin.metric_names import METRICS, RELAY_COUNTERS, declaration, undeclared

PACKAGE = Path(metric_names.__file__).parent
#: the relay's package, in the sampler host's distribution
RELAY = PACKAGE.parent / "sampler" / "gepo_sampler" / "relay"


def test_each_key_is_declared_once_with_a_meaning():
    keys = [metric.key for metric in METRICS]
    assert len(keys) == len(set(keys))
    assert all(metric.meaning and metric.key.startswith(metric_names.NAMESPACES) for metric in METRICS)


def test_a_key_outside_the_table_is_caught_and_verls_own_are_left_alone():
    assert undeclared(["hetero/sampler_group_3/weight_age", "actor/gepo/iw_by_lag/3-8/ess"]) == []
    assert undeclared(["hetero/sampler_group_3/weight_agee", "actor/gepo/step_totals/rows", "actor/pg_loss"]) == [
        "actor/gepo/step_totals/rows",  # a total that must be turned into a mean before it is logged
        "hetero/sampler_group_3/weight_agee",
    ]
    assert declaration("hetero/sampler_group_0/paused").meaning.startswith("1 while")


def test_every_counter_the_relay_counts_is_declared():
    counted = set()
    for path in RELAY.glob("*.py"):
        counted |= set(re.findall(r"counters\.add\(\s*\"([a-z_]+)\"", path.read_text()))
    assert counted and counted <= set(RELAY_COUNTERS), counted - set(RELAY_COUNTERS)


@pytest.mark.parametrize("guard", [False, True])
def test_the_books_the_staleness_core_reports_are_declared_under_hetero(guard):
    core = StalenessCore(StalenessPolicy(max_lag=2), GuardConfig(enable=guard) if guard else None)
    core.finished("a", 0, 0)
    roster = SamplerRoster([1, 1])
    roster.retire(0, "hung", 0, 1.0)
    emitted = {
        **metric_names.under(metric_names.HETERO, core.metrics()),
        **metric_names.under(metric_names.HETERO, roster.metrics()),
    }
    assert {f"hetero/dropped/{reason}" for reason in REASONS} <= set(emitted)
    assert {f"hetero/sampler_failures/{kind}" for kind in FAILURES} <= set(emitted)
    assert undeclared(emitted) == []
