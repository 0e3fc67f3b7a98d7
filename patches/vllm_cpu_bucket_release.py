"""verl 0.9.1's weight-update bucket outlives a run whose vLLM engine died: 64 MB (or 2 GiB) left in ``/dev/shm``.

On a CPU verl's ``BucketedWeightSender`` (``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``, the
sender in the trainer's rollout worker) creates a named POSIX shared-memory segment ``verl_weights_<uuid>`` for each
weight update and unlinks it in ``_cleanup`` when the update has ended. When the engine dies mid-update, the sender
waits for its acknowledgement until the run is killed, and the segment stays: /dev/shm is memory. The fix releases
the name as soon as the receiver has attached (the sender's ``_init_buffer`` returns after the receiver's reply):
both processes keep their mapping, the kernel frees the memory when the last of them exits however it exits, and
``_cleanup``'s own unlink then has nothing to do. (A bucket whose receiver never attached is released by the
survivors: ``gepo_plugin/cpu_backend/vllm/weight_buckets.py``.) Applied in CPU-backend processes whose vLLM
platform is the CPU.
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

_INIT_BUFFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer.BucketedWeightSender._init_buffer"


def _released(shm) -> None:
    """Unlink ``shm``'s name now and make its later ``unlink()`` a no-op (the name is gone)."""
    shm.unlink()
    shm.unlink = lambda: None


def _apply() -> None:
    original = seam.resolve(_INIT_BUFFER)

    @functools.wraps(original)
    def _init_buffer(self):
        result = original(self)
        if getattr(self, "shm", None) is not None:  # the receiver has attached: the name is no longer needed
            _released(self.shm)
        return result

    seam.replace(_INIT_BUFFER, _init_buffer)


PATCH = Patch(
    name="vllm_cpu_bucket_release",
    versions={"verl": "==0.9.1"},
    reason="verl's shared-memory weight bucket is unlinked only when an update ends; a dead engine leaves it",
    apply=_apply,
    feature="vllm_cpu",
    check_contacts=seam.require,
)
