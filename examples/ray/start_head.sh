#!/usr/bin/env bash
# Start the Ray head on this node (run it first, on the node that will run the launch script).
# Run in this repository's CI (CPU, logical GPUs): tests/ray_nodes.py starts the multi-node test clusters with it,
# and the Slurm job's srun steps run it on every node (tests/test_slurm_e2e.py).
#
# Resources: one GPU node of the cluster (it also serves as a learner or sampler node: pass its GPUs to Ray);
# the head's ports must be reachable from every other node: RAY_PORT (GCS), DASHBOARD_PORT, RAY_CLIENT_PORT,
# and Ray's node-manager/object-manager/worker ports (pin them with RAY_EXTRA_ARGS behind a firewall).
# Software: the same Python environment (gepo-plugin, verl 0.9.1, vLLM, math-verify, Ray >= 2.44 for --labels)
# on every node.
#
# Environment variables (defaults in brackets):
#   NODE_IP [first address of `hostname -I`]  RAY_PORT [6379]  DASHBOARD_PORT [8265]  RAY_CLIENT_PORT [10001]
#   RAY_NUM_CPUS [unset: Ray detects]
#   NUM_GPUS [the number of GPUs `nvidia-smi -L` lists; printed to stderr]: without nvidia-smi, or when it fails or
#     lists none, the script stops and asks for NUM_GPUS (NUM_GPUS=0 for a node without GPUs, e.g. a CPU-only head)
#   NODE_ROLE [learner]: Ray node label gepo-role=<role>, empty = no label; a learner node also offers the custom
#     resource LEARNER_RESOURCE, where HeteroRL keeps verl's own services (TaskRunner, TransferQueue, load balancer,
#     agent-loop and reward workers), so any sampler node can be lost (hetero.learner_resource must name it)
#   LEARNER_RESOURCE [gepo_learner]: that resource's name (no other --resources in RAY_EXTRA_ARGS on a learner node)
#   RAY_BLOCK [0]: 1 = keep `ray start` in the foreground (what Slurm's srun needs)
#   RAY_EXTRA_ARGS []: more `ray start` arguments, e.g. "--min-worker-port 20000 --max-worker-port 29999"
#   PRINT_ONLY [0]: 1 (or --print-command) prints the `ray start` command instead of running it
# Afterwards: start_worker.sh on every other node with RAY_HEAD_ADDRESS=<NODE_IP>:<RAY_PORT>, check with
# `ray status`, then run the launch script on this node.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # the helpers shared by the examples
if gepo_print_flag "${1:-}"; then shift; fi

RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
SCRIPT_NAME=start_head.sh  # (names this script in gepo_num_gpus's messages)
# NODE_IP, NUM_GPUS (detected, or refused when it cannot be), NODE_ROLE [learner], RAY_BLOCK: see ../common.sh
gepo_ray_node learner

COMMAND=(ray start --head
  --node-ip-address="$NODE_IP"
  --port="$RAY_PORT"
  --dashboard-host=0.0.0.0
  --dashboard-port="$DASHBOARD_PORT"
  --ray-client-server-port="$RAY_CLIENT_PORT")
gepo_ray_start_options "$@"

gepo_print_only_exit "${COMMAND[@]}"
echo "starting the Ray head at $NODE_IP:$RAY_PORT with $NUM_GPUS GPUs (dashboard :$DASHBOARD_PORT)"
"${COMMAND[@]}"
