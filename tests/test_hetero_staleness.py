"""The staleness bound is exact (K means K), and no rollout is ever lost (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gepo_plugin.hetero.accounting import AccountingError, RolloutLedger
from gepo_plugin.hetero.staleness import (
    BoundedStalenessQueue,
    StalenessConfigError,
    StalenessPolicy,
    Verdict,
)


@pytest.mark.parametrize("k", [0, 1, 8])
def test_lag_k_is_trained_and_lag_k_plus_one_is_not(k):
    policy = StalenessPolicy(max_lag=k)
    v = 20
    assert policy.verdict(v, v - k, v - k) is Verdict.TRAIN
    assert policy.verdict(v, v - k - 1, v - k - 1) is Verdict.DROP_STALE
    assert policy.trainable(v, np.array([v - k, v - k - 1, v])).tolist() == [True, False, True]
    if k == 0:
        assert policy.verdict(v, v, v) is Verdict.TRAIN  # on-policy


def test_lag_counts_the_oldest_token_of_a_mixed_group():
    policy = StalenessPolicy(max_lag=2)
    assert policy.verdict(10, 7, 10) is Verdict.DROP_STALE  # newest tokens are fresh, oldest are 3 behind
    assert StalenessPolicy(max_lag=2, refuse_mixed_versions=True).verdict(10, 9, 10) is Verdict.DROP_MIXED


def test_admission_and_waiting():
    policy = StalenessPolicy(max_lag=2, strategy="wait", admission_margin=1)
    assert policy.may_start(10, 9) and not policy.may_start(10, 8)
    assert policy.learner_may_advance(10, np.array([9, 10]))
    assert not policy.learner_may_advance(10, np.array([8, 10]))  # at 11 the version-8 group would lag 3
    assert policy.must_train_now(10, np.array([8, 9])).tolist() == [True, False]
    assert StalenessPolicy(max_lag=2, strategy="drop").learner_may_advance(10, np.array([0]))


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


operations = st.lists(
    st.one_of(
        st.tuples(st.just("produce"), st.integers(0, 6), st.integers(0, 2)),  # sampler behind by d, spans s
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),  # learner update, batch size
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, k=st.integers(0, 4), strategy=st.sampled_from(["drop", "wait"]))
def test_random_interleavings_never_exceed_the_bound_nor_lose_a_rollout(ops, k, strategy):
    policy = StalenessPolicy(max_lag=k, strategy=strategy, admission_margin=0)
    queue = BoundedStalenessQueue(policy)
    version, produced_min_version, trained_lags = 0, {}, []
    for kind, a, b in ops:
        if kind == "produce":
            min_version = max(0, version - a)
            if strategy == "wait" and not policy.may_start(version, min_version):
                continue  # admission control: this rollout could not be trained in time
            group_id = f"g{len(produced_min_version)}"
            produced_min_version[group_id] = min_version
            queue.add(group_id, min_version, min(version, min_version + b))
        else:
            chosen = queue.select(version, batch_size=a)
            trained_lags += [version - produced_min_version[g] for g in chosen]
            pending = list(queue.ledger.queued_groups().values())
            if policy.learner_may_advance(version, np.array(pending)):
                version += 1
        queue.ledger.check()
        assert queue.ledger.produced == len(produced_min_version)
    assert all(lag <= k for lag in trained_lags), trained_lags
    if strategy == "wait":
        assert sum(queue.ledger.dropped.values()) == 0  # dropless
    restored = RolloutLedger.from_state_dict(queue.ledger.state_dict())
    assert restored.metrics() == queue.ledger.metrics()
