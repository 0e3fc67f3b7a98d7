#!/usr/bin/env bash
# HeteroRL + GEPO on math, Qwen3-1.7B, on ONE 8-GPU node: 4 GPUs for the learner (FSDP) and 4 GPUs for
# 4 standalone vLLM samplers (one replica per GPU, each its own delay stream), verl V1 `separate_async`.
# Same settings as run_qwen3_1.7b_gepo_math.sh (which this script calls), only the layout differs.
#
# Not executed by the tests: it is run_qwen3_1.7b_gepo_math.sh, which CI runs under Slurm (tests/test_slurm_e2e.py),
# with a one-node layout of 4 + 4 GPUs; on CPU that layout is eight processes on a 2-core machine for the same path.
# tests/test_examples.py resolves its command (layout included) through the launcher's and verl's checks.
# Resources (estimates):
#   GPUs    1 node x 8 GPUs with >= 40 GB each (80 GB A100/H100 comfortable)
#   memory  >= 128 GB host RAM
#   disk    ~4 GB model cache; ~21 GB per checkpoint x MAX_CKPT_TO_KEEP [3] in CKPT_DIR
#   Ray     none needed beforehand: verl starts a local Ray instance (or joins one started on this machine)
#
# Environment variables: those of run_qwen3_1.7b_gepo_math.sh (MODEL_PATH, DATA_DIR, MAX_LAG, DELAY, ...), with
# these defaults changed: LEARNER_GPUS_PER_NODE [4]  SAMPLER_GPUS_PER_NODE [4]  LEARNER_NODES=SAMPLER_NODES=1
#   SAMPLER_GROUPS [null: one delay stream per sampler replica]  RAY_ADDRESS [empty: ray.init() default]
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Extra Hydra overrides go after the script's own and win.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

export LEARNER_NODES=1
export SAMPLER_NODES=1
export LEARNER_GPUS_PER_NODE="${LEARNER_GPUS_PER_NODE:-4}"
export SAMPLER_GPUS_PER_NODE="${SAMPLER_GPUS_PER_NODE:-4}"
export SAMPLER_GROUPS="${SAMPLER_GROUPS:-null}"
export RAY_ADDRESS="${RAY_ADDRESS-}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3-1.7b-gepo-math-1node-${LEARNER_GPUS_PER_NODE}L${SAMPLER_GPUS_PER_NODE}S-lag${MAX_LAG:-64}-${DELAY:-lognormal}}"

exec bash "$here/run_qwen3_1.7b_gepo_math.sh" "$@"
