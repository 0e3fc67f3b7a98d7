"""Resolve command lines with ``python -m gepo_plugin.main_ppo <overrides> --cfg job``, the real CLI, in one process.

Each start of the CLI imports verl (about 10 s of CPU), so one interpreter runs the module the way ``python -m`` does
(runpy, ``run_name="__main__"``) once per command line, in the background while other tests run. Used by the
example scripts' tests and the docs' tests (every command a page shows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

MARKER = "=== gepo-cfg-job"
RUNNER = f"""
import json, runpy, sys

for name, overrides in json.loads(sys.argv[1]):
    print("{MARKER} begin", name, flush=True)
    sys.argv = ["gepo_plugin.main_ppo", *overrides, "--cfg", "job"]
    code = 0
    try:
        runpy.run_module("gepo_plugin.main_ppo", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    print("{MARKER} end", name, code, flush=True)
"""

#: name -> (exit status, what ``--cfg job`` printed); the key ``"stderr"`` holds (the runner's status, its stderr).
Results = dict[str, tuple[int, str]]


def start(
    jobs: Sequence[tuple[str, Sequence[str]]], workdir: Path, timeout_s: float = 300
) -> tuple[subprocess.Popen, Callable[[], Results]]:
    """Start resolving ``jobs`` (name, overrides) in one background interpreter; returns it and a function that
    waits for it and returns the results (a command that never ended reads as status -1)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", RUNNER, json.dumps([[name, list(overrides)] for name, overrides in jobs])],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results: Results = {}

    def collect() -> Results:
        if not results:
            stdout, stderr = process.communicate(timeout=timeout_s)
            for chunk in stdout.split(f"{MARKER} begin ")[1:]:
                name, _, rest = chunk.partition("\n")
                text, _, end = rest.partition(f"{MARKER} end {name} ")
                results[name] = (int(end.split()[0]) if end else -1, text)
            for name, _ in jobs:
                results.setdefault(name, (-1, ""))
            results["stderr"] = (process.returncode, stderr)
        return results

    return process, collect


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.communicate()
