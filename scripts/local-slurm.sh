#!/usr/bin/env bash
# A single-node Slurm cluster on loopback, for the launch tests: start | stop | status.
# Idempotent. Installs Debian's slurmctld/slurmd/slurm-client when missing (needs root).
# Uses AuthType=auth/none (fine on a test VM, never on a shared machine), so munged is not needed.
set -euo pipefail
CONF=/etc/slurm/slurm.conf
CPUS="${LOCAL_SLURM_CPUS:-8}"
export SLURM_CONF="$CONF"

ready() { [ "$(sinfo -h -o %T 2>/dev/null | head -1)" = idle ] || [ "$(sinfo -h -o %T 2>/dev/null | head -1)" = mixed ]; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS CMD...
    local end=$(( $(date +%s) + $1 )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -ge "$end" ] && return 1
        sleep 0.2
    done
}

start() {
    [ "$(id -u)" = 0 ] || { echo "local-slurm.sh start needs root" >&2; exit 1; }
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null
    fi
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    local mem
    mem=$(awk '/MemTotal/ {printf "%d", $2/1024 - 1024}' /proc/meminfo)
    cat > "$CONF.new" <<CONFIG
ClusterName=meshtrain
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job may start once its old credential has expired (default 120 s): short for the tests.
AuthInfo=cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONFIG
    if ! cmp -s "$CONF.new" "$CONF"; then
        mv "$CONF.new" "$CONF"
        stop_daemons
    else
        rm "$CONF.new"
    fi
    alive /run/slurmctld.pid || slurmctld -i
    alive /run/slurmd.pid || slurmd -N localhost
    wait_for 60 scontrol ping || { tail -20 /var/log/slurm/slurmctld.log >&2; exit 1; }
    if ! wait_for 60 ready; then
        scontrol update nodename=localhost state=resume || true
        wait_for 30 ready || { sinfo >&2; tail -20 /var/log/slurm/slurmd.log >&2; exit 1; }
    fi
}

stop_daemons() {
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        if alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
    done
    sleep 0.5
}

case "${1:-}" in
    start) start ;;
    stop) squeue -h -o %i 2>/dev/null | xargs -r scancel || true; stop_daemons ;;
    status) ready ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
