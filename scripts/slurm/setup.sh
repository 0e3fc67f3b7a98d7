#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests/test_slurm_e2e.py: munge, MariaDB + slurmdbd (so `sacct`
# answers), slurmctld, and one slurmd per node, each node in its own network namespace (own address 10.77.0.<i>,
# own loopback, so every node's Ray binds its default ports as on separate machines) joined by a bridge that the
# controller listens on, and with its own /tmp/ray (Ray's default session folder, per machine as on separate machines:
# two nodes joining at once through one shared folder time out). Everything else is the shared file system, the
# repository and the jobs' files included, wherever they lie (/tmp too).
# Debian's packages (slurm-wlm 22.05, munge, slurmdbd, MariaDB) are installed with apt-get.
#
# Idempotent: a second run with the same settings finds everything up and does nothing; different settings restart
# the Slurm daemons with the new configuration. Needs root (network namespaces, daemons) and apt-get (or the
# packages already installed). Prints the environment a client needs (SLURM_CONF=...) as its last line.
#
# Environment variables (defaults in brackets):
#   GEPO_SLURM_NODES [3]  nodes n1..nN         GEPO_SLURM_GPUS [1]  GRES gpus per node (stand-in device files)
#   GEPO_SLURM_CPUS [64]  CPUs each node declares (SlurmdParameters=config_overrides: more than the machine has)
#   GEPO_SLURM_DIR [/var/lib/gepo-slurm]  configuration, state, logs, the database and the nodes' /tmp/ray
# Undo with scripts/slurm/teardown.sh.
set -euo pipefail

NODES="${GEPO_SLURM_NODES:-3}"
GPUS="${GEPO_SLURM_GPUS:-1}"
CPUS="${GEPO_SLURM_CPUS:-64}"
DIR="${GEPO_SLURM_DIR:-/var/lib/gepo-slurm}"
BRIDGE=br-gepo-slurm
SUBNET=10.77.0
CONTROLLER_IP="$SUBNET.254"
CONF="$DIR/etc/slurm.conf"
DB_SOCKET=/run/mysqld/mysqld.sock # where slurmdbd's MySQL client looks for StorageHost=localhost

say() { echo "[slurm setup] $*" >&2; }

if ((EUID != 0)); then
  echo "scripts/slurm/setup.sh needs root (network namespaces and system daemons)" >&2
  exit 2
fi

# ---------------------------------------------------------------- packages
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server-core mariadb-client-core iproute2)
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null ||
  ! command -v munged >/dev/null || ! command -v ip >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "Slurm is not installed and apt-get is unavailable: install ${PACKAGES[*]}" >&2
    exit 3
  fi
  say "installing ${PACKAGES[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
fi

# alive PIDFILE: the process named in PIDFILE runs (PID 1 here may not reap, so a zombie counts as dead)
alive() {
  local pid state
  [[ -f "$1" ]] || return 1
  pid="$(cat "$1")"
  [[ -n "$pid" && -r "/proc/$pid/stat" ]] || return 1
  state="$(awk '{print $3}' "/proc/$pid/stat")"
  [[ "$state" != Z ]]
}

# wait_for WHAT SECONDS COMMAND...: polls COMMAND until it succeeds
wait_for() {
  local what="$1" limit="$2"
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "scripts/slurm/setup.sh: $what did not come up within ${limit}s; logs in $DIR/log" >&2
      exit 1
    fi
    sleep 0.5
  done
}

mkdir -p "$DIR"/{etc,state,log,spool,run,db}
chmod 755 "$DIR"

# ---------------------------------------------------------------- munge
if ! alive /run/munge/munged.pid; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  say "starting munged"
  if id munge >/dev/null 2>&1; then runuser -u munge -- munged; else munged --force; fi
  wait_for munged 30 bash -c 'munge -n | unmunge'
fi

# ---------------------------------------------------------------- the network: one namespace per node
ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
ip addr show dev "$BRIDGE" | grep -q "$CONTROLLER_IP/24" || ip addr add "$CONTROLLER_IP/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for ((i = 1; i <= NODES; i++)); do
  ns="n$i"
  if ! ip netns list | grep -qw "$ns"; then
    ip netns add "$ns"
  fi
  if ! ip link show "veth-$ns" >/dev/null 2>&1; then
    ip link add "veth-$ns" type veth peer name eth0 netns "$ns"
    ip link set "veth-$ns" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  fi
done

# ---------------------------------------------------------------- configuration
node_lines=""
for ((i = 1; i <= NODES; i++)); do
  node_lines+="NodeName=n$i NodeAddr=$SUBNET.$i CPUs=$CPUS RealMemory=1000 Gres=gpu:$GPUS State=UNKNOWN"$'\n'
done
new_conf="$(
  cat <<EOF
# written by scripts/slurm/setup.sh (each node n<i> in network namespace n<i> with its own /tmp/ray)
ClusterName=gepo
SlurmctldHost=$(hostname -s)($CONTROLLER_IP)
MailProg=/bin/true
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)"
# Slurm counts a node's GPUs from device files: stand-ins for them (each a copy of /dev/null's character device), so
# that --gpus-per-node is allocated, read back and exported (CUDA_VISIBLE_DEVICES) as on a GPU node.
# nvidia_gpu_env: as an NVIDIA node (AutoDetect=nvml), Slurm exports CUDA_VISIBLE_DEVICES only (without a flag it
# also exports ROCR_VISIBLE_DEVICES, which verl's workers refuse beside CUDA_VISIBLE_DEVICES)
for ((g = 0; g < GPUS; g++)); do
  [[ -c "/dev/gepo-slurm-gpu$g" ]] || mknod "/dev/gepo-slurm-gpu$g" c 1 3
done
new_gres="$(printf 'AutoDetect=off\nName=gpu File=/dev/gepo-slurm-gpu[0-%s] Flags=nvidia_gpu_env' "$((GPUS - 1))")"
restart=0
# install_file PATH CONTENT: writes CONTENT to PATH when it differs (then the Slurm daemons restart below)
install_file() {
  if [[ ! -f "$1" ]] || [[ "$(cat "$1")" != "$2" ]]; then
    echo "$2" >"$1"
    restart=1
  fi
}
install_file "$CONF" "$new_conf"
install_file "$DIR/etc/gres.conf" "$new_gres"
cat >"$DIR/etc/slurmdbd.conf" <<EOF
# written by scripts/slurm/setup.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=gepo_slurm_acct
EOF
chmod 600 "$DIR/etc/slurmdbd.conf"
export SLURM_CONF="$CONF"

# ---------------------------------------------------------------- the accounting database (MariaDB) and slurmdbd
if ! alive "$DIR/run/mariadb.pid"; then
  if [[ ! -d "$DIR/db/mysql" ]]; then
    say "creating the accounting database"
    mariadb-install-db --user=root --datadir="$DIR/db" --auth-root-authentication-method=socket >/dev/null
  fi
  mkdir -p /run/mysqld
  say "starting mariadbd"
  setsid mariadbd --user=root --datadir="$DIR/db" --socket="$DB_SOCKET" --pid-file="$DIR/run/mariadb.pid" \
    --skip-networking --log-error="$DIR/log/mariadb.log" </dev/null >/dev/null 2>&1 &
  wait_for mariadbd 60 mariadb --socket="$DB_SOCKET" -e "select 1"
fi
if ! alive "$DIR/run/slurmdbd.pid"; then
  say "starting slurmdbd"
  slurmdbd
  wait_for slurmdbd 60 sacctmgr -i show cluster
fi
if ! sacctmgr -n -P show cluster format=cluster | grep -qx gepo; then
  sacctmgr -i add cluster gepo >/dev/null
fi

# ---------------------------------------------------------------- slurmctld and the node daemons
if ((restart)); then
  say "configuration changed: restarting the Slurm daemons"
  pkill -x slurmctld || true
  pkill -x slurmd || true
  sleep 1
fi
if ! alive "$DIR/run/slurmctld.pid"; then
  say "starting slurmctld"
  slurmctld -c -i
  wait_for slurmctld 60 scontrol ping
fi
for ((i = 1; i <= NODES; i++)); do
  if ! alive "$DIR/run/slurmd-n$i.pid"; then
    say "starting slurmd n$i ($SUBNET.$i)"
    mkdir -p "$DIR/nodes/n$i/ray" /tmp/ray
    chmod 1777 "$DIR/nodes/n$i/ray" /tmp/ray
    # its own mount namespace with its own /tmp/ray; nsenter, not `ip netns exec`, which remounts /sys for the namespace
    # and hides the cgroup mounts slurmd needs
    unshare --mount --propagation private \
      bash -c 'mount --bind "$1" /tmp/ray && exec nsenter --net="$2" slurmd -N "$3"' _ "$DIR/nodes/n$i/ray" \
      "/run/netns/n$i" "n$i"
  fi
done
# ready: every node idle; a node drained by an earlier configuration (e.g. fewer GPUs) is resumed once it registered
ready() {
  local drained
  drained="$(sinfo -h -N -t drain -o '%N' | sort -u | paste -sd, -)"
  if [[ -n "$drained" ]]; then scontrol update nodename="$drained" state=resume >/dev/null 2>&1 || true; fi
  [[ "$(sinfo -h -N -o '%N %t' | awk '$2 == "idle"' | sort -u | wc -l)" == "$NODES" ]]
}
wait_for "$NODES idle nodes" 90 ready
say "up: $NODES nodes ($GPUS GPU(s), $CPUS CPUs each), controller $CONTROLLER_IP; SLURM_CONF=$CONF"
echo "SLURM_CONF=$CONF"
