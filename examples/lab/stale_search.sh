#!/usr/bin/env bash
# The search for a lab setting where stale rollouts break GRPO or GSPO (and on-policy training does not): the
# sensitivity sweep's one-change variants, moved to long delays so that lags reach max lag 256, for grpo and gspo at
# max lags 0 and 256. Fixed before any run: delays log-normal on [64, 4096] simulated s (99.5% mass), 300 updates
# (lags cannot exceed the updates made), evaluation every 20 updates, seeds 0-1; varied one at a time: the learning
# rate (2e-3, 3e-3), the group size (4) and the task's difficulty (a in [0, 100): 4-digit answers). A setting
# qualifies when a method's last eval at max lag 256 falls well below its best while its lag-0 run keeps it.
#
# Run in this repository's CI as commands: tests/test_examples.py parses every command it prints (PRINT_ONLY=1) and
# runs examples/lab/sensitivity.sh, which it calls with these variables, in its quick form.
# Resources: CPU only, one torch thread per process, JOBS (2) variants at once. Measured on the 2-core machine:
# see docs/results.md (section "A harder setting").
#
#   bash examples/lab/stale_search.sh                  # all variants of the search
#   PRINT_ONLY=1 bash examples/lab/stale_search.sh     # the commands only
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
export OUT="${OUT:-$root/docs/lab/stale_search}"
export SEEDS="${SEEDS:-0 1}"
export METHODS="${METHODS:-grpo gspo}"
export LAGS="${LAGS:-0 256}"
export STEPS="${STEPS:-300}"
export COMMON="${COMMON:---delay-low 64 --delay-high 4096 --eval-every 20}"
if [ "$#" -eq 0 ]; then
  set -- base lr_2e-3 lr_3e-3 group_4 hard_task
fi
exec bash "$here/sensitivity.sh" "$@"
