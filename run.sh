#!/usr/bin/env bash
# The main job on its embedded default. Sets up .venv on first use.
# Today: the plugin's self-check and a one-step GEPO loss demo through verl's real ppo_loss.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
.venv/bin/python -m gepo_plugin doctor "$@"
.venv/bin/python -m gepo_plugin demo
