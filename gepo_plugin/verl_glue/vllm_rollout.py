"""verl's vLLM rollout, on any device: whether a run uses it (decided here only), and its warnings kept visible.

vLLM's API server imports ``model_hosting_container_standards`` (a dependency of vLLM), which at import sets the
root logger, and every handler on it, to ``SAGEMAKER_CONTAINER_LOG_LEVEL`` (default ``ERROR``). Every process that
imports verl's ``vLLMHttpServer`` (verl's TaskRunner among them) then drops all warnings: verl's, Ray's, and the
plugin's (a retired sampler, a refused manifest). Where the user set nothing, the launcher passes the variable to
every Ray worker as ``WARNING``, Python's own default for the root logger (``--cfg job`` shows it).
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.config_keys import RAY_ENV_VARS, ROLLOUT_NAME
from gepo_plugin.names import VLLM_ROLLOUT

ROOT_LEVEL_ENV = "SAGEMAKER_CONTAINER_LOG_LEVEL"


def uses_vllm_rollout(config: DictConfig) -> bool:
    """The run generates with verl's vLLM rollout (``actor_rollout_ref.rollout.name=vllm``)."""
    return OmegaConf.select(config, ROLLOUT_NAME) == VLLM_ROLLOUT


def vllm_logging_settings(config: DictConfig) -> dict[str, object]:
    """``{ray env var: level}`` for a run with verl's vLLM rollout (empty otherwise)."""
    if not uses_vllm_rollout(config):
        return {}
    return {f"{RAY_ENV_VARS}.{ROOT_LEVEL_ENV}": os.environ.get(ROOT_LEVEL_ENV, "WARNING")}
