"""Where the end-to-end tier's time goes: every Ray and end-to-end test's set-up, call and tear-down, and the timeline
of every trainer run (``tests/trainer_run.py``), added to the JSON file ``GEPO_E2E_TIMING`` names.

A pytest plugin (``conftest.py`` loads it): ``GEPO_E2E_TIMING=timing.json bash test.sh`` measures the tier (remove the
file first: every session, and each of its pytest-xdist workers, adds what it ran), and ``python
scripts/e2e_timing_table.py timing.json`` turns the file into the development page's table. A test helper, not
shipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "GEPO_E2E_TIMING"
#: what a pytest-xdist worker hands its controller (``workeroutput``)
WORKER_KEY = "gepo_e2e_runs"

_tests: dict[str, dict[str, float]] = {}
_runs: list[tuple[str, Any]] = []
_from_workers: list[dict] = []


def current_test() -> str:
    """The node id of the test pytest is running (its set-up included: a module's scenario runs in its first test's
    set-up)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


def record_timeline(timeline: Any) -> None:
    """Keep a trainer run's timeline (filled in as the run goes) with the test that started it."""
    _runs.append((current_test(), timeline))


def _run_records() -> list[dict]:
    return [
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


def pytest_runtest_logreport(report) -> None:
    if "ray" in report.keywords or "e2e" in report.keywords:  # the tier's tests only
        _tests.setdefault(report.nodeid, {})[report.when] = report.duration


def pytest_testnodedown(node, error) -> None:
    """A pytest-xdist worker ended: keep the runs it timed (its tests' durations reached the controller as reports)."""
    _from_workers.extend(json.loads(getattr(node, "workeroutput", {}).get(WORKER_KEY, "[]")))


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workerinput"):  # a worker: its runs go to the controller, which writes them
        session.config.workeroutput[WORKER_KEY] = json.dumps(_run_records())
        return
    path = os.environ.get(ENV)
    if not path:
        return
    record = json.loads(Path(path).read_text()) if Path(path).exists() else {"tests": {}, "runs": []}
    record["tests"].update(_tests)
    record["runs"] += _run_records() + _from_workers
    Path(path).write_text(json.dumps(record, indent=1))
