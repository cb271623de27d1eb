#!/usr/bin/env bash
# A real, single-host SLURM cluster for the tests: one slurmctld and two slurmd "nodes" (n1, n2) on
# this machine, each declaring 8 CPUs whatever the host has. Debian/Ubuntu, as root (or via sudo).
#
#   slurm/test-cluster.sh start    install (apt) if needed, configure, start, wait until both nodes are idle
#   slurm/test-cluster.sh stop     stop the daemons, remove what start added (config, sacct stand-in, hosts)
#   slurm/test-cluster.sh status   sinfo
#   slurm/test-cluster.sh report   nodes with their reasons, every job, the daemons' recent errors
#
# Never touches a slurm.conf it did not write: a machine with a real SLURM is left alone.
set -euo pipefail

STATE=/var/lib/fldp-slurm                  # spool, state, logs, pid files
CONF=/etc/slurm/slurm.conf
SACCT=/usr/bin/sacct                       # the real one is diverted to sacct.real while the cluster is up
MARK="# fldp test cluster"                 # marks every file and line this script owns
NODES=(n1 n2)
PORTS=(17001 17002)

if [ "$(id -u)" != 0 ]; then exec sudo -- bash "$0" "$@"; fi

log() { echo "test-cluster: $*" >&2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    log "$CONF exists and is not ours: refusing to replace a real SLURM configuration"; exit 1
  fi
  mkdir -p "$STATE"/{ctld,log} /etc/slurm
  local host; host=$(hostname -s)
  cat >"$CONF" <<EOF
$MARK: written by slurm/test-cluster.sh, removed by "slurm/test-cluster.sh stop"
ClusterName=fldp-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# no cgroups in containers: track processes by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# jobs start within a second of submission
SchedulerParameters=batch_sched_delay=0
# impossible requests (too many nodes or CPUs) fail at submission instead of pending forever
EnforcePartLimits=ALL
# no accounting database: finished jobs stay visible to squeue (read by the sacct stand-in) for a day
MinJobAge=86400
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
InactiveLimit=0
# a node may declare more CPUs than the host has (8 per node on a 2-core machine)
SlurmdParameters=config_overrides
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=${PORTS[0]} CPUs=8 RealMemory=4000 State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=${PORTS[1]} CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
  # node names resolve here (MASTER_ADDR is the allocation's first node name)
  if ! grep -qF "$MARK" /etc/hosts; then
    echo "127.0.0.1 ${NODES[*]} $MARK" >>/etc/hosts
  fi
  # submitit polls `sacct`; without accounting the real one fails and a dead job would be waited on
  # forever. This stand-in answers from `squeue -t all` in sacct's --parsable2 format. It replaces
  # the real sacct in place (a dpkg diversion, undone by stop), so whatever PATH a caller has finds it.
  if ! grep -qF "$MARK" "$SACCT" 2>/dev/null; then
    dpkg-divert --local --rename --divert "$SACCT.real" --add "$SACCT" >/dev/null
  fi
  cat >"$SACCT" <<'EOF'
#!/bin/sh
# fldp test cluster: sacct stand-in (no accounting database); job states from `squeue -t all`.
ids=""
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) ids="$ids ${2:-}"; shift 2 || shift ;;
    -j*) ids="$ids ${1#-j}"; shift ;;
    --jobs=*) ids="$ids ${1#--jobs=}"; shift ;;
    *) shift ;;
  esac
done
echo "JobID|State|NodeList"
if [ -z "$ids" ]; then
  exec squeue -h -r -t all -o '%i|%T|%N'
fi
for id in $(echo "$ids" | tr ',' ' '); do
  squeue -h -r -t all -j "$id" -o '%i|%T|%N' 2>/dev/null || true
done
EOF
  chmod 755 "$SACCT"
}

running() {  # $1: pid file of a live process (no procps on slim images: no pgrep)
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  munge -n >/dev/null 2>&1 && return   # a munged answers already
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null;
                                   chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/munged.ours"   # stop ends only a munged that start started
}

start() {
  install_packages
  write_config
  start_munge
  running "$STATE/slurmctld.pid" || slurmctld
  local n
  for n in "${NODES[@]}"; do
    mkdir -p "$STATE/$n"
    running "$STATE/slurmd-$n.pid" || slurmd -N "$n"
  done
  # ready when both nodes are idle (ReturnToService=2 brings them up as they register)
  for _ in $(seq 60); do
    if [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" = "${#NODES[@]}" ]; then
      log "up: $(sinfo -h -o '%P %D nodes %C (alloc/idle/other/total CPUs)')"; return
    fi
    sleep 1
  done
  log "nodes did not become idle in 60 s:"; sinfo -N -l >&2 || true
  tail -20 "$STATE"/log/*.log >&2 || true
  exit 1
}

stop_pid() {  # $1: pid file; SIGTERM, then SIGKILL after 10 s
  [ -s "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    log "$CONF is not ours: nothing to stop"; return
  fi
  scancel --user=root --full 2>/dev/null || true   # jobs first, so no step outlives its slurmd
  local n
  for n in "${NODES[@]}"; do stop_pid "$STATE/slurmd-$n.pid"; done
  stop_pid "$STATE/slurmctld.pid"
  # a munged that was already running is left alone: other software on the host may use it
  [ -e "$STATE/munged.ours" ] && stop_pid /run/munge/munged.pid
  rm -f "$CONF"
  if grep -qF "$MARK" "$SACCT" 2>/dev/null; then
    rm -f "$SACCT"
    dpkg-divert --local --rename --remove "$SACCT" >/dev/null
  fi
  if grep -qF "$MARK" /etc/hosts; then
    grep -vF "$MARK" /etc/hosts >/etc/hosts.fldp && cat /etc/hosts.fldp >/etc/hosts && rm -f /etc/hosts.fldp
  fi
  rm -rf "$STATE"
  log "stopped"
}

report() {  # what a failed test run needs to know about the cluster, before stop removes the logs
  echo "--- test cluster: nodes ---"; sinfo -N -o '%N %T %E' 2>&1 || true
  echo "--- test cluster: jobs (newest 20) ---"; squeue -t all -o '%i %j %T %r %M %Z' 2>&1 | tail -20 || true
  echo "--- test cluster: daemons' errors (last 20) ---"
  grep -hiE 'drain|not responding|kill task|unkillable|error' "$STATE"/log/*.log 2>/dev/null \
    | grep -viE 'pmix|MailProg|state file|Trying backup' | tail -20 || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo -N -l ;;
  report) report ;;
  *) echo "usage: $0 start|stop|status|report" >&2; exit 2 ;;
esac
