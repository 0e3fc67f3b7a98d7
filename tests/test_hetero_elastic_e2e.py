"""Elastic samplers through verl's real separate_async trainer on CPU: a sampler dies, hangs, is replaced, and
all are lost. The failures are real (the rollout server's Ray actor is killed, or its event loop blocked) and come
from outside the run (tests/chaos.py), as from a failing machine; nothing in the run is mocked or hooked.

Two runs (each a few minutes of CI): a sampler dies, the run finishes and resumes, then every sampler is lost;
and, with a non-GEPO loss (verl's own gspo under HeteroRL), a sampler hangs and a replacement takes its place."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
from chaos import act, hetero_overrides, ray_cluster, read_metrics, start_run, wait_for_step, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

LEARNERS, SAMPLERS, MAX_LAG = 2, 2, 2
PROMPTS, RESPONSES = 4, 4  # per step: cpu_run_overrides' defaults
INTERVAL_S = 1.0


def _books_balance(m: dict) -> bool:
    return m["hetero/produced"] == m["hetero/trained"] + m["hetero/dropped"] + m["hetero/queued"]


def _failed(kind: str):
    """A condition on the logged metrics: a sampler failure of ``kind`` has been counted."""
    return lambda logged: any(m.get(f"hetero/sampler_failures/{kind}", 0) >= 1 for m in logged.values())


def _finish(process, log, timeout_s: float = 900) -> str:
    process.wait(timeout=timeout_s)
    return log.read_text()


def _step_times(metrics: dict[int, dict]) -> list[float]:
    return [round(m["timing_s/step"], 1) for _, m in sorted(metrics.items()) if "timing_s/step" in m]


def _check_every_step(metrics: dict[int, dict]) -> None:
    for step, m in sorted(metrics.items()):
        if "hetero/produced" in m:
            assert _books_balance(m), (step, m)
            assert m["hetero/lag/max"] <= MAX_LAG, (step, m["hetero/lag/max"])


def _check_hetero_step(step: int, m: dict) -> None:
    """What every HeteroRL step must show (sampler group 0 gets every weight version at once)."""
    assert m["hetero/trained"] == PROMPTS * step, (step, m)  # one batch of groups per step, nothing trained twice
    assert m["hetero/sampler_group_0/weight_version"] == step  # no delay: every version at once
    assert m["actor/gepo/group_term_present"] == 1.0 and math.isfinite(m["actor/pg_loss"])
    # GEPO's weight by lag bucket: finalised shares of the step's sequences
    shares = [v for k, v in m.items() if k.startswith("actor/gepo/iw_by_lag/") and k.endswith("/fraction")]
    assert shares and sum(shares) == pytest.approx(1.0), m
    assert not any(k.startswith("actor/gepo/iw_by_lag/") and k.endswith(("/sum", "/sumsq", "/count")) for k in m)
    # every trained trajectory is attributed to the server that generated it
    per_group = {k: v for k, v in m.items() if k.endswith("/trained_trajectories")}
    assert (
        sum(per_group.values()) == PROMPTS * RESPONSES and "hetero/sampler_group_unknown/trained_trajectories" not in m
    )


def test_a_killed_sampler_is_retired_the_books_survive_a_resume_and_losing_every_sampler_stops_the_run(tiny, tmp_path):
    """HeteroRL with two samplers, group 1's weights 2 s late; group 1 dies mid-run, the run resumes with both; in
    the resumed run both die, and the run stops with a clear error."""
    steps, kill_after, resumed_checkpoint = 14, 2, 15  # save_freq 5: the resumed run's first checkpoint is step 15
    overrides = [
        *hetero_overrides(tiny, tmp_path, steps, "{address}", SAMPLERS),
        "hetero.group_delays=[{{distribution: none}},{{distribution: constant, seconds: 2}}]",  # (str.format)
        f"hetero.health.interval_s={INTERVAL_S}",
    ]
    with ray_cluster(cpus=32, gpus=LEARNERS + SAMPLERS) as address:
        process, metrics_file, log = start_run([o.format(address=address) for o in overrides], tmp_path / "run")
        wait_for_step(process, metrics_file, kill_after)
        act(address, sampler=1, action="kill")
        killed_at = max(read_metrics(metrics_file))
        wait_until(process, metrics_file, _failed("died"), "the dead sampler's retirement")
        text = _finish(process, log)
        assert process.returncode == 0, text[-4000:]
        # the same run resumed from its last checkpoint, in the same cluster: every configured sampler starts again
        resume = [o.replace(f"total_training_steps={steps}", "total_training_steps=200") for o in overrides]
        process2, resumed_file, log2 = start_run([o.format(address=address) for o in resume], tmp_path / "resume")
        wait_for_step(process2, resumed_file, resumed_checkpoint + 1)
        # then both samplers are lost (group 1 first: the chaos driver numbers the servers alive)
        act(address, sampler=1, action="kill")
        wait_until(process2, resumed_file, _failures(2), "the second loss's retirement")
        act(address, sampler=0, action="kill")
        lost_all = time.monotonic()
        text2 = _finish(process2, log2, timeout_s=300)
        stopped_after = time.monotonic() - lost_all
    metrics = read_metrics(metrics_file)
    assert sorted(metrics) == list(range(1, steps + 1))
    assert "'trainer_mode': 'gepo_separate_async'" in text and "HeteroReplayBuffer" in text
    assert "hybrid replicas disabled" in text  # verl's set-up logged it (with flush=True) through the patch
    _check_every_step(metrics)
    failed_step = min(s for s, m in metrics.items() if m.get("hetero/sampler_failures", 0) == 1)
    for step, m in metrics.items():
        _check_hetero_step(step, m)
    before = {step: m for step, m in metrics.items() if step < failed_step}
    assert max(m["hetero/lag/max"] for m in metrics.values()) >= 1, "nothing stale was trained: not asynchronous"
    # before its loss the delayed sampler really trails the learner, and its rollouts are trained
    assert any(m["hetero/sampler_group_1/weight_version"] < step for step, m in before.items())
    assert sum(m.get("hetero/sampler_group_1/trained_trajectories", 0) for m in before.values()) > 0

    last = metrics[steps]
    assert last["hetero/sampler_failures"] == 1 and last["hetero/sampler_failures/died"] == 1
    assert last["hetero/sampler_group_1/alive"] == 0 and last["hetero/sampler_group_0/alive"] == 1
    assert last["hetero/sampler_detect_s/last"] <= 2 * INTERVAL_S + 1.0
    assert "retired sampler replica 1 of group 1 (died" in text
    # killed mid-generation: the groups it was working on failed, and were counted
    assert last["hetero/dropped/failed"] >= 1, last
    # after the loss every trained trajectory comes from the sampler left
    for step in (steps - 1, steps):
        assert metrics[step].get("hetero/sampler_group_1/trained_trajectories", 0) == 0
    # the failure, the failed groups and the rest of the books survive in hetero.json
    state = json.loads((tmp_path / "checkpoints" / f"global_step_{steps}" / "hetero.json").read_text())
    assert [f["kind"] for f in state["samplers"]["failures"]] == ["died"]
    ledger = state["replay_buffer"]["ledger"]
    assert ledger["dropped"]["failed"] == last["hetero/dropped/failed"] and ledger["trained"] == last["hetero/trained"]
    assert sum(ledger["dropped"].values()) == last["hetero/dropped"]

    # the resume: the books go on from the checkpoint, with both samplers serving again
    resumed = read_metrics(resumed_file)
    assert sorted(resumed) == list(range(steps + 1, max(resumed) + 1)) and max(resumed) > resumed_checkpoint
    _check_every_step(resumed)
    for step, m in resumed.items():
        if m["hetero/sampler_failures"] == 1:  # both samplers serving
            _check_hetero_step(step, m)  # the trained counter continues from the checkpoint
    first, saved = resumed[steps + 1], resumed[resumed_checkpoint]
    assert first["hetero/learner_version"] == steps
    assert first["hetero/sampler_failures"] == 1 and first["hetero/sampler_failures/died"] == 1
    assert first["hetero/sampler_group_1/alive"] == 1 and first["hetero/sampler_replicas_alive"] == SAMPLERS
    assert first["hetero/dropped/failed"] >= last["hetero/dropped/failed"]
    # the checkpoint's queued groups come back with verl's TransferQueue checkpoint, so the first resumed step
    # may train only those; by the next checkpoint the restarted samplers have produced new groups
    assert first["hetero/produced"] >= last["hetero/produced"]
    assert saved["hetero/produced"] > last["hetero/produced"]
    state = json.loads((tmp_path / "checkpoints" / f"global_step_{resumed_checkpoint}" / "hetero.json").read_text())
    assert [f["kind"] for f in state["samplers"]["failures"]] == ["died"]
    assert state["replay_buffer"]["ledger"]["dropped"]["failed"] == saved["hetero/dropped/failed"]
    assert state["replay_buffer"]["ledger"]["trained"] == saved["hetero/trained"]

    # every sampler lost: a clear error, soon, and no further step
    assert process2.returncode != 0
    assert "NoSamplerLeft" in text2 and "every sampler is lost" in text2
    assert stopped_after < 120, stopped_after
    print(
        f"\n[elastic] killed after step {killed_at}; retired by step {failed_step}; detection "
        f"{last['hetero/sampler_detect_s/last']:.1f} s; failed groups {last['hetero/dropped/failed']:.0f}; step "
        f"times {_step_times(metrics)} s; resumed {len(resumed)} steps, failed groups "
        f"{saved['hetero/dropped/failed']:.0f} at step {resumed_checkpoint}; stopped {stopped_after:.0f} s after "
        "the last sampler died"
    )


def _failures(count: int):
    """A condition on the logged metrics: ``count`` sampler failures have been counted."""
    return lambda logged: any(m.get("hetero/sampler_failures", 0) >= count for m in logged.values())


def _replacement_trained(logged: dict[int, dict]) -> bool:
    """The replacement joined and, in a later step, rollouts of its group were trained."""
    joined = [s for s, m in logged.items() if m.get("hetero/sampler_replacements", 0) == 1]
    return bool(joined) and any(
        m.get("hetero/sampler_group_1/trained_trajectories", 0) > 0 for s, m in logged.items() if s > min(joined)
    )


def test_a_hung_sampler_is_detected_and_replaced_and_the_replacements_rollouts_are_trained(tiny, tmp_path):
    """With verl's own gspo loss (HeteroRL is not GEPO's alone). The run is stopped once the replacement's rollouts
    were trained (a clean finish is the first test's)."""
    timeout_s, hang_after = 6.0, 2
    overrides = [
        *hetero_overrides(tiny, tmp_path, 200, "{address}", SAMPLERS, loss="gspo"),
        f"hetero.health.interval_s={INTERVAL_S}",
        f"hetero.health.timeout_s={timeout_s}",
        "hetero.replace_failed=true",
    ]
    with ray_cluster(cpus=32, gpus=LEARNERS + SAMPLERS) as address:
        process, metrics_file, log = start_run([o.format(address=address) for o in overrides], tmp_path / "run")
        wait_for_step(process, metrics_file, hang_after)
        act(address, sampler=1, action="hang")
        wait_until(process, metrics_file, _replacement_trained, "training the replacement's rollouts")
        process.terminate()
        text = _finish(process, log)
    metrics = read_metrics(metrics_file)
    _check_every_step(metrics)
    hung = [m for m in metrics.values() if m.get("hetero/sampler_failures/hung", 0) == 1]
    assert hung, "the hung sampler was never retired"
    assert hung[0]["hetero/sampler_detect_s/last"] <= timeout_s + 2 * INTERVAL_S
    assert max(m["hetero/dropped/failed"] for m in metrics.values()) >= 1  # it hung mid-generation
    last = metrics[max(metrics)]
    assert last["hetero/sampler_failures"] == 1 and last["hetero/sampler_replacements"] == 1
    assert last["hetero/sampler_group_1/alive"] == 1
    joined = re.search(
        r"replica \d+ \(rank \d+\) replaces a lost one in sampler group 1 with weight version (\d+)", text
    )
    assert joined, text[-4000:]
    version = int(joined.group(1))
    joined_step = min(s for s, m in metrics.items() if m.get("hetero/sampler_replacements", 0) == 1)
    # the learner's current version at the join: the version published at the end of the step before
    assert version in (joined_step - 1, joined_step), (version, joined_step)
    after = [m.get("hetero/sampler_group_1/trained_trajectories", 0) for s, m in metrics.items() if s > joined_step]
    assert sum(after) > 0, "the replacement's rollouts were never trained"
    # it started in the background: the learner logged steps while it was starting
    assert any(m.get("hetero/sampler_replacements/starting", 0) == 1 for m in metrics.values())
    # verl's own loss trained every step, and nothing of GEPO's ran
    assert "'loss_mode': 'gspo'" in text and "'trainer_mode': 'hetero_separate_async'" in text  # no group term
    for step, m in metrics.items():
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), step
        assert not any(key.startswith("actor/gepo/") for key in m), "a non-GEPO loss must not log GEPO metrics"
    print(
        f"\n[elastic] hang detected after {hung[0]['hetero/sampler_detect_s/last']:.1f} s; replacement joined at "
        f"step {joined_step} with version {version}; group 1 trained {after} trajectories afterwards; step times "
        f"{_step_times(metrics)} s"
    )
