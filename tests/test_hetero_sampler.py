"""The HeteroRL sampler against verl's real ReplayBufferAsync machinery and a real TransferQueue.

The test plays the rollout side exactly as verl's agent loop writes it (prompt keys with
``is_prompt``/``status``/``global_steps`` tags, trajectories ``{uid}_{session}_{i}`` with
``min_global_steps``/``max_global_steps``) and advances learner versions itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

from conftest import hetero_buffer  # noqa: E402
from rollout_writer import RolloutWriter, clear_all  # noqa: E402

from gepo_plugin.hetero.settings import HeteroConfigError  # noqa: E402

pytestmark = pytest.mark.ray
GROUP = 2  # responses per prompt


@pytest.fixture
def clean(transfer_queue):
    yield transfer_queue
    clear_all(tq)


def trained_uids(batch) -> set[str]:
    return {key.split("_")[0] for key in batch.keys}


@pytest.mark.parametrize("max_lag", [0, 1, 8])
def test_drop_bound_is_exact(clean, max_lag):
    """At learner version v, lag K is trained and lag K+1 is dropped (not K+1 trained, not K dropped)."""
    rollouts, refills = RolloutWriter(tq, group_size=GROUP), []
    buffer = hetero_buffer(refills, max_lag=max_lag, strategy="drop")
    step = 20  # sample(global_steps=20) trains version v = 19
    v = step - 1
    edge = rollouts.produce(step=1, version=v - max_lag)
    over = rollouts.produce(step=1, version=v - max_lag - 1)
    fresh = rollouts.produce(step=1, version=v)
    batch, metrics = buffer.sample(global_steps=step, partition_id="train", batch_size=2)
    assert trained_uids(batch) == set(edge) | set(fresh)
    assert len(batch.keys) == 2 * GROUP
    assert metrics["hetero/lag/max"] == max_lag and metrics["hetero/lag/min"] == 0
    assert metrics["hetero/dropped/stale"] == 1 and refills == [1]
    assert metrics["hetero/produced"] == 3 and metrics["hetero/trained"] == 2 and metrics["hetero/queued"] == 0
    assert over[0] not in (tq.kv_list("train") or {}).get("train", {})  # evicted from TransferQueue


def test_dropped_trajectories_report_their_length_and_reward(clean):
    """The step's dropped totals are read back from TransferQueue before verl clears the groups: exactly the
    lengths and rewards the rollout side wrote (the trainer turns them into means beside the trained ones)."""
    rollouts = RolloutWriter(tq, group_size=GROUP, width=6)
    buffer = hetero_buffer(max_lag=1, strategy="drop")
    stale = rollouts.submit(1, 2)
    for uid, lengths in zip(stale, ([6, 2], [1, 3]), strict=True):
        rollouts.finish(uid, [(3, 3)] * GROUP, 1, lengths=lengths)
    fresh = rollouts.produce(step=1, version=9, n=2)
    batch, metrics = buffer.sample(global_steps=10, partition_id="train", batch_size=2)
    assert trained_uids(batch) == set(fresh)
    dropped = [rollouts.written[key] for key in rollouts.written if key.split("_")[0] in stale]
    assert metrics["hetero/dropped_step/trajectories"] == 4
    assert metrics["hetero/dropped_step/length_sum"] == 12
    assert metrics["hetero/dropped_step/reward_sum"] == pytest.approx(sum(r for _, r in dropped), rel=1e-6)


def test_oldest_group_first_and_queue_depth(clean):
    rollouts = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(max_lag=8, strategy="drop")
    young = rollouts.produce(step=3, version=4, n=2)
    old = rollouts.produce(step=3, version=2)
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert set(old) <= trained_uids(batch)
    assert metrics["hetero/queue/finished_untrained"] == 1
    assert metrics["hetero/lag/max"] == 3  # v = 5, oldest token version 2
    assert buffer.ledger.queued_groups().keys() <= set(young)


def test_lag_uses_the_oldest_token_of_the_group(clean):
    """A group whose trajectories span versions 3..6 has min_version 3, whatever its newest token."""
    rollouts = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(max_lag=2, strategy="drop")
    (uid,) = rollouts.submit(step=4)
    rollouts.finish(uid, [(5, 6), (3, 6)], step=4)
    _, metrics = _sample_some(buffer, rollouts, global_steps=7)  # v = 6: lag 3 > 2
    assert metrics["hetero/dropped/stale"] == 1
    assert metrics["hetero/mixed_version_groups"] == 0


def _sample_some(buffer, rollouts, global_steps):
    rollouts.produce(step=global_steps, version=global_steps - 1)
    return buffer.sample(global_steps=global_steps, partition_id="train", batch_size=1)


def test_mixed_versions_recorded_or_refused(clean):
    rollouts = RolloutWriter(tq, group_size=GROUP)
    recorder = hetero_buffer(max_lag=8, strategy="drop")
    (uid,) = rollouts.submit(step=2)
    rollouts.finish(uid, [(1, 2), (1, 1)], step=2)
    batch, metrics = recorder.sample(global_steps=3, partition_id="train", batch_size=1)
    assert trained_uids(batch) == {uid} and metrics["hetero/mixed_version_groups"] == 1

    refuser = hetero_buffer(max_lag=8, strategy="drop", refuse_mixed_versions=True)
    (mixed,) = rollouts.submit(step=2)
    rollouts.finish(mixed, [(1, 2), (1, 1)], step=2)
    pure = rollouts.produce(step=2, version=2)
    batch, metrics = refuser.sample(global_steps=3, partition_id="train", batch_size=1)
    assert trained_uids(batch) == set(pure)
    assert metrics["hetero/dropped/mixed_versions"] == 1


def test_failed_groups_are_counted(clean):
    rollouts, refills = RolloutWriter(tq, group_size=GROUP), []
    buffer = hetero_buffer(refills, max_lag=4, strategy="drop")
    (bad,) = rollouts.submit(step=1)
    rollouts.finish(bad, [], step=1, status="failure")
    rollouts.produce(step=1, version=0)
    _, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert metrics["hetero/dropped/failed"] == 1 and refills == [1]
    assert metrics["hetero/produced"] == 2 and metrics["hetero/trained"] == 1


def test_wait_blocks_until_an_urgent_group_finishes_and_trains_it_first(clean):
    """wait, K=2: at step g the learner may not train while an in-flight group from version g-3 runs."""
    rollouts = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(max_lag=2, strategy="wait")
    (urgent,) = rollouts.submit(step=3)  # submitted at step 3: its tokens are from version >= 2
    rollouts.start(urgent)
    rollouts.produce(step=5, version=4, n=3)  # plenty of fresh groups
    buffer.core.record_floor(3, 2)
    # step 5 trains v=4; a group with min_version 2 has lag 2 now, 3 next step: it must be in this batch
    done = threading.Event()

    def finish_later():
        time.sleep(0.5)
        rollouts.finish(urgent, [(2, 2)] * GROUP, step=3)
        done.set()

    threading.Thread(target=finish_later, daemon=True).start()
    start = time.perf_counter()
    batch, metrics = buffer.sample(global_steps=5, partition_id="train", batch_size=2)
    waited = time.perf_counter() - start
    assert done.is_set() and waited >= 0.4, "the learner did not wait for the urgent group"
    assert urgent in trained_uids(batch)
    assert metrics["hetero/lag/max"] == 2 and metrics["hetero/dropped"] == 0
    assert metrics["hetero/learner_wait_s"] >= 0.4


def test_wait_does_not_block_on_groups_that_can_still_wait(clean):
    rollouts = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(max_lag=2, strategy="wait")
    (later,) = rollouts.submit(step=4)  # version >= 3: lag 1 at v=4, 2 at v=5 -> may wait
    rollouts.start(later)
    fresh = rollouts.produce(step=5, version=4)
    start = time.perf_counter()
    batch, _ = buffer.sample(global_steps=5, partition_id="train", batch_size=1)
    assert time.perf_counter() - start < 0.3
    assert trained_uids(batch) == set(fresh)


def test_wait_overflow_is_evicted_and_counted_never_trained_late(clean):
    """More urgent groups than one batch: the excess is dropped as stale_overflow (counted), the bound holds."""
    rollouts = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(max_lag=1, strategy="wait")
    rollouts.produce(step=2, version=1, n=3)
    _, metrics = buffer.sample(global_steps=3, partition_id="train", batch_size=1)  # v=2: lag 1 ok
    assert metrics["hetero/lag/max"] == 1 and metrics["hetero/queue/finished_untrained"] == 2
    rollouts.produce(step=3, version=2)
    _, metrics = buffer.sample(global_steps=4, partition_id="train", batch_size=1)  # v=3: version 1 -> lag 2
    assert metrics["hetero/dropped/stale_overflow"] == 2 and metrics["hetero/dropped/stale"] == 0
    assert metrics["hetero/lag/max"] <= 1


def test_resume_restores_ledger_and_queued_groups(clean):
    rollouts = RolloutWriter(tq, group_size=GROUP)
    first = hetero_buffer(max_lag=8, strategy="drop")
    rollouts.produce(step=1, version=0, n=3)
    first.sample(global_steps=1, partition_id="train", batch_size=1)
    state = first.state_dict()
    assert state["ledger"]["trained"] == 1 and len(state["ledger"]["queued"]) == 2

    resumed = hetero_buffer(max_lag=8, strategy="drop")
    resumed.load_state_dict(state)
    batch, metrics = resumed.sample(global_steps=2, partition_id="train", batch_size=2)
    assert trained_uids(batch) == set(state["ledger"]["queued"])
    assert metrics["hetero/produced"] == 3 and metrics["hetero/trained"] == 3 and metrics["hetero/queued"] == 0


def test_resume_counts_groups_missing_from_the_queue(clean):
    rollouts = RolloutWriter(tq, group_size=GROUP)
    first = hetero_buffer(max_lag=8, strategy="drop")
    uids = rollouts.produce(step=1, version=0, n=2)
    first.sample(global_steps=1, partition_id="train", batch_size=1)
    state = first.state_dict()
    left = next(iter(state["ledger"]["queued"]))
    tq.kv_clear(keys=[left, f"{left}_0_0", f"{left}_1_0"], partition_id="train")  # lost with the storage
    resumed = hetero_buffer(max_lag=8, strategy="drop")
    resumed.load_state_dict(state)
    rollouts.produce(step=2, version=1)
    _, metrics = resumed.sample(global_steps=2, partition_id="train", batch_size=1)
    assert metrics["hetero/dropped/missing_after_resume"] == 1
    assert metrics["hetero/produced"] == 3 and set(uids) >= {left}


def test_random_interleavings_keep_the_bound_and_the_books(clean):
    """Seeded random production (versions lagging by 0..6, some mixed, some failed) and sampling."""
    rng = np.random.default_rng(0)
    rollouts, refills = RolloutWriter(tq, group_size=GROUP), []
    buffer = hetero_buffer(refills, max_lag=3, strategy="drop")
    produced = 0
    for step in range(1, 16):
        v = step - 1
        for _ in range(int(rng.integers(1, 4))):
            (uid,) = rollouts.submit(step)
            produced += 1
            if rng.random() < 0.1:
                rollouts.finish(uid, [], step, status="failure")
                continue
            lo = max(0, v - int(rng.integers(0, 7)))
            hi = min(v, lo + int(rng.integers(0, 2)))
            rollouts.finish(uid, [(lo, hi), (lo, lo)], step)
        rollouts.produce(step, v)  # at least one trainable group per step
        produced += 1
        _, metrics = buffer.sample(global_steps=step, partition_id="train", batch_size=1)
        assert metrics["hetero/lag/max"] <= 3
        assert metrics["hetero/produced"] == produced
        assert (
            metrics["hetero/trained"] + metrics["hetero/dropped"] + metrics["hetero/queued"]
            == metrics["hetero/produced"]
        )
    assert buffer.ledger.trained == 15 and sum(refills) == int(metrics["hetero/dropped"])


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"max_lag": -1}, "max_lag"),
        ({"strategy": "sometimes"}, "strategy"),
        ({"delay": {"distribution": "gamma"}}, r"hetero\.delay\.distribution='gamma'"),
        ({"delay": {"distribution": "lognormal", "low": 1920, "high": 60}}, "low"),
        ({"delay": {"distribution": "lognormal", "low": 60, "high": 1920, "mu": 1.0}}, "either the interval"),
        ({"sampler_groups": [2, 0]}, "sampler_groups"),
        ({"bogus": 1}, r"hetero\.bogus: unknown option"),
        ({"max_lag": 0, "strategy": "wait", "admission_margin": 1}, "admission_margin"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(block, message):
    with pytest.raises(HeteroConfigError, match=message):
        hetero_buffer(**block)
