"""Play verl's rollout side over a real TransferQueue: what ``AgentLoopWorkerTQ`` writes, and nothing else.

The replay buffer reads prompt keys (tags ``is_prompt``, ``status`` pending/running/finished/failure,
``global_steps``: the learner step the prompt was submitted at) and trajectory keys ``{uid}_{session}_{index}``
(tags ``min_global_steps``/``max_global_steps``: the weight versions of their first and last token). The tests
of :class:`~gepo_plugin.verl_glue.hetero.replay_buffer.HeteroReplayBuffer` and ``bench/bench_sampler.py`` drive
it with this writer, so a buffer sees exactly what it sees in a verl run, without a model or a rollout server.
A test helper: it is not shipped in the package (the bench puts ``tests/`` on its path to use it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

PARTITION = "train"


class RolloutWriter:
    """Writes prompts and finished groups into TransferQueue as verl's agent loop does."""

    def __init__(self, tq: Any, group_size: int = 2, width: int = 3, seed: int = 0, partition: str = PARTITION):
        import torch
        from tensordict import TensorDict

        self.tq = tq
        self.group_size = group_size
        self.width = width
        self.partition = partition
        self.fields = TensorDict({"x": torch.zeros(group_size, width)}, batch_size=group_size)
        self.rng = np.random.default_rng(seed)
        #: trajectory key -> (response length, reward) as written (what a test expects the buffer to read back)
        self.written: dict[str, tuple[int, float]] = {}

    def _fields(self, keys: Sequence[str], lengths: Sequence[int] | None = None):
        """verl's per-trajectory fields the buffer reads: ``rm_scores`` (the reward on the last response token),
        with a random reward and the given response lengths (default: the full width); remembered in ``written``."""
        import torch
        from tensordict import TensorDict

        lengths = [self.width] * len(keys) if lengths is None else [int(n) for n in lengths]
        rewards = self.rng.random(len(keys))
        scores = torch.zeros(len(keys), self.width)
        for row, (length, reward) in enumerate(zip(lengths, rewards, strict=True)):
            scores[row, length - 1] = float(reward)
        for key, length, reward in zip(keys, lengths, scores.sum(-1).tolist(), strict=True):
            self.written[key] = (length, reward)
        fields = TensorDict({"x": torch.zeros(len(keys), self.width), "rm_scores": scores}, batch_size=len(keys))
        return fields, lengths

    def submit(self, step: int | Sequence[int], n: int = 1, uids: Sequence[str] | None = None) -> list[str]:
        """New prompts, pending, each tagged with the learner step it was submitted at (``n`` at ``step``, or one
        per entry of a sequence of steps). ``uids``: the prompt ids (no ``_``), random by default, as verl's."""
        steps = [int(step)] * n if isinstance(step, int | np.integer) else [int(s) for s in step]
        uids = list(uids) if uids is not None else [uuid.uuid4().hex for _ in steps]
        if len(uids) != len(steps) or any("_" in uid for uid in uids):
            raise ValueError("one uid per prompt, without '_' (verl splits trajectory keys on it)")
        self.tq.kv_batch_put(
            keys=uids,
            partition_id=self.partition,
            tags=[{"is_prompt": True, "status": "pending", "global_steps": int(step)} for step in steps],
        )
        return uids

    def start(self, uid: str) -> None:
        self.tq.kv_put(key=uid, partition_id=self.partition, tag={"status": "running"})

    def trajectory_tag(self, step: int, lo: int, hi: int, length: int | None = None) -> dict[str, Any]:
        return {
            "status": "success",
            "global_steps": step,
            "min_global_steps": lo,
            "max_global_steps": hi,
            "response_len": self.width if length is None else length,
            "seq_len": self.width,
        }

    def finish(
        self,
        uid: str,
        versions: Sequence[tuple[int, int]],
        step: int = 1,
        status: str = "finished",
        lengths: Sequence[int] | None = None,
    ) -> None:
        """One trajectory per ``(oldest, newest)`` weight version pair, then the prompt turns terminal."""
        keys = [f"{uid}_{i}_0" for i in range(len(versions))]
        if keys:
            fields, lengths = self._fields(keys, lengths)
            self.tq.kv_batch_put(
                keys=keys,
                partition_id=self.partition,
                fields=fields,
                tags=[self.trajectory_tag(step, lo, hi, n) for (lo, hi), n in zip(versions, lengths, strict=True)],
            )
        self.tq.kv_put(key=uid, partition_id=self.partition, tag={"status": status})

    def produce(self, step: int, version: int, n: int = 1) -> list[str]:
        """``n`` whole groups submitted at ``step`` and generated entirely with ``version``."""
        uids = self.submit(step, n)
        for uid in uids:
            self.finish(uid, [(version, version)] * self.group_size, step)
        return uids

    def fill(self, groups: int, inflight: int, global_steps: int, spread: int, mixed: float, per_group: bool) -> None:
        """``groups`` finished groups submitted over the last ``spread`` steps, plus ``inflight`` in-flight prompts.

        A finished group submitted at step ``s`` has tokens from version ``s-1`` (``s-1..s`` for the ``mixed``
        fraction whose trajectories span a weight update); in-flight prompts are submitted at ``global_steps``
        (half of them running). ``per_group``: one put of trajectories and one status put per group, as rollout
        workers write them; otherwise the same keys and tags in four batched puts.
        """

        steps = [int(s) for s in global_steps - self.rng.integers(0, spread, groups)]
        versions = []
        for step in steps:
            lo = step - 1
            hi = min(step, global_steps - 1) if self.rng.random() < mixed else lo
            versions.append([(lo, hi)] + [(lo, lo)] * (self.group_size - 1))
        uids = self.submit(steps)
        if per_group:
            for uid, step, group in zip(uids, steps, versions, strict=True):
                self.finish(uid, group, step)
        else:
            keys = [f"{uid}_{i}_0" for uid in uids for i in range(self.group_size)]
            self.tq.kv_batch_put(
                keys=keys,
                partition_id=self.partition,
                fields=self._fields(keys)[0],
                tags=[
                    self.trajectory_tag(step, lo, hi)
                    for step, group in zip(steps, versions, strict=True)
                    for lo, hi in group
                ],
            )
            self.tq.kv_batch_put(keys=uids, partition_id=self.partition, tags=[{"status": "finished"} for _ in uids])
        if inflight:
            running = self.submit([global_steps] * inflight)[: inflight // 2]
            if per_group:
                for uid in running:
                    self.start(uid)
            elif running:
                self.tq.kv_batch_put(
                    keys=running, partition_id=self.partition, tags=[{"status": "running"} for _ in running]
                )


def clear_all(tq: Any) -> None:
    """Empty every partition (between tests or benchmark repetitions)."""
    for partition, items in (tq.kv_list() or {}).items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)
