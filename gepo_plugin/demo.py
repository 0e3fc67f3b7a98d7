"""``python -m gepo_plugin demo``: one GEPO loss step through verl's real ``ppo_loss``, on CPU.

It builds a batch of several prompts x several responses, computes the per-prompt group term
the way the plugin's trainer does (whole groups), then scatters the rows over micro-batches
as verl's balancing would, runs verl's ``ppo_loss`` on each, and checks that the summed
gradient equals the gradient computed on the whole batch at once.
"""

from __future__ import annotations

import torch
import verl  # noqa: F401  (loads the plugin's registrations)

from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.synthetic import random_batch
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config
from gepo_plugin.verl_glue.losses import step_metrics
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, ppo_loss_with_response_terms


def run(prompts: int = 4, responses: int = 4, micro_batches: int = 4, seed: int = 0) -> int:
    if prompts < 1 or responses < 2 or micro_batches < 1:
        raise SystemExit("demo needs --prompts >= 1, --responses >= 2 and --micro-batches >= 1")
    config = compose_actor_config(
        [
            "strategy=fsdp2",
            "ppo_micro_batch_size_per_gpu=1",
            "policy_loss.loss_mode=gepo",
            "loss_agg_mode=seq-mean-token-mean",
            "clip_ratio_low=0.2",
            "clip_ratio_high=0.2",
        ]
    )
    b = random_batch(group_sizes=(responses,) * prompts, width=12, seed=seed, dtype=torch.float32, spread=0.4)
    total = len(b.group_ids)
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    print(f"batch: {prompts} prompts x {responses} responses, rows shuffled; groups per row: {list(b.group_ids)}")

    def step(partition):
        logp = b.log_prob.clone().requires_grad_()
        losses, metrics = [], []
        for rows in partition:
            model_output, data = build_loss_inputs(
                logp[rows],
                b.old_log_prob[rows],
                b.advantages[rows],
                b.mask[rows],
                {LOG_GROUP_EXPECTATION: log_eq[rows]},
                batch_num_tokens=int(b.mask.sum()),
                global_batch_size=total,
            )
            loss, m = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
            losses.append(loss)
            metrics.append(m)
        summed = torch.stack(losses).sum()
        summed.backward()
        return summed.detach(), logp.grad, step_metrics(metrics)  # aggregated as verl's engine and trainer do

    whole_loss, whole_grad, _ = step([torch.arange(total)])
    split = torch.arange(total).chunk(micro_batches)
    loss, grad, metrics = step(split)
    print(f"micro-batches: {[r.tolist() for r in split]}")
    print(f"GEPO loss (whole batch) {whole_loss.item():+.6f} | summed over micro-batches {loss.item():+.6f}")
    for key in sorted(metrics):
        if key.startswith("actor/gepo/") or key in ("actor/pg_loss", "actor/pg_clipfrac"):
            print(f"  {key:<32} {metrics[key]:+.5f}")
    diff = (grad - whole_grad).abs().max().item()
    print(f"max |grad(micro-batches) - grad(whole batch)| = {diff:.2e}")
    if diff > 1e-5:
        print("FAILED: the per-prompt group semantics did not survive the micro-batch split")
        return 1
    print("OK: per-prompt group expectation is preserved across verl's micro-batch split")
    return 0
