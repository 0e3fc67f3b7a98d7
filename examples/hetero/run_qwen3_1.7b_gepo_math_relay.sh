#!/usr/bin/env bash
# HeteroRL + GEPO on math, Qwen3-1.7B, with samplers in a second cluster: the learner publishes each weight version
# once to a bucket both sites reach, and every sampler replica pulls exact deltas from it over its own link
# (hetero.transport=relay; README "Samplers in another cluster"). No NCCL route between the sites is needed.
#
# Run in this repository's CI on CPU with a tiny model, called by the remote-samplers launch script in the Slurm job
# (tests/test_slurm_e2e.py; a directory store); tests/test_relay_e2e.py runs the same transport over a local S3
# server on four Ray nodes. On GPUs it has not been run here.
# Resources (estimates for the Qwen run on GPUs):
#   GPUs    as run_qwen3_1.7b_gepo_math.sh: LEARNER_NODES x 8 in the learner's cluster, SAMPLER_NODES x 8 in the
#           samplers' cluster
#   nodes   ONE Ray cluster spanning both sites (examples/ray/start_head.sh in the learner's cluster,
#           start_worker.sh on every node of both): Ray's ports must be reachable between the sites (a VPN or
#           peering); rollouts (token ids and log-probs, kilobytes per sample) travel through verl's TransferQueue
#   store   RELAY_URL: an s3:// (or gs://, az://, any fsspec URL) prefix both sites can read and the learner's head
#           can write; about one full model (3.4 GB bf16) per keyframe plus small deltas, pruned as samplers move on
#   network per version the samplers download a delta of roughly 1-15% of 3.4 GB at RL learning rates (see
#           bench/bench_relay.py), a keyframe (3.4 GB) when they fall behind a keyframe
#   credentials only the storage provider's usual configuration on every node (AWS_* environment variables, config
#           files or instance roles for s3://); never in the command line
#   software gepo-plugin[s3] (or the fsspec driver of RELAY_URL's protocol) + verl 0.9.1 + vLLM on every node
#
# Environment variables (defaults in brackets), on top of run_qwen3_1.7b_gepo_math.sh's:
#   RELAY_URL (required) e.g. s3://my-bucket/gepo-runs: the run's versions go under RELAY_URL/<project>/<experiment>
#   RELAY_ENDPOINT []: an S3-compatible endpoint (MinIO, Ceph, R2), e.g. https://minio.example.org:9000
#   RELAY_SECRET_ENV []: the name of an environment variable, set on every node, holding a shared secret: manifests
#     are then HMAC-signed and samplers refuse any they cannot verify
#   RELAY_KEYFRAME_EVERY [10]: a full keyframe every this many versions
#   TQ_STORAGE_RESOURCE []: a Ray custom resource only the learner's nodes have (RAY_EXTRA_ARGS of start_head.sh /
#     start_worker.sh: --resources='{"gepo_learner": 1}'): TransferQueue keeps the rollouts' storage on those nodes,
#     so losing a sampler node (or site) loses no stored rollout
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Check a node's access first: python -m gepo_plugin doctor --relay-url "$RELAY_URL" [--relay-read-only]
# Extra Hydra overrides go after the script's own and win, e.g. hetero.relay.links=[{bandwidth_mbps:1000},{}]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

export WEIGHT_TRANSPORT=relay
export DELAY=none  # the delay is real now: the samplers' own downloads
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3-1.7b-gepo-math-relay-L${LEARNER_NODES:-1}S${SAMPLER_NODES:-1}-lag${MAX_LAG:-64}}"

exec bash "$here/run_qwen3_1.7b_gepo_math.sh" "$@"
