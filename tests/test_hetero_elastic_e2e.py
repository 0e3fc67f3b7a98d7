"""HeteroRL's fleet and its staleness guard through verl's real separate_async trainer on CPU, in one run.

Two sampler groups, the second's weights 3 s late, ``strategy=drop`` with the staleness guard on and a harsh learning
rate, and a modelled GPU (each answer's finish time depends on its length, so what is dropped can differ from what is
trained):

* **the guard**: a stale batch's sequence ratios p_i/q_i spread out (ESS/N well below 1) while an on-policy batch has
  them all equal to 1 (ESS/N = 1); with a threshold between the two and patience 1, the guard must tighten the bound
  after a stale batch and relax it after an on-policy one, again and again;
* **a sampler that hangs**: once the guard has been seen at work, the first group's rollout server's event loop is
  blocked from outside the run (``tests/chaos.py``), as on a failing machine: it is retired as hung within its timeout,
  training goes on, the groups it was generating are counted as failed, and with ``hetero.replace_failed`` a
  replacement starts while the learner trains, joins with the learner's current version, and its rollouts are trained.

The run joins the session's Ray cluster, so the test can reach its servers; nothing in it is mocked or hooked. A
sampler that dies (a whole node lost), the books surviving a resume and every sampler lost are shown over the relay by
``tests/test_relay_e2e.py``; a non-GEPO loss under HeteroRL, by ``tests/test_vllm_e2e.py``.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from chaos import act, check_every_step, group_delays, hetero_overrides
from trainer_run import TrainerRun

from gepo_plugin.config_keys import HF_ROLLOUT_LATENCY

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

MAX_LAG, THRESHOLD, MAX_RESPONSE = 2, 0.99, 8
#: the guard is watched over these steps (their checkpoint holds its changes); then the first group hangs
GUARD_STEPS = 8
#: the group whose server hangs: the one without a weight delay, so its replacement joins with the current version
HUNG = 0
INTERVAL_S, TIMEOUT_S = 1.0, 6.0


def _replacement_trained(logged: dict[int, dict]) -> bool:
    """The replacement joined and, in a later step, rollouts of its group were trained."""
    joined = [s for s, m in logged.items() if m.get("hetero/sampler_replacements", 0) == 1]
    return bool(joined) and any(
        m.get(f"hetero/sampler_group_{HUNG}/trained_trajectories", 0) > 0 for s, m in logged.items() if s > min(joined)
    )


@pytest.fixture(scope="module")
def scenario(tiny, shared_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hetero_fleet")
    overrides = [
        *hetero_overrides(tiny, workdir, 200, samplers=2, learners=1, max_lag=MAX_LAG, strategy="drop"),
        f"trainer.save_freq={GUARD_STEPS}",
        "actor_rollout_ref.actor.optim.lr=0.05",
        group_delays(None, 3),
        "hetero.guard.enable=true",
        f"hetero.guard.min_ess={THRESHOLD}",
        f"hetero.guard.relax_ess={THRESHOLD}",
        "hetero.guard.patience=1",
        "hetero.guard.floor=0",
        f"+{HF_ROLLOUT_LATENCY}={{decode_tokens_per_s: 16, prefill_s: 0.1}}",
        f"hetero.health.interval_s={INTERVAL_S}",
        f"hetero.health.timeout_s={TIMEOUT_S}",
        "hetero.replace_failed=true",
        *shared_cluster.join_overrides(),
    ]
    run = TrainerRun("hetero fleet: guard, a hung sampler replaced", overrides, workdir / "run", env=shared_cluster.env)
    with run:
        run.wait_for_step(GUARD_STEPS)
        act(shared_cluster, sampler=HUNG, action="hang")
        run.mark("sampler hung")
        run.wait_until(_replacement_trained, "training the replacement's rollouts")
    state = json.loads((workdir / "checkpoints" / f"global_step_{GUARD_STEPS}" / "hetero.json").read_text())
    return {"metrics": run.metrics, "log": run.log, "state": state}


def test_the_books_and_the_bound_hold_at_every_step(scenario):
    metrics = scenario["metrics"]
    check_every_step({s: m for s, m in metrics.items() if s < max(metrics)}, MAX_LAG)
    for step, m in metrics.items():
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), step
        # every batch respects the bound in force when it was selected, itself within the configured ceiling
        assert m["hetero/lag/max"] <= m["hetero/guard/max_lag"] <= MAX_LAG, (step, m)
        assert 0 < m["actor/gepo/ess_step"] <= 1 + 1e-9


def test_the_guard_tightens_after_stale_batches_and_relaxes_after_fresh_ones(scenario):
    metrics, log = scenario["metrics"], scenario["log"]
    watched = metrics[GUARD_STEPS]
    assert watched["hetero/guard/tightened"] >= 1 and watched["hetero/guard/relaxed"] >= 1, watched
    # each change saved in hetero.json, triggered by that step's ESS/N on the right side of the threshold
    changes = scenario["state"]["replay_buffer"]["guard"]["changes"]
    assert {change["kind"] for change in changes} == {"tighten", "relax"}
    for change in changes:
        ess = metrics[change["step"]]["actor/gepo/ess_step"]
        assert change["ess"] == pytest.approx(ess, rel=1e-6)
        assert (ess < THRESHOLD) if change["kind"] == "tighten" else (ess >= THRESHOLD), change
        assert f"effective max_lag {'tightened' if change['kind'] == 'tighten' else 'relaxed'}" in log
    # the effective bound a step shows is the one the changes so far left
    effective = MAX_LAG
    for step in range(1, GUARD_STEPS + 1):
        assert metrics[step]["hetero/guard/max_lag"] == effective, step
        for change in (c for c in changes if c["step"] == step):
            effective = change["to"]
    print(f"\n[guard] changes {[(c['step'], c['kind'], c['from'], c['to']) for c in changes]}")


def test_dropped_trajectories_are_reported_with_their_length_and_reward(scenario):
    """What dropping costs: both sides' lengths are real answer lengths; dropped ones reported with their books."""
    dropped_steps = [m for m in scenario["metrics"].values() if "hetero/dropped/length_mean" in m]
    assert dropped_steps, "nothing was dropped"
    for m in dropped_steps:
        for side in ("dropped", "trained"):
            assert 1 <= m[f"hetero/{side}/length_mean"] <= MAX_RESPONSE
            assert 0 <= m[f"hetero/{side}/reward_mean"] <= 1 and math.isfinite(m["hetero/drop_bias/length"])
    assert not any(key.startswith("hetero/dropped_step/") for m in scenario["metrics"].values() for key in m)


def test_a_hung_sampler_is_retired_within_its_timeout_and_its_groups_counted_as_failed(scenario):
    metrics = scenario["metrics"]
    hung = [m for m in metrics.values() if m.get("hetero/sampler_failures/hung", 0) == 1]
    assert hung, "the hung sampler was never retired"
    assert hung[0]["hetero/sampler_detect_s/last"] <= TIMEOUT_S + 2 * INTERVAL_S
    assert max(m["hetero/dropped/failed"] for m in metrics.values()) >= 1  # it hung mid-generation
    last = metrics[max(metrics)]
    assert last["hetero/sampler_failures"] == 1


def test_a_replacement_starts_while_the_learner_trains_joins_with_its_version_and_is_trained(scenario):
    metrics, log = scenario["metrics"], scenario["log"]
    last = metrics[max(metrics)]
    assert last["hetero/sampler_replacements"] == 1 and last[f"hetero/sampler_group_{HUNG}/alive"] == 1
    joined = re.search(
        rf"replica \d+ \(rank \d+\) replaces a lost one in sampler group {HUNG} with weight version (\d+)", log
    )
    assert joined, log[-4000:]
    version = int(joined.group(1))
    joined_step = min(s for s, m in metrics.items() if m.get("hetero/sampler_replacements", 0) == 1)
    # the learner's current version at the join: the version published at the end of the step before
    assert version in (joined_step - 1, joined_step), (version, joined_step)
    after = [
        m.get(f"hetero/sampler_group_{HUNG}/trained_trajectories", 0) for s, m in metrics.items() if s > joined_step
    ]
    assert sum(after) > 0, "the replacement's rollouts were never trained"
    # it started in the background: the learner logged steps while it was starting
    assert any(m.get("hetero/sampler_replacements/starting", 0) == 1 for m in metrics.values())
