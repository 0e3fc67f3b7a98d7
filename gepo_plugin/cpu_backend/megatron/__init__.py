"""verl's Megatron engine (``model_engine=megatron``) on the CPU backend: ``settings`` and ``engines``.

Only for ``trainer.device=cpu`` runs whose actor is on verl's Megatron engine, with the ``[megatron-cpu]`` extra
(megatron-core 0.16.1 and mbridge 0.15.1, the versions every patch was written for). Nothing here imports
megatron-core until a CPU Megatron engine is built, so a GPU host or an FSDP run never pays for it.
"""

from omegaconf import DictConfig, OmegaConf

from gepo_plugin import config_keys as keys

MEGATRON_STRATEGY = "megatron"
#: The roles whose engine ``model_engine=megatron`` selects (each has a ``<role>.megatron`` subtree then).
MEGATRON_ROLES = keys.ENGINE_ROLES


def megatron_selected(config: DictConfig) -> bool:
    """Is the actor on verl's Megatron engine? (``model_engine=megatron`` composes ``actor.strategy=megatron``.)"""
    return OmegaConf.select(config, keys.ACTOR_STRATEGY, default=None) == MEGATRON_STRATEGY
