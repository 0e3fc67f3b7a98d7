"""The sampler host's hook inside vLLM's worker: install a weight version from a local safetensors file, in place.

Given to ``vllm serve`` as ``--worker-extension-cls gepo_sampler.host.vllm_extension.RelayInstall``; vLLM
adds the class to its worker's bases, and the host calls its method through vLLM's ``/collective_rpc`` endpoint
(bound to localhost). vLLM's own ``reload_weights`` does the in-place reload (vLLM 0.24 to 0.33 alike: layer-wise,
so a CPU build's repacked linear weights are rebuilt too). Nothing here imports the rest of the plugin: vLLM's
worker process imports only this module.
"""

from __future__ import annotations


class RelayInstall:
    """Methods vLLM adds to its worker (their names must not clash with the worker's own)."""

    def gepo_install_weights(self, path: str) -> dict:
        """Load every tensor of the safetensors file at ``path`` into the model, in place; the count and bytes."""
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return {"tensors": len(tensors), "bytes": int(sum(t.numel() * t.element_size() for t in tensors.values()))}
