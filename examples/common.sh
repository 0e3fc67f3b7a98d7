# Sourced by the example scripts (never run on its own): the --print-command switch, printing or running a command,
# the math recipe's defaults and override blocks, and the options every `ray start` gets. One place, so the sync
# and HeteroRL recipes, and the Ray head and worker, cannot drift apart.
# shellcheck shell=bash disable=SC2034  # the arrays and defaults set here are read by the sourcing script

# ---------------------------------------------------------------- printing or running

# `if gepo_print_flag "${1:-}"; then shift; fi`: --print-command as the first argument means PRINT_ONLY=1.
gepo_print_flag() {
  if [[ "$1" == "--print-command" ]]; then
    PRINT_ONLY=1
    return 0
  fi
  PRINT_ONLY="${PRINT_ONLY:-0}"
  return 1
}

# Print a command shell-quoted on one line.
gepo_print() {
  printf '%q ' "$@"
  printf '\n'
}

# With PRINT_ONLY=1: print the command and exit; otherwise return and let the script run it.
gepo_print_only_exit() {
  if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
    gepo_print "$@"
    exit 0
  fi
}

# ---------------------------------------------------------------- the math recipe (Qwen3-1.7B, GEPO paper settings)

# Defaults both math scripts share (a caller's environment wins); the paper's settings, arXiv 2508.17850.
gepo_math_defaults() {
  PYTHON="${PYTHON:-python3}"
  MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-1.7B}"
  DATA_DIR="${DATA_DIR:-$HOME/data/gepo_math}"
  TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/train.parquet}"
  VAL_FILE="${VAL_FILE:-$DATA_DIR/test.parquet}"
  # Qwen3-1.7B fits one GPU: one vLLM replica per GPU (verl's default TP is 2)
  ROLLOUT_TP="${ROLLOUT_TP:-1}"
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
}

# The override blocks both math scripts share, as arrays DATA, ALGORITHM, MODEL, OPTIM, SAMPLING, REWARD, TRAINER
# (call after the defaults and EXPERIMENT_NAME, CKPT_DIR, SAMPLER_KL_COEF, PPO_MINI_BATCH_SIZE are set).
gepo_math_blocks() {
  DATA=(
    data.train_files="$TRAIN_FILE"
    data.val_files="$VAL_FILE"
    data.train_batch_size="$PROMPTS_PER_STEP"
    data.max_prompt_length="$MAX_PROMPT_LENGTH"
    data.max_response_length="$MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=True
    data.truncation=error
  )
  ALGORITHM=(
    # preset: loss_mode=gepo, per-prompt group, mean-centred advantages (grpo without std), seq-mean-token-mean,
    # q = the sampler's log-probs (rollout_correction.bypass_mode), clip 0.2/0.2
    algorithm.loss=gepo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.2
    # KL toward the sampler policy (k3, per token; the paper's async runs); no reference-model KL
    actor_rollout_ref.actor.policy_loss.sampler_kl_coef="$SAMPLER_KL_COEF"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
  )
  MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
  )
  OPTIM=(
    # one optimizer step per batch of 32 prompts x 8 responses (paper)
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKENS_PER_GPU"
    # lr 1e-6 constant with 3% warm-up (paper); weight decay 0 as in the reference's HF-Trainer defaults
    actor_rollout_ref.actor.optim.lr="$LR"
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.03
    actor_rollout_ref.actor.optim.weight_decay=0.0
  )
  SAMPLING=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEMORY"
    actor_rollout_ref.rollout.n="$GROUP_SIZE"
    actor_rollout_ref.rollout.temperature=0.6
    actor_rollout_ref.rollout.top_p=0.95
    actor_rollout_ref.rollout.top_k=20
    actor_rollout_ref.rollout.calculate_log_probs=True
    # evaluation: pass@1 averaged over 8 samples with the training sampling parameters (paper)
    actor_rollout_ref.rollout.val_kwargs.n=8
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6
    actor_rollout_ref.rollout.val_kwargs.top_p=0.95
    actor_rollout_ref.rollout.val_kwargs.top_k=20
  )
  REWARD=(
    # rule reward computed in verl's streaming reward loop, as each rollout finishes (no reward model)
    reward.custom_reward_function.path=pkg://gepo_plugin.rewards.math_verify_reward
    reward.custom_reward_function.name=compute_score
    reward.reward_model.enable=False
    reward.num_workers="$REWARD_WORKERS"
  )
  TRAINER=(
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
  )
}

# Stop with the fix when the math data set has not been prepared.
gepo_require_math_data() {
  local file
  for file in "$TRAIN_FILE" "$VAL_FILE"; do
    if [[ ! -f "$file" ]]; then
      echo "missing $file: create it with examples/data/prepare_math.py (see examples/README.md)" >&2
      exit 1
    fi
  done
}

# Print the command, then replace this shell with it (Hydra's full error on failure).
gepo_exec() {
  export HYDRA_FULL_ERROR=1
  gepo_print "$@"
  exec "$@"
}

# ---------------------------------------------------------------- `ray start` on a node of the cluster

# Append to COMMAND the options head and worker share: GPUs, CPUs, the role label, --block, extra arguments.
# Reads NUM_GPUS, RAY_NUM_CPUS, NODE_ROLE, RAY_BLOCK, RAY_EXTRA_ARGS; further arguments are appended last.
gepo_ray_start_options() {
  COMMAND+=(--num-gpus="$NUM_GPUS")
  if [[ -n "${RAY_NUM_CPUS:-}" ]]; then
    COMMAND+=(--num-cpus="$RAY_NUM_CPUS")
  fi
  if [[ -n "$NODE_ROLE" ]]; then
    COMMAND+=(--labels="gepo-role=$NODE_ROLE")
  fi
  if [[ "${RAY_BLOCK:-0}" == 1 ]]; then
    COMMAND+=(--block)
  fi
  # shellcheck disable=SC2206  # word splitting of RAY_EXTRA_ARGS is intended
  COMMAND+=(${RAY_EXTRA_ARGS:-} "$@")
}
