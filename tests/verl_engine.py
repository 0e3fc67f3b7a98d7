"""verl's real ``TrainingWorker`` (its FSDP2 engine on the CPU) in the test process, no Ray: for tests of what happens
inside verl's actor update (micro-batch splits, data-parallel ranks).

:func:`cpu_engine_backend` does the least of the CPU backend this needs and undoes it afterwards (verl's platform,
the FSDP engines registered for ``cpu``, a plain gloo process group, so verl's own group set-up and the plugin's
irreversible ``gloo_process_group`` patch are not involved). :func:`build_worker` builds the worker as verl's
``ActorRolloutRefWorker.init_model`` does; :func:`ppo_batch` is a batch as verl's trainer hands ``update_actor``
one (left-padded prompts, right-padded responses, converted to verl's no-padding layout). Compute and parameters are
float32 and the optimizer SGD, so a parameter difference measures a gradient difference (verl's default bf16 and
AdamW's sign-like first step would hide it).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from free_ports import free_port

#: float32 compute and an SGD step (see the module's docstring)
EXACT_ENGINE = (
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.actor.optim.optimizer=SGD",
)


@contextmanager
def cpu_engine_backend(rank: int = 0, world: int = 1, port: int | None = None) -> Iterator[None]:
    """verl's platform set to the plugin's CPU platform, verl's FSDP engines registered for ``cpu`` and a gloo process
    group of ``world`` ranks (its rendezvous on ``port``: the ranks' shared one, or a free one for a single rank);
    everything restored afterwards."""
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager, set_platform

    if port is None and world > 1:
        raise ValueError("ranks of one group must share its rendezvous port: pass the same `port` to every rank")
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from gepo_plugin.cpu_backend.platform import PlatformCPU

    saved_platform = platform_manager._current_platform
    saved_engines = copy.deepcopy(EngineRegistry._engines)
    saved_env = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or free_port()),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    set_platform(PlatformCPU())
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        EngineRegistry._engines.clear()
        EngineRegistry._engines.update(saved_engines)
        platform_manager._current_platform = saved_platform
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def actor_configs(model_path: str, micro: int, overrides: Sequence[str] = ()) -> tuple[Any, Any, Any]:
    """(the composed config, verl's ``HFModelConfig``, its ``ActorConfig``) from the plugin's Hydra config."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from verl.utils.config import omega_conf_to_dataclass

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="gepo_plugin.config", version_base=None):
        config = compose(
            config_name="gepo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_path}",
                "actor_rollout_ref.model.use_remove_padding=True",
                "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                "actor_rollout_ref.actor.strategy=fsdp2",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                "actor_rollout_ref.actor.optim.lr=1e-2",
                "actor_rollout_ref.actor.use_kl_loss=False",
                "actor_rollout_ref.actor.entropy_coeff=0",
                *EXACT_ENGINE,
                *overrides,
            ],
        )
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    return config, model_config, actor_config


def build_worker(model_path: str, micro: int, overrides: Sequence[str] = ()) -> Any:
    """verl's ``TrainingWorker`` for the actor, as ``ActorRolloutRefWorker.init_model`` builds it, with the plugin's
    loss wrapper (``ppo_loss_with_response_terms``, as the plugin's trainers install it) bound to its config."""
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from gepo_plugin.verl_glue.response_terms import ppo_loss_with_response_terms

    config, model_config, actor_config = actor_configs(model_path, micro, overrides)
    worker_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    engine = worker_config.engine_config
    engine.use_dynamic_bsz = False
    engine.micro_batch_size_per_gpu = engine.infer_micro_batch_size_per_gpu = micro
    engine.max_token_len_per_gpu = config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    engine.infer_max_token_len_per_gpu = config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    engine.use_remove_padding = True
    worker = TrainingWorker(config=worker_config)
    worker.reset()  # the FSDP2 module and the optimizer
    worker.set_loss_fn(partial(ppo_loss_with_response_terms, config=actor_config))
    return worker


def ppo_batch(
    tokenizer: Any, prompts: int = 2, n: int = 4, seed: int = 0, old_shift: float = 0.3, group_term: bool = False
) -> Any:
    """A batch as verl's trainer hands ``update_actor``: prompts left-padded, responses right-padded, the old
    log-probs ``old_shift`` nats above a typical tiny-model log-prob with noise (a stale sampler), group-normalised
    advantages; in verl's no-padding layout with the trainer's non-tensor keys (one mini-batch). ``group_term``: with
    GEPO's per-prompt group term, as the plugin's trainer adds it."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(seed)
    rows, prompt_len, response_len = prompts * n, 6, 5
    low, high = 3, len(tokenizer)
    prompt_ids = torch.full((rows, prompt_len), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_len, dtype=torch.long)
    for p in range(prompts):
        length = int(torch.randint(2, prompt_len + 1, (1,), generator=generator))
        ids = torch.randint(low, high, (length,), generator=generator)
        prompt_ids[p * n : (p + 1) * n, prompt_len - length :] = ids
        prompt_mask[p * n : (p + 1) * n, prompt_len - length :] = 1
    lengths = torch.randint(1, response_len + 1, (rows,), generator=generator)
    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).to(torch.long)
    responses = torch.randint(low, high, (rows, response_len), generator=generator) * response_mask
    responses[response_mask == 0] = tokenizer.pad_token_id
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    scores = torch.randn(prompts, n, generator=generator)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).reshape(rows, 1)
    old = -torch.log(torch.tensor(float(len(tokenizer)))) + old_shift * torch.randn(
        rows, response_len, generator=generator
    )
    batch = TensorDict(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0) * attention_mask,
            "response_mask": response_mask,
            "old_log_probs": (old * response_mask).float(),
            "advantages": (advantages.expand(rows, response_len) * response_mask).float(),
        },
        batch_size=[rows],
    )
    if group_term:
        from gepo_plugin.maths import group_log_expectation_from_tokens
        from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION

        group_ids = torch.arange(prompts).repeat_interleave(n)
        batch[LOG_GROUP_EXPECTATION] = group_log_expectation_from_tokens(
            batch["old_log_probs"], response_mask, group_ids
        )
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(
        batch,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=rows,
        mini_batch_size=rows,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
        temperature=1.0,
        multi_turn=False,
    )
    return batch


def parameters(worker: Any) -> dict[str, torch.Tensor]:
    """The worker's full (unsharded) parameters, copied."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().float()
        for name, p in worker.engine.module.named_parameters()
    }


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)
