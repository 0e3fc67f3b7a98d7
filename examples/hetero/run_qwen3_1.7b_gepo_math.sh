#!/usr/bin/env bash
# HeteroRL + GEPO on math, Qwen3-1.7B: learner (FSDP) on LEARNER_NODES nodes, samplers (verl's standalone
# vLLM rollout replicas) on SAMPLER_NODES other nodes, verl V1 `separate_async` with the plugin's exact
# staleness bound and simulated log-normal weight-arrival delay (GEPO, arXiv 2508.17850).
#
# Run in this repository's CI on CPU, with a tiny model in place of Qwen: submitted under a real Slurm through
# examples/slurm/gepo_hetero.sbatch (tests/test_slurm_e2e.py). On GPUs it has not been run here.
# Resources (estimates for Qwen3-1.7B on GPUs):
#   GPUs    (LEARNER_NODES + SAMPLER_NODES) nodes x 8 GPUs with >= 40 GB each (80 GB A100/H100 comfortable);
#           default 1 learner node + 1 sampler node = 16 GPUs
#   nodes   a running Ray cluster spanning all of them (examples/ray/start_head.sh + start_worker.sh, or
#           examples/slurm/gepo_hetero.sbatch); run this script ON THE HEAD NODE
#   memory  >= 128 GB host RAM per node (FSDP state, Ray object store, vLLM)
#   disk    ~4 GB for the model in every node's HF cache; ~21 GB per checkpoint (fp32 weights + Adam state),
#           MAX_CKPT_TO_KEEP of them, in CKPT_DIR on a file system shared by all learner nodes
#   network learner <-> sampler NCCL (weight sync, ~3.4 GB bf16 per update) and Ray ports between all nodes
#   software gepo-plugin + verl 0.9.1 + vLLM + math-verify on every node (pip install "gepo-plugin[math]")
#
# Environment variables (defaults in brackets):
#   MODEL_PATH [Qwen/Qwen3-1.7B]  DATA_DIR [$HOME/data/gepo_math]  TRAIN_FILE [$DATA_DIR/train.parquet]
#   VAL_FILE [$DATA_DIR/test.parquet]  (make both with examples/data/prepare_math.py)
#   LEARNER_NODES [1]  LEARNER_GPUS_PER_NODE [8]  SAMPLER_NODES [1]  SAMPLER_GPUS_PER_NODE [8]
#   LEARNER_ENGINE [fsdp]: fsdp, or megatron (verl's Megatron engine; run_qwen3_1.7b_gepo_math_megatron.sh sets it
#   and explains MEGATRON_TP [1], MEGATRON_PP [1], VANILLA_MBRIDGE [True])
#   ROLLOUT_TP [1]  ROLLOUT_GPU_MEMORY [0.85]  HYBRID_ENGINE [False]
#   SAMPLERS_PER_NODE_GROUP [1]: sampler nodes per delay stream (hetero.sampler_groups), or set
#   SAMPLER_GROUPS verbatim, e.g. [8,4,4] replicas per group, or null (one group per replica)
#   WEIGHT_TRANSPORT [simulated]: simulated = NCCL from learner to samplers with the simulated DELAY below; relay =
#     through the store RELAY_URL (run_qwen3_1.7b_gepo_math_relay.sh sets it and explains RELAY_*)
#   MAX_LAG [64]  LAG_STRATEGY [wait]  DELAY [lognormal]  DELAY_LOW [60]  DELAY_HIGH [1920]
#   DELAY_CONFIDENCE [0.995]  HETERO_SEED [0]  SAMPLER_KL_COEF [0.005]
#   PROMPTS_PER_STEP [32]  GROUP_SIZE [8]  MAX_PROMPT_LENGTH [768]  MAX_RESPONSE_LENGTH [2048]  LR [1e-6]
#   TOTAL_STEPS [1300]  TEST_FREQ [64]  SAVE_FREQ [64]  MAX_CKPT_TO_KEEP [3]  PPO_MAX_TOKENS_PER_GPU [16384]
#   REWARD_WORKERS [8]  PROJECT_NAME [gepo_hetero]  EXPERIMENT_NAME [derived]  CKPT_DIR [checkpoints/...]
#   RAY_ADDRESS [auto: the cluster this node belongs to; empty: ray.init() default]  PYTHON [python3]
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Extra Hydra overrides go after the script's own and win: ./run_qwen3_1.7b_gepo_math.sh hetero.max_lag=8
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # the defaults, override blocks and helpers shared by the examples
if gepo_print_flag "${1:-}"; then shift; fi

gepo_math_defaults  # MODEL_PATH, DATA_DIR, ROLLOUT_TP, the paper's settings, ...: see ../common.sh

# ---- layout: learner nodes and sampler nodes ----
LEARNER_NODES="${LEARNER_NODES:-1}"
LEARNER_GPUS_PER_NODE="${LEARNER_GPUS_PER_NODE:-8}"
SAMPLER_NODES="${SAMPLER_NODES:-1}"
SAMPLER_GPUS_PER_NODE="${SAMPLER_GPUS_PER_NODE:-8}"
# the sampler GPUs hold only vLLM, so most of their memory can go to the KV cache (verl default 0.5)
ROLLOUT_GPU_MEMORY="${ROLLOUT_GPU_MEMORY:-0.85}"
# False: the learner's GPUs never generate; every training rollout comes from a (delayed) sampler
HYBRID_ENGINE="${HYBRID_ENGINE:-False}"
# Delay streams: one sampler group (one independent weight-arrival delay) per SAMPLERS_PER_NODE_GROUP nodes
SAMPLERS_PER_NODE_GROUP="${SAMPLERS_PER_NODE_GROUP:-1}"

# ---- the learner's engine: verl's FSDP (default) or Megatron ----
LEARNER_ENGINE="${LEARNER_ENGINE:-fsdp}"
MEGATRON_TP="${MEGATRON_TP:-1}"
MEGATRON_PP="${MEGATRON_PP:-1}"
VANILLA_MBRIDGE="${VANILLA_MBRIDGE:-True}"

# ---- HeteroRL (paper: log-normal delay with [60 s, 1920 s] as its central 99.5% interval for 1.7B) ----
WEIGHT_TRANSPORT="${WEIGHT_TRANSPORT:-simulated}"
MAX_LAG="${MAX_LAG:-64}"
LAG_STRATEGY="${LAG_STRATEGY:-wait}"
DELAY="${DELAY:-lognormal}"
DELAY_LOW="${DELAY_LOW:-60}"
DELAY_HIGH="${DELAY_HIGH:-1920}"
DELAY_CONFIDENCE="${DELAY_CONFIDENCE:-0.995}"
HETERO_SEED="${HETERO_SEED:-0}"

# ---- GEPO paper settings (arXiv 2508.17850, https://arxiv.org/abs/2508.17850; the rest in ../common.sh) ----
SAMPLER_KL_COEF="${SAMPLER_KL_COEF:-0.005}"
gepo_math_names "qwen3-1.7b-gepo-math-L${LEARNER_NODES}S${SAMPLER_NODES}-lag${MAX_LAG}-${DELAY}"

# one entry per sampler group, each the number of rollout replicas it holds
replicas_per_node=$((SAMPLER_GPUS_PER_NODE / ROLLOUT_TP))
if ((replicas_per_node < 1 || SAMPLER_GPUS_PER_NODE % ROLLOUT_TP != 0)); then
  echo "SAMPLER_GPUS_PER_NODE ($SAMPLER_GPUS_PER_NODE) must be a multiple of ROLLOUT_TP ($ROLLOUT_TP)" >&2
  exit 2
fi
if ((SAMPLER_NODES % SAMPLERS_PER_NODE_GROUP != 0)); then
  echo "SAMPLER_NODES ($SAMPLER_NODES) must be a multiple of SAMPLERS_PER_NODE_GROUP ($SAMPLERS_PER_NODE_GROUP)" >&2
  exit 2
fi
groups=()
for ((i = 0; i < SAMPLER_NODES / SAMPLERS_PER_NODE_GROUP; i++)); do
  groups+=("$((replicas_per_node * SAMPLERS_PER_NODE_GROUP))")
done
SAMPLER_GROUPS="${SAMPLER_GROUPS:-[$(IFS=,; echo "${groups[*]}")]}"

# separate_async: one optimizer step per weight version, as in the paper (32 prompts x 8 = 256 rollouts)
PARAMETER_SYNC_STEP=1
PPO_MINI_BATCH_SIZE=$((PROMPTS_PER_STEP / PARAMETER_SYNC_STEP))

gepo_math_blocks  # DATA, ALGORITHM, MODEL, OPTIM, ROLLOUT_ENGINE, ROLLOUT, VALIDATION, REWARD, TRAINER

LEARNER=(
  "${MODEL[@]}"
  actor_rollout_ref.hybrid_engine="$HYBRID_ENGINE"
  "${OPTIM[@]}"
  # weight decay 0 as in the reference's HF-Trainer defaults
  actor_rollout_ref.actor.optim.weight_decay=0.0
  trainer.nnodes="$LEARNER_NODES"
  trainer.n_gpus_per_node="$LEARNER_GPUS_PER_NODE"
)
case "$LEARNER_ENGINE" in
  fsdp) LEARNER+=(actor_rollout_ref.actor.optim.lr_scheduler_type=constant) ;;
  megatron)
    if (((LEARNER_NODES * LEARNER_GPUS_PER_NODE) % (MEGATRON_TP * MEGATRON_PP) != 0)); then
      echo "MEGATRON_TP x MEGATRON_PP ($MEGATRON_TP x $MEGATRON_PP) must divide the learner GPUs" \
        "($((LEARNER_NODES * LEARNER_GPUS_PER_NODE)))" >&2
      exit 2
    fi
    LEARNER+=(
      model_engine=megatron
      # megatron's optimizer config names the schedule lr_decay_style
      actor_rollout_ref.actor.optim.lr_decay_style=constant
      actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$MEGATRON_TP"
      actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$MEGATRON_PP"
      # shards the fp32 master weights and Adam state over the data-parallel ranks
      actor_rollout_ref.actor.megatron.use_distributed_optimizer=True
      actor_rollout_ref.actor.megatron.use_mbridge=True
      actor_rollout_ref.actor.megatron.vanilla_mbridge="$VANILLA_MBRIDGE"
    )
    ;;
  *)
    echo "LEARNER_ENGINE=$LEARNER_ENGINE: use fsdp or megatron" >&2
    exit 2
    ;;
esac

SAMPLERS=(
  "${ROLLOUT_ENGINE[@]}"
  actor_rollout_ref.rollout.nnodes="$SAMPLER_NODES"
  actor_rollout_ref.rollout.n_gpus_per_node="$SAMPLER_GPUS_PER_NODE"
  "${ROLLOUT[@]}"
  "${VALIDATION[@]}"
)

ASYNC=(
  trainer.v1.trainer_mode=separate_async
  trainer.v1.separate_async.parameter_sync_step="$PARAMETER_SYNC_STEP"
  transfer_queue.enable=True
  hetero.enable=true
  hetero.max_lag="$MAX_LAG"
  hetero.strategy="$LAG_STRATEGY"
  hetero.seed="$HETERO_SEED"
  hetero.sampler_groups="$SAMPLER_GROUPS"
  hetero.delay.distribution="$DELAY"
)
case "$DELAY" in
  lognormal | weibull)
    ASYNC+=(hetero.delay.low="$DELAY_LOW" hetero.delay.high="$DELAY_HIGH" hetero.delay.confidence="$DELAY_CONFIDENCE")
    ;;
esac
case "$WEIGHT_TRANSPORT" in
  # weights by NCCL inside the cluster (learner and samplers share a network)
  simulated) SAMPLERS+=(actor_rollout_ref.rollout.checkpoint_engine.backend=nccl) ;;
  # weights through the store: the plugin sets verl's checkpoint engine to its relay
  relay)
    if [[ -z "${RELAY_URL:-}" ]]; then
      echo "WEIGHT_TRANSPORT=relay needs RELAY_URL (e.g. s3://my-bucket/gepo-runs)" >&2
      exit 2
    fi
    ASYNC+=(hetero.transport=relay hetero.relay.url="$RELAY_URL")
    if [[ -n "${RELAY_ENDPOINT:-}" ]]; then
      ASYNC+=(+hetero.relay.storage_options.client_kwargs.endpoint_url="$RELAY_ENDPOINT")
    fi
    if [[ -n "${RELAY_SECRET_ENV:-}" ]]; then
      ASYNC+=(hetero.relay.secret_env="$RELAY_SECRET_ENV")
    fi
    ASYNC+=(hetero.relay.keyframe_every="${RELAY_KEYFRAME_EVERY:-10}")
    if [[ -n "${TQ_STORAGE_RESOURCE:-}" ]]; then
      ASYNC+=(+transfer_queue.backend.SimpleStorage.required_node_resource="$TQ_STORAGE_RESOURCE")
    fi
    ;;
  *)
    echo "WEIGHT_TRANSPORT=$WEIGHT_TRANSPORT: use simulated or relay" >&2
    exit 2
    ;;
esac

COMMAND=("$PYTHON" -m gepo_plugin.main_ppo "${DATA[@]}" "${ALGORITHM[@]}" "${LEARNER[@]}" "${SAMPLERS[@]}"
  "${REWARD[@]}" "${ASYNC[@]}" "${TRAINER[@]}" "$@")

gepo_print_only_exit "${COMMAND[@]}"
gepo_require_math_data
# verl's ray.init() joins the cluster this node belongs to ("auto"); an empty RAY_ADDRESS leaves it to ray.init()'s
# default (join a cluster started on this machine, or start a local one), as the single-node script does
RAY_ADDRESS="${RAY_ADDRESS-auto}"
if [[ -n "$RAY_ADDRESS" ]]; then export RAY_ADDRESS; else unset RAY_ADDRESS; fi
echo "learner: ${LEARNER_NODES}x${LEARNER_GPUS_PER_NODE} GPUs, samplers: ${SAMPLER_NODES}x${SAMPLER_GPUS_PER_NODE} GPUs" \
  "(groups $SAMPLER_GROUPS), max_lag=$MAX_LAG, delay=$DELAY"
gepo_exec "${COMMAND[@]}"
