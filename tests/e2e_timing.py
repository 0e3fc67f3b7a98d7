"""Where the end-to-end tier's time goes: every test's set-up, call and tear-down, and the timeline of every trainer
run (``tests/trainer_run.py``), written as JSON when ``GEPO_E2E_TIMING`` names a file.

A pytest plugin (``conftest.py`` loads it): ``GEPO_E2E_TIMING=timing.json bash test.sh -m "(ray or e2e)"`` measures a
tier, and ``python scripts/e2e_timing_table.py timing.json`` turns the file into the development page's table. A test
helper, not shipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "GEPO_E2E_TIMING"

_tests: dict[str, dict[str, float]] = {}
_runs: list[tuple[str, Any]] = []


def current_test() -> str:
    """The node id of the test pytest is running (its set-up included: a module's scenario runs in its first test's
    set-up)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


def record_timeline(timeline: Any) -> None:
    """Keep a trainer run's timeline (filled in as the run goes) with the test that started it."""
    _runs.append((current_test(), timeline))


def pytest_runtest_logreport(report) -> None:
    _tests.setdefault(report.nodeid, {})[report.when] = report.duration


def pytest_sessionfinish(session) -> None:
    path = os.environ.get(ENV)
    if not path or hasattr(session.config, "workerinput"):  # one file per session, from its main process
        return
    runs = [
        {
            "test": test,
            "name": timeline.name,
            "summary": timeline.summary(),
            "exited": timeline.exited,
            "steps": len(timeline.steps),
            "marks": timeline.marks,
            "waits": timeline.waits,
        }
        for test, timeline in _runs
    ]
    Path(path).write_text(json.dumps({"tests": _tests, "runs": runs}, indent=1))
