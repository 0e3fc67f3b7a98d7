#!/usr/bin/env bash
# Stops what scripts/slurm/setup.sh started: every job, the node daemons, slurmctld, slurmdbd, MariaDB, the nodes'
# network namespaces and the bridge (munge is left running: other software may use it). --purge also deletes
# GEPO_SLURM_DIR [/var/lib/gepo-slurm] (configuration, state, logs, the database). Safe to run when nothing is up.
set -euo pipefail
DIR="${GEPO_SLURM_DIR:-/var/lib/gepo-slurm}"
BRIDGE=br-gepo-slurm
export SLURM_CONF="$DIR/etc/slurm.conf"

if [[ -f "$SLURM_CONF" ]] && command -v scancel >/dev/null; then
  scancel --full --signal=KILL --state=RUNNING --partition=debug >/dev/null 2>&1 || true
fi
# stop_pidfile FILE: the daemon whose pid FILE holds (TERM, then KILL after 10 s)
stop_pidfile() {
  local pid
  [[ -f "$1" ]] || return 0
  pid="$(cat "$1")"
  [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 20); do
    kill -0 "$pid" 2>/dev/null || return 0
    [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] && return 0
    sleep 0.5
  done
  kill -9 "$pid" 2>/dev/null || true
}
for pidfile in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid" "$DIR/run/mariadb.pid"; do
  [[ -e "$pidfile" ]] && stop_pidfile "$pidfile"
done
rm -f "$DIR"/run/*.pid

for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^n[0-9]+$/ {print $1}'); do
  ip link delete "veth-$ns" 2>/dev/null || true
  ip netns delete "$ns"
done
ip link delete "$BRIDGE" 2>/dev/null || true
if [[ "${1:-}" == "--purge" ]]; then
  rm -rf "$DIR"
fi
echo "[slurm teardown] done"
