#!/usr/bin/env bash
# HeteroRL + GEPO on math, Qwen3-1.7B, with samplers OUTSIDE the learner's Ray cluster: in-cluster samplers as in
# run_qwen3_1.7b_gepo_math_relay.sh, plus vLLM servers anywhere (another cloud, behind NAT) that each run
# examples/remote/sampler_host.sh, follow the relay from RELAY_URL and dial this learner's gateway for work
# (docs/remote.md). Run this script on the learner's head node.
#
# Run in this repository's CI on CPU with a tiny model: the Slurm job's launch script in tests/test_slurm_e2e.py (the
# gateway open for a declared sampler that does not dial in). On GPUs it has not been run here.
# Resources (estimates for the Qwen run; tests/test_remote_e2e.py runs the same
# path on CPU: verl's trainer, an in-cluster vLLM sampler and a sampler host outside Ray, with moto's S3 server):
#   as run_qwen3_1.7b_gepo_math_relay.sh, plus per remote sampler: one machine with GPUs for vLLM, read access to
#   the store, and an outbound HTTPS connection to this node's GATEWAY_PORT (the only port opened, on this side)
#
# Environment variables (defaults in brackets), on top of run_qwen3_1.7b_gepo_math_relay.sh's (RELAY_URL required):
#   REMOTE_SAMPLERS (required) name:TOKEN_VARIABLE pairs, comma-separated, e.g. dc-west:GEPO_SAMPLER_DC_WEST: each
#     variable, set on this node, holds that sampler's bearer token (>= 16 characters)
#   RELAY_SIGNING_KEY_ENV [GEPO_RELAY_SIGNING_KEY]: the variable, set on this node only, holding the Ed25519 private
#     key that signs the manifests; RELAY_PUBLIC_KEY (required): its public key (python -m gepo_plugin keygen)
#   GATEWAY_PORT [8471]  GATEWAY_CERT []  GATEWAY_KEY []: the gateway's TLS certificate and key (HTTPS; without them
#     plain HTTP, for a private network only)
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Extra Hydra overrides go after the script's own and win.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

: "${REMOTE_SAMPLERS:?set REMOTE_SAMPLERS, e.g. dc-west:GEPO_SAMPLER_DC_WEST}"
: "${RELAY_PUBLIC_KEY:?set RELAY_PUBLIC_KEY (python -m gepo_plugin keygen)}"
RELAY_SIGNING_KEY_ENV="${RELAY_SIGNING_KEY_ENV:-GEPO_RELAY_SIGNING_KEY}"
GATEWAY_PORT="${GATEWAY_PORT:-8471}"

entries=()
IFS=',' read -ra pairs <<<"$REMOTE_SAMPLERS"
for pair in "${pairs[@]}"; do
  entries+=("{name:${pair%%:*},token_env:${pair#*:}}")
done
remote=(
  "hetero.relay.signing_key_env=$RELAY_SIGNING_KEY_ENV"
  "hetero.relay.public_key=$RELAY_PUBLIC_KEY"
  "hetero.remote_samplers=[$(IFS=','; echo "${entries[*]}")]"
  "hetero.gateway.port=$GATEWAY_PORT"
)
if [[ -n "${GATEWAY_CERT:-}" ]]; then
  remote+=("hetero.gateway.certfile=$GATEWAY_CERT" "hetero.gateway.keyfile=${GATEWAY_KEY:?GATEWAY_KEY goes with GATEWAY_CERT}")
fi
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3-1.7b-gepo-math-remote-L${LEARNER_NODES:-1}S${SAMPLER_NODES:-1}-lag${MAX_LAG:-64}}"

flag=()
if [[ "${1:-}" == "--print-command" ]]; then flag=(--print-command); shift; fi
exec bash "$here/../hetero/run_qwen3_1.7b_gepo_math_relay.sh" "${flag[@]}" "${remote[@]}" "$@"
