#!/bin/bash
# Entrypoint of the slurm-mapa cluster image; the first argument picks the role:
#   mariadb | slurmdbd | slurmctld | slurmd      (init-db: used once at image build time)
# Configuration is bind-mounted read-only under /etc/slurm-mapa (see compose.yml):
#   config/     slurm.conf cgroup.conf slurmdbd.conf mapa.toml
#   gres_conf/  <preset>.gres.conf, chosen by $MAPA_PRESET on compute nodes
# and the repository's slurm_mapa/ package under /opt/slurm-mapa (job_submit.lua, and the code the
# hooks run; compute nodes write their hook wrappers from it with `mapa hooks` at start), so that a
# code change needs no image rebuild either.
set -euo pipefail

MAPA=/etc/slurm-mapa
DB_SOCKET=/run/mysqld/mysqld.sock

log() { printf '[entrypoint %s] %s\n' "${ROLE:-?}" "$*" >&2; }

# /etc/slurm/* point into the bind mounts, so an edited file is read on the next
# `scontrol reconfigure` or container restart with no image rebuild.
link_config() {
    local f
    for f in slurm.conf cgroup.conf; do
        ln -sfn "$MAPA/config/$f" "/etc/slurm/$f"
    done
    ln -sfn /opt/slurm-mapa/slurm_mapa/data/slurm/job_submit.lua /etc/slurm/job_submit.lua
    # A copy, not a link: fault tests change a node's hook config and put it back.
    install -m 644 "$MAPA/config/mapa.toml" /etc/slurm/mapa.toml
}

start_munge() {
    mkdir -p /run/munge
    chown munge:munge /run/munge
    rm -f /run/munge/*
    runuser -u munge -- /usr/sbin/munged
    local i
    for i in $(seq 100); do
        [[ -S /run/munge/munge.socket.2 ]] && return
        sleep 0.1
    done
    log "munged did not start"
    exit 1
}

# The hooks slurm.conf names, written by `mapa hooks` from the mounted source, as an admin would.
write_hooks() {
    /usr/bin/python3 -I -X pycache_prefix=/var/cache/slurm-mapa/pycache -c \
        'import sys; sys.path.insert(0, "/opt/slurm-mapa"); from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))' \
        hooks /usr/local/sbin --python /usr/bin/python3 --config /etc/slurm/mapa.toml \
        --pycache-prefix /var/cache/slurm-mapa/pycache >/dev/null
}

# mapa-agent runs the Prolog and Epilog for the hook wrappers; like slurmd, it comes back when it
# dies or is killed. Without it the wrappers run the hooks in-process, only slower.
start_agent() {
    (
        set +e  # the agent exiting (or killed: status 137) must not end this loop
        while true; do
            /usr/bin/python3 -I -X pycache_prefix=/var/cache/slurm-mapa/pycache -c \
                'import sys; sys.path.insert(0, "/opt/slurm-mapa"); from slurm_mapa.slurm.agent import main; sys.exit(main())' \
                --config /etc/slurm/mapa.toml
            log "mapa-agent exited ($?); restarting it"
            sleep 1
        done
    ) &
}

shared_dirs() {
    mkdir -p /shared/jobs
    chmod 1777 /shared/jobs
}

# Mock GPUs: one character device per File= entry of the node's gres.conf (Slurm only stat()s
# them; a regular file is rejected and a GPU without File= is dropped). NVIDIA: /dev/nvidiaN
# (major 195) and /dev/nvidiactl; AMD: /dev/dri/renderDN (major 226, the DRM major) and the
# amdgpu driver's /dev/kfd, by which the TaskProlog tells an AMD node.
make_gpu_devices() {
    local gres=$1 spec path base lo hi i major
    while read -r spec; do
        path=${spec#File=}
        if [[ $path =~ ^(.*[^0-9])\[([0-9]+)-([0-9]+)\]$ ]]; then
            base=${BASH_REMATCH[1]} lo=${BASH_REMATCH[2]} hi=${BASH_REMATCH[3]}
        elif [[ $path =~ ^(.*[^0-9])([0-9]+)$ ]]; then
            base=${BASH_REMATCH[1]} lo=${BASH_REMATCH[2]} hi=${BASH_REMATCH[2]}
        else
            log "cannot make a device for $path"
            continue
        fi
        major=195
        if [[ $base == /dev/dri/* ]]; then
            major=226
            mkdir -p /dev/dri
            [[ -c /dev/kfd ]] || mknod -m 666 /dev/kfd c 511 0
        fi
        for ((i = lo; i <= hi; i++)); do
            [[ -c $base$i ]] || { rm -f "$base$i"; mknod -m 666 "$base$i" c "$major" "$i"; }
        done
    done < <(grep -v '^[[:space:]]*#' "$gres" | grep -o 'File=[^[:space:]]*' || true)
    if grep -q 'File=/dev/nvidia' "$gres"; then
        [[ -c /dev/nvidiactl ]] || mknod -m 666 /dev/nvidiactl c 195 255
    fi
}

mariadb_server() {
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld
    exec /usr/sbin/mariadbd --no-defaults --user=mysql --datadir=/var/lib/mysql --socket="$DB_SOCKET" \
        --bind-address=0.0.0.0 --port=3306 --skip-log-bin --skip-name-resolve \
        --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
        --innodb-flush-log-at-trx-commit=2 "$@"
}

init_db() {
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld
    if [[ ! -d /var/lib/mysql/mysql ]]; then
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db >/dev/null
    fi
    /usr/sbin/mariadbd --no-defaults --user=mysql --datadir=/var/lib/mysql --socket="$DB_SOCKET" \
        --skip-networking --skip-log-bin &
    local pid=$! i
    for i in $(seq 300); do
        mariadb-admin --socket="$DB_SOCKET" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    mariadb --socket="$DB_SOCKET" <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'%' IDENTIFIED BY 'mapa-slurmdbd';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'%';
FLUSH PRIVILEGES;
SQL
    mariadb-admin --socket="$DB_SOCKET" shutdown
    wait "$pid" || true
}

ROLE=${1:-slurmd}
[[ $# -gt 0 ]] && shift
case $ROLE in
    init-db)
        init_db
        ;;
    mariadb)
        mariadb_server "$@"
        ;;
    slurmdbd)
        link_config
        start_munge
        # slurmdbd insists on a private config file owned by SlurmUser.
        install -o slurm -g slurm -m 600 "$MAPA/config/slurmdbd.conf" /etc/slurm/slurmdbd.conf
        exec /usr/sbin/slurmdbd -D "$@"
        ;;
    slurmctld)
        link_config
        start_munge
        shared_dirs
        exec /usr/sbin/slurmctld -D -i "$@"
        ;;
    slurmd)
        link_config
        : "${MAPA_PRESET:?compute nodes need MAPA_PRESET (the gres_conf/<preset>.gres.conf to use)}"
        gres="$MAPA/gres_conf/$MAPA_PRESET.gres.conf"
        [[ -f $gres ]] || { log "no $gres"; exit 1; }
        ln -sfn "$gres" /etc/slurm/gres.conf
        make_gpu_devices "$gres"
        # The mock nvidia-smi (rocm-smi on an AMD node) prints this node's topology, so
        # `mapa topo discover` works here.
        if grep -q 'File=/dev/dri/' "$gres"; then
            ln -sfn /opt/slurm-mapa/scripts/mock-rocm-smi /usr/local/bin/rocm-smi
        else
            ln -sfn /opt/slurm-mapa/scripts/mock-nvidia-smi /usr/local/bin/nvidia-smi
        fi
        start_munge
        shared_dirs
        write_hooks
        start_agent
        # A slurmd that dies or is killed by hand comes back, as systemd would restart it; its jobs
        # (slurmstepd) keep running meanwhile. The container stops on SIGTERM as before.
        trap 'kill -TERM "$slurmd_pid" 2>/dev/null; wait "$slurmd_pid"; exit 0' TERM INT
        while true; do
            /usr/sbin/slurmd -D "$@" &
            slurmd_pid=$!
            wait "$slurmd_pid" || log "slurmd exited ($?); restarting it"
            sleep 1
        done
        ;;
    *)
        exec "$ROLE" "$@"
        ;;
esac
