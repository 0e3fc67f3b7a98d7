#!/usr/bin/env bash
# The stale-rollout comparison: GEPO against GEPO+, GSPO, GRPO, M2PO, GEPO with M2PO's mask (gepo_m2) and GEPO with
# verl's sequence-level truncated importance sampling (gepo+decoupled_seq_is), at max lags 0, 64 and 256, over
# paired seeds, in the setting examples/lab/stale_search.sh found (its `base`: the `paper` preset's defaults with
# weight delays log-normal on [64, 4096] simulated s, 300 updates, evaluation every 20).
#
# Every seed is one task per group of runs (the plain methods; GEPO with verl's correction), written to
# $OUT/<group>/seed_<n>/; a task whose summary exists is skipped, so an interrupted comparison resumes where it
# stopped and more seeds can be added later. JOBS tasks run at once. At the end `gepo-lab paired` pairs every
# seed present: $OUT/paired_{last,best,gap}.md (GEPO minus each method: mean, 95% CI, sign test),
# $OUT/intervals.md (each method's best, last and best - last with 95% intervals) and $OUT/staleness.png (last eval
# against max lag, one line per method with its interval). A control, CONTROL_METHODS (grpo, gspo) with the same
# correction at max lags 64 and 256 over CONTROL_SEEDS (0-2; empty: none), goes to $OUT/control_<correction>/:
# is a collapse under the correction GEPO's, or the decoupled mode's?
#
# Run in this repository's CI in its quick form (one seed, two methods, lags 0 and 8, 4 updates: tests/test_examples.py).
# Resources: CPU only, one torch thread per process. Measured on the 2-core machine with JOBS=2: about 60 s per
# 300-update run, 24 runs per seed (so about 12 minutes per seed); docs/results.md has the numbers.
#
#   bash examples/lab/stale_comparison.sh                        # seeds 0-19
#   SEEDS="20 21" bash examples/lab/stale_comparison.sh          # add seeds; the report covers all present
#   PRINT_ONLY=1 bash examples/lab/stale_comparison.sh           # the commands only
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python_bin="${PYTHON:-$root/.venv/bin/python}"
OUT="${OUT:-$root/docs/lab/stale_comparison}"
SEEDS="${SEEDS:-$(seq -s ' ' 0 19)}"
JOBS="${JOBS:-2}"
METHODS="${METHODS:-gepo gepo_plus gspo grpo m2po gepo_m2}"
CORRECTION="${CORRECTION:-decoupled_seq_is}"
LAGS="${LAGS:-0 64 256}"
STEPS="${STEPS:-300}"
SETTING="${SETTING:---preset paper --delay-low 64 --delay-high 4096 --eval-every 20}"
CONTROL_METHODS="${CONTROL_METHODS:-grpo gspo}"
CONTROL_SEEDS="${CONTROL_SEEDS-0 1 2}"

tasks=()
for seed in $SEEDS; do
  # shellcheck disable=SC2086  # the lists and SETTING split into words
  common="-m gepo_plugin.lab stability $SETTING --lags $LAGS --seeds $seed --rl-steps $STEPS --no-progress"
  tasks+=("plain/seed_$seed|$common --methods $METHODS")
  tasks+=("$CORRECTION/seed_$seed|$common --methods gepo --rollout-correction $CORRECTION")
done
if [ -n "$CONTROL_SEEDS" ]; then
  for method in $CONTROL_METHODS; do
    tasks+=("control_$CORRECTION/$method|-m gepo_plugin.lab stability $SETTING --lags 64 256 --seeds $CONTROL_SEEDS \
--rl-steps $STEPS --no-progress --methods $method --rollout-correction $CORRECTION")
  done
fi
if [ "${PRINT_ONLY:-0}" = "1" ]; then
  for task in "${tasks[@]}"; do
    echo "$python_bin ${task#*|} --out $OUT/${task%%|*}"
  done
  exit 0
fi

run_task() {  # $1: "<dir>|<arguments>"; skipped when its summary exists
  local dir="${1%%|*}" arguments="${1#*|}"
  if [ -f "$OUT/$dir/stability_summary.json" ]; then
    echo "present: $dir"
    return 0
  fi
  mkdir -p "$OUT/$dir"
  # shellcheck disable=SC2086  # the arguments split into words
  if "$python_bin" $arguments --out "$OUT/$dir" > "$OUT/$dir.log" 2>&1; then
    echo "done: $dir"
  else
    echo "FAILED: $dir (see $OUT/$dir.log)" >&2
    return 1
  fi
}
export -f run_task
export OUT python_bin
started=$(date +%s)
status=0
printf '%s\0' "${tasks[@]}" | xargs -0 -P "$JOBS" -I{} bash -c 'run_task "$1"' _ {} || status=1

mapfile -t summaries < <(for group in plain "$CORRECTION"; do
  find "$OUT/$group" -name stability_summary.json -path '*/seed_*' 2>/dev/null | sort -V
done)
others=()
for method in $METHODS "gepo+$CORRECTION"; do
  [ "$method" = gepo ] || others+=("$method")
done
paired=("$python_bin" -m gepo_plugin.lab paired "${summaries[@]}" --a gepo --b "${others[@]}")
"${paired[@]}" --json "$OUT/paired_last.json" --intervals "$OUT/intervals.md" \
  --staleness-png "$OUT/staleness.png" | tee "$OUT/paired_last.md"
"${paired[@]}" --metric best_eval | tee "$OUT/paired_best.md"
"${paired[@]}" --metric best_to_last_gap | tee "$OUT/paired_gap.md"
cat "$OUT/intervals.md"
echo "total $(( $(date +%s) - started )) s; ${#summaries[@]} summaries; outputs in $OUT" >&2
exit "$status"
