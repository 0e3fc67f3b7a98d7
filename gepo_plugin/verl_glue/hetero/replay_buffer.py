"""HeteroRL's replay buffer for verl V1: verl's async buffer over TransferQueue, with HeteroRL's decisions.

Selected with ``trainer.v1.sampler.custom_sampler.{path,name}`` (``hetero.enable=true`` sets both). It is verl's
own :class:`ReplayBufferAsync` (the same TransferQueue storage, polling, refill of evicted prompts and batch
materialisation) in which every staleness decision is made by :class:`gepo_plugin.hetero.core.StalenessCore`,
the framework-free core the CPU lab runs too. This class only translates:

* **versions** are verl's weight versions (``global_steps`` passed to ``update_weights``); every trajectory
  carries ``min_global_steps``/``max_global_steps``, the versions of its first and last token, and a group's
  oldest token version is the minimum over its trajectories. ``sample(global_steps=g)`` trains the update
  ``g-1 -> g``, so the learner version is ``v = g-1`` (:func:`~gepo_plugin.verl_glue.weight_versions.learner_version`;
  a group's lag is verl's ``trajectory_staleness_worst``);
* **events**: groups that turned ``finished`` (or ``failure``) in TransferQueue are reported to the core once,
  with their versions and the step their prompt was submitted at (for in-flight groups the core bounds their
  oldest possible version by the oldest weights any sampler held at that step, which the weight sync records);
* **decisions**: the core's evictions (with their reason) become verl's evictions (verl clears and refills
  them), its wait condition becomes ``_has_enough_samples``, its selection order ``_select_prompt_uids``, and a
  trained batch is recorded in its books. Every private method of verl's buffer overridden here is a contact of
  the ``hetero`` feature in :mod:`gepo_plugin.verl_glue.seam`.

:meth:`HeteroReplayBuffer.state_dict` (the core's books and queued versions) is saved beside verl's checkpoint;
the finished-but-untrained groups themselves are in verl's TransferQueue checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from gepo_plugin import metric_names
from gepo_plugin.hetero.core import OVERFLOW, STALENESS_REASONS, StalenessCore
from gepo_plugin.hetero.drop_bias import DROPPED_STEP
from gepo_plugin.hetero.drop_bias import totals as drop_totals
from gepo_plugin.hetero.lags import lag_summary
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue import replay_wait, seam
from gepo_plugin.verl_glue.hetero.server_identity import server_of
from gepo_plugin.verl_glue.weight_versions import learner_version

logger = logging.getLogger(__name__)

TRAIN = "train"


def uid_of(key: str) -> str:
    """The prompt id of a trajectory key ``{uid}_{session}_{index}`` (verl's key layout)."""
    return key.split("_")[0]


class HeteroReplayBuffer(ReplayBufferAsync):
    """verl's async replay buffer whose staleness decisions and books are HeteroRL's core's."""

    def __init__(self, *args, **kwargs) -> None:
        seam.require("hetero")
        # verl's own prompt-step threshold is replaced by the core's version rule: switched off as the installed verl
        # takes it (None on 0.9.1; a bound no run reaches where it wants an int; left out where it takes none).
        kwargs.pop("max_off_policy_threshold", None)
        kwargs |= seam.accepted_kwargs(
            "verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync.__init__", max_off_policy_threshold=seam.NO_BOUND
        )
        super().__init__(*args, **kwargs)
        #: the ``hetero`` settings and the staleness core, given by the trainer that built this buffer (:meth:`attach`)
        self.settings: HeteroSettings | None = None
        self.core: StalenessCore | None = None
        self._evicting: dict[str, str] = {}
        self._resumed_check_pending = False
        #: called while the learner waits for data (the delayed weight sync installs due arrivals).
        self.on_poll: Callable[[], None] | None = None
        self._last_sample_end: float | None = None
        #: server addresses of samplers the audit quarantined (the fleet adds them when it retires one): groups with a
        #: trajectory of theirs are evicted as ``quarantined``
        self.quarantined_servers: set[str] = set()
        self._quarantine_scanned: set[str] = set()

    def attach(self, settings: HeteroSettings) -> None:
        """Take the run's ``hetero`` settings (parsed once, by the trainer) and build the staleness core from them."""
        self.settings = settings
        self.core = StalenessCore(settings.policy, settings.guard)

    @property
    def ledger(self):
        return self.core.ledger

    # ------------------------------------------------------------------ translation
    def _group_versions(self, partition_id: str, uids: set[str]) -> dict[str, tuple[int, int]]:
        """(oldest, newest) weight version per group from its trajectories' tags (groups without any: absent)."""
        out: dict[str, tuple[int, int]] = {}
        for key, tag in self.partitions[partition_id].items():
            uid = uid_of(key)
            if uid not in uids:
                continue
            lo, hi = tag.get("min_global_steps"), tag.get("max_global_steps")
            if lo is None or hi is None:
                raise RuntimeError(
                    f"trajectory {key!r} has no weight version (min/max_global_steps); the rollout server must "
                    "report global_steps in extra_fields (verl's vLLM/SGLang servers and the plugin's CPU server do)"
                )
            if uid in out:
                out[uid] = (min(out[uid][0], int(lo)), max(out[uid][1], int(hi)))
            else:
                out[uid] = (int(lo), int(hi))
        return out

    def _submitted(self, partition_id: str, uid: str) -> int:
        """The learner step a prompt was submitted at (verl tags prompts with ``global_steps``)."""
        return int(self.prompt_global_steps[partition_id].get(uid, 1))

    def _report_terminal_groups(self, partition_id: str) -> None:
        """Report groups that became terminal since the last poll to the core (once each)."""
        finished = {uid for uid in self.finished_keys[partition_id] if not self.core.known(uid)}
        failed = {uid for uid in self.failure_keys[partition_id] if not self.core.known(uid)} - finished
        versions = self._group_versions(partition_id, finished)
        failed |= finished - versions.keys()  # finished without a trajectory: verl treats it as failed
        for uid in sorted(versions):
            self.core.finished(uid, *versions[uid], submitted=self._submitted(partition_id, uid))
        for uid in sorted(failed):
            self.core.failed(uid, submitted=self._submitted(partition_id, uid))
        if self.quarantined_servers:
            self._quarantine_groups(partition_id, set(versions))
        if self._resumed_check_pending:
            self._resumed_check_pending = False
            missing = self.core.reconcile(self.finished_keys[partition_id] | self.failure_keys[partition_id])
            if missing:
                logger.warning(
                    "hetero: %d queued group(s) of the checkpoint are not in the restored TransferQueue; counted as "
                    "dropped (missing_after_resume)",
                    len(missing),
                )

    def _quarantine_groups(self, partition_id: str, new: set[str]) -> None:
        """Groups with a trajectory of a quarantined sampler go to the core as quarantined: the groups that finished
        now and, when a sampler was quarantined since the last scan, every queued one (their servers are read from
        TransferQueue only then: a quarantine is rare)."""
        fresh = self.quarantined_servers - self._quarantine_scanned
        uids = set(self.core.queued) if fresh else new
        self._quarantine_scanned |= fresh
        keys = [key for key in self.partitions[partition_id] if uid_of(key) in uids]
        if not keys:
            return
        extras = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])["extra_fields"]
        servers = self.quarantined_servers
        hit = {uid_of(key) for key, extra in zip(keys, extras, strict=True) if server_of(extra) in servers}
        if hit:
            self.core.quarantine(hit)
            logger.warning("hetero: %d queued group(s) hold rollouts of a quarantined sampler: dropped", len(hit))

    def _in_flight(self, partition_id: str) -> dict[str, int]:
        """In-flight groups and the step each was submitted at."""
        inflight = self.pending_keys[partition_id] | self.running_keys[partition_id]
        return {uid: self._submitted(partition_id, uid) for uid in inflight}

    # ------------------------------------------------------------------ verl's hooks (seam contacts)
    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str):
        if partition_id != TRAIN:
            return super()._terminal_eviction_reasons(global_steps, partition_id)
        self._report_terminal_groups(partition_id)
        self._evicting = self.core.evictions(learner_version(global_steps))
        failed = set(self._evicting) & self.core.failed_ids  # (failed, or quarantined after failing)
        evicted = set(self._evicting) - failed
        overflow = sum(reason == OVERFLOW for reason in self._evicting.values())
        if overflow:
            logger.warning(
                "hetero: %d finished group(s) exceed max_lag=%s under the wait strategy (more urgent groups than one "
                "batch); evicted (stale_overflow) to keep the bound; pause old samplers earlier with "
                "hetero.admission_margin",
                overflow,
                self.core.policy.max_lag,
            )
        return evicted, set(), failed, Counter()

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons):
        dropped: dict[str, float] = {}
        if partition_id == TRAIN:
            stale = {uid for uid, reason in self._evicting.items() if reason in STALENESS_REASONS}
            dropped = self._dropped_totals(partition_id, stale)
            self.core.drop(self._evicting)
            self._evicting = {}
        evicted, stale_count, dapo_count, metrics = super()._evict_terminal_groups(
            global_steps, partition_id, eviction_reasons
        )
        # verl's own stale metrics count prompt-submission spans; HeteroRL's books are under hetero/.
        metrics = {k: v for k, v in metrics.items() if "/off_policy/" not in k}
        # additive: verl sums them over its polls; the trainer turns them into means beside the trained ones
        metrics.update(metric_names.under(metric_names.HETERO + DROPPED_STEP, dropped))
        return evicted, stale_count, dapo_count, metrics

    def _dropped_totals(self, partition_id: str, uids: set[str]) -> dict[str, float]:
        """Count, response length and reward of the trajectories of ``uids`` (read before verl clears them)."""
        tags = {key: tag for key, tag in self.partitions[partition_id].items() if uid_of(key) in uids}
        if not tags:
            return {}
        keys = list(tags)
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["rm_scores"]).to_padded_tensor()
        rewards = data["rm_scores"].float().sum(-1).numpy()
        return drop_totals([tags[key].get("response_len", 0) for key in keys], rewards)

    def _has_enough_samples(self, global_steps, partition_id, batch_size, sampleable_keys) -> bool:
        if partition_id == TRAIN and self.core.urgent(learner_version(global_steps), self._in_flight(partition_id)):
            return False
        return len(sampleable_keys) >= batch_size

    def _select_prompt_uids(self, partition_id, sampleable_keys, batch_size):
        if partition_id != TRAIN:
            return super()._select_prompt_uids(partition_id, sampleable_keys, batch_size)
        chosen = self.core.select(sampleable_keys, batch_size)
        return chosen, dict(self.partitions[partition_id]), dict(self.prompt_global_steps[partition_id])

    def _sync_metadata_from_transfer_queue(self) -> None:
        replay_wait.mark_poll(self)
        super()._sync_metadata_from_transfer_queue()

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        """Install what arrived, then verl's wait, paced (the plugin's own, whether or not verl's is patched)."""
        if self.on_poll is not None:
            self.on_poll()
        return replay_wait.paced_wait(self, partition_id, last_debug_time)

    # ------------------------------------------------------------------ sampling
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != TRAIN:
            return super().sample(global_steps, partition_id, batch_size)
        start = time.perf_counter()
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        end = time.perf_counter()
        selected = list(dict.fromkeys(uid_of(key) for key in batch.keys))
        mixed = self.core.mixed(selected)
        version = learner_version(global_steps)
        lags = self.core.train(selected, version)
        metrics.update(self.step_metrics(partition_id, version, lags, mixed, wait=end - start, end=end))
        return batch, metrics

    def step_metrics(
        self, partition_id: str, version: int, lags: np.ndarray, mixed: int, wait: float, end: float
    ) -> dict:
        """Everything a user watches per step (names under ``hetero/``)."""
        metrics = metric_names.under(metric_names.HETERO, self.core.metrics())  # checks produced == trained + ...
        inflight = len(self.pending_keys[partition_id]) + len(self.running_keys[partition_id])
        metrics.update(metric_names.under(metric_names.LAG, lag_summary(lags.astype(float))))
        cycle = end - self._last_sample_end if self._last_sample_end is not None else None
        self._last_sample_end = end
        step = {
            "learner_version": float(version),
            "queue/finished_untrained": float(self.ledger.queued),
            "queue/in_flight": float(inflight),
            "mixed_version_groups": float(mixed),
            "learner_wait_s": float(wait),
        }
        if cycle is not None and cycle > 0:
            step["learner_idle_fraction"] = float(min(1.0, wait / cycle))
        metrics.update(metric_names.under(metric_names.HETERO, step))
        return metrics

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The core's books and queued versions (the groups themselves are in verl's TransferQueue checkpoint)."""
        return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.core.load_state_dict(state)
        self._resumed_check_pending = True
