#!/usr/bin/env bash
# The lab's sensitivity sweep: does the ordering at max lag 64 (GEPO vs GSPO vs GRPO) depend on the
# learning rate, the group size, the clip range, the delay distribution or the training length?
#
# Each variant changes ONE setting of the `paper` preset's defaults (lr 1e-3, G 8, clip 0.2, delays
# log-normal on [4, 256] simulated s, 200 updates) and runs METHODS (gepo, gspo and grpo) at LAGS (max lag 64)
# over SEEDS seeds; COMMON adds options to every variant (the stale-setting search, examples/lab/stale_search.sh,
# moves the base this way). Outputs: $OUT/<variant>/ (the usual stability files) and $OUT/sensitivity.md.
#
# Run in this repository's CI in its quick form (two variants, one method and seed, 4 updates: tests/test_examples.py).
# Resources: CPU only, one torch thread per process; JOBS variants run at once (default 2).
# Measured on a 2-core machine with JOBS=2: about 40 minutes for the 8 variants x 3 methods x 3 seeds.
#
#   bash examples/lab/sensitivity.sh                     # all variants
#   SEEDS="0 1" OUT=/tmp/sens bash examples/lab/sensitivity.sh base lr_3e-3
#   PRINT_ONLY=1 bash examples/lab/sensitivity.sh        # print the commands, run nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python_bin="${PYTHON:-$root/.venv/bin/python}"
OUT="${OUT:-$root/docs/lab/sensitivity}"
SEEDS="${SEEDS:-0 1 2}"
JOBS="${JOBS:-2}"
METHODS="${METHODS:-gepo gspo grpo}"
STEPS="${STEPS:-200}"
LAGS="${LAGS:-64}"
COMMON="${COMMON:-}"

declare -A VARIANTS=(
  [base]=""
  [lr_3e-3]="--lr 3e-3"
  [lr_3e-4]="--lr 3e-4"
  [lr_2e-3]="--lr 2e-3"
  [group_4]="--group-size 4"
  [group_16]="--group-size 16"
  [clip_0.1]="--clip 0.1"
  [clip_0.4]="--clip 0.4"
  [long_delays]="--delay-low 32 --delay-high 2048"
  [steps_400]="--rl-steps 400"
  [hard_task]="--max-a 100"
)
ORDER=(base lr_3e-3 lr_3e-4 group_4 group_16 clip_0.1 clip_0.4 long_delays steps_400)
if [ "$#" -gt 0 ]; then
  ORDER=("$@")
fi
for name in "${ORDER[@]}"; do
  if [ -z "${VARIANTS[$name]+set}" ]; then
    echo "unknown variant '$name'; choose from: ${!VARIANTS[*]}" >&2
    exit 2
  fi
done

build_command() {  # sets cmd: the lab command of variant $1
  # shellcheck disable=SC2206  # METHODS, LAGS, SEEDS, COMMON and the variant's options split into words
  cmd=("$python_bin" -m gepo_plugin.lab stability --preset paper --methods $METHODS --lags $LAGS --seeds $SEEDS
    --rl-steps "$STEPS" --no-progress $COMMON ${VARIANTS[$1]} --out "$OUT/$1")
}
if [ "${PRINT_ONLY:-0}" = "1" ]; then
  for name in "${ORDER[@]}"; do
    build_command "$name"
    printf '%q ' "${cmd[@]}"
    echo
  done
  exit 0
fi

mkdir -p "$OUT"
run_variant() {
  local name="$1"
  build_command "$name"
  "${cmd[@]}" > "$OUT/$name.log" 2>&1 \
    && echo "done: $name" || { echo "FAILED: $name (see $OUT/$name.log)" >&2; return 1; }
}
started=$(date +%s)
status=0
running=0
for name in "${ORDER[@]}"; do
  run_variant "$name" &  # a forked subshell: sees VARIANTS and the settings
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done

"$python_bin" - "$OUT" "${ORDER[@]}" <<'EOF'
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
lines = [
    "| variant | method | max lag | best eval | last eval | best - last | IW var (own weight) | KL(learner, sampler) "
    "| lag mean |",
    "|---|---|---|---|---|---|---|---|---|",
]
for name in names:
    path = out / name / "stability_summary.json"
    if not path.exists():
        lines.append(f"| {name} | (no result) | | | | | | | |")
        continue
    for row in json.loads(path.read_text())["aggregate"]:
        def pm(key, row=row):
            return f"{row[key + '_mean']:.3f} ± {row[key + '_std']:.3f}"
        lines.append(
            f"| {name} | {row['method']} | {row['max_lag']} | {pm('best_eval')} | {pm('last_eval')} | {pm('best_to_last_gap')} "
            f"| {row['iw_var_mean_mean']:.3g} | {row['kl_mean_mean']:.3g} | {row['lag_mean']:.1f} |"
        )
(out / "sensitivity.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "total $(( $(date +%s) - started )) s; tables in $OUT/sensitivity.md" >&2
exit "$status"
