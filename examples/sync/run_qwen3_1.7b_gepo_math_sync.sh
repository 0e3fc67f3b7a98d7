#!/usr/bin/env bash
# Synchronous (online) GEPO baseline on math, Qwen3-1.7B, one 8-GPU node: verl V1 `sync` trainer, vLLM
# colocated with the FSDP learner (hybrid engine), no HeteroRL delay. The paper's "online" row.
#
# Not executed by the tests: one node of 8 GPUs with vLLM colocated in the learner (verl's hybrid engine), which
# needs GPUs; verl's sync trainer with GEPO runs on CPU in tests/test_cpu_e2e.py, and tests/test_examples.py
# resolves this script's command through the launcher's and verl's checks.
# Resources (estimates):
#   GPUs    1 node x 8 GPUs with >= 40 GB each (80 GB A100/H100 comfortable)
#   memory  >= 128 GB host RAM
#   disk    ~4 GB model cache; ~21 GB per checkpoint x MAX_CKPT_TO_KEEP [3] in CKPT_DIR
#   Ray     none needed beforehand: verl starts a local Ray instance (or joins one started on this machine)
#
# Environment variables (defaults in brackets):
#   MODEL_PATH [Qwen/Qwen3-1.7B]  DATA_DIR [$HOME/data/gepo_math]  TRAIN_FILE [$DATA_DIR/train.parquet]
#   VAL_FILE [$DATA_DIR/test.parquet]  (make both with examples/data/prepare_math.py)
#   NNODES [1]  GPUS_PER_NODE [8]  ROLLOUT_TP [1]  ROLLOUT_GPU_MEMORY [0.6]
#   SAMPLER_KL_COEF [0.0: the paper used the sampler KL only in its asynchronous runs]
#   PROMPTS_PER_STEP [32]  GROUP_SIZE [8]  MAX_PROMPT_LENGTH [768]  MAX_RESPONSE_LENGTH [2048]  LR [1e-6]
#   TOTAL_STEPS [1300]  TEST_FREQ [64]  SAVE_FREQ [64]  MAX_CKPT_TO_KEEP [3]  PPO_MAX_TOKENS_PER_GPU [16384]
#   REWARD_WORKERS [8]  PROJECT_NAME [gepo_hetero]  EXPERIMENT_NAME [qwen3-1.7b-gepo-math-sync]
#   CKPT_DIR [checkpoints/...]  PYTHON [python3]
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Extra Hydra overrides go after the script's own and win: ./run_qwen3_1.7b_gepo_math_sync.sh algorithm.loss=gspo
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # the defaults, override blocks and helpers shared by the examples
if gepo_print_flag "${1:-}"; then shift; fi

gepo_math_defaults  # MODEL_PATH, DATA_DIR, ROLLOUT_TP, the paper's settings, ...: see ../common.sh
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# vLLM shares the GPUs with the FSDP learner (it sleeps during the update): keep its share moderate
ROLLOUT_GPU_MEMORY="${ROLLOUT_GPU_MEMORY:-0.6}"
# the paper used the KL toward the sampler only in its asynchronous runs
SAMPLER_KL_COEF="${SAMPLER_KL_COEF:-0.0}"
# one optimizer step per batch of 32 prompts x 8 responses (paper)
PPO_MINI_BATCH_SIZE="$PROMPTS_PER_STEP"
gepo_math_names qwen3-1.7b-gepo-math-sync
gepo_math_blocks  # DATA, ALGORITHM, MODEL, OPTIM, ROLLOUT_ENGINE, ROLLOUT, VALIDATION, REWARD, TRAINER

COMMAND=(
  "$PYTHON" -m gepo_plugin.main_ppo
  "${DATA[@]}" "${ALGORITHM[@]}" "${MODEL[@]}" "${OPTIM[@]}"
  actor_rollout_ref.actor.optim.lr_scheduler_type=constant
  # weight decay 0 as in the reference's HF-Trainer defaults
  actor_rollout_ref.actor.optim.weight_decay=0.0
  "${ROLLOUT_ENGINE[@]}" "${ROLLOUT[@]}" "${VALIDATION[@]}" "${REWARD[@]}"
  trainer.v1.trainer_mode=sync
  hetero.enable=false
  trainer.nnodes="$NNODES"
  trainer.n_gpus_per_node="$GPUS_PER_NODE"
  "${TRAINER[@]}"
  "$@"
)

gepo_print_only_exit "${COMMAND[@]}"
gepo_require_math_data
gepo_exec "${COMMAND[@]}"
