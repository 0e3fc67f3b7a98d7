"""Which trainer runs: ``trainer.v1.trainer_mode`` is decided here, once, from the loss preset and ``hetero.enable``.

The user names one of verl's modes (``sync``, ``colocate_async``, ``separate_async``). A loss that reads per-response
terms (GEPO's per-prompt group term, M2PO's mini-batch cap) needs the plugin's trainer of that mode (``gepo_<mode>``),
which installs the loss wrapper that hands them over; HeteroRL needs ``separate_async`` with the plugin's
books and weight sync (``gepo_separate_async`` for GEPO, ``hetero_separate_async`` otherwise). Both rules meet in
:func:`decide_trainer_mode`, so their order cannot matter.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from gepo_plugin.config_keys import ROLLOUT_GPUS_PER_NODE, ROLLOUT_NNODES, TRAINER_MODE
from gepo_plugin.names import GEPO_TRAINER_FOR_MODE, HETERO_TRAINER
from gepo_plugin.verl_glue.errors import PluginConfigError

#: The trainers that run HeteroRL (``hetero.enable=true``).
HETERO_TRAINERS = (HETERO_TRAINER, GEPO_TRAINER_FOR_MODE["separate_async"])


def decide_trainer_mode(requested: str, response_terms: bool, hetero: bool) -> str:
    """The trainer to run for the ``requested`` mode, when the loss needs ``response_terms`` and when HeteroRL
    is on; a mode HeteroRL cannot run on is an error naming the fix. Any other name (a user's own registered
    trainer) is kept, and checked against verl's registry at start-up."""
    mode = requested
    if response_terms and mode in GEPO_TRAINER_FOR_MODE:
        mode = GEPO_TRAINER_FOR_MODE[mode]
    if not hetero:
        return mode
    if mode == "separate_async":
        return HETERO_TRAINER
    if mode not in HETERO_TRAINERS:
        raise PluginConfigError(
            f"hetero.enable=true needs samplers on their own devices, but {TRAINER_MODE}={requested}: set "
            f"{TRAINER_MODE}=separate_async (with {ROLLOUT_NNODES} / {ROLLOUT_GPUS_PER_NODE.rsplit('.', 1)[-1]} for "
            "the samplers), or hetero.enable=false"
        )
    return mode


def settle_trainer_mode(config: DictConfig, response_terms: bool, hetero: bool) -> str:
    """Write :func:`decide_trainer_mode`'s answer into ``config`` (the launcher's one call) and return it."""
    mode = decide_trainer_mode(OmegaConf.select(config, TRAINER_MODE), response_terms, hetero)
    with open_dict(config):
        OmegaConf.update(config, TRAINER_MODE, mode, force_add=True)
    return mode
