"""verl's REAL trainer on CPU with M2PO over whole mini-batches, and the control every learning run is measured
against: the same trainer with a learning rate of 0 does not learn (tiny model, two data-parallel learners, real Ray
and TransferQueue).

One run of ``algorithm.loss=m2po`` at a budget of 0 (every harmful token clipped) for the steps the learning runs take,
with ``optim.lr=0``, on verl's separate_async trainer without HeteroRL (one rollout replica beside the learners, its
weights synced every step: the mode's own path, which no HeteroRL run takes). The other answers to stale rollouts
run elsewhere: GEPO with M2PO's mask in the FSDP2 run (``tests/test_cpu_e2e.py``), GEPO beside verl's decoupled
sequence-level truncated IS in the vLLM run (``tests/test_vllm_e2e.py``).
"""

from __future__ import annotations

import math

import pytest
from learning import STEPS_TO_LEARN, assert_does_not_learn
from trainer_run import complete_run

from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import cpu_run_overrides

pytestmark = pytest.mark.e2e


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


@pytest.fixture(scope="module")
def m2po_run(tiny, shared_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("m2po_lr0")
    overrides = [
        *cpu_run_overrides(tiny, loss="m2po", mode="separate_async", steps=STEPS_TO_LEARN, output_dir=str(workdir)),
        "actor_rollout_ref.actor.policy_loss.m2_budget=0",
        "actor_rollout_ref.actor.optim.lr=0",
        *shared_cluster.join_overrides(),
    ]
    return complete_run("m2po, learning rate 0", overrides, workdir, env=shared_cluster.env)


def test_m2po_measures_each_mini_batch_in_the_learners_and_trains(m2po_run):
    """Without the launcher's switch or the patch in the learner processes the loss would stop at its first
    micro-batch (the cap missing): the run trains, with the cap measured over each whole mini-batch, which verl then
    splits over two learners and two-row micro-batches. The budget 0 clips every harmful token."""
    metrics = m2po_run.metrics
    assert sorted(metrics) == list(range(1, STEPS_TO_LEARN + 1))
    assert "'trainer_mode': 'gepo_separate_async'" in m2po_run.log  # the plugin's trainer of verl's mode
    assert not any(key.startswith("hetero/") for m in metrics.values() for key in m)  # and no HeteroRL
    for step, m in metrics.items():
        assert _finite(m["actor/pg_loss"]) and _finite(m["actor/grad_norm"]), step
        for key in ("m2", "m2_after", "cap_binds", "harmful_tokens"):
            assert _finite(m[f"actor/m2po/{key}"]), key
        # the mini-batch's count, the same in every micro-batch of both learners (a micro-batch's own is smaller)
        assert m["actor/m2po/harmful_tokens"] == int(m["actor/m2po/harmful_tokens"]) > 0, step
        assert m["actor/m2po/cap_binds"] == 1.0 and m["actor/pg_clipfrac"] > 0, step
        assert not undeclared(m), undeclared(m)


def test_with_a_learning_rate_of_0_the_reward_stays_at_chance(m2po_run):
    """The control: gradients are computed (non-zero) and applied with a step of 0, so the policy, and with it the
    reward, stays where it started over the steps in which every learning run climbs."""
    metrics = m2po_run.metrics
    assert any(m["actor/grad_norm"] > 0 for m in metrics.values())
    assert_does_not_learn(metrics)
