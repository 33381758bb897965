#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, with accounting (slurmdbd on MariaDB) so `sacct`
# works as on a real cluster: what tests/test_slurm.py runs the workflow against.
#
#   sudo tests/cluster/slurm_up.sh up      # install if missing, start, wait until the node is idle
#   sudo tests/cluster/slurm_up.sh down    # stop every daemon it started, remove its state
#   tests/cluster/slurm_up.sh status       # sinfo
#
# Idempotent: `up` on a running cluster only checks it; `down` on a stopped one does nothing.
# Exit codes: 0 done, 1 failed, 3 the packages could not be installed (no apt, no network).
# Needs root (daemons, /etc/slurm, apt-get on a fresh machine). Partitions `cpu` (default) and
# `gpu` both hold this node; there is no GPU and no gres here, so the test profile asks for none.
# Everything it writes lives in $MOE_SLURM_STATE (default /var/lib/moe-batch-slurm) and
# /etc/slurm/{slurm,slurmdbd}.conf; the MariaDB data dir is its own, not the system's.
set -euo pipefail

STATE=${MOE_SLURM_STATE:-/var/lib/moe-batch-slurm}
CLUSTER=moebatch
ACCOUNT=moebatch
DB_SOCKET="$STATE/mysql/mysqld.sock"
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

log() { echo "slurm_up: $*" >&2; }

wait_for() {  # wait_for <seconds> <description> <command...>
    local limit=$1 what=$2
    shift 2
    for _ in $(seq "$limit"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    log "timed out after ${limit}s waiting for $what"
    return 1
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || command -v mysqld >/dev/null || missing+=(mariadb-server)
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        # policy-rc.d keeps the packages from starting their own daemons (this script owns
        # them); one the system already has (Docker images ship one) is left as it is.
        local own_policy=0
        if [[ ! -e /usr/sbin/policy-rc.d ]]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
            chmod +x /usr/sbin/policy-rc.d
            own_policy=1
        fi
        local ok=1
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null || ok=0
        if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
        if ((!ok)); then
            log "could not install ${PACKAGES[*]} with apt-get"
            exit 3  # tests/test_slurm.py skips on this code: no cluster to test, not a failure of it
        fi
    fi
}

start_munge() {
    if pgrep -x munged >/dev/null; then return; fi  # the system's: used, never stopped by down
    install -d "$STATE"
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1
    touch "$STATE/munged.ours"  # down stops munged only when this script started it
    wait_for 10 munged munge -n
}

start_mariadb() {
    if [[ -S $DB_SOCKET ]] && mysqladmin --socket="$DB_SOCKET" ping >/dev/null 2>&1; then return; fi
    local data="$STATE/mysql/data"
    install -d -o mysql -g mysql "$STATE/mysql" "$data"
    if [[ ! -d $data/mysql ]]; then
        mariadb-install-db --user=mysql --datadir="$data" --auth-root-authentication-method=socket >/dev/null
    fi
    runuser -u mysql -- mariadbd --datadir="$data" --socket="$DB_SOCKET" --pid-file="$STATE/mysql/mysqld.pid" \
        --skip-networking=0 --bind-address=127.0.0.1 --port=3307 --log-error="$STATE/mysql/error.log" \
        </dev/null >/dev/null 2>&1 &
    disown
    wait_for 60 MariaDB mysqladmin --socket="$DB_SOCKET" ping
    mariadb --socket="$DB_SOCKET" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

write_configs() {
    install -d /etc/slurm "$STATE/spool/ctld" "$STATE/spool/d" "$STATE/log"
    cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
    chmod 600 /etc/slurm/slurmdbd.conf
    # The node line is what slurmd measures on this machine (CPUs, sockets, memory).
    local node
    node=$(slurmd -C | head -1)
    # batch_sched_delay=0: a batch job is scheduled when it is submitted. By default Slurm may
    # hold it up to 3 s to batch the scheduling of a high submit rate; here every job waited
    # 2.8 s for that (0.8-0.9 s from sbatch to start without it), and the test's workflow runs
    # its ~8 jobs one after another.
    cat >/etc/slurm/slurm.conf <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=ALL MaxTime=INFINITE State=UP
EOF
}

up() {
    [[ $(id -u) -eq 0 ]] || { log "needs root"; exit 1; }
    install_packages
    start_munge
    start_mariadb
    write_configs
    if ! pgrep -x slurmdbd >/dev/null; then
        slurmdbd </dev/null >/dev/null 2>&1
        wait_for 30 slurmdbd sacctmgr -n list cluster
    fi
    sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=moe-batch Organization=moe-batch >/dev/null 2>&1 || true
    sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null 2>&1 || true
    pgrep -x slurmctld >/dev/null || slurmctld </dev/null >/dev/null 2>&1
    pgrep -x slurmd >/dev/null || slurmd </dev/null >/dev/null 2>&1
    # idle, or already running jobs (mix, alloc) when `up` checks a running cluster
    wait_for 60 "the node to be up" bash -c 'sinfo -h -o "%t" | grep -qxE "idle|mix|alloc"'
    log "up: $(sinfo -h -o '%P %t %c CPUs %m MB' | tr '\n' ';')"
}

# The pid files of the daemons `up` started, in the order `down` stops them (the ones that talk
# to the others first). A daemon the system was already running is left alone.
pidfiles() {
    echo "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$STATE/slurmdbd.pid" "$STATE/mysql/mysqld.pid"
    if [[ -e $STATE/munged.ours ]]; then echo /run/munge/munged.pid; fi
}

# True when none of the given pids is alive (daemons remove their pid file as they begin to
# shut down, so `down` waits on the pids it read, not on the files).
none_alive() {
    local pid
    for pid in "$@"; do
        if kill -0 "$pid" 2>/dev/null; then return 1; fi
    done
}

down() {
    [[ -d $STATE ]] || { log "down: nothing to stop"; return; }
    if [[ -s $STATE/slurmctld.pid ]] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
        # Jobs first, and wait for their steps to end: killing slurmd under a running step
        # would leave the job's processes behind.
        scancel --full --user=root >/dev/null 2>&1 || true
        wait_for 60 "the jobs to end" bash -c '[[ -z $(squeue -h 2>/dev/null) ]] && ! pgrep -x slurmstepd'
    fi
    local f pids=()
    for f in $(pidfiles); do
        if [[ -s $f ]]; then pids+=("$(cat "$f")"); fi
    done
    if ((${#pids[@]})); then
        kill "${pids[@]}" 2>/dev/null || true
        wait_for 60 "the daemons to stop" none_alive "${pids[@]}"
    fi
    rm -rf "$STATE" /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf
    log "down"
}

case "${1:-up}" in
    up) up ;;
    down) down ;;
    status) sinfo ;;
    *) echo "usage: $0 [up|down|status]" >&2; exit 2 ;;
esac
