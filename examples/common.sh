# Sourced by the example scripts (never run on its own). Why it exists: the sync and HeteroRL math recipes share
# their defaults and most of their Hydra overrides, and the Ray head and worker share their node settings (address,
# GPU count, role label, --block, extra arguments) and the --print-command / PRINT_ONLY handling; kept once here,
# they cannot drift apart. Each script sources it relative to its own location,
#     source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
# except the Slurm job, which Slurm runs as a copy elsewhere: it sources "$REPO_DIR/examples/common.sh".
# The override blocks are arrays the scripts splice into their command in the order they print it, so the
# printed commands stay exactly what they were before this file existed (tests/test_examples.py resolves them).
# Everything here runs inside the sourcing script's `set -euo pipefail`; `exit` in a function ends that script.
# shellcheck shell=bash disable=SC2034  # the arrays and defaults set here are read by the sourcing script

# ---------------------------------------------------------------- printing or running

# `if gepo_print_flag "${1:-}"; then shift; fi`: --print-command as the first argument means PRINT_ONLY=1;
# otherwise PRINT_ONLY keeps its value from the environment (default 0).
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
  # Qwen3-1.7B fits one GPU: one vLLM replica per GPU (notes silent; verl's default TP is 2)
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

# gepo_math_names DEFAULT: EXPERIMENT_NAME (DEFAULT unless set) and CKPT_DIR (checkpoints/<project>/<experiment>).
gepo_math_names() {
  EXPERIMENT_NAME="${EXPERIMENT_NAME:-$1}"
  CKPT_DIR="${CKPT_DIR:-checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}"
}

# The override blocks both math scripts share, as arrays DATA, ALGORITHM, MODEL, OPTIM, ROLLOUT_ENGINE, ROLLOUT,
# VALIDATION, REWARD, TRAINER; each script splices them, with its own overrides between them, into its command
# (call after gepo_math_defaults, gepo_math_names and the scripts' SAMPLER_KL_COEF, ROLLOUT_GPU_MEMORY and
# PPO_MINI_BATCH_SIZE).
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
    # lr 1e-6 constant (the schedule's key depends on the engine: the scripts set it) with 3% warm-up (paper)
    actor_rollout_ref.actor.optim.lr="$LR"
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.03
  )
  ROLLOUT_ENGINE=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
  )
  ROLLOUT=(
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEMORY"
    actor_rollout_ref.rollout.n="$GROUP_SIZE"
    actor_rollout_ref.rollout.temperature=0.6
    actor_rollout_ref.rollout.top_p=0.95
    actor_rollout_ref.rollout.top_k=20
    actor_rollout_ref.rollout.calculate_log_probs=True
  )
  VALIDATION=(
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

# gepo_ray_node DEFAULT_ROLE: the settings head and worker share. NODE_IP [first address of `hostname -I`, else
# 127.0.0.1]; NUM_GPUS (gepo_num_gpus); NODE_ROLE [DEFAULT_ROLE; empty = no label]; RAY_BLOCK [0].
gepo_ray_node() {
  NODE_IP="${NODE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
  NODE_IP="${NODE_IP:-127.0.0.1}"
  gepo_num_gpus
  NODE_ROLE="${NODE_ROLE-$1}"
  RAY_BLOCK="${RAY_BLOCK:-0}"
}

# Sets NUM_GPUS, the GPUs given to Ray: NUM_GPUS if set (a whole number; 0 is fine for a node without GPUs), else
# what `nvidia-smi -L` lists. No silent 0: a node where the count cannot be detected (no nvidia-smi, or it fails
# or lists none) is an error unless NUM_GPUS says so. SCRIPT_NAME names the calling script in the messages.
gepo_num_gpus() {
  local gpu_list
  if [[ -z "${NUM_GPUS:-}" ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
      echo "$SCRIPT_NAME: nvidia-smi is not on PATH, so the GPU count cannot be detected: set NUM_GPUS" \
        "(NUM_GPUS=0 for a node without GPUs)" >&2
      exit 2
    fi
    if ! gpu_list="$(nvidia-smi -L 2>&1)"; then
      echo "$SCRIPT_NAME: \`nvidia-smi -L\` failed (${gpu_list:-no output}): set NUM_GPUS (NUM_GPUS=0 for no GPUs)" >&2
      exit 2
    fi
    NUM_GPUS="$(grep -c '^GPU' <<<"$gpu_list" || true)"
    if ((NUM_GPUS == 0)); then
      echo "$SCRIPT_NAME: nvidia-smi lists no GPUs: set NUM_GPUS (NUM_GPUS=0 to start without GPUs)" >&2
      exit 2
    fi
    echo "$SCRIPT_NAME: detected $NUM_GPUS GPUs with nvidia-smi" >&2
  elif [[ ! "$NUM_GPUS" =~ ^[0-9]+$ ]]; then
    echo "$SCRIPT_NAME: NUM_GPUS=$NUM_GPUS is not a whole number" >&2
    exit 2
  else
    echo "$SCRIPT_NAME: using NUM_GPUS=$NUM_GPUS GPUs" >&2
  fi
}

# Append to COMMAND the options head and worker share: GPUs, CPUs, the role label (and a learner's resource),
# --block, extra arguments. Reads NUM_GPUS, RAY_NUM_CPUS, NODE_ROLE, LEARNER_RESOURCE, RAY_BLOCK, RAY_EXTRA_ARGS;
# further arguments are appended last.
gepo_ray_start_options() {
  COMMAND+=(--num-gpus="$NUM_GPUS")
  if [[ -n "${RAY_NUM_CPUS:-}" ]]; then
    COMMAND+=(--num-cpus="$RAY_NUM_CPUS")
  fi
  if [[ -n "$NODE_ROLE" ]]; then
    COMMAND+=(--labels="gepo-role=$NODE_ROLE")
  fi
  # a learner node offers the custom resource HeteroRL keeps verl's own services on (hetero.learner_resource), so
  # that any sampler node can be lost without stopping the run
  if [[ "$NODE_ROLE" == learner ]]; then
    COMMAND+=(--resources="{\"${LEARNER_RESOURCE:-gepo_learner}\": 1}")
  fi
  if [[ "${RAY_BLOCK:-0}" == 1 ]]; then
    COMMAND+=(--block)
  fi
  # shellcheck disable=SC2206  # word splitting of RAY_EXTRA_ARGS is intended
  COMMAND+=(${RAY_EXTRA_ARGS:-} "$@")
}
