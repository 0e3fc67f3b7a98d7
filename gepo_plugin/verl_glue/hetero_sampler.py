"""HeteroRL's sampler for verl V1: an exact bounded-staleness replay buffer over TransferQueue.

Selected with ``trainer.v1.sampler.custom_sampler.{path,name}`` (``hetero.enable=true`` sets both).
It is verl's own :class:`ReplayBufferAsync` (same TransferQueue storage, polling, refill of evicted
prompts, batch materialisation) with the staleness rule replaced by the exact one of
:mod:`gepo_plugin.hetero.staleness`:

* versions are verl's weight versions (``global_steps`` passed to ``update_weights``); every
  trajectory carries ``min_global_steps``/``max_global_steps``, the versions of its first and last
  token. A group's ``min_version`` is the minimum over its trajectories.
* ``sample(global_steps=g)`` trains the update ``g-1 -> g``, so the learner version is ``v = g-1``
  and a group's lag is ``v - min_version`` (verl's ``trajectory_staleness_worst``). ``max_lag=K``:
  no trained group has lag > K.
* ``drop``: finished groups with lag > K are evicted (reason ``stale``) and refilled.
  ``wait``: the learner does not train version ``v`` while a group still in flight could expire
  (its version lower bound ``< v + 1 - K``), and such "urgent" groups are selected first. If more
  urgent groups finish than one batch holds, the excess would break the bound: it is evicted with
  reason ``stale_overflow`` and a warning (raise ``max_lag``/``admission_margin`` or lower the delay).
* ``refuse_mixed_versions``: groups whose tokens span several versions are evicted (``mixed_versions``).
* Failed groups (verl evicts and refills them) are counted as ``failed``.

Every terminal group enters a :class:`~gepo_plugin.hetero.accounting.RolloutLedger`:
``produced == trained + dropped(by reason) + queued`` is checked and exported at every step, and
:meth:`HeteroReplayBuffer.state_dict` goes into verl's checkpoint (finished-but-untrained groups
themselves are in verl's TransferQueue checkpoint).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from gepo_plugin.hetero.accounting import RolloutLedger
from gepo_plugin.hetero.settings import HeteroSettings, parse_hetero
from gepo_plugin.hetero.staleness import Verdict
from gepo_plugin.verl_glue import seam

logger = logging.getLogger(__name__)

TRAIN = "train"
PREFIX = "hetero/"
#: Reason recorded for failed rollout groups (verl evicts and refills them).
FAILED = "failed"
#: Reason under ``wait`` when more groups expire at once than one batch can train.
OVERFLOW = "stale_overflow"
#: Reason for ledger-queued groups that a resumed TransferQueue no longer holds.
MISSING = "missing_after_resume"


def lag_summary(lags: np.ndarray, prefix: str = PREFIX + "lag/") -> dict[str, float]:
    """min / p50 / p95 / max / mean of the trained groups' lags (empty: nothing)."""
    if lags.size == 0:
        return {}
    p50, p95 = np.percentile(lags, [50, 95])
    return {
        f"{prefix}min": float(lags.min()),
        f"{prefix}p50": float(p50),
        f"{prefix}p95": float(p95),
        f"{prefix}max": float(lags.max()),
        f"{prefix}mean": float(lags.mean()),
    }


class HeteroReplayBuffer(ReplayBufferAsync):
    """verl's async replay buffer with the exact staleness bound, version accounting and metrics."""

    def __init__(self, *args, sampler_kwargs: Mapping[str, Any] | None = None, **kwargs) -> None:
        seam.require("hetero")
        self.settings: HeteroSettings = parse_hetero(sampler_kwargs)
        # verl's own prompt-step threshold is replaced by the version rule below.
        kwargs["max_off_policy_threshold"] = None
        super().__init__(*args, sampler_kwargs=sampler_kwargs, **kwargs)
        self.policy = self.settings.policy
        self.ledger = RolloutLedger()
        self._min_version: dict[str, int] = {}  # queued group -> oldest token version
        self._max_version: dict[str, int] = {}
        self._reasons: dict[str, str] = {}  # uid -> drop reason, for the eviction in progress
        self._resumed_check_pending = False
        #: learner step -> lowest weight version any sampler held when the step began; set by the
        #: weight-sync side. Missing steps fall back to ``step - 1`` (verl syncs every sampler at once).
        self.version_floor_by_step: dict[int, int] = {}
        #: called while the learner waits for data (the delayed weight sync installs due arrivals).
        self.on_poll: Callable[[], None] | None = None
        self._wait_seconds = 0.0
        self._last_sample_end: float | None = None
        self.mixed_version_trained = 0

    # ------------------------------------------------------------------ versions
    def _group_versions(self, partition_id: str, uids: set[str]) -> dict[str, tuple[int, int]]:
        """(min, max) weight version per group from its trajectories' tags (groups without any: absent)."""
        out: dict[str, tuple[int, int]] = {}
        for key, tag in self.partitions[partition_id].items():
            uid = key.split("_")[0]
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

    def _version_lower_bound(self, partition_id: str, uid: str) -> int:
        """A version no older than the oldest token an in-flight group can have."""
        step = int(self.prompt_global_steps[partition_id].get(uid, 1))
        return int(self.version_floor_by_step.get(step, step - 1))

    def _register_terminal_groups(self, partition_id: str) -> None:
        """Enter groups that became terminal since the last poll into the ledger (once each)."""
        known = self._min_version.keys()
        finished = self.finished_keys[partition_id] - known
        failed = self.failure_keys[partition_id] - known - finished
        if finished:
            versions = self._group_versions(partition_id, finished)
            for uid in finished:
                if uid not in versions:  # finished with no trajectory: verl treats it as failed
                    failed = failed | {uid}
                    continue
                lo, hi = versions[uid]
                self.ledger.produce(uid, lo)
                self._min_version[uid], self._max_version[uid] = lo, hi
        for uid in failed:
            bound = self._version_lower_bound(partition_id, uid)
            self.ledger.produce(uid, bound)
            self._min_version[uid], self._max_version[uid] = bound, bound
            self._reasons[uid] = FAILED
        if self._resumed_check_pending:
            self._resumed_check_pending = False
            present = self.finished_keys[partition_id] | self.failure_keys[partition_id]
            missing = [uid for uid in self.ledger.queued_groups() if uid not in present]
            if missing:
                logger.warning(
                    "hetero: %d queued group(s) of the checkpoint are not in the restored TransferQueue; "
                    "counted as dropped (%s)",
                    len(missing),
                    MISSING,
                )
                self._forget(missing)
                self.ledger.drop(missing, MISSING)

    def _forget(self, uids) -> None:
        for uid in uids:
            self._min_version.pop(uid, None)
            self._max_version.pop(uid, None)
            self._reasons.pop(uid, None)

    # ------------------------------------------------------------------ verl hooks
    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str):
        if partition_id != TRAIN:
            return super()._terminal_eviction_reasons(global_steps, partition_id)
        self._register_terminal_groups(partition_id)
        learner_version = global_steps - 1
        evict: set[str] = set()
        for uid in self.finished_keys[partition_id]:
            if self._reasons.get(uid) == FAILED:
                continue
            lo, hi = self._min_version[uid], self._max_version[uid]
            verdict = self.policy.verdict(learner_version, lo, min(hi, learner_version))
            if verdict is not Verdict.TRAIN:
                overflow = verdict is Verdict.DROP_STALE and self.policy.strategy == "wait"
                self._reasons[uid] = OVERFLOW if overflow else verdict.value
                evict.add(uid)
        if any(self._reasons[uid] == OVERFLOW for uid in evict):
            logger.warning(
                "hetero: %d finished group(s) exceed max_lag=%s under the wait strategy (more urgent groups than "
                "one batch); evicted (%s) to keep the bound; pause old samplers earlier with hetero.admission_margin",
                len(evict),
                self.policy.max_lag,
                OVERFLOW,
            )
        failed = {uid for uid, reason in self._reasons.items() if reason == FAILED}
        return evict, set(), failed, {}

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons):
        if partition_id == TRAIN:
            stale, _dapo, failed, _counts = eviction_reasons
            by_reason: dict[str, list[str]] = {}
            for uid in stale | failed:
                by_reason.setdefault(self._reasons.get(uid, FAILED), []).append(uid)
            for reason, uids in by_reason.items():
                self.ledger.drop(uids, reason)
                self._forget(uids)
        evicted, stale_count, dapo_count, metrics = super()._evict_terminal_groups(
            global_steps, partition_id, eviction_reasons
        )
        # verl's own stale metrics count prompt-submission spans; ours are in hetero/.
        metrics = {k: v for k, v in metrics.items() if "/off_policy/" not in k}
        return evicted, stale_count, dapo_count, metrics

    def _urgent_inflight(self, global_steps: int, partition_id: str) -> list[str]:
        """In-flight groups that could exceed the bound if the learner trained past them now."""
        if self.policy.max_lag is None or self.policy.strategy != "wait":
            return []
        deadline = global_steps - self.policy.max_lag  # min_version < (v + 1 - K) with v = g - 1
        inflight = self.pending_keys[partition_id] | self.running_keys[partition_id]
        return [uid for uid in inflight if self._version_lower_bound(partition_id, uid) < deadline]

    def _has_enough_samples(self, global_steps, partition_id, batch_size, sampleable_keys) -> bool:
        if partition_id == TRAIN and self._urgent_inflight(global_steps, partition_id):
            return False
        return len(sampleable_keys) >= batch_size

    def _select_prompt_uids(self, partition_id, sampleable_keys, batch_size):
        if partition_id != TRAIN:
            return super()._select_prompt_uids(partition_id, sampleable_keys, batch_size)
        steps = self.prompt_global_steps[partition_id]
        ordered = sorted(sampleable_keys, key=lambda uid: (self._min_version[uid], steps.get(uid, 0), uid))
        return ordered[:batch_size], dict(self.partitions[partition_id]), dict(steps)

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        if self.on_poll is not None:
            self.on_poll()
        return super()._wait_for_next_poll(partition_id, last_debug_time)

    # ------------------------------------------------------------------ sampling
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != TRAIN:
            return super().sample(global_steps, partition_id, batch_size)
        start = time.perf_counter()
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        end = time.perf_counter()
        selected = list(dict.fromkeys(key.split("_")[0] for key, tag in zip(batch.keys, batch.tags, strict=True)))
        learner_version = global_steps - 1
        lags = np.array([learner_version - self._min_version[uid] for uid in selected], dtype=float)
        mixed = sum(self._min_version[uid] != self._max_version[uid] for uid in selected)
        if self.policy.max_lag is not None and lags.size and lags.max() > self.policy.max_lag:
            raise AssertionError(f"hetero sampler selected lag {lags.max()} > max_lag {self.policy.max_lag}")
        self.ledger.train(selected)
        self._forget(selected)
        self.mixed_version_trained += int(mixed)
        metrics.update(self.step_metrics(partition_id, learner_version, lags, mixed, wait=end - start, end=end))
        return batch, metrics

    def step_metrics(
        self, partition_id: str, learner_version: int, lags: np.ndarray, mixed: int, wait: float, end: float
    ) -> dict:
        """Everything a user watches per step (names under ``hetero/``)."""
        metrics = self.ledger.metrics(PREFIX)  # checks produced == trained + dropped + queued
        inflight = len(self.pending_keys[partition_id]) + len(self.running_keys[partition_id])
        metrics.update(lag_summary(lags))
        cycle = end - self._last_sample_end if self._last_sample_end is not None else None
        self._last_sample_end = end
        metrics.update(
            {
                PREFIX + "learner_version": float(learner_version),
                PREFIX + "queue/finished_untrained": float(self.ledger.queued),
                PREFIX + "queue/in_flight": float(inflight),
                PREFIX + "mixed_version_groups": float(mixed),
                PREFIX + "mixed_version_groups_total": float(self.mixed_version_trained),
                PREFIX + "learner_wait_s": float(wait),
            }
        )
        for reason in (Verdict.DROP_STALE.value, OVERFLOW, Verdict.DROP_MIXED.value, FAILED):
            metrics.setdefault(PREFIX + f"dropped/{reason}", 0.0)
        if cycle is not None and cycle > 0:
            metrics[PREFIX + "learner_idle_fraction"] = float(min(1.0, wait / cycle))
        return metrics

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The ledger and the versions of queued groups (the groups themselves are in verl's TQ checkpoint)."""
        return {
            "ledger": self.ledger.state_dict(),
            "max_version": dict(self._max_version),
            "mixed_version_trained": self.mixed_version_trained,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ledger = RolloutLedger.from_state_dict(state["ledger"])
        queued = self.ledger.queued_groups()
        self._min_version = dict(queued)
        self._max_version = {uid: int(state["max_version"].get(uid, v)) for uid, v in queued.items()}
        self.mixed_version_trained = int(state.get("mixed_version_trained", 0))
        self._resumed_check_pending = True
