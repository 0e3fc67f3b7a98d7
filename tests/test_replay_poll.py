"""verl's replay buffer waits for rollouts in paced polls, not 2 s sleeps, and a lost engine ends its wait.

verl's own buffers (sync and asynchronous) are driven over a real TransferQueue with the patch applied, exactly as
verl's trainer samples them, while a thread plays the agent loop finishing a group a moment later: the buffer must
poll in the paced intervals (the number of sleeps and the intervals it held are asserted, not wall times), and with
the switch off it must sleep verl's 2 s, once. The checks the rollout watchdog registers must end a wait and a refill
loop. The separate_async idle heuristic must count waits, not compare a duration with the poll interval.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from gepo_plugin import patching
from gepo_plugin.verl_glue import replay_wait, seam

#: How long after the buffer starts waiting the agent loop (a thread here) finishes the group.
FINISH_AFTER_S = 0.3


class EngineLost(RuntimeError):
    """Stands for the watchdog's RolloutReplicaLost."""


@pytest.fixture(scope="module")
def paced(transfer_queue):
    """verl's buffers patched in this process, as in a run the launcher starts (undone afterwards, for the modules
    that run after this one in the same process)."""
    patching.apply_named(replay_wait.PATCH_NAME)
    yield transfer_queue
    for contact in seam.CONTACTS:
        if replay_wait.FEATURE in contact.features:
            seam.restore(contact.name)
    patching.APPLIED.remove(replay_wait.PATCH_NAME)


@pytest.fixture
def writer(paced):
    from rollout_writer import RolloutWriter, clear_all

    clear_all(paced)
    yield RolloutWriter(paced, group_size=2)
    clear_all(paced)


def verl_buffer(mode: str, refill=None):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    cls = ReplayBuffer if mode == "sync" else ReplayBufferAsync
    extra = {"train_batch_size": 1, "gen_batch_size": 1} if mode == "sync" else {}
    return cls(
        trainer_mode=mode,
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({}),
        refill_fn=refill or (lambda n: n),
        **extra,
    )


def finish_later(writer, uid: str, after_s: float = FINISH_AFTER_S) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), writer.finish(uid, [(0, 0), (0, 0)])))
    thread.start()
    return thread


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_verls_buffer_polls_in_paced_intervals_until_the_group_is_there(writer, mode):
    buffer = verl_buffer(mode)
    (uid,) = writer.submit(1)
    thread = finish_later(writer, uid)
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    thread.join()
    state = replay_wait.wait_state(buffer)
    assert {key.split("_")[0] for key in batch.keys} == {uid}
    # 0.3 s of waiting in paced intervals: many sleeps, each within the pacing's bounds (verl: one sleep of 2 s)
    assert state.waits >= 3, state
    assert replay_wait.PACING.min_interval_s <= state.last_interval_s <= replay_wait.PACING.max_interval_s
    assert state.waited_s < state.waits * (replay_wait.PACING.max_interval_s + 0.5)
    assert buffer.poll_interval == 2.0  # verl's attribute keeps its value between waits


@pytest.mark.ray
def test_with_the_switch_off_the_buffer_sleeps_verls_two_seconds_once(writer, monkeypatch):
    monkeypatch.setenv(replay_wait.PACED_POLL_ENV, "0")
    buffer = verl_buffer("sync")
    (uid,) = writer.submit(1)
    thread = finish_later(writer, uid)
    buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    thread.join()
    state = replay_wait.wait_state(buffer)
    assert state.waits == 1 and state.last_interval_s == 2.0
    assert state.waited_s >= 2.0


@pytest.mark.ray
def test_a_check_that_raises_ends_the_wait_before_any_rollout_arrives(writer):
    buffer = verl_buffer("separate_async")
    lost = threading.Event()

    def watchdog() -> None:
        if lost.is_set():
            raise EngineLost("replica 0 died")

    replay_wait.add_check(buffer, watchdog)
    writer.submit(1)  # never finishes: only the check can end this wait
    threading.Timer(0.2, lost.set).start()
    with pytest.raises(EngineLost, match="replica 0 died"):
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert replay_wait.wait_state(buffer).waits >= 1


@pytest.mark.ray
def test_a_check_ends_verls_refill_loop_of_groups_that_fail_at_once(writer):
    """A dead server fails every group at once; verl evicts and refills them without waiting (no poll): the refill
    itself must ask the check."""
    refills: list[int] = []
    lost = threading.Event()

    def refill(count: int) -> int:
        refills.append(count)
        if len(refills) == 3:
            lost.set()  # the watchdog's verdict arrives while verl keeps refilling
        for uid in writer.submit(1, count):
            writer.finish(uid, [], status="failure")
        return count

    def watchdog() -> None:
        if lost.is_set():
            raise EngineLost("replica 0 died")

    buffer = verl_buffer("separate_async", refill=refill)
    replay_wait.add_check(buffer, watchdog)
    (uid,) = writer.submit(1)
    writer.finish(uid, [], status="failure")
    with pytest.raises(EngineLost):
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert len(refills) == 3  # the fourth refill was refused by the check


def separate_async_trainer(buffer):
    """verl's separate_async trainer with just what its step and sample hooks read (no cluster)."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    trainer = object.__new__(PPOTrainerSeparateAsync)
    trainer.replay_buffer = buffer
    trainer.hybrid_rollout_config = SimpleNamespace(enable_switch=False)
    trainer.current_mode = None
    trainer.timing_raw = {}
    return trainer


@pytest.mark.ray
def test_separate_async_counts_a_step_idle_when_its_sampling_waited_not_when_it_was_slow(paced):
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    buffer = SimpleNamespace(poll_interval=2.0)
    trainer = separate_async_trainer(buffer)
    original = seam.original("verl.trainer.ppo.v1.trainer_separate_async.PPOTrainerSeparateAsync._step_had_idle")

    trainer.on_step_begin()
    trainer.on_sample_begin()
    trainer._sample_start -= 3.0  # a sample call that took 3 s without waiting (a large batch's bookkeeping)
    trainer.on_sample_end()
    assert original(trainer)  # verl's rule: longer than one poll interval, so idle
    assert not PPOTrainerSeparateAsync._step_had_idle(trainer)  # it never waited

    trainer.on_step_begin()
    trainer.on_sample_begin()
    replay_wait.wait_state(buffer).waits += 1  # one paced wait of 20 ms inside the sample call
    trainer.on_sample_end()
    assert not original(trainer)  # 20 ms < verl's 2 s interval: verl's rule would miss it
    assert PPOTrainerSeparateAsync._step_had_idle(trainer)

    trainer.on_step_begin()  # a new step starts counting from zero
    assert not PPOTrainerSeparateAsync._step_had_idle(trainer)


def test_the_pacing_spends_at_most_its_duty_polling_within_its_bounds():
    pacing = replay_wait.PollPacing(min_interval_s=0.02, max_interval_s=0.5, duty=0.1)
    for cost in (0.0, 0.0005, 0.002, 0.01, 0.03, 0.05, 0.2, 3.0):
        interval = pacing.interval(cost)
        assert pacing.min_interval_s <= interval <= pacing.max_interval_s
        if interval < pacing.max_interval_s:
            assert cost <= pacing.duty * interval + 1e-12  # polling takes at most `duty` of the time
        if interval > pacing.min_interval_s:
            assert interval == pytest.approx(min(pacing.max_interval_s, cost / pacing.duty))


def test_a_verl_whose_wait_no_longer_sleeps_the_interval_keeps_its_polls_with_a_warning(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    config = OmegaConf.create({})
    OmegaConf.update(config, replay_wait.PACED_POLL_KEY, "1", force_add=True)
    seam.clear_cache()
    assert replay_wait.check_pacing(config) == []

    def rewritten(self, partition_id, last_debug_time):
        time.sleep(0.1)
        return last_debug_time

    monkeypatch.setattr(ReplayBuffer, "_wait_for_next_poll", rewritten)
    seam.clear_cache()
    try:
        (warning,) = replay_wait.check_pacing(config)
        assert "keeps its own 2 s polls" in warning and "time.sleep(self.poll_interval)" in warning
        with pytest.raises(seam.SeamError, match="_wait_for_next_poll: no longer contains"):
            seam.require(replay_wait.FEATURE)
    finally:
        seam.clear_cache()


def test_another_verl_version_keeps_its_polls_with_a_warning(installed_versions):
    config = OmegaConf.create({})
    OmegaConf.update(config, replay_wait.PACED_POLL_KEY, "1", force_add=True)
    installed_versions(verl="0.9.2")
    (warning,) = replay_wait.check_pacing(config)
    assert "written for verl ==0.9.1 but verl 0.9.2" in warning
    OmegaConf.update(config, replay_wait.PACED_POLL_KEY, "0")
    assert replay_wait.check_pacing(config) == []  # switched off: nothing to apply


@pytest.mark.parametrize("value", ["yes", "true", "2", 0, 1])
def test_the_switch_takes_only_0_or_1(value):
    config = OmegaConf.create({})
    OmegaConf.update(config, replay_wait.PACED_POLL_KEY, value, force_add=True)
    with pytest.raises(replay_wait.PluginConfigError, match=f"GEPO_PACED_REPLAY_POLL={value!r}"):
        replay_wait.paced_in(config)


@pytest.mark.slow
def test_the_launcher_switches_the_pacing_on_where_the_user_set_nothing(tmp_path):
    """What ``--cfg job`` prints: the launcher's fill-in, unless the user set the switch."""
    from cpu_runs import valid_gepo_command

    from gepo_plugin.launch import settled_config
    from gepo_plugin.tiny import write_all

    valid = valid_gepo_command(write_all(tmp_path))
    assert OmegaConf.select(settled_config(valid), replay_wait.PACED_POLL_KEY) == "1"
    off = settled_config([*valid, f"+{replay_wait.PACED_POLL_KEY}='0'"])
    assert OmegaConf.select(off, replay_wait.PACED_POLL_KEY) == "0"
