"""What dropping costs: the books behind ``hetero/dropped/length_mean`` and friends, in verl's trainer and the lab."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gepo_plugin.hetero import drop_bias


def test_pooled_totals_give_the_means_of_the_concatenated_trajectories():
    rng = np.random.default_rng(0)
    parts = [(rng.integers(1, 50, n), rng.random(n)) for n in (3, 7, 1)]
    pooled: dict = {}
    for lengths, rewards in parts:
        pooled = drop_bias.add(pooled, drop_bias.totals(lengths, rewards))
    lengths = np.concatenate([p[0] for p in parts])
    rewards = np.concatenate([p[1] for p in parts])
    means = drop_bias.means("dropped", pooled)
    assert means["dropped/length_mean"] == pytest.approx(lengths.mean(), rel=1e-12)
    assert means["dropped/reward_mean"] == pytest.approx(rewards.mean(), rel=1e-12)
    assert drop_bias.means("dropped", {}) == {}  # nothing dropped: no mean, not NaN
    with pytest.raises(ValueError):
        drop_bias.totals([1, 2], [0.5])


def test_the_length_gap_is_reported_only_when_both_sides_exist():
    trained = drop_bias.totals([4, 6], [1.0, 0.0])
    dropped = drop_bias.totals([10, 20, 30], [0.0, 0.0, 1.0])
    out = drop_bias.bias_metrics(dropped, trained)
    assert out["drop_bias/length"] == pytest.approx(20.0 - 5.0)
    assert out["dropped/reward_mean"] == pytest.approx(1 / 3) and out["trained/reward_mean"] == 0.5
    only_trained = drop_bias.bias_metrics({}, trained)
    assert "drop_bias/length" not in only_trained and only_trained["trained/length_mean"] == 5.0


def test_the_trainer_turns_the_buffers_totals_into_means_beside_the_trained_batch():
    """verl's trainer path: the buffer's per-step totals (in the step's metrics) and the trained batch's tags and
    rm_scores (read in the trainer's one TransferQueue round trip); padding rows are not trajectories."""
    from transfer_queue import KVBatchMeta

    from gepo_plugin.verl_glue.hetero.trainer import HeteroMixin

    tags = [{"response_len": 3}, {"response_len": 5}, {"response_len": 5, "is_padding": True}]
    batch = KVBatchMeta(keys=["a_0_0", "a_1_0", "a_2_0"], tags=tags, partition_id="train")
    scores = torch.tensor([[0.0, 0.0, 1.0, 0, 0], [0, 0, 0, 0, 0.5], [0, 0, 0, 0, 0.5]])
    metrics = {"hetero/dropped_step/trajectories": 2.0, "hetero/dropped_step/length_sum": 14.0}
    metrics["hetero/dropped_step/reward_sum"] = 0.25
    out = HeteroMixin._drop_bias_metrics(batch, scores, metrics)
    assert not any(key.startswith("hetero/dropped_step/") for key in metrics)  # the raw totals are consumed
    assert out == {
        "hetero/dropped/length_mean": 7.0,
        "hetero/dropped/reward_mean": 0.125,
        "hetero/trained/length_mean": 4.0,
        "hetero/trained/reward_mean": 0.75,
        "hetero/drop_bias/length": 3.0,
    }


def test_the_lab_pools_its_seeds_drop_books():
    from gepo_plugin.lab.stability import _pooled_drop_bias

    runs = [
        {"drop_totals": {"dropped": drop_bias.totals([2, 4], [0, 1]), "trained": drop_bias.totals([3], [1])}},
        {"drop_totals": {"dropped": drop_bias.totals([6], [1]), "trained": drop_bias.totals([1, 1], [0, 0])}},
    ]
    pooled = _pooled_drop_bias(runs)
    assert pooled["dropped/length_mean"] == pytest.approx(4.0) and pooled["trained/length_mean"] == pytest.approx(5 / 3)
    assert pooled["dropped_trajectories"] == 3.0
