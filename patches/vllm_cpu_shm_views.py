"""verl 0.9.1 hands vLLM, on a CPU, views into the shared-memory bucket that the next bucket overwrites.

``BucketedWeightReceiver.receive_weights`` (``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``)
rebuilds each received tensor as a view of the bucket buffer and moves it to the worker's device with
``tensor.to(device)``: a copy on a GPU, a no-op on a CPU. vLLM's layer-wise reload (which vLLM-CPU needs, see
``patches/vllm_cpu_weight_reload.py``) keeps a layer's tensors until all of them have arrived, possibly from a later
bucket, so on a CPU it would hold views of memory already overwritten, and the views also keep the shared memory
from being closed. The fix hands the callback copies when the receiving device is the CPU (what ``.to`` does on a
GPU); on any other device verl's method runs unchanged.
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

_RECEIVE = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer.BucketedWeightReceiver.receive_weights"


def _apply() -> None:
    original = seam.resolve(_RECEIVE)

    @functools.wraps(original)
    def receive_weights(self, on_bucket_received):
        if getattr(self.device, "type", str(self.device)) != "cpu":
            return original(self, on_bucket_received)

        def copied(weights, is_last):
            return on_bucket_received([(name, tensor.clone()) for name, tensor in weights], is_last)

        return original(self, copied)

    seam.replace(_RECEIVE, receive_weights)


PATCH = Patch(
    name="vllm_cpu_shm_views",
    versions={"verl": "==0.9.1"},
    reason="on a CPU verl hands vLLM views into the reused shared-memory bucket (tensor.to(cpu) copies nothing)",
    apply=_apply,
    feature="vllm_cpu",
    check_contacts=seam.require,
)
