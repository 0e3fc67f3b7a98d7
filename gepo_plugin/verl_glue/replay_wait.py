"""The replay buffer's wait for rollouts: paced polls with no fixed granularity, and the checks that end a wait.

verl 0.9.1's replay buffer (``verl/trainer/ppo/v1/replay_buffer.py``) reads TransferQueue's metadata, and when too
few prompt groups have finished it calls ``_wait_for_next_poll``, which sleeps ``self.poll_interval``: 2.0 s, the
constructor's default, which no config key reaches. Generation finishing 20 ms after a poll is noticed 2 s later, so
every step's ``timing_s/gen``, every validation batch and every asynchronous wait ends on a multiple of 2 s.

**Paced polls.** The plugin sleeps :meth:`PollPacing.interval` instead: the cost of the poll just made (reading
TransferQueue's tags, the buffer's own decisions and hooks) divided by :attr:`PollPacing.duty`, between
:attr:`PollPacing.min_interval_s` and :attr:`PollPacing.max_interval_s`. So polling takes at most ``duty`` of the
waiting time (the cost grows with the number of keys: 0.3 ms for 80, 1.3 ms for 1,152, 9.7 ms for 8,704 keys,
measured with TransferQueue 0.1.11 here), and a wait ends at most one interval (20 ms on small batches, never more
than 0.5 s) after the data is there. A poll, not an event: TransferQueue 0.1.11 notifies no client when a tag
changes (its controller's only wait is for the production of fields, not for ``kv_put`` tags), and the agent loop
that writes a group's terminal status runs in other processes; an event would need a patch inside verl's agent-loop
workers and an actor to ring, to save at most one 20 ms interval per wait.

**Checks.** Callables registered with :func:`add_check` run before every wait and before every refill of failed
groups, in the trainer's own thread: one that raises ends the wait with its error. The rollout watchdog registers
its ``raise_if_lost`` (:mod:`gepo_plugin.verl_glue.rollout_watchdog`), so a run whose only engine died stops at the
next poll, or at the next refill when verl keeps resubmitting groups that fail at once, with the watchdog's error.

Where it applies: the plugin's HeteroRL buffer calls :func:`paced_wait` itself; verl's own buffers get it from the
version-checked patch ``patches/replay_buffer_poll.py``, in every run the plugin's launcher starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import patching
from gepo_plugin.config_keys import RAY_ENV_VARS
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.registration import PACED_POLL_ENV

#: verl's wait between polls, which the patch and the HeteroRL buffer pace (a seam contact: it must sleep
#: ``self.poll_interval``).
VERL_WAIT = "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._wait_for_next_poll"
#: The launcher's switch in the Ray runtime env (``1``: patch verl's buffers in the run's processes; ``0``: leave
#: verl's 2 s polls): where ``--cfg job`` shows it.
PACED_POLL_KEY = f"{RAY_ENV_VARS}.{PACED_POLL_ENV}"
#: The patch that paces verl's own buffers, and its seam feature.
PATCH_NAME, FEATURE = "replay_buffer_poll", "paced_replay_poll"
#: The attribute of a replay buffer holding its :class:`BufferWait`.
STATE_ATTRIBUTE = "_gepo_wait"


@dataclass(frozen=True)
class PollPacing:
    """How long to sleep between two polls of TransferQueue, from what the last poll cost."""

    #: The shortest sleep: the granularity of a wait when polls are cheap.
    min_interval_s: float = 0.02
    #: The longest sleep, however costly a poll: a wait never ends more than this after its data is there.
    max_interval_s: float = 0.5
    #: At most this fraction of a wait is spent polling.
    duty: float = 0.1

    def interval(self, poll_cost_s: float) -> float:
        return min(self.max_interval_s, max(self.min_interval_s, poll_cost_s / self.duty))


PACING = PollPacing()


@dataclass
class BufferWait:
    """One replay buffer's waits: the pacing, the checks, and what its waits cost so far."""

    pacing: PollPacing = PACING
    checks: list[Callable[[], None]] = field(default_factory=list)
    #: Number of sleeps between polls, and their total seconds.
    waits: int = 0
    waited_s: float = 0.0
    #: The last sleep's length (what a test or the doctor can read).
    last_interval_s: float | None = None
    #: ``time.perf_counter()`` when the current poll began (its metadata read), or None before the first.
    poll_started: float | None = None

    def run_checks(self) -> None:
        for check in self.checks:
            check()


def wait_state(buffer: Any) -> BufferWait:
    """The :class:`BufferWait` of ``buffer`` (created on first use)."""
    state = buffer.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        state = BufferWait()
        setattr(buffer, STATE_ATTRIBUTE, state)
    return state


def add_check(buffer: Any, check: Callable[[], None]) -> None:
    """Run ``check()`` before every wait and every refill of ``buffer``; what it raises ends the wait."""
    wait_state(buffer).checks.append(check)
    refill = buffer.refill_fn
    if refill is not None and not getattr(refill, "_gepo_checked", False):
        buffer.refill_fn = _checked_refill(buffer, refill)


def _checked_refill(buffer: Any, refill: Callable[[int], Any]) -> Callable[[int], Any]:
    def checked(count: int) -> Any:
        wait_state(buffer).run_checks()
        return refill(count)

    checked._gepo_checked = True  # type: ignore[attr-defined]
    return checked


def mark_poll(buffer: Any) -> None:
    """A poll begins (the buffer reads TransferQueue's metadata): the clock of the next interval's cost."""
    wait_state(buffer).poll_started = time.perf_counter()


def switched_off() -> bool:
    """This process was told to keep verl's own 2 s polls (``GEPO_PACED_REPLAY_POLL=0``, for a comparison)."""
    return os.environ.get(PACED_POLL_ENV) == "0"


def paced_wait(buffer: Any, partition_id: str, last_debug_time: float) -> float:
    """verl's ``_wait_for_next_poll`` with a paced sleep, after the checks; returns verl's ``last_debug_time``.

    Where the switch is off (:func:`switched_off`) the sleep is verl's own ``poll_interval``; the checks still run.
    """
    state = wait_state(buffer)
    state.run_checks()
    now = time.perf_counter()
    verl_interval = buffer.poll_interval
    if switched_off():
        interval = verl_interval
    else:
        interval = state.pacing.interval(now - state.poll_started if state.poll_started is not None else 0.0)
    buffer.poll_interval = interval  # verl's wait sleeps exactly this, and keeps its own progress log
    try:
        return _verl_wait()(buffer, partition_id, last_debug_time)
    finally:
        buffer.poll_interval = verl_interval
        state.waits += 1
        state.waited_s += time.perf_counter() - now
        state.last_interval_s = interval


def _verl_wait() -> Callable[..., float]:
    """verl's own ``_wait_for_next_poll`` (the original, where the patch replaced it)."""
    return seam.original(VERL_WAIT)


def launch_settings() -> dict[str, str]:
    """What the launcher fills in for every run (where the user set nothing): the switch, on."""
    return {PACED_POLL_KEY: "1"}


def paced_in(config: DictConfig) -> bool:
    """Does ``config`` switch the paced polls on? Refuses a value other than ``0`` or ``1`` (never guessed)."""
    value = OmegaConf.select(config, PACED_POLL_KEY)
    if value is None:
        return False
    if value not in ("0", "1"):  # (Ray takes only strings as environment variables: an unquoted 0 fails there)
        raise PluginConfigError(
            f"{PACED_POLL_KEY}={value!r}: use '1' (verl's replay buffer polls every few tens of milliseconds; the "
            "default) or '0' (verl's own 2 s polls), quoted: Ray's environment variables are strings"
        )
    return value == "1"


def check_pacing(config: DictConfig) -> list[str]:
    """The launcher's check of the switch: a value other than ``0``/``1`` is refused; where the patch cannot apply
    (another verl, or verl's wait no longer sleeping ``poll_interval``) the run goes on with verl's own polls, and
    the warning says why (a slower wait is no reason to stop a run)."""
    if not paced_in(config):
        return []
    problem = patching.version_problem(patching.named_patch(PATCH_NAME))
    if problem is None:
        contacts = seam.feature_problems(FEATURE)
        problem = "; ".join(f"{name}: {why}" for name, why in contacts.items()) or None
    if problem is None:
        return []
    return [
        f"verl's replay buffer keeps its own 2 s polls in this run (the patch {PATCH_NAME!r} cannot apply: {problem})"
    ]
