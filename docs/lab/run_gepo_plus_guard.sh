#!/usr/bin/env bash
# GEPO+, the staleness guard and the cost of dropping, decided over paired seeds (the README's "GEPO+ and the guard
# over 20 paired seeds"). The settings were fixed here before any of these runs:
#   * the lab's `paper` preset defaults, 400 updates, max lag 0 and 64, seeds 0-19 (the setting of docs/lab/seeds20,
#     whose gepo, gspo and grpo runs are reused: the simulation is deterministic, and a check run of seed 0 must
#     reproduce them before they are);
#   * methods gepo_plus (hard) and gepo_plus_soft at lags 0 and 64 (the authors' threshold 0.002);
#   * at lag 64: grpo and gepo with the guard on (defaults: min_ess 0.5, relax_ess 0.8, patience 2, floor 1), against
#     the same methods without it from docs/lab/seeds20;
#   * then the harsh setting (lr 3e-3, otherwise the same) for gepo_plus, gepo_plus_soft, gepo, gspo at lags 0 and 64
#     and grpo/gepo with and without the guard at lag 64, for as many seeds as the session allows (the count is
#     reported).
# Paired differences with 95% Student-t intervals and exact sign tests (`gepo-lab paired`).
# Usage: bash docs/lab/run_gepo_plus_guard.sh [main|harsh]   (PRINT_ONLY=1 prints the commands)
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
harsh=("$LAB" "${COMMON[@]}" --lr 3e-3 --methods gepo_plus gepo_plus_soft gepo gspo grpo --lags 0 64)
harsh_guard=("$LAB" "${COMMON[@]}" --lr 3e-3 --methods gepo grpo --lags 64 --guard-enable)
stage="${1:-main}"
if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
  for command in check_a check_b plus_hard plus_soft guard_gepo guard_grpo harsh harsh_guard; do
    declare -n words="$command"
    printf '%q ' "${words[@]}"
    printf '\n'
  done
  exit 0
fi
if [[ "$stage" == main ]]; then
  { time "${check_a[@]}"; time "${plus_hard[@]}"; time "${guard_gepo[@]}"; } > "$OUT.process1.$SUFFIX.log" 2>&1 &
  { time "${check_b[@]}"; time "${plus_soft[@]}"; time "${guard_grpo[@]}"; } > "$OUT.process2.$SUFFIX.log" 2>&1 &
  wait
else
  seeds="${HARSH_SEEDS:-0 1 2 3 4}"
  # shellcheck disable=SC2086
  { time "${harsh[@]}" --seeds $seeds --out "$OUT/harsh"; } > "$OUT.harsh1.log" 2>&1 &
  # shellcheck disable=SC2086
  { time "${harsh_guard[@]}" --seeds $seeds --out "$OUT/harsh_guard"; } > "$OUT.harsh2.log" 2>&1 &
  wait
fi
