#!/usr/bin/env bash
# HeteroRL + GEPO on math, Qwen3-1.7B, with the learner on verl's MEGATRON engine (model_engine=megatron) instead
# of FSDP: learner on LEARNER_NODES 8-GPU nodes, vLLM samplers on SAMPLER_NODES other 8-GPU nodes, verl V1
# `separate_async` with the plugin's staleness bound and simulated weight-arrival delay. Every other setting is
# run_qwen3_1.7b_gepo_math.sh's (which this script calls); only the learner's engine differs.
#
# Parallel layout (the defaults, for 8 x 80 GB GPUs per learner node):
#   TP 1, PP 1, so data-parallel size = all learner GPUs (8 per node). Qwen3-1.7B's bf16 weights (3.4 GB) and
#   fp32 gradients (6.8 GB) fit every GPU whole, and the distributed optimizer shards the fp32 master weights and
#   Adam state (20 GB in all) over the data-parallel ranks, so splitting layers (TP) or stages (PP) would only add
#   per-layer all-reduces and pipeline bubbles. Raise MEGATRON_TP to 2 on 40 GB GPUs or with much longer
#   responses: it halves each rank's activations (28 layers, 16 query / 8 KV heads: TP must divide 8).
#   PP above 1 is for models that do not fit; keep it 1 here. TP x PP must divide the learner GPUs.
# Verified on CPU in this repository (tests/test_cpu_megatron_e2e.py: verl's Megatron engine, TP = PP = 1, local
# attention, no packing); NOT run here: GPUs, Transformer Engine attention, the packed "thd" format that
# use_remove_padding=True selects, TP/PP above 1, and Megatron-Bridge's default path (Python >= 3.12).
#
# Not executed by the tests: it is run_qwen3_1.7b_gepo_math.sh (run in CI under Slurm, tests/test_slurm_e2e.py) with
# LEARNER_ENGINE=megatron, whose engine the Megatron runs above exercise (about 4 minutes each); running the script
# too would add as much to CI for the same path. tests/test_examples.py resolves its command and its layout checks.
# Resources (estimates): as run_qwen3_1.7b_gepo_math.sh,
# plus megatron-core and Transformer Engine on the learner nodes (verl's Megatron install instructions).
#
# Environment variables: those of run_qwen3_1.7b_gepo_math.sh (MODEL_PATH, DATA_DIR, LEARNER_NODES, SAMPLER_NODES,
# MAX_LAG, DELAY, ...), and
#   MEGATRON_TP [1]  MEGATRON_PP [1]: tensor / pipeline parallel sizes of the learner
#   VANILLA_MBRIDGE [True]: build the model through mbridge (works on Python 3.10+); False selects verl's default,
#     Megatron-Bridge, which needs Python >= 3.12 and a newer megatron-core
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# The Megatron overrides themselves live in run_qwen3_1.7b_gepo_math.sh (LEARNER_ENGINE=megatron), next to the
# FSDP ones they replace.
# Extra Hydra overrides go after the script's own and win.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

export LEARNER_ENGINE=megatron
export MEGATRON_TP="${MEGATRON_TP:-1}"
export MEGATRON_PP="${MEGATRON_PP:-1}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3-1.7b-gepo-math-megatron-tp${MEGATRON_TP}pp${MEGATRON_PP}-L${LEARNER_NODES:-1}S${SAMPLER_NODES:-1}-lag${MAX_LAG:-64}-${DELAY:-lognormal}}"

exec bash "$here/run_qwen3_1.7b_gepo_math.sh" "$@"
