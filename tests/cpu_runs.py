"""Runs of verl's real trainer on CPU that several test modules share (the FSDP2 and Megatron e2e tests).

One tiny model for all of them, with weights exactly representable in bf16: verl's Megatron engine keeps bf16
parameters and FSDP2 fp32 ones, and only then do both hold (and send the rollout) the same weights, so a GEPO run
under one engine can be compared step for step with the other. Rollouts are deterministic
(``rollout.full_determinism``), so both engines train on the same responses.
"""

from __future__ import annotations

import time
from pathlib import Path

from gepo_plugin.tiny import cpu_run_overrides, run_cpu_training

PROMPTS, RESPONSES, LEARNERS = 4, 4, 2


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


def gepo_sync_overrides(tiny: dict[str, str], workdir: Path, steps: int, engine: list[str] = ()) -> list[str]:
    """GEPO in sync mode, checkpoint (with an HF copy of the actor) at step 3; ``engine`` picks the actor's."""
    overrides = cpu_run_overrides(
        tiny,
        loss="gepo",
        mode="sync",
        steps=steps,
        prompts_per_step=PROMPTS,
        responses=RESPONSES,
        learners=LEARNERS,
        output_dir=str(workdir),
        save_freq=3,
    )
    return [
        *overrides,
        *engine,
        "actor_rollout_ref.rollout.full_determinism=true",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]


def timed_run(
    name: str, overrides: list[str], workdir: Path, env: dict[str, str] | None = None
) -> tuple[int, dict[int, dict], str]:
    """:func:`run_cpu_training`, printing the wall time, the start-up (wall minus verl's step times) and s/step."""
    started = time.perf_counter()
    code, metrics, log = run_cpu_training(overrides, workdir, env=env)
    wall = time.perf_counter() - started
    steps = [m["timing_s/step"] for _, m in sorted(metrics.items()) if "timing_s/step" in m]
    updates = [m["timing_s/update_actor"] for m in metrics.values() if "timing_s/update_actor" in m]
    if steps:
        print(
            f"\n[timing] {name}: wall {wall:.0f} s, start-up and shutdown {wall - sum(steps):.0f} s, steps "
            f"{[round(x, 1) for x in steps]} s, update_actor mean {sum(updates) / len(updates):.2f} s"
        )
    return code, metrics, log
