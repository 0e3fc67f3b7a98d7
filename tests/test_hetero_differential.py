"""One event trace, two adapters, identical decisions: verl's replay buffer (over a real TransferQueue) and the lab.

The trace is what a HeteroRL run produces: weight publications and their delayed arrivals at sampler groups
(:class:`~gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule`), prompts submitted at a learner step and
finished later with the versions of their oldest and newest token (some spanning an update), learner steps, and a
resume from a checkpoint that lost one queued group. It is fed to

* :class:`~gepo_plugin.verl_glue.hetero.replay_buffer.HeteroReplayBuffer`, written to exactly as verl's agent loop
  writes TransferQueue (:class:`RolloutWriter` (tests/rollout_writer.py)) and sampled as
  verl's trainer samples it;
* :class:`~gepo_plugin.lab.rollout_queue.LabRolloutQueue`, as the lab's simulator feeds it.

At every step both must agree on whether the learner may train (the wait rule), on which groups it trains, and on
the books (produced, trained, dropped by reason, queued, with versions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

from conftest import hetero_buffer  # noqa: E402
from rollout_writer import RolloutWriter, clear_all  # noqa: E402

from gepo_plugin.hetero.delays import ExponentialDelay  # noqa: E402
from gepo_plugin.hetero.weight_schedule import WeightArrivalSchedule  # noqa: E402
from gepo_plugin.lab.rollout_queue import LabRolloutQueue  # noqa: E402
from gepo_plugin.verl_glue.hetero.replay_buffer import HeteroReplayBuffer  # noqa: E402

pytestmark = pytest.mark.ray
GROUP = 2


@dataclass
class Group:
    """A finished group as the lab sees it."""

    group_id: str
    min_version: int
    max_version: int
    submitted: int


def books(core) -> dict:
    state = core.state_dict()
    return {
        "ledger": state["ledger"],
        "groups": state["groups"],
        "floors": state["version_floors"],
        "guard": state["guard"],
        "bound": core.policy.max_lag,
    }


def verl_poll(buffer: HeteroReplayBuffer, step: int) -> None:
    """One pass of verl's sampling loop (``ReplayBufferAsync.wait_for_sampleable``): sync, decide, evict. A real
    trainer runs it while it waits for data; the trace runs it when the learner may not train yet."""
    buffer._sync_metadata_from_transfer_queue()
    reasons = buffer._terminal_eviction_reasons(step, "train")
    buffer._evict_terminal_groups(step, "train", reasons)


def run_trace(hetero: dict, seed: int, ticks: int = 18, batch: int = 3) -> dict:
    """Drive both adapters with one random trace; assert identical decisions; return what happened."""
    rng = np.random.default_rng(seed)
    writer = RolloutWriter(tq, group_size=GROUP)
    buffer = hetero_buffer(poll_interval=0.01, **hetero)
    lab = LabRolloutQueue(buffer.core.configured_policy, buffer.settings.guard)
    schedule = WeightArrivalSchedule([None, ExponentialDelay(2.0), ExponentialDelay(5.0)], seed=seed)
    in_flight: dict[str, tuple[int, int, int]] = {}  # name -> (submitted step, sampler version, finish tick)
    counter, now, trained, log, version, guard_notes = 0, 0.0, 0, [], 0, []
    for name in ("verl", "lab"):  # step 1 begins: every sampler holds version 0
        (buffer if name == "verl" else lab).core.record_floor(1, 0)
    resume_at = ticks // 2
    for tick in range(1, ticks + 1):
        step = version + 1
        now += float(rng.uniform(0.5, 2.0))
        schedule.advance(now)
        # prompts submitted during this step, served by a random sampler group with the weights it holds
        for _ in range(int(rng.integers(2, 5))):
            name = f"p{counter:05d}"
            counter += 1
            held = schedule.held[int(rng.integers(0, 3))]
            writer.submit(step, uids=[name])
            writer.start(name)
            in_flight[name] = (step, held, tick + int(rng.integers(0, 3)))
        # groups whose generation ends now (a partial rollout may have its last tokens from a newer version)
        done = sorted(name for name, (_, _, end) in in_flight.items() if end <= tick)
        finished = []
        for name in done:
            submitted, held, _ = in_flight.pop(name)
            newest = min(version, held + int(rng.random() < 0.25))
            writer.finish(name, [(held, newest)] + [(held, held)] * (GROUP - 1), step=submitted)
            finished.append(Group(name, held, newest, submitted))
        lab.admit(finished)
        # the learner's decision at this step
        flight = {name: submitted for name, (submitted, _, _) in in_flight.items()}
        lab_ready = lab.ready(version, batch, flight)
        verl_poll(buffer, step)
        verl_count = buffer.get_sampleable_count(step, "train")
        verl_ready = verl_count >= batch and not buffer.core.urgent(version, buffer._in_flight("train"))
        assert verl_ready == lab_ready, (tick, verl_count, books(buffer.core), books(lab.core))
        if lab_ready:
            groups, lab_lags = lab.take(version, batch)
            meta, metrics = buffer.sample(global_steps=step, partition_id="train", batch_size=batch)
            verl_chosen = sorted({key.split("_")[0] for key in meta.keys})
            assert verl_chosen == sorted(g.group_id for g in groups), step
            tq.kv_clear(keys=list(meta.keys), partition_id="train")  # verl clears a trained batch
            assert metrics["hetero/lag/max"] == float(lab_lags.max())
            trained += len(groups)
            version += 1  # the learner publishes the new version; the next step begins
            ess = float(rng.choice([0.1, 0.3, 0.7, 0.9, 0.95]))  # the trained batch's ESS/N: the guard's input
            notes = [core.observe_ess(version, ess) for core in (buffer.core, lab.core)]
            assert notes[0] == notes[1], (step, notes)
            guard_notes.extend(note for note in notes[:1] if note is not None)
            schedule.publish(version, now)
            for core in (buffer.core, lab.core):  # what verl's delayed weight sync / the lab's driver record
                core.record_floor(version + 1, schedule.oldest_held())
        assert books(buffer.core) == books(lab.core), tick
        log.append({"step": step, "ready": lab_ready, "floor": buffer.core.lower_bound(version + 1)})
        if tick == resume_at:  # checkpoint, lose one queued group, restore both
            state_verl, state_lab = buffer.state_dict(), lab.state_dict()
            queued = sorted(lab.core.queued)
            lost = queued[0] if queued else None
            if lost is not None:
                keys = [k for k in (tq.kv_list("train") or {}).get("train", {}) if k.split("_")[0] == lost]
                tq.kv_clear(keys=keys, partition_id="train")
            buffer = hetero_buffer(poll_interval=0.01, **hetero)
            buffer.load_state_dict(state_verl)
            store = {uid: group for uid, group in lab.store.items() if uid != lost}
            lab = LabRolloutQueue(buffer.core.configured_policy, buffer.settings.guard)
            lab.load_state_dict(state_lab, store)
            verl_poll(buffer, step)  # verl notices the loss at its first poll
            assert books(buffer.core) == books(lab.core)
            if lost is not None:
                assert lab.core.ledger.dropped["missing_after_resume"] == 1
    return {
        "trained": trained,
        "log": log,
        "dropped": dict(lab.core.ledger.dropped),
        "books": books(lab.core),
        "guard_notes": guard_notes,
    }


@pytest.mark.parametrize(
    "hetero",
    [
        {"max_lag": 2, "strategy": "wait"},
        {"max_lag": 1, "strategy": "drop"},
        {"max_lag": 3, "strategy": "wait", "refuse_mixed_versions": True},
        {"max_lag": 4, "strategy": "drop", "guard": {"enable": True, "patience": 1, "floor": 1}},
    ],
    ids=["wait-K2", "drop-K1", "wait-K3-refuse-mixed", "drop-K4-guard"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_verls_buffer_and_the_lab_make_identical_decisions(transfer_queue, hetero, seed):
    clear_all(tq)
    result = run_trace(hetero, seed)
    clear_all(tq)
    assert result["trained"] > 0
    if hetero["strategy"] == "wait":
        assert any(not entry["ready"] for entry in result["log"]), "the trace should make the learner wait"
    assert any(entry["floor"] < entry["step"] - 1 for entry in result["log"]), "no delayed weights in the trace"
    if hetero["strategy"] == "drop":
        assert result["dropped"].get("stale", 0) > 0, "the trace should make drop evict something"
    if "guard" in hetero:  # the guard moved the bound both ways, identically in both adapters
        notes = " ".join(result["guard_notes"])
        assert "tightened" in notes and "relaxed" in notes, notes
