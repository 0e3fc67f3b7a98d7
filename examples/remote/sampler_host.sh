#!/usr/bin/env bash
# A remote sampler for examples/remote/run_qwen3_1.7b_gepo_math_remote.sh: vLLM on this machine, joined to the run
# by URL (python -m gepo_sampler; docs/remote.md). No Ray here, and no port opened: it dials the learner.
#
# Run in this repository's CI on CPU with vLLM's CPU build: every honest sampler host of tests/test_remote_e2e.py and
# tests/test_remote_sampler.py is started with this script (tests/remote_hosts.py). On GPUs it has not been run here.
# Resources (estimates):
#   GPUs    one vLLM server (ROLLOUT_TP GPUs of >= 40 GB for Qwen3-1.7B; more with --vllm-arg=--data-parallel-size=N)
#   network outbound HTTPS to GATEWAY_URL; read access to the store (each version: a delta, or a 3.4 GB keyframe)
#   software gepo-plugin + vLLM 0.24 or 0.30 (pip install gepo-plugin vllm)
#
# Environment variables (defaults in brackets):
#   GATEWAY_URL (required) e.g. https://learner.example.org:8471   SAMPLER_NAME (required) as in REMOTE_SAMPLERS
#   GEPO_SAMPLER_TOKEN (required) this sampler's token   RELAY_PUBLIC_KEY (required) the learner's public key
#   MODEL_PATH [Qwen/Qwen3-1.7B]  MAX_MODEL_LEN [2816]  DTYPE [bfloat16]  CA_CERT []: the gateway's CA (self-signed)
#   VLLM_URL []: attach to a vLLM server already running on this machine (one a supervisor keeps, or the one a host
#     that died started) instead of starting one; MODEL_PATH, MAX_MODEL_LEN and DTYPE are then the server's own
#   RELAY_URL []: the store as this machine reaches it (default: the learner's)  STORAGE_OPTIONS [{}]
#   store credentials: the provider's usual variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://)
#   PRINT_ONLY [0]  1 (or --print-command as the first argument): print the command instead of running it
# Extra arguments go to `python -m gepo_sampler` (try --help).
set -euo pipefail
print_only="${PRINT_ONLY:-0}"
if [[ "${1:-}" == "--print-command" ]]; then print_only=1; shift; fi
: "${GATEWAY_URL:?set GATEWAY_URL, e.g. https://learner.example.org:8471}"
: "${SAMPLER_NAME:?set SAMPLER_NAME (its entry in the learner's REMOTE_SAMPLERS)}"
: "${RELAY_PUBLIC_KEY:?set RELAY_PUBLIC_KEY (the learner's hetero.relay.public_key)}"
command=(
  "${PYTHON:-python3}" -m gepo_sampler
  --gateway "$GATEWAY_URL" --name "$SAMPLER_NAME" --public-key "$RELAY_PUBLIC_KEY"
  --storage-options "${STORAGE_OPTIONS:-{\}}"
)
if [[ -n "${VLLM_URL:-}" ]]; then
  command+=(--vllm-url "$VLLM_URL")
else
  command+=(--model "${MODEL_PATH:-Qwen/Qwen3-1.7B}" --max-model-len "${MAX_MODEL_LEN:-2816}" --dtype "${DTYPE:-bfloat16}")
fi
if [[ -n "${CA_CERT:-}" ]]; then command+=(--ca-cert "$CA_CERT"); fi
if [[ -n "${RELAY_URL:-}" ]]; then command+=(--relay-url "$RELAY_URL"); fi
command+=("$@")
if [[ "$print_only" == "1" ]]; then
  printf '%q ' "${command[@]}"
  echo
else
  exec "${command[@]}"
fi
