"""The plugin's hook in every vLLM process (vLLM's ``vllm.general_plugins`` entry point): on the CPU backend, release
vLLM's shared-memory queues once attached (``patches/vllm_cpu_shm_release.py``) and keep tqdm's lock in the process;
anywhere else, nothing."""

from __future__ import annotations

import threading

from tqdm import tqdm

from gepo_plugin.cpu_backend import cpu_platform_selected


def register() -> None:
    """Called by vLLM in its engine core and worker processes (cheap: an environment check first)."""
    if not cpu_platform_selected():
        return
    from vllm.platforms import current_platform  # optional: vllm; the platform only after the env check

    if not current_platform.is_cpu():
        return
    # lazy: vLLM loads this hook in every process, GPU ones too
    from gepo_plugin.patching import apply_named
    from gepo_plugin.verl_glue.registration import run_recorded

    run_recorded("release vLLM's shared memory once attached", lambda: apply_named("vllm_cpu_shm_release"))
    _thread_lock_for_tqdm()


def _thread_lock_for_tqdm() -> None:
    """tqdm's default lock includes a multiprocessing semaphore; in vLLM's spawned processes its name stays in
    /dev/shm (``sem.mp-*``) until Python's resource tracker unlinks it at exit, so a process group killed with its
    tracker leaves it behind. vLLM's processes start no children that share a progress bar: a thread lock serves
    (tqdm's public ``set_lock``)."""
    tqdm.set_lock(threading.RLock())
