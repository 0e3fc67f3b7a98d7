"""Does the model learn? The checks every long end-to-end run makes of its reward, with bounds fixed in advance.

The tiny task (``gepo_plugin.tiny.compute_score``: the share of the answer's characters that are digits) starts at
chance, about 0.2, and verl's trainer with the plugin climbs it within a few dozen steps. The bounds below were chosen
before the tests were written, from ``bench/bench_tiny_learning.py`` over ten seeds (``docs/bench/tiny_learning.json``):
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
#: step, not a mean of the first few: on-policy, the reward already climbs within five steps.
AT_CHANCE = 0.32
#: A run that learned: the last steps' mean reward is at least this (ten seeds after 25 steps: on-policy 0.87 and
#: more; two versions stale, 0.61 and more; with a frozen sampler group beside, its live group 0.52 and more).
LEARNED = 0.45
#: A control that must not learn (a learning rate of 0, a sampler that never receives the weights): the last steps'
#: mean reward stays at most this (ten seeds: 0.26 at most).
NOT_LEARNED = 0.32
#: Steps a run needs for :data:`LEARNED` (the slowest seed of the slowest setting crossed it by step 20).
STEPS_TO_LEARN = 25
#: The same for the Megatron learner with a group that never receives the weights beside the one that does: half of
#: every batch stays at chance, and the live group climbs more slowly.
STEPS_TO_LEARN_BESIDE_A_FROZEN_GROUP = 40
#: The same on-policy (every trained batch from the learner's own version): the slowest seed crossed it by step 10.
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
