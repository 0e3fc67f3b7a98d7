"""One TransferQueue round trip after verl's advantage step, shared by every plugin mixin that adds per-sample fields.

verl's ``_compute_advantage`` already reads the batch from TransferQueue and writes it back. The plugin's mixins
(GEPO's group term, HeteroRL's per-response lag and throughput) each need a few more fields read and a few more
written. Done per mixin that is a get and a put each (about 15-20 ms apiece on the 2-core CI machine, see
``bench/bench_hetero_overhead.py``); here the mixins declare what they read (:meth:`_advantage_reads`) and
compute what they write (:meth:`_advantage_writes`, cooperative through ``super()``), and this class does one
``kv_batch_get`` of the union and one ``kv_batch_put`` of the merged fields.
"""

from __future__ import annotations

from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict


class AdvantageFieldsMixin:
    """Reads every field the plugin's mixins need once, and writes everything they computed once."""

    def _advantage_reads(self) -> frozenset[str]:
        """TransferQueue fields the mixins read (each mixin adds its own through ``super()``)."""
        return frozenset()

    def _advantage_writes(self, batch, data: Any, metrics: dict) -> dict[str, torch.Tensor]:
        """Per-sample fields to write, from ``data`` (the fields read, padded; None if none were read)."""
        return {}

    def _compute_advantage(self, batch, metrics: dict):
        batch = super()._compute_advantage(batch, metrics)
        reads = sorted(self._advantage_reads())
        data = None
        if reads:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=reads)
            data = data.to_padded_tensor()  # as verl's _compute_advantage: nested -> padded
        writes = self._advantage_writes(batch, data, metrics)
        if not writes:
            return batch
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(writes, batch_size=len(batch))
        )
