#!/usr/bin/env bash
# Join this node to a running Ray cluster (after start_head.sh on the head node).
# Run in this repository's CI (CPU, logical GPUs): tests/ray_nodes.py starts the multi-node test clusters with it,
# and the Slurm job's srun steps run it on every node (tests/test_slurm_e2e.py).
#
# Resources: one GPU node (learner or sampler); it must reach the head's RAY_PORT and the other nodes' Ray ports,
# and (for NCCL weight sync between learner and samplers) the other GPU nodes' network. The same Python
# environment as the head (gepo-plugin, verl 0.9.1, vLLM, math-verify, Ray >= 2.44 for --labels).
#
# Environment variables (defaults in brackets):
#   RAY_HEAD_ADDRESS (required) <head ip>:<port>, e.g. 10.0.0.1:6379
#   NODE_IP [first address of `hostname -I`]  RAY_NUM_CPUS [unset: Ray detects]
#   NUM_GPUS [the number of GPUs `nvidia-smi -L` lists; printed to stderr]: without nvidia-smi, or when it fails or
#     lists none, the script stops and asks for NUM_GPUS (NUM_GPUS=0 for a node without GPUs)
#   NODE_ROLE [sampler]: Ray node label gepo-role=<role>, empty = no label; NODE_ROLE=learner for a further learner
#     node: it offers LEARNER_RESOURCE [gepo_learner] too, see start_head.sh
#   RAY_BLOCK [0]: 1 = keep `ray start` in the foreground (what Slurm's srun needs)
#   RAY_EXTRA_ARGS []: more `ray start` arguments
#   PRINT_ONLY [0]: 1 (or --print-command) prints the `ray start` command instead of running it
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # the helpers shared by the examples
if gepo_print_flag "${1:-}"; then shift; fi

if [[ -z "${RAY_HEAD_ADDRESS:-}" ]]; then
  echo "set RAY_HEAD_ADDRESS=<head ip>:<port> (what start_head.sh printed)" >&2
  exit 2
fi
SCRIPT_NAME=start_worker.sh  # (names this script in gepo_num_gpus's messages)
# NODE_IP, NUM_GPUS (detected, or refused when it cannot be), NODE_ROLE [sampler], RAY_BLOCK: see ../common.sh
gepo_ray_node sampler

COMMAND=(ray start
  --address="$RAY_HEAD_ADDRESS"
  --node-ip-address="$NODE_IP")
gepo_ray_start_options "$@"

gepo_print_only_exit "${COMMAND[@]}"
echo "joining the Ray cluster at $RAY_HEAD_ADDRESS as $NODE_IP with $NUM_GPUS GPUs (role ${NODE_ROLE:-none})"
"${COMMAND[@]}"
