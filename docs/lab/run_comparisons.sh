#!/usr/bin/env bash
# The lab's measurements on the shared HeteroRL core, as run for the README (two processes on a 2-core machine).
# The settings were fixed before any of these runs: the `paper` preset's defaults; 400 updates (the length at which
# the earlier 5-seed comparison showed staleness effects grow); lags 0 and 64; 20 paired seeds; and one harsh
# setting, lr 3e-3 (the variant of the earlier sensitivity sweep in which GRPO collapsed), over 10 seeds.
# Usage: bash docs/lab/run_comparisons.sh   (PRINT_ONLY=1 prints the commands)
set -euo pipefail
cd "$(dirname "$0")/../.."
LAB="${LAB:-.venv/bin/gepo-lab}"
COMMON=(stability --preset paper --methods gepo gspo grpo --lags 0 64 --no-progress)
first=("$LAB" "${COMMON[@]}" --rl-steps 400 --seeds 0 1 2 3 4 5 6 7 8 9 --out docs/lab/seeds20/part1)
second=("$LAB" "${COMMON[@]}" --rl-steps 400 --seeds 10 11 12 13 14 15 16 17 18 19 --out docs/lab/seeds20/part2)
harsh=("$LAB" "${COMMON[@]}" --lr 3e-3 --seeds 0 1 2 3 4 5 6 7 8 9 --out docs/lab/harsh)
paper=("$LAB" stability --preset paper --no-progress --out docs/lab/paper)
if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
  for command in first second harsh paper; do
    declare -n words="$command"
    printf '%q ' "${words[@]}"
    printf '\n'
  done
  exit 0
fi
{ time "${first[@]}"; time "${harsh[@]}"; } > docs/lab/process1.log 2>&1 &
{ time "${second[@]}"; time "${paper[@]}"; } > docs/lab/process2.log 2>&1 &
wait
"$LAB" paired docs/lab/seeds20/part1/stability_summary.json docs/lab/seeds20/part2/stability_summary.json \
  --a gepo --b gspo grpo --json docs/lab/seeds20/paired.json | tee docs/lab/seeds20/paired.md
"$LAB" paired docs/lab/seeds20/part1/stability_summary.json docs/lab/seeds20/part2/stability_summary.json \
  --a gepo --b gspo grpo --metric best_to_last_gap | tee docs/lab/seeds20/paired_gap.md
.venv/bin/python docs/lab/combined_table.py docs/lab/seeds20/part1/stability_summary.json \
  docs/lab/seeds20/part2/stability_summary.json | tee docs/lab/seeds20/table.md
"$LAB" paired docs/lab/harsh/stability_summary.json --a gepo --b gspo grpo --json docs/lab/harsh/paired.json \
  | tee docs/lab/harsh/paired.md
