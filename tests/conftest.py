"""Shared fixtures: random GEPO batches with ragged responses and several prompt groups."""

from __future__ import annotations

import os

import pytest

from gepo_plugin.synthetic import SyntheticBatch, random_batch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

make_batch = random_batch


@pytest.fixture
def batch() -> SyntheticBatch:
    return random_batch()
