"""A weight bucket that a killed run left in /dev/shm is released; one a live process holds is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest

from gepo_plugin.cpu_backend.vllm.weight_buckets import BUCKET_PREFIX, SHM_DIR, release_abandoned_buckets

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="POSIX shared memory in /dev/shm (Linux)")

# Creates (or attaches to) a bucket the way verl's sender (receiver) does, then waits to be killed.
# Python's resource tracker would unlink it when the holder dies; Ray's end of a run kills the tracker too, so the
# holder leaves it untracked.
HOLDER = """
import os, sys, time
from multiprocessing import resource_tracker, shared_memory
name, create, lifetime = sys.argv[1], sys.argv[2] == "create", float(sys.argv[3])
segment = shared_memory.SharedMemory(name=name, create=create, size=1 << 16 if create else 0)
resource_tracker.unregister(segment._name, "shared_memory")
print("ready", flush=True)
time.sleep(lifetime)
os._exit(0)
"""


def _hold(name: str, create: bool, lifetime_s: float = 600) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, "create" if create else "attach", str(lifetime_s)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def _kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_a_bucket_is_released_once_no_process_holds_it_and_not_before():
    name = f"{BUCKET_PREFIX}{uuid.uuid4().hex}"
    path = SHM_DIR / name
    sender = _hold(name, create=True)
    receiver = _hold(name, create=False)
    try:
        assert name not in release_abandoned_buckets()  # the sender holds it open
        _kill(sender)
        assert path.exists()  # the leak: nobody of the run is left to unlink it
        assert name not in release_abandoned_buckets()  # the receiver still maps it
        assert path.exists()
    finally:
        _kill(receiver)
        if sender.poll() is None:
            _kill(sender)
    assert name in release_abandoned_buckets()
    assert not path.exists()


def test_a_runs_end_waits_for_its_processes_to_exit_before_releasing():
    name = f"{BUCKET_PREFIX}{uuid.uuid4().hex}"
    path = SHM_DIR / name
    sender = _hold(name, create=True, lifetime_s=2)  # a run's process still ending when the run's end looks
    try:
        assert name not in release_abandoned_buckets()  # without waiting: held, so kept
        released = release_abandoned_buckets(wait_for=[psutil.Process(sender.pid)], timeout_s=60)
    finally:
        if sender.poll() is None:
            _kill(sender)
    assert name in released and not path.exists()
