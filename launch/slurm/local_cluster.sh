#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the launcher tests and for trying the sbatch
# scripts: munged, slurmctld and slurmd started directly (no systemd), run as root.
#
#   bash launch/slurm/local_cluster.sh start    # install the Debian packages if missing, configure, start, wait for idle
#   bash launch/slurm/local_cluster.sh status   # exit 0 when the node answers and is usable
#   bash launch/slurm/local_cluster.sh stop     # stop the three daemons this script started
#
# The configuration is minimal on purpose: this host under its real hostname, CPUs from nproc, real
# memory, select/cons_tres, proctrack/linuxproc and no cgroups (containers rarely allow them), no
# accounting database (jobs are followed with squeue/scontrol; finished jobs stay visible for
# MinJobAge seconds). An existing /etc/slurm/slurm.conf not written by this script is left alone.
set -euo pipefail

conf_dir=/etc/slurm
conf="$conf_dir/slurm.conf"
marker="# written by rlmega launch/slurm/local_cluster.sh"
state_dir=/var/spool/slurmctld
spool_dir=/var/spool/slurmd
log_dir=/var/log/slurm
run_dir=/run/slurm
wait_s="${SLURM_LOCAL_WAIT_S:-60}"

log() { echo "local_cluster: $*"; }

node_usable() {
    # idle, mixed or allocated: the node answers and takes jobs.
    local state
    state="$(sinfo -h -N -n "$(hostname -s)" -o '%T' 2>/dev/null | head -n1)" || return 1
    case "$state" in idle* | mix* | alloc* | completing*) return 0 ;; *) return 1 ;; esac
}

install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
    [ "${#missing[@]}" -eq 0 ] && return 0
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

write_config() {
    if [ -f "$conf" ] && ! grep -qF "$marker" "$conf"; then
        log "keeping the existing $conf (not written by this script)"
        return 0
    fi
    local host cpus mem_mb
    host="$(hostname -s)"
    cpus="$(nproc)"
    # Leave 512 MB to the system, so slurmd's own memory check never finds less than configured.
    mem_mb="$(awk '/MemTotal/ {print int($2 / 1024) - 512}' /proc/meminfo)"
    mkdir -p "$conf_dir" "$state_dir" "$spool_dir" "$log_dir" "$run_dir"
    cat >"$conf" <<EOF
$marker
ClusterName=rlmega-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$state_dir
SlurmdSpoolDir=$spool_dir
SlurmctldPidFile=$run_dir/slurmctld.pid
SlurmdPidFile=$run_dir/slurmd.pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=900
KillWait=30
InactiveLimit=0
SlurmdTimeout=120
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    # Debian's slurm packages read /etc/slurm/cgroup.conf only with cgroup plugins; none are used.
    log "wrote $conf ($host, $cpus CPUs, $mem_mb MB)"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    local i
    for i in $(seq 20); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    log "munged did not answer; see /var/log/munge/munged.log"
    return 1
}

daemon_running() { # pidfile
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
    if command -v sinfo >/dev/null 2>&1 && node_usable; then
        log "already running"
        return 0
    fi
    install_packages
    write_config
    start_munge
    if ! daemon_running "$run_dir/slurmctld.pid"; then
        log "starting slurmctld"
        /usr/sbin/slurmctld
    fi
    if ! daemon_running "$run_dir/slurmd.pid"; then
        log "starting slurmd"
        /usr/sbin/slurmd
    fi
    local deadline=$((SECONDS + wait_s)) host
    host="$(hostname -s)"
    until node_usable; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "node $host not idle after ${wait_s}s:"
            sinfo -N -l || true
            tail -n 20 "$log_dir/slurmctld.log" "$log_dir/slurmd.log" || true
            return 1
        fi
        # A node that was down (e.g. after an unclean stop) is returned to service explicitly.
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
        sleep 1
    done
    log "node $host is up: $(sinfo -h -N -o '%T %c CPUs %m MB')"
}

stop() {
    local pidfile pid
    for pidfile in "$run_dir/slurmd.pid" "$run_dir/slurmctld.pid"; do
        if daemon_running "$pidfile"; then
            pid="$(cat "$pidfile")"
            log "stopping $(basename "$pidfile" .pid) ($pid)"
            kill -TERM "$pid"
        fi
    done
    if [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        log "stopping munged"
        kill -TERM "$(cat /run/munge/munged.pid)"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) node_usable ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 2
        ;;
esac
