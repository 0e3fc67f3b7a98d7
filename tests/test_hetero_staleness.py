"""The staleness bound is exact (K means K), and no rollout is ever lost (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gepo_plugin.hetero.accounting import AccountingError, RolloutLedger
from gepo_plugin.hetero.core import MIXED, OVERFLOW, QUARANTINED, STALE, BoundViolation, StalenessCore
from gepo_plugin.hetero.staleness import StalenessConfigError, StalenessPolicy, Verdict


@pytest.mark.parametrize("k", [0, 1, 8])
def test_lag_k_is_trained_and_lag_k_plus_one_is_not(k):
    policy = StalenessPolicy(max_lag=k)
    v = 20
    assert policy.verdict(v, v - k, v - k) is Verdict.TRAIN
    assert policy.verdict(v, v - k - 1, v - k - 1) is Verdict.DROP_STALE
    assert policy.must_train_now(v, np.array([v - k, v - k + 1])).tolist() == [True, False]
    if k == 0:
        assert policy.verdict(v, v, v) is Verdict.TRAIN  # on-policy


def test_lag_counts_the_oldest_token_of_a_mixed_group():
    policy = StalenessPolicy(max_lag=2)
    assert policy.verdict(10, 7, 10) is Verdict.DROP_STALE  # newest tokens are fresh, oldest are 3 behind
    assert StalenessPolicy(max_lag=2, refuse_mixed_versions=True).verdict(10, 9, 10) is Verdict.DROP_MIXED


def test_admission_and_waiting():
    policy = StalenessPolicy(max_lag=2, strategy="wait", admission_margin=1)
    assert policy.may_start(10, 9) and not policy.may_start(10, 8)
    assert policy.must_train_now(10, np.array([8, 9])).tolist() == [True, False]  # at 11 version 8 would lag 3
    core = StalenessCore(policy)
    # in flight: "old" submitted at step 9 (its tokens are from version >= 8), "fresh" at step 10
    assert core.urgent(10, {"old": 9, "fresh": 10}) == ["old"]  # the learner waits for "old" at version 10
    core.record_floor(10, 8)  # a sampler still held version 8 when step 10 began: "fresh" may be that old
    assert sorted(core.urgent(10, {"old": 9, "fresh": 10})) == ["fresh", "old"]
    assert StalenessCore(StalenessPolicy(max_lag=2, strategy="drop")).urgent(10, {"old": 1}) == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_lag": -1}, "max_lag must be an integer >= 0"),
        ({"max_lag": 1.5}, "max_lag must be an integer"),
        ({"strategy": "block"}, "unknown staleness strategy"),
        ({"max_lag": 1, "strategy": "wait", "admission_margin": 2}, "never let a sampler start"),
    ],
)
def test_impossible_staleness_settings_are_rejected(kwargs, match):
    with pytest.raises(StalenessConfigError, match=match):
        StalenessPolicy(**kwargs)


def test_ledger_refuses_double_counting_and_restores_from_state():
    ledger = RolloutLedger()
    ledger.produce("a", 0)
    with pytest.raises(AccountingError, match="produced twice"):
        ledger.produce("a", 0)
    ledger.produce("b", 1)
    ledger.train(["a"])
    with pytest.raises(AccountingError, match="not queued"):
        ledger.drop(["a"], "stale")
    restored = RolloutLedger.from_state_dict(ledger.state_dict())
    assert restored.metrics() == ledger.metrics()
    assert restored.queued_groups() == {"b": 1}
    broken = ledger.state_dict() | {"produced": 5}
    with pytest.raises(AccountingError, match="rollouts lost"):
        RolloutLedger.from_state_dict(broken)


def test_the_core_evicts_with_reasons_selects_oldest_first_and_refuses_to_break_the_bound():
    core = StalenessCore(StalenessPolicy(max_lag=2, strategy="drop", refuse_mixed_versions=True))
    core.finished("old", 5, 5, submitted=6)
    core.finished("mixed", 8, 9, submitted=9)
    core.finished("b", 9, 9, submitted=10)
    core.finished("a", 9, 9, submitted=9)
    core.record_floor(10, 7)  # a sampler still held version 7 when step 10 began
    core.failed("gone", submitted=10)
    assert core.ledger.queued_groups()["gone"] == 7
    assert core.evictions(10) == {"old": STALE, "mixed": MIXED, "gone": "failed"}
    core.drop(core.evictions(10))
    assert core.select(["b", "a"], 1) == ["a"]  # same version: the earlier submission first
    assert core.train(["a", "b"], 10).tolist() == [1, 1]
    assert core.metrics()["dropped/stale"] == 1 and core.metrics()["trained"] == 2
    core.finished("late", 7, 7)
    with pytest.raises(BoundViolation, match="lag 3 > max_lag 2"):
        core.train(["late"], 10)
    waiting = StalenessCore(StalenessPolicy(max_lag=2, strategy="wait"))
    waiting.finished("x", 7, 7)
    assert waiting.evictions(10) == {"x": OVERFLOW}  # under wait an expired group is an overflow, never "stale"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("produce"), st.integers(0, 6), st.integers(0, 2)),  # sampler behind by d, spans s
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),  # learner update, batch size
        st.tuples(st.just("resume"), st.just(0), st.just(0)),  # save and restore the books mid-run
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, k=st.integers(0, 4), strategy=st.sampled_from(["drop", "wait"]))
def test_random_interleavings_never_exceed_the_bound_nor_lose_a_rollout(ops, k, strategy):
    """The core driven as verl drives it: every step evicts, selects and trains one batch, then the learner
    advances. The bound always holds, the books always balance, and a resume changes nothing."""
    core = StalenessCore(StalenessPolicy(max_lag=k, strategy=strategy, admission_margin=0))
    version, produced, trained_lags = 0, 0, []
    for kind, a, b in ops:
        if kind == "produce":
            min_version = max(0, version - a)
            if not core.may_start(version, min_version):
                continue  # admission control: this rollout could not be trained in time
            core.finished(f"g{produced:04d}", min_version, min(version, min_version + b), submitted=version + 1)
            produced += 1
        elif kind == "step":
            reasons = core.evictions(version)
            assert set(reasons.values()) <= ({STALE} if strategy == "drop" else {OVERFLOW})
            core.drop(reasons)
            chosen = core.select(core.queued, batch_size=a)
            trained_lags += core.train(chosen, version).tolist()
            version += 1
        else:
            restored = StalenessCore(core.policy)
            restored.load_state_dict(core.state_dict())
            assert restored.metrics() == core.metrics() and restored.queued == core.queued
            core = restored
        core.ledger.check()
        assert core.ledger.produced == produced
    assert all(lag <= k for lag in trained_lags), trained_lags


def test_groups_of_a_quarantined_sampler_are_evicted_as_quarantined_never_trained_and_the_books_balance():
    core = StalenessCore(StalenessPolicy(max_lag=4))
    core.finished("a", 3, 3, submitted=4)  # a finished group the liar took part in
    core.finished("b", 3, 3, submitted=4)  # an honest one
    core.failed("c", submitted=4)  # one that failed when the liar was retired
    core.quarantine(["a", "c", "gone"])  # (an id no longer queued is ignored)
    with pytest.raises(BoundViolation, match="quarantined"):
        core.train(["a"], learner_version=4)
    assert core.select(["a", "b"], batch_size=2) == ["b"]
    evictions = core.evictions(learner_version=4)
    assert evictions == {"a": QUARANTINED, "c": QUARANTINED} and core.failed_ids == {"c"}
    restored = StalenessCore(StalenessPolicy(max_lag=4))
    restored.load_state_dict(core.state_dict())  # a checkpoint between the verdict and the eviction keeps it
    assert restored.evictions(learner_version=4) == evictions
    core.drop(evictions)
    core.train(["b"], learner_version=4)
    m = core.metrics()
    assert m["dropped/quarantined"] == 2 and m["trained"] == 1 and m["produced"] == 3 and m["queued"] == 0
