"""Does the model learn? The checks every long end-to-end run makes of its reward, with bounds fixed in advance.

The tiny task (``gepo_plugin.tiny.compute_score``: the share of the answer's characters that are digits) starts at
chance, about 0.2, and verl's trainer with the plugin climbs it within a few dozen steps. The bounds below were chosen
from ``bench/bench_tiny_learning.py`` over seeds (``docs/bench/tiny_learning.json``, ``tiny_learning_megatron.json``):
each is far from every seed's value on its side, so a test fails on a defect (a sign error in the loss, weights that
never reach the sampler, an update that changes nothing) and not on a seed. A test helper, not shipped.
"""

from __future__ import annotations

import math
import statistics

#: verl's mean reward of the step's trained batch
SCORE = "critic/score/mean"
#: The learned reward is averaged over this many last steps: one step's batch is 16 answers.
WINDOW = 5
#: The first step's reward (the random model's answers, before any update) is at chance: at most this. The first
#: step, not a mean of the first few: on-policy, the reward already climbs within five steps. Over the study's seeds
#: it was 0.29 at most (a sampler group's reward: 8 answers).
AT_CHANCE = 0.36
#: A run that learned: the last steps' mean reward is at least this (over the study's seeds: the slowest, a live group
#: beside a frozen one, 0.62; on-policy and two versions stale, far above).
LEARNED = 0.45
#: A control that must not learn (a learning rate of 0, a sampler that never receives the weights): the last steps'
#: mean reward stays at most this (over the study's seeds: 0.23 at most).
NOT_LEARNED = 0.32
#: Steps a run needs for :data:`LEARNED`: the study's runs, all measured at their last five of these.
STEPS_TO_LEARN = 25
#: The same for the Megatron learner with a group that never receives the weights beside the one that does: half of
#: every batch stays at chance, and the live group climbs more slowly.
STEPS_TO_LEARN_BESIDE_A_FROZEN_GROUP = 40
#: The same on-policy (every trained batch from the learner's own version): steps 11-15 averaged 0.75 at least.
STEPS_TO_LEARN_ON_POLICY = 15


def curve(metrics: dict[int, dict], key: str = SCORE) -> list[float]:
    """``key`` at every step that logged it, in step order."""
    return [m[key] for _, m in sorted(metrics.items()) if key in m and math.isfinite(m[key])]


def first_and_last(metrics: dict[int, dict], key: str = SCORE) -> tuple[float, float]:
    """``key`` at the first step that logged it, and its mean over the last :data:`WINDOW` steps that did."""
    values = curve(metrics, key)
    assert len(values) >= 2 * WINDOW, f"{key}: {len(values)} steps logged it, {2 * WINDOW} needed: {values}"
    return values[0], statistics.fmean(values[-WINDOW:])


def assert_learns(metrics: dict[int, dict], key: str = SCORE) -> None:
    """The reward rose from chance to :data:`LEARNED`."""
    first, last = first_and_last(metrics, key)
    assert first <= AT_CHANCE and last >= LEARNED, (f"{key}: first {first:.3f}, last {last:.3f}", curve(metrics, key))


def assert_does_not_learn(metrics: dict[int, dict], key: str = SCORE) -> None:
    """The reward started at chance and stayed there."""
    first, last = first_and_last(metrics, key)
    assert first <= AT_CHANCE and last <= NOT_LEARNED, (
        f"{key}: first {first:.3f}, last {last:.3f}",
        curve(metrics, key),
    )
