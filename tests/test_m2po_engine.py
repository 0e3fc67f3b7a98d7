"""M2PO's mini-batch scope through verl's REAL engine (its FSDP2 ``TrainingWorker`` on the CPU, in this process): the
mini-batch measured before verl trains it makes the update independent of the micro-batch size and of the
data-parallel split, and equal to the authors' loss over one micro-batch holding the whole mini-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from free_ports import free_port
from verl_engine import build_worker, cpu_engine_backend, largest_difference, parameters, ppo_batch

pytestmark = pytest.mark.slow

M2PO = ("actor_rollout_ref.actor.policy_loss.loss_mode=m2po", "actor_rollout_ref.actor.loss_agg_mode=token-mean")
ROWS = 8  # 2 prompts x 4 responses: one mini-batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, object]:
    from transformers import AutoTokenizer

    from gepo_plugin.tiny import write_tiny_model

    path = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    return path, AutoTokenizer.from_pretrained(path)


def m2po_patch_applied():
    """patches/m2po_mini_batch.py applied (its contacts checked first); returns what to restore."""
    from verl.workers.engine.base import BaseEngine

    from gepo_plugin.patching import named_patch

    patch = named_patch("m2po_mini_batch")
    original = BaseEngine.train_batch
    patch.check_contacts(patch.feature)
    patch.apply()
    return lambda: setattr(BaseEngine, "train_batch", original)


def train_one_mini_batch(
    model: str, tokenizer, micro: int, scope: str, rank: int = 0, world: int = 1, loss: tuple[str, ...] = M2PO
):
    """Parameters before and after one mini-batch of ``loss`` (M2PO) in ``scope``, and the step's metrics (rank 0's)."""
    from verl.utils import tensordict_utils as tu

    worker = build_worker(model, micro, (*loss, f"actor_rollout_ref.actor.policy_loss.m2_scope={scope}"))
    batch = ppo_batch(tokenizer, group_term=loss != M2PO)
    data = batch if world == 1 else tu.chunk_tensordict(batch, world)[rank]
    before = parameters(worker)
    output = worker.train_mini_batch(data)
    return before, parameters(worker), (tu.get(output, "metrics") if output is not None else {})


def test_the_mini_batch_scope_trains_the_same_update_whatever_the_micro_batch_size(tiny):
    model, tokenizer = tiny
    with cpu_engine_backend():
        restore = m2po_patch_applied()
        try:
            runs = {
                (scope, micro): train_one_mini_batch(model, tokenizer, micro, scope)
                for scope, micro in (("mini_batch", 2), ("mini_batch", 4), ("micro_batch", 2), ("micro_batch", ROWS))
            }
        finally:
            restore()
    before, mini_2, metrics = runs["mini_batch", 2]
    assert largest_difference(before, mini_2) > 1e-4  # the step moved the weights
    assert all(value == 1.0 for value in metrics["actor/m2po/cap_binds"])  # the budget was exceeded: tau clips
    assert largest_difference(mini_2, runs["mini_batch", 4][1]) < 1e-6
    # the cap measured before the update is the authors' cap over one micro-batch holding the whole mini-batch
    assert largest_difference(mini_2, runs["micro_batch", ROWS][1]) < 1e-6
    # their scope on verl's smaller micro-batches trains another update
    assert largest_difference(runs["micro_batch", 2][1], runs["micro_batch", ROWS][1]) > 1e-5


def _rank(rank: int, world: int, model: str, port: int, out: str) -> None:
    from transformers import AutoTokenizer

    with cpu_engine_backend(rank, world, port):
        restore = m2po_patch_applied()
        try:
            _, after, _ = train_one_mini_batch(
                model, AutoTokenizer.from_pretrained(model), 2, "mini_batch", rank, world
            )
        finally:
            restore()
    if rank == 0:
        torch.save(after, out)


def test_the_mini_batch_scope_gathers_every_data_parallel_rank(tiny, tmp_path: Path):
    """Two gloo ranks (spawned processes), each training its half of the mini-batch: the cap is solved over both
    halves' harmful tokens, so the update is the one of a single rank holding the whole mini-batch."""
    model, tokenizer = tiny
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, model, free_port(), str(out)), nprocs=2, join=True)
    with cpu_engine_backend():
        restore = m2po_patch_applied()
        try:
            _, single, _ = train_one_mini_batch(model, tokenizer, 2, "mini_batch")
        finally:
            restore()
    assert largest_difference(torch.load(out), single) < 1e-6


GEPO_M2 = (
    "actor_rollout_ref.actor.policy_loss.loss_mode=gepo",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.policy_loss.m2_mask=true",
)


def test_gepo_with_m2pos_mask_reads_the_same_measured_cap_whatever_the_micro_batch_size(tiny):
    """GEPO with ``m2_mask=true`` through the same engine pre-pass: the loss reads the measured cap (it binds and masks
    tokens), micro-batches of 2 and 4 train the same update, and the micro-batch scope on micro-batches of 2, whose
    caps differ, trains another one."""
    model, tokenizer = tiny
    with cpu_engine_backend():
        restore = m2po_patch_applied()
        try:
            runs = {
                (scope, micro): train_one_mini_batch(model, tokenizer, micro, scope, loss=GEPO_M2)
                for scope, micro in (("mini_batch", 2), ("mini_batch", 4), ("micro_batch", 2))
            }
        finally:
            restore()
    before, mini_2, metrics = runs["mini_batch", 2]
    assert largest_difference(before, mini_2) > 1e-4
    assert all(value == 1.0 for value in metrics["actor/m2po/cap_binds"])
    assert max(metrics["actor/m2po/masked_frac"]) > 0
    assert largest_difference(mini_2, runs["mini_batch", 4][1]) < 1e-6
    assert largest_difference(mini_2, runs["micro_batch", 2][1]) > 1e-5
