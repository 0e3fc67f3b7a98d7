"""verl's trainer (``python -m gepo_plugin.main_ppo``) as the end-to-end tests run it: in the background, its metrics
read as they arrive, its log in a file, and a timeline of where its wall time went.

One class for every end-to-end run, so that every run is timed the same way: the timeline (launch, the arrival of each
step's metrics, the scenario's own marks such as a fault or a deliberate wait, the exit) is what the per-test timing
table of the development page is built from (``tests/e2e_timing.py``). A test helper, not shipped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from e2e_timing import record_timeline

from gepo_plugin.tiny import read_metrics

#: How often the background reader looks at the metrics file and the log (seconds): the resolution of the timeline.
READ_EVERY_S = 0.25
#: Lines of verl 0.9.1's TaskRunner that split a run's start-up, in the order they come: the TaskRunner's first line
#: (Ray started or joined, the driver's imports), its learner built (FSDP2 or Megatron workers), everything else
#: built (the rollout engines: vLLM, the transformers server; the checkpoint engine, the reward loop).
LANDMARKS = {
    "task_runner": "(TaskRunner",
    "learner": "actor and ref model engine initialized",
    "engines": "all initialize finished, ready to fit",
}


@dataclass
class Timeline:
    """Seconds since the launch: when each step's metrics arrived, the scenario's marks, the exit."""

    name: str
    steps: dict[int, float] = field(default_factory=dict)
    step_seconds: dict[int, float] = field(default_factory=dict)
    marks: list[tuple[str, float]] = field(default_factory=list)
    waits: list[tuple[str, float]] = field(default_factory=list)
    landmarks: dict[str, float] = field(default_factory=dict)
    exited: float | None = None

    def start_up_parts(self) -> dict[str, float] | None:
        """Start-up split at :data:`LANDMARKS`: Ray and the driver, the learner, the engines, step 1 (its lazy starts
        included); None when the log did not show every landmark (a run that failed early)."""
        if not self.steps or any(name not in self.landmarks for name in LANDMARKS):
            return None
        at = [0.0, *(self.landmarks[name] for name in LANDMARKS), self.steps[min(self.steps)]]
        names = ("ray_and_driver", "learner", "engines", "step_1")
        return {name: max(end - start, 0.0) for name, start, end in zip(names, at[:-1], at[1:], strict=True)}

    def summary(self) -> dict[str, float]:
        """Start-up (launch to the first step's metrics: Ray, verl's workers, the engines, step 1 and its lazy
        starts), training (verl's own time of the later steps), deliberate waits (declared by the scenario), the rest
        between the first and the last step (the learner waiting for samplers, faults being detected), tear-down."""
        if not self.steps:
            return {"start_up": self.exited or 0.0, "training": 0.0, "waits": 0.0, "between": 0.0, "tear_down": 0.0}
        first, last = min(self.steps), max(self.steps)
        training = sum(seconds for step, seconds in self.step_seconds.items() if step != first)
        waits = sum(seconds for _, seconds in self.waits)
        span = self.steps[last] - self.steps[first]
        return {
            "start_up": self.steps[first],
            **(self.start_up_parts() or {}),
            "training": training,
            "waits": waits,
            "between": max(span - training - waits, 0.0),
            "tear_down": (self.exited - self.steps[last]) if self.exited is not None else 0.0,
        }


class TrainerRun:
    """One run of the launcher with ``overrides``, started at once; the caller waits for steps, acts, and ends it.

    ``env`` is added to this process's environment (a cluster's token, a storage credential); the run's actors
    learn the metrics file through the job's runtime environment, so the run may join a cluster started elsewhere.
    """

    def __init__(self, name: str, overrides: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path, self.log_path = self.workdir / "metrics.jsonl", self.workdir / "run.log"
        self.metrics_path.unlink(missing_ok=True)
        self.overrides = [
            *overrides,
            f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={self.metrics_path}",
        ]
        self.timeline = Timeline(name)
        self._launched = time.monotonic()
        run_env = {
            **os.environ,
            **(env or {}),
            "VERL_FILE_LOGGER_PATH": str(self.metrics_path),
            "PYTHONWARNINGS": "ignore",
            "RAY_DEDUP_LOGS": "0",  # every line the actors print, in order (tests read the TaskRunner's config back)
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gepo_plugin.main_ppo", *self.overrides],
            cwd=self.workdir,
            env=run_env,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its process group: a run that outlives its test is ended whole
        )
        self._log_offset, self._log_tail = 0, ""
        self._stop_reading = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"metrics-{name}", daemon=True)
        self._reader.start()
        record_timeline(self.timeline)

    # ------------------------------------------------------------------ what the run logged

    def _now(self) -> float:
        return time.monotonic() - self._launched

    def _read(self) -> None:
        while not self._stop_reading.is_set():
            self._note_steps()
            if len(self.timeline.landmarks) < len(LANDMARKS):
                self._note_landmarks()
            self._stop_reading.wait(READ_EVERY_S)

    def _note_landmarks(self) -> None:
        """The first time each of :data:`LANDMARKS` shows in the log (read on from where the last look stopped)."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            raw = log.read()
        self._log_offset += len(raw)
        text, now = self._log_tail + raw.decode(errors="replace"), self._now()
        for name, line in LANDMARKS.items():
            if name not in self.timeline.landmarks and line in text:
                self.timeline.landmarks[name] = now
        self._log_tail = text[-200:]  # a landmark split across two reads

    def _note_steps(self) -> dict[int, dict]:
        metrics = read_metrics(self.metrics_path)
        now = self._now()
        for step, values in metrics.items():
            if step not in self.timeline.steps:
                self.timeline.steps[step] = now
                if "timing_s/step" in values:
                    self.timeline.step_seconds[step] = float(values["timing_s/step"])
        return metrics

    @property
    def metrics(self) -> dict[int, dict]:
        """Every step's metrics logged so far."""
        return read_metrics(self.metrics_path)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def mark(self, what: str) -> None:
        """A moment of the scenario (a fault, a sampler started), on the timeline."""
        self.timeline.marks.append((what, self._now()))

    def waited(self, what: str, seconds: float) -> None:
        """A deliberate wait of the scenario (an outage held open, a cut kept past a timeout): its own column."""
        self.timeline.waits.append((what, seconds))

    # ------------------------------------------------------------------ waiting

    def wait_until(self, done: Callable[[dict[int, dict]], object], what: str, timeout_s: float = 600) -> dict:
        """Block until ``done(metrics by step)`` holds (returns the metrics), or fail if the run ended or took too
        long (with the end of its log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            logged = self._note_steps()
            if done(logged):
                return logged
            if self.process.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.process.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s} s:\n{self.tail()}")
            time.sleep(0.2)

    def wait_for_step(self, step: int, timeout_s: float = 600) -> dict[int, dict]:
        return self.wait_until(lambda logged: step in logged, f"step {step}", timeout_s)

    def finish(self, timeout_s: float = 900) -> int:
        """Wait for the run to end by itself; its exit code (killed, and failing, if it outlives ``timeout_s``)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout_s} s:\n{self.tail()}") from None
        self._ended()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120) -> None:
        """End the run now (its whole process group): a test that has seen what it needs stops the learner."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        self._ended()

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)
        self._ended()

    def _ended(self) -> None:
        if self.timeline.exited is None:
            self._note_steps()
            self.timeline.exited = self._now()
        self._stop_reading.set()

    def tail(self, chars: int = 6000) -> str:
        return self.log[-chars:] if self.log_path.exists() else "(no log)"

    def __enter__(self) -> TrainerRun:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def complete_run(
    name: str, overrides: list[str], workdir: Path, env: dict[str, str] | None = None, **wait
) -> TrainerRun:
    """A run started and waited for to its end; asserts it ended well (the end of its log otherwise)."""
    run = TrainerRun(name, overrides, workdir, env)
    code = run.finish(**wait)
    assert code == 0, run.tail()
    return run
