#!/usr/bin/env bash
# The main job on its embedded default: the CPU lab's `quick` stability comparison
# (GEPO vs GSPO vs GRPO at max lag 0 and 64, 2 seeds; about 4 minutes on 2 cores).
# Sets up .venv on first use; extra arguments go to `gepo-lab stability` (try --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
.venv/bin/python -m gepo_plugin.lab stability --preset quick --out lab_out/quick "$@"
