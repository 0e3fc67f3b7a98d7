#!/usr/bin/env bash
# GEPO+, the staleness guard and the cost of dropping, decided over paired seeds (the README's "GEPO+ and the guard
# over 20 paired seeds"). The settings were fixed here before any of these runs:
#   * the lab's `paper` preset defaults, 400 updates, max lag 0 and 64, seeds 0-19 (the setting of docs/lab/seeds20,
#     whose gepo, gspo and grpo runs are reused: the simulation is deterministic, and a check run of seed 0 must
#     reproduce them before they are);
#   * methods gepo_plus (hard) and gepo_plus_soft at lags 0 and 64 (the authors' threshold 0.002);
#   * at lag 64: grpo and gepo with the guard on (defaults: min_ess 0.5, relax_ess 0.8, patience 2, floor 1), against
#     the same methods without it from docs/lab/seeds20;
#   * then the harsh setting of docs/lab/harsh (lr 3e-3, the lab's default 200 updates, seeds 0-9; its gepo, gspo and
#     grpo runs are reused after the same seed-0 check): gepo_plus and gepo_plus_soft at lags 0 and 64, grpo and gepo
#     with the guard at lag 64, for as many seeds as the session allows (the count is reported).
#   (Changed before any harsh run: first written as 400 updates, which would have left no baseline to reuse.)
# Paired differences with 95% Student-t intervals and exact sign tests (`gepo-lab paired`).
# Usage: [SEEDS="0 1 ..."] bash docs/lab/run_gepo_plus_guard.sh [main|harsh|tables]   (PRINT_ONLY=1 prints the commands)
set -euo pipefail
cd "$(dirname "$0")/../.."
LAB="${LAB:-.venv/bin/gepo-lab}"
OUT=docs/lab/gepo_plus
SEEDS=(${SEEDS:-0 1 2 3 4 5 6 7 8 9})  # stage main ran 0-9 in the 180-minute session; SEEDS="10 ... 19" completes 20
SUFFIX="seeds${SEEDS[0]}-${SEEDS[-1]}"
COMMON=(stability --preset paper --rl-steps 400 --no-progress)
check_a=("$LAB" "${COMMON[@]}" --methods gepo gspo grpo --lags 0 --seeds 0 --out "$OUT/check_seed0_lag0")
check_b=("$LAB" "${COMMON[@]}" --methods gepo gspo grpo --lags 64 --seeds 0 --out "$OUT/check_seed0_lag64")
plus_hard=("$LAB" "${COMMON[@]}" --methods gepo_plus --lags 0 64 --seeds "${SEEDS[@]}" --out "$OUT/plus_hard_$SUFFIX")
plus_soft=("$LAB" "${COMMON[@]}" --methods gepo_plus_soft --lags 0 64 --seeds "${SEEDS[@]}" --out "$OUT/plus_soft_$SUFFIX")
guard_gepo=("$LAB" "${COMMON[@]}" --methods gepo --lags 64 --guard-enable --seeds "${SEEDS[@]}" --out "$OUT/guard_gepo_$SUFFIX")
guard_grpo=("$LAB" "${COMMON[@]}" --methods grpo --lags 64 --guard-enable --seeds "${SEEDS[@]}" --out "$OUT/guard_grpo_$SUFFIX")
HARSH=(stability --preset paper --lr 3e-3 --no-progress)
harsh_check=("$LAB" "${HARSH[@]}" --methods gepo gspo grpo --lags 64 --seeds 0 --out "$OUT/harsh_check_seed0")
harsh_plus=("$LAB" "${HARSH[@]}" --methods gepo_plus gepo_plus_soft --lags 0 64)
harsh_guard=("$LAB" "${HARSH[@]}" --methods gepo grpo --lags 64 --guard-enable)
stage="${1:-main}"
if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
  for command in check_a check_b plus_hard plus_soft guard_gepo guard_grpo harsh_check harsh_plus harsh_guard; do
    declare -n words="$command"
    printf '%q ' "${words[@]}"
    printf '\n'
  done
  exit 0
fi
if [[ "$stage" == main ]]; then
  if [[ " ${SEEDS[*]} " != *" 0 "* ]]; then check_a=(true) check_b=(true); fi  # the check is of seed 0
  { time "${check_a[@]}"; time "${plus_hard[@]}"; time "${guard_gepo[@]}"; } > "$OUT.process1.$SUFFIX.log" 2>&1 &
  { time "${check_b[@]}"; time "${plus_soft[@]}"; time "${guard_grpo[@]}"; } > "$OUT.process2.$SUFFIX.log" 2>&1 &
  wait
elif [[ "$stage" == tables ]]; then
  # every comparison against the reused runs of the same seeds (seeds20 part1 = seeds 0-9, part2 = 10-19)
  base=(docs/lab/seeds20/part1/stability_summary.json)
  [[ "${SEEDS[-1]}" -ge 10 ]] && base+=(docs/lab/seeds20/part2/stability_summary.json)
  runs=("${base[@]}" "$OUT"/{plus_hard,plus_soft,guard_gepo,guard_grpo}_seeds*/stability_summary.json)
  .venv/bin/python docs/lab/combined_table.py "${runs[@]}" | tee "$OUT/table.md"
  {
    "$LAB" paired "${runs[@]}" --a gepo_plus gepo_plus_soft --b gepo gspo --json "$OUT/paired_plus.json" \
      --png "$OUT/paired_plus.png"
    "$LAB" paired "${runs[@]}" --a gepo+guard --b gepo --json "$OUT/paired_guard_gepo.json" | tail -n +3
    "$LAB" paired "${runs[@]}" --a grpo+guard --b grpo --json "$OUT/paired_guard_grpo.json" | tail -n +3
  } | tee "$OUT/paired.md"
  harsh_runs=(docs/lab/harsh/stability_summary.json "$OUT"/harsh_{plus,guard}_seeds*/stability_summary.json)
  if compgen -G "$OUT/harsh_*_seeds*" > /dev/null; then
    .venv/bin/python docs/lab/combined_table.py "${harsh_runs[@]}" | tee "$OUT/harsh_table.md"
    {
      "$LAB" paired "${harsh_runs[@]}" --a gepo_plus gepo_plus_soft --b gepo gspo --json "$OUT/harsh_paired_plus.json" \
        --png "$OUT/harsh_paired_plus.png"
      "$LAB" paired "${harsh_runs[@]}" --a gepo+guard --b gepo | tail -n +3
      "$LAB" paired "${harsh_runs[@]}" --a grpo+guard --b grpo | tail -n +3
    } | tee "$OUT/harsh_paired.md"
  fi
else
  { time "${harsh_check[@]}"; time "${harsh_plus[@]}" --seeds "${SEEDS[@]}" --out "$OUT/harsh_plus_$SUFFIX"; } \
    > "$OUT.harsh1.$SUFFIX.log" 2>&1 &
  { time "${harsh_guard[@]}" --seeds "${SEEDS[@]}" --out "$OUT/harsh_guard_$SUFFIX"; } > "$OUT.harsh2.$SUFFIX.log" 2>&1 &
  wait
fi
