#!/usr/bin/env bash
# The test suite (what CI runs). Sets up .venv on first use; extra arguments go to pytest (one serial run).
# Without arguments: the sampler host's environment (.venv-host) set up beside .venv, ruff, then the suite in two
# phases: the tests that start no Ray cluster on both cores (pytest-xdist); then the Ray and end-to-end runs in two
# lanes at once (one worker each, the lanes of tests/conftest.py: LANES; each lane's runs one at a time, most
# joining one Ray cluster its session shares), and last the few that run alone (SOLO: timings of a second, or
# `ray stop`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
if [ "$#" -eq 0 ]; then
  # the sampler host's own environment (.venv-host: vLLM's newest CPU build, no Ray), which the remote end-to-end run
  # uses, is installed beside .venv's: pip installs on one core, so the two installs share the machine's two
  bash scripts/bootstrap_host.sh > .venv-host.log 2>&1 &
  host_env=$!
fi
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not ray and not e2e and not host_env" || status=$?
if ! wait "$host_env"; then
  cat .venv-host.log >&2
  exit 1
fi
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "(ray or e2e or host_env) and not solo" || status=$?
.venv/bin/python -m pytest -q -p no:cacheprovider -m "(ray or e2e) and solo" || status=$?
exit "$status"
