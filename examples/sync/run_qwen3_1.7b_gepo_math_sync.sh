#!/usr/bin/env bash
# Synchronous (online) GEPO baseline on math, Qwen3-1.7B, one 8-GPU node: verl V1 `sync` trainer, vLLM
# colocated with the FSDP learner (hybrid engine), no HeteroRL delay. The paper's "online" row.
#
# Resources (estimates; NOT run in this repository's CI, which has no GPUs):
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

if [[ "${1:-}" == "--print-command" ]]; then
  PRINT_ONLY=1
  shift
fi
PRINT_ONLY="${PRINT_ONLY:-0}"

PYTHON="${PYTHON:-python3}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-1.7B}"
DATA_DIR="${DATA_DIR:-$HOME/data/gepo_math}"
TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/train.parquet}"
VAL_FILE="${VAL_FILE:-$DATA_DIR/test.parquet}"

NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# Qwen3-1.7B fits one GPU: one vLLM replica per GPU (notes silent; verl's default TP is 2)
ROLLOUT_TP="${ROLLOUT_TP:-1}"
# vLLM shares the GPUs with the FSDP learner (it sleeps during the update): keep its share moderate
ROLLOUT_GPU_MEMORY="${ROLLOUT_GPU_MEMORY:-0.6}"

SAMPLER_KL_COEF="${SAMPLER_KL_COEF:-0.0}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-32}"
GROUP_SIZE="${GROUP_SIZE:-8}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-768}"
MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-2048}"
LR="${LR:-1e-6}"
TOTAL_STEPS="${TOTAL_STEPS:-1300}"
TEST_FREQ="${TEST_FREQ:-64}"
SAVE_FREQ="${SAVE_FREQ:-64}"
MAX_CKPT_TO_KEEP="${MAX_CKPT_TO_KEEP:-3}"
PPO_MAX_TOKENS_PER_GPU="${PPO_MAX_TOKENS_PER_GPU:-16384}"
REWARD_WORKERS="${REWARD_WORKERS:-8}"

PROJECT_NAME="${PROJECT_NAME:-gepo_hetero}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3-1.7b-gepo-math-sync}"
CKPT_DIR="${CKPT_DIR:-checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}"

COMMAND=(
  "$PYTHON" -m gepo_plugin.main_ppo
  data.train_files="$TRAIN_FILE"
  data.val_files="$VAL_FILE"
  data.train_batch_size="$PROMPTS_PER_STEP"
  data.max_prompt_length="$MAX_PROMPT_LENGTH"
  data.max_response_length="$MAX_RESPONSE_LENGTH"
  data.filter_overlong_prompts=True
  data.truncation=error
  # preset: loss_mode=gepo, per-prompt group, mean-centred advantages, seq-mean-token-mean, bypass mode, clip 0.2
  algorithm.loss=gepo
  algorithm.use_kl_in_reward=False
  actor_rollout_ref.actor.clip_ratio_low=0.2
  actor_rollout_ref.actor.clip_ratio_high=0.2
  actor_rollout_ref.actor.policy_loss.sampler_kl_coef="$SAMPLER_KL_COEF"
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  # one optimizer step per batch of 32 prompts x 8 responses (paper)
  actor_rollout_ref.actor.ppo_mini_batch_size="$PROMPTS_PER_STEP"
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKENS_PER_GPU"
  actor_rollout_ref.actor.optim.lr="$LR"
  actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.03
  actor_rollout_ref.actor.optim.lr_scheduler_type=constant
  actor_rollout_ref.actor.optim.weight_decay=0.0
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=async
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
  actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEMORY"
  actor_rollout_ref.rollout.n="$GROUP_SIZE"
  actor_rollout_ref.rollout.temperature=0.6
  actor_rollout_ref.rollout.top_p=0.95
  actor_rollout_ref.rollout.top_k=20
  actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.val_kwargs.n=8
  actor_rollout_ref.rollout.val_kwargs.do_sample=True
  actor_rollout_ref.rollout.val_kwargs.temperature=0.6
  actor_rollout_ref.rollout.val_kwargs.top_p=0.95
  actor_rollout_ref.rollout.val_kwargs.top_k=20
  reward.custom_reward_function.path=pkg://gepo_plugin.rewards.math_verify_reward
  reward.custom_reward_function.name=compute_score
  reward.reward_model.enable=False
  reward.num_workers="$REWARD_WORKERS"
  trainer.v1.trainer_mode=sync
  hetero.enable=false
  trainer.nnodes="$NNODES"
  trainer.n_gpus_per_node="$GPUS_PER_NODE"
  trainer.logger='[console,wandb]'
  trainer.project_name="$PROJECT_NAME"
  trainer.experiment_name="$EXPERIMENT_NAME"
  trainer.total_training_steps="$TOTAL_STEPS"
  trainer.total_epochs=100
  trainer.test_freq="$TEST_FREQ"
  trainer.save_freq="$SAVE_FREQ"
  trainer.max_actor_ckpt_to_keep="$MAX_CKPT_TO_KEEP"
  trainer.val_before_train=True
  trainer.default_local_dir="$CKPT_DIR"
  "$@"
)

if [[ "$PRINT_ONLY" == 1 ]]; then
  printf '%q ' "${COMMAND[@]}"
  printf '\n'
  exit 0
fi

for file in "$TRAIN_FILE" "$VAL_FILE"; do
  if [[ ! -f "$file" ]]; then
    echo "missing $file: create it with examples/data/prepare_math.py (see examples/README.md)" >&2
    exit 1
  fi
done
export HYDRA_FULL_ERROR=1
printf '%q ' "${COMMAND[@]}"
printf '\n'
exec "${COMMAND[@]}"
