"""verl V1 trainers that compute GEPO's group term where prompt groups are whole.

Registered with verl's public ``register_trainer`` as ``gepo_sync``, ``gepo_colocate_async`` and
``gepo_separate_async`` (select with ``trainer.v1.trainer_mode``). Each is verl's own trainer
of that mode plus :class:`ResponseTermsMixin`, which

1. after verl's ``_compute_advantage`` (the last step that sees the batch with ``uid`` before
   the actor update), reads ``old_log_probs`` (the sampler's log-probs in bypass mode),
   computes ``log E_hat_q[q]`` per prompt group for all groups at once, and writes it per
   sample into the batch (TransferQueue), so it survives verl's repartitioning (in the same round trip
   as HeteroRL's fields: :mod:`gepo_plugin.verl_glue.advantage_fields`);
2. after verl's worker set-up, installs :func:`ppo_loss_with_response_terms` on the actor
   workers through verl's public ``set_loss_fn``, so the registered ``gepo`` loss can read it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import ClassVar

import numpy as np
import torch
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass

from gepo_plugin import metric_names
from gepo_plugin.maths import GroupIndex, group_log_expectation_from_tokens
from gepo_plugin.names import GEPO_TRAINER_FOR_MODE, HETERO_TRAINER
from gepo_plugin.verl_glue import replay_wait, seam
from gepo_plugin.verl_glue.advantage_fields import AdvantageFieldsMixin
from gepo_plugin.verl_glue.hetero.trainer import HeteroMixin
from gepo_plugin.verl_glue.losses import finalize_gepo_metrics
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms
from gepo_plugin.verl_glue.rollout_agreement import RolloutAgreementMixin
from gepo_plugin.verl_glue.rollout_watchdog import RolloutReplicaLost, RolloutWatchdog

logger = logging.getLogger(__name__)


def compute_group_terms(uids: np.ndarray, old_log_probs: torch.Tensor, response_mask: torch.Tensor, is_padding):
    """Per-sample ``log E_hat_q[q]`` of each prompt group plus summary metrics (framework-free inputs)."""
    valid = torch.as_tensor(~np.asarray(is_padding, dtype=bool))
    index = GroupIndex.from_ids(uids)  # one index for the term and its metrics (padding rows copy a real uid)
    log_eq = group_log_expectation_from_tokens(old_log_probs, response_mask, index, valid=valid)
    real_sizes = torch.bincount(index.inverse[valid], minlength=index.num_groups)
    real_sizes = real_sizes[real_sizes > 0]
    metrics = {
        metric_names.GEPO_GROUPS + "num_groups": float(real_sizes.numel()),
        metric_names.GEPO_GROUPS + "group_size_mean": float(real_sizes.float().mean()),
        metric_names.GEPO_GROUPS + "log_group_expectation_mean": float(log_eq[valid].mean()),
    }
    return log_eq.to(torch.float32), metrics


class VerlModeMixin:
    """verl sees a plugin trainer as the mode it extends.

    verl's base trainer keeps the registered name in ``self.trainer_mode`` and branches on it: ``== "sync"`` picks
    the sync replay buffer (failed groups are trained as they are, not evicted and refilled), the dataloader's fetch
    size and whether TransferQueue is checkpointed; ``trainer.v1.<mode>`` holds ``parameter_sync_step``. Under the
    names the plugin registers (``gepo_sync``, ``gepo_separate_async``, ...) verl took every such branch as an
    asynchronous mode and read no ``parameter_sync_step`` (always 1). Here ``trainer_mode`` answers verl's mode
    (:attr:`verl_mode`); the registered name is kept in :attr:`registered_mode`.
    """

    #: verl's mode this trainer extends.
    verl_mode: ClassVar[str]
    registered_mode: str

    def __init__(self, config):
        seam.require("verl_trainer_mode")
        super().__init__(config)

    @property
    def trainer_mode(self) -> str:
        return self.verl_mode

    @trainer_mode.setter
    def trainer_mode(self, registered: str) -> None:  # verl's PPOTrainer.__init__ assigns the configured name
        self.registered_mode = registered


class ResponseTermsMixin(AdvantageFieldsMixin):
    """Adds the trainer-side group term and the loss wrapper to a verl V1 trainer."""

    def __init__(self, config):
        seam.require("group_term", "metric_aggregation")
        super().__init__(config)

    def _setup(self):
        super()._setup()
        self._install_response_terms_loss()

    def _install_response_terms_loss(self) -> None:
        if is_distillation_enabled(self.config.get("distillation")):
            raise ValueError(
                "the gepo_* trainers do not support distillation (it installs its own loss); "
                "use trainer.v1.trainer_mode=sync|colocate_async|separate_async for distillation"
            )
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.actor_rollout_wg.set_loss_fn(partial(ppo_loss_with_response_terms, config=actor_config))
        logger.info("gepo-plugin: per-sample term loss installed on actor workers")

    def _update_actor(self, batch, metrics: dict):
        batch = super()._update_actor(batch, metrics=metrics)
        finalize_gepo_metrics(metrics)  # the step's exact means from the loss's totals
        return batch

    def _advantage_reads(self) -> frozenset[str]:
        return super()._advantage_reads() | {"uid", "old_log_probs", "response_mask"}

    def _advantage_writes(self, batch, data, metrics: dict) -> dict[str, torch.Tensor]:
        writes = super()._advantage_writes(batch, data, metrics)
        uid_values = data.get("uid")  # a NonTensorStack, or its plain list (LinkedList) on some paths
        uids = np.array(uid_values.tolist() if hasattr(uid_values, "tolist") else list(uid_values), dtype=object)
        is_padding = [tag.get("is_padding", False) for tag in batch.tags]
        log_eq, term_metrics = compute_group_terms(uids, data["old_log_probs"], data["response_mask"], is_padding)
        metrics.update(term_metrics)
        writes[LOG_GROUP_EXPECTATION] = log_eq
        return writes


class RolloutWatchdogMixin:
    """A rollout replica that dies ends the run with an error naming it (:mod:`gepo_plugin.verl_glue.rollout_watchdog`),
    instead of verl waiting for ever on its requests (trainers without HeteroRL, whose samplers have their own)."""

    def _setup(self):
        super()._setup()
        seam.require("rollout_watchdog")
        self._rollout_watchdog = RolloutWatchdog(self.llm_server_manager.rollout_replicas)
        # the trainer's waits for rollouts and its refills of failed groups raise the watchdog's error themselves
        replay_wait.add_check(self.replay_buffer, self._rollout_watchdog.raise_if_lost)

    def fit(self, agent_loop_manager):
        try:
            return super().fit(agent_loop_manager)
        except RolloutReplicaLost:
            raise  # raised by a wait for rollouts or a refill (the checks added in _setup)
        except BaseException as error:
            watchdog = getattr(self, "_rollout_watchdog", None)
            if watchdog is not None:
                watchdog.raise_if_lost(error)
            raise
        finally:
            if getattr(self, "_rollout_watchdog", None) is not None:
                self._rollout_watchdog.stop()


@register_trainer(GEPO_TRAINER_FOR_MODE["sync"])
class GEPOTrainerSync(VerlModeMixin, ResponseTermsMixin, RolloutAgreementMixin, RolloutWatchdogMixin, PPOTrainerSync):
    """verl's sync trainer with GEPO's trainer-side group term."""

    verl_mode = "sync"


@register_trainer(GEPO_TRAINER_FOR_MODE["colocate_async"])
class GEPOTrainerColocateAsync(
    VerlModeMixin, ResponseTermsMixin, RolloutAgreementMixin, RolloutWatchdogMixin, PPOTrainerColocateAsync
):
    """verl's colocate_async trainer with GEPO's trainer-side group term."""

    verl_mode = "colocate_async"


@register_trainer(GEPO_TRAINER_FOR_MODE["separate_async"])
class GEPOTrainerSeparateAsync(
    VerlModeMixin, ResponseTermsMixin, RolloutAgreementMixin, HeteroMixin, PPOTrainerSeparateAsync
):
    """verl's separate_async trainer with GEPO's trainer-side group term and HeteroRL (``hetero.enable``)."""

    verl_mode = "separate_async"


@register_trainer(HETERO_TRAINER)
class HeteroTrainerSeparateAsync(VerlModeMixin, RolloutAgreementMixin, HeteroMixin, PPOTrainerSeparateAsync):
    """verl's separate_async trainer with HeteroRL, for losses other than GEPO (``hetero.enable=true``)."""

    verl_mode = "separate_async"


__all__ = [
    "GEPOTrainerColocateAsync",
    "GEPOTrainerSeparateAsync",
    "GEPOTrainerSync",
    "HeteroMixin",
    "HeteroTrainerSeparateAsync",
    "PPOTrainer",
    "ResponseTermsMixin",
    "RolloutWatchdogMixin",
    "VerlModeMixin",
    "compute_group_terms",
]
