#!/usr/bin/env bash
# Build the documentation site into docs/_build/html (open docs/_build/html/index.html), as CI and Read the Docs do:
# warnings are errors, every cross-reference is checked (-n), nothing is fetched from the network.
# Sets up .venv on first use; extra arguments go to sphinx-build (e.g. -b linkcheck is not offline: don't).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
.venv/bin/python -m sphinx -E -W -n --keep-going -q docs docs/_build/html "$@"
echo "docs: $root/docs/_build/html/index.html"
