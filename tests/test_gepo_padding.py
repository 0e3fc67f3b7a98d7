"""GEPO on the batches verl itself pads: verl's own ``upsample_batch_to_divisible_size`` over a real TransferQueue.

verl 0.9.1's ``_balance_batch`` pads a batch whose size is not a multiple of lcm(data-parallel size,
``ppo_mini_batch_size`` x ``rollout.n``) with synthetic rows: they share one fresh uid ``pad<hex>`` and carry no
response token. The trainer's group term must give them nothing (and not stop the step), and the loss must be the
loss of the real rows alone. verl's trainer training GEPO on batches it pads, end to end, is a claim of the vLLM run
(``tests/test_vllm_e2e.py``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch
from tensordict import NonTensorStack, TensorDict

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms
from gepo_plugin.verl_glue.trainers import ResponseTermsMixin

pytestmark = pytest.mark.ray

PARTITION = "train"
PROMPT_LEN, EOS = 3, 2


def write_rollouts(tq, b) -> object:
    """The batch as verl's agent loop leaves it in TransferQueue (the fields the padding template copies), and its
    ``KVBatchMeta``."""
    from transfer_queue import KVBatchMeta

    n, width = b.mask.shape
    uids = [f"prompt{g}" for g in b.group_ids.tolist()]
    keys = [f"{uid}_{i}_0" for i, uid in enumerate(uids)]
    responses = torch.randint(3, 50, (n, width))
    prompts = torch.randint(3, 50, (n, PROMPT_LEN))
    attention_mask = torch.cat([torch.ones(n, PROMPT_LEN, dtype=torch.int64), b.mask.to(torch.int64)], dim=1)
    fields = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": torch.cumsum(attention_mask, dim=1) - 1,
            "response_mask": b.mask.to(torch.int64),
            "old_log_probs": b.old_log_prob.to(torch.float32),
            "rollout_log_probs": b.old_log_prob.to(torch.float32),
            "rm_scores": torch.zeros(n, width),
            "uid": NonTensorStack(*uids),
        },
        batch_size=[n],
    )
    lengths = b.mask.sum(-1).to(torch.int64).tolist()
    tags = [
        {"prompt_len": PROMPT_LEN, "response_len": length, "seq_len": PROMPT_LEN + length, "min_global_steps": 0}
        for length in lengths
    ]
    tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=fields, tags=tags)
    return KVBatchMeta(keys=keys, tags=tags, partition_id=PARTITION, fields=list(fields.keys()))


def test_verls_own_padding_rows_get_no_group_term_and_no_weight_in_the_loss(transfer_queue):
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    tq = transfer_queue
    b = make_batch(group_sizes=(3, 3, 4), seed=5, spread=0.3)  # 10 responses of 3 prompts
    real = len(b.group_ids)
    meta = upsample_batch_to_divisible_size(write_rollouts(tq, b), 8, EOS)  # as _balance_batch: to a multiple of 8
    padding = [bool(tag.get("is_padding", False)) for tag in meta.tags]
    assert len(meta) == 16 and padding == [False] * real + [True] * 6

    # the trainer's round trip (AdvantageFieldsMixin): read the fields back from TransferQueue, padded; then the
    # group term exactly as the gepo_* trainers write it
    fields = sorted(ResponseTermsMixin._advantage_reads(object.__new__(ResponseTermsMixin)))
    data = tq.kv_batch_get(keys=meta.keys, partition_id=PARTITION, select_fields=fields).to_padded_tensor()
    pad_uids = {uid for uid, pad in zip(list(data["uid"]), padding, strict=True) if pad}
    assert len(pad_uids) == 1 and next(iter(pad_uids)).startswith("pad")  # one uid of their own, no response
    assert int(data["response_mask"][torch.tensor(padding)].sum()) == 0
    metrics: dict = {}
    writes = ResponseTermsMixin._advantage_writes(object.__new__(ResponseTermsMixin), meta, data, metrics)
    log_eq = writes[LOG_GROUP_EXPECTATION]
    expected = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids).to(torch.float32)
    torch.testing.assert_close(log_eq[:real], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(log_eq[real:], torch.zeros(6)) and torch.isfinite(log_eq).all()
    assert metrics["gepo/num_groups"] == 3 and metrics["gepo/group_size_mean"] == pytest.approx(real / 3)

    # the loss through verl's ppo_loss: the padded batch gives the real rows' loss, and no gradient to the padding
    width = data["response_mask"].shape[1]
    config = compose_actor_config(
        ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=2", "policy_loss.loss_mode=gepo", "loss_agg_mode=token-mean"]
    )
    log_prob = (data["old_log_probs"] + 0.05 * torch.randn(16, width)).requires_grad_()
    advantages = torch.randn(16, 1).expand(16, width) * data["response_mask"]
    info = {"batch_num_tokens": int(b.mask.sum()), "global_batch_size": 16}

    def loss_of(rows):
        rows = torch.as_tensor(rows)
        model_output, batch = build_loss_inputs(
            log_prob[rows],
            data["old_log_probs"][rows],
            advantages[rows],
            data["response_mask"][rows],
            {LOG_GROUP_EXPECTATION: log_eq[rows]},
            **info,
        )
        loss, _ = ppo_loss_with_response_terms(config, model_output=model_output, data=batch)
        return loss

    padded_loss = loss_of(range(16))
    (grad,) = torch.autograd.grad(padded_loss, log_prob)
    real_loss = loss_of(range(real))
    assert torch.isfinite(padded_loss) and float(padded_loss) == pytest.approx(float(real_loss), rel=1e-6)
    assert torch.count_nonzero(grad[real:]) == 0 and torch.count_nonzero(grad[:real]) > 0
