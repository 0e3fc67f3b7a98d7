"""Runs of verl's real trainer on CPU that several test modules share (the FSDP2 and Megatron e2e tests).

One tiny model for all of them, with weights exactly representable in bf16: verl's Megatron engine keeps bf16
parameters and FSDP2 fp32 ones, and only then do both hold (and send the rollout) the same weights, so a GEPO run
under one engine can be compared step for step with the other. Rollouts are deterministic
(``rollout.full_determinism``), so both engines train on the same responses.
"""

from __future__ import annotations

from pathlib import Path

from chaos import NEVER_S, group_delays, hetero_overrides

from gepo_plugin.config_keys import HF_ROLLOUT_LATENCY
from gepo_plugin.tiny import cpu_run_overrides

PROMPTS, RESPONSES, LEARNERS = 4, 4, 2
#: GEPO with M2PO's mask at a budget of 0: every harmful token's gradient is zeroed (the FSDP2 run carries it: the
#: mini-batch pre-pass, the launcher's switch and the cap fields, read by GEPO's loss; Megatron's pre-pass is not run)
M2_MASK = ("actor_rollout_ref.actor.policy_loss.m2_mask=true", "actor_rollout_ref.actor.policy_loss.m2_budget=0")


def valid_gepo_command(paths: dict[str, str]) -> list[str]:
    """A valid tiny GEPO command line for the launcher (GPU defaults; start-up checks read it, nothing is run)."""
    return [
        "algorithm.loss=gepo",
        f"data.train_files={paths['train_files']}",
        f"data.val_files={paths['val_files']}",
        "data.train_batch_size=4",
        f"actor_rollout_ref.model.path={paths['model']}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        f"reward.custom_reward_function.path={paths['reward_path']}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=2",
    ]


def gepo_sync_overrides(
    tiny: dict[str, str], workdir: Path, steps: int, engine: list[str] = (), learners: int = LEARNERS
) -> list[str]:
    """GEPO in sync mode, checkpoint (with an HF copy of the actor) at step 3; ``engine`` picks the actor's."""
    overrides = cpu_run_overrides(
        tiny,
        loss="gepo",
        mode="sync",
        steps=steps,
        prompts_per_step=PROMPTS,
        responses=RESPONSES,
        learners=learners,
        output_dir=str(workdir),
        save_freq=3,
    )
    return [
        *overrides,
        *engine,
        "actor_rollout_ref.rollout.full_determinism=true",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]


MEGATRON = "model_engine=megatron"
#: the Megatron HeteroRL run's first group gets each version this late (seconds): it installs snapshots of the learner's
#: Megatron weights; its second group never gets one (the control)
MEGATRON_DELAY_S = 2
#: the modelled GPU of the Megatron HeteroRL run's CPU rollout (fast enough not to slow it): hetero.json records it
MODELLED_GPU = {"decode_tokens_per_s": 4000, "prefill_s": 0.01}


def megatron_hetero_overrides(tiny: dict[str, str], workdir: Path, steps: int) -> list[str]:
    """HeteroRL on separate_async with the Megatron learner: group 0's weights MEGATRON_DELAY_S late, group 1's never
    (``max_lag`` above the run's length, so its rollouts stay trainable); a checkpoint at the last step. What
    ``tests/test_cpu_megatron_e2e.py`` runs and ``bench/bench_tiny_learning.py`` measured over seeds."""
    latency = ", ".join(f"{key}: {value}" for key, value in MODELLED_GPU.items())
    return [
        *hetero_overrides(tiny, workdir, steps, samplers=2, learners=1, max_lag=steps + 1),
        MEGATRON,
        f"trainer.save_freq={steps}",
        group_delays(MEGATRON_DELAY_S, NEVER_S),
        f"+{HF_ROLLOUT_LATENCY}={{{latency}}}",
    ]
