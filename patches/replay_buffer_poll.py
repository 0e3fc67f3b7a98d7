"""verl 0.9.1's replay buffer sleeps 2 s between polls: every step's generation ends on a multiple of 2 s.

``ReplayBuffer._wait_for_next_poll`` sleeps ``self.poll_interval`` (2.0, the constructor's default; no config key
reaches it) whenever too few prompt groups have finished, in sync mode (the ``gen`` timer), for validation and in
the asynchronous modes. This patch paces the polls instead (:mod:`gepo_plugin.verl_glue.replay_wait`: 20 ms on
small batches, at most a tenth of a wait spent polling), and marks where each poll begins so its cost is known.

``separate_async``'s switch heuristic (``_step_had_idle``) read the same interval as its idle threshold: with 2 s
sleeps, a step's sampling that took longer than one interval was a sampling that had to wait. It now asks exactly
that: whether the step's ``sample`` calls waited at least once (waits counted between ``on_sample_begin`` and
``on_sample_end``), which keeps its meaning whatever the interval.

Applied in the processes of every run the plugin's launcher starts (``GEPO_PACED_REPLAY_POLL=1`` in the Ray runtime
env, shown by ``--cfg job``), once verl's replay buffer module is imported.
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import replay_wait, seam

_BUFFER = "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer"
_SEPARATE = "verl.trainer.ppo.v1.trainer_separate_async.PPOTrainerSeparateAsync"
#: The trainer's count of its current step's waits inside ``sample`` calls, and the buffer's count at the start of
#: the current ``sample`` call.
STEP_WAITS, MARK = "_gepo_step_sample_waits", "_gepo_sample_waits_mark"


def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
    return replay_wait.paced_wait(self, partition_id, last_debug_time)


def _marking(sync):
    @functools.wraps(sync)
    def _sync_metadata_from_transfer_queue(self):
        replay_wait.mark_poll(self)
        return sync(self)

    return _sync_metadata_from_transfer_queue


def _after(hook, then):
    @functools.wraps(hook)
    def wrapper(self, *args, **kwargs):
        result = hook(self, *args, **kwargs)
        then(self)
        return result

    return wrapper


def _start_step(trainer) -> None:
    setattr(trainer, STEP_WAITS, 0)


def _start_sample(trainer) -> None:
    setattr(trainer, MARK, replay_wait.wait_state(trainer.replay_buffer).waits)


def _end_sample(trainer) -> None:
    waited = replay_wait.wait_state(trainer.replay_buffer).waits - getattr(trainer, MARK, 0)
    setattr(trainer, STEP_WAITS, getattr(trainer, STEP_WAITS, 0) + waited)


def _step_had_idle(self) -> bool:
    """Whether this step's sampling waited for sampleable prompts (at least one wait inside its ``sample`` calls)."""
    return getattr(self, STEP_WAITS, 0) > 0


def _apply() -> None:
    sync = f"{_BUFFER}._sync_metadata_from_transfer_queue"
    seam.replace(sync, _marking(seam.resolve(sync)))
    seam.replace(f"{_BUFFER}._wait_for_next_poll", _wait_for_next_poll)
    hooks = (("on_step_begin", _start_step), ("on_sample_begin", _start_sample), ("on_sample_end", _end_sample))
    for hook, then in hooks:
        seam.replace(f"{_SEPARATE}.{hook}", _after(seam.resolve(f"{_SEPARATE}.{hook}"), then))
    seam.replace(f"{_SEPARATE}._step_had_idle", _step_had_idle)


PATCH = Patch(
    name="replay_buffer_poll",
    versions={"verl": "==0.9.1"},
    reason="the replay buffer sleeps 2 s (a constant no config key reaches) whenever rollouts are not yet done, so "
    "every step's generation, validation batch and asynchronous wait ends on a multiple of 2 s",
    apply=_apply,
    feature="paced_replay_poll",
    check_contacts=seam.require,
)
