#!/usr/bin/env bash
# A single-node Son of Grid Engine on this machine, for the launch tests: start | stop | status.
# Idempotent; installs Debian's gridengine packages when missing (needs root). Queue all.q with
# 8 slots and parallel environments smp ($pe_slots) and mpi ($fill_up).
set -euo pipefail
export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
COMMON=$SGE_ROOT/$SGE_CELL/common
QMASTER_PID=/var/spool/gridengine/qmaster/qmaster.pid
EXECD_PID=/var/spool/gridengine/execd/localhost/execd.pid
HOST=$(hostname)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS CMD...
    local end=$(( $(date +%s) + $1 )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -ge "$end" ] && return 1
        sleep 0.3
    done
}
execd_ready() { qstat -f -q all.q 2>/dev/null | awk -v q="all.q@$HOST" '$1 == q && $4 != "-NA-" {ok = 1} END {exit !ok}'; }

configure_once() {
    [ -f "$COMMON/.meshtrain-configured" ] && return 0
    cd "$WORK"
    # shellcheck disable=SC2094  # "global" is a new file in $WORK, not what qconf reads
    qconf -sconf global | sed -e 's/^min_uid .*/min_uid 0/' -e 's/^min_gid .*/min_gid 0/' > global
    qconf -Mconf global                          # lets root run jobs (the file name is the config name)
    qconf -ssconf | sed -e 's/^schedule_interval .*/schedule_interval 0:0:1/' \
        -e 's/^flush_submit_sec .*/flush_submit_sec 1/' -e 's/^flush_finish_sec .*/flush_finish_sec 1/' > sched
    qconf -Msconf sched                          # schedule every second, not every 15
    qconf -as "$HOST" >/dev/null
    printf '%s\n' "hostname $HOST" "load_scaling NONE" "complex_values NONE" "user_lists NONE" "xuser_lists NONE" \
        "projects NONE" "xprojects NONE" "usage_scaling NONE" "report_variables NONE" > exechost
    qconf -Ae exechost
    for pe in smp mpi; do
        rule="\$pe_slots"  # SGE's own $-keywords, not shell variables
        if [ "$pe" = mpi ]; then rule="\$fill_up"; fi
        printf '%s\n' "pe_name $pe" "slots 999" "user_lists NONE" "xuser_lists NONE" "start_proc_args NONE" \
            "stop_proc_args NONE" "allocation_rule $rule" "control_slaves TRUE" "job_is_first_task FALSE" \
            "urgency_slots min" "accounting_summary FALSE" "qsort_args NONE" > "$pe"
        qconf -Ap "$pe"
    done
    printf '%s\n' "group_name @allhosts" "hostlist $HOST" > allhosts
    qconf -Ahgrp allhosts
    {
        printf '%s\n' "qname all.q" "hostlist @allhosts" "seq_no 0" "load_thresholds NONE" "suspend_thresholds NONE" \
            "nsuspend 1" "suspend_interval 00:05:00" "priority 0" "min_cpu_interval 00:05:00" "processors UNDEFINED" \
            "qtype BATCH INTERACTIVE" "ckpt_list NONE" "pe_list smp mpi" "rerun FALSE" "slots 8" "tmpdir /tmp" \
            "shell /bin/bash" "prolog NONE" "epilog NONE" "shell_start_mode unix_behavior" "starter_method NONE" \
            "suspend_method NONE" "resume_method NONE" "terminate_method NONE" "notify 00:00:60" "owner_list NONE" \
            "user_lists NONE" "xuser_lists NONE" "subordinate_list NONE" "complex_values NONE" "projects NONE" \
            "xprojects NONE" "calendar NONE" "initial_state default"
        for limit in s_rt h_rt s_cpu h_cpu s_fsize h_fsize s_data h_data s_stack h_stack s_core h_core s_rss h_rss \
            s_vmem h_vmem; do
            echo "$limit INFINITY"
        done
    } > all.q
    qconf -Aq all.q
    touch "$COMMON/.meshtrain-configured"
}

start() {
    [ "$(id -u)" = 0 ] || { echo "local-sge.sh start needs root" >&2; exit 1; }
    if ! command -v sge_qmaster >/dev/null && [ ! -x /usr/sbin/sge_qmaster ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends gridengine-master gridengine-exec gridengine-client >/dev/null
    fi
    echo "$HOST" > "$COMMON/act_qmaster"
    echo "$HOST localhost" > "$COMMON/host_aliases"   # without it execd's name does not match the qmaster's
    chown sgeadmin:sgeadmin "$COMMON/act_qmaster" "$COMMON/host_aliases"
    mkdir -p /var/run/gridengine && chown sgeadmin:sgeadmin /var/run/gridengine
    alive "$QMASTER_PID" || /usr/sbin/sge_qmaster
    wait_for 60 qstat || { tail /var/spool/gridengine/qmaster/messages >&2; exit 1; }
    configure_once
    alive "$EXECD_PID" || /usr/sbin/sge_execd
    wait_for 60 execd_ready || { qstat -f >&2; exit 1; }
}

stop() {
    alive "$QMASTER_PID" && { qdel -u '*' '*' >/dev/null 2>&1 || true; }
    for pidfile in "$EXECD_PID" "$QMASTER_PID"; do
        if alive "$pidfile"; then kill "$(cat "$pidfile")" || true; fi
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) execd_ready ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
