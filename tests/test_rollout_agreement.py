"""The rollout-vs-learner log-prob gap: only the learner's own version's responses, only their real tokens."""

from __future__ import annotations

import numpy as np
import torch

from gepo_plugin.maths.rollout_agreement import fresh_logprob_gap, fresh_responses


def test_fresh_responses_are_those_entirely_generated_by_the_learners_version():
    tags = [
        {"min_global_steps": 3, "max_global_steps": 3},  # fresh
        {"min_global_steps": 2, "max_global_steps": 3},  # spans an install: partly older weights
        {"min_global_steps": 2, "max_global_steps": 2},  # stale
        {"min_global_steps": 3, "max_global_steps": 3, "is_padding": True},  # verl's padding
    ]
    assert fresh_responses(tags, learner_version=3).tolist() == [True, False, False, False]


def test_the_gap_covers_the_masked_tokens_of_fresh_rows_only_whatever_the_padding():
    generator = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=generator)
    learner = rollout + 1e-3 * torch.randn(4, 6, generator=generator)
    learner[1] += 5.0  # a stale row: far off, but not counted
    mask = torch.ones(4, 6)
    mask[:, 5:] = 0  # the longest response has 5 tokens; the mask is padded further, as verl's may be
    mask[0, 4:] = 0
    learner[0, 4:] += 7.0  # beyond the response: not counted
    fresh = np.array([True, False, True, True])
    got = fresh_logprob_gap(fresh, rollout, learner[:, :5], mask)  # the learner's field padded shorter
    expected = [abs(rollout[r, t] - learner[r, t]).item() for r in (0, 2, 3) for t in range(5) if mask[r, t]]
    assert got["tokens"] == len(expected) == 4 + 5 + 5
    assert np.isclose(got["max"], max(expected))
    assert np.isclose(got["mean"], np.mean(expected))
    assert fresh_logprob_gap(np.zeros(4, dtype=bool), rollout, learner, mask) == {"tokens": 0.0}
