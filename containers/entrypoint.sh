#!/bin/bash
# Entrypoint of the slurm-mapa cluster image; the first argument picks the role:
#   mariadb | slurmdbd | slurmctld | slurmd      (init-db: used once at image build time)
# Configuration is bind-mounted read-only under /etc/slurm-mapa (see compose.yml):
#   config/     slurm.conf cgroup.conf plugstack.conf slurmdbd.conf mapa.toml prometheus.yml
#   gres_conf/  <preset>.gres.conf, chosen by $MAPA_PRESET on compute nodes (slurm_mapa/data/gres_conf/)
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
    for f in slurm.conf cgroup.conf plugstack.conf; do
        ln -sfn "$MAPA/config/$f" "/etc/slurm/$f"
    done
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
    mapa hooks /usr/local/sbin --python /usr/bin/python3 --config /etc/slurm/mapa.toml \
        --pycache-prefix /var/cache/slurm-mapa/pycache --client /usr/local/lib/slurm-mapa/mapa-hook-client >/dev/null
}

# mapa-agent runs the Prolog and Epilog for the hook wrappers; like slurmd, it comes back when it
# dies or is killed. Without it the wrappers run the hooks in-process, only slower.
start_agent() {
    (
        set +e  # the agent exiting (or killed: status 137) must not end this loop
        while true; do
            /usr/bin/python3 -I -X pycache_prefix=/var/cache/slurm-mapa/pycache -c \
                'import sys; sys.path.insert(0, "/opt/slurm-mapa"); from slurm_mapa.slurm.agent.service import main; sys.exit(main())' \
                --config /etc/slurm/mapa.toml
            log "mapa-agent exited ($?); restarting it"
            sleep 1
        done
    ) &
}

# The mapa CLI from the mounted source, as root.
mapa() {
    /usr/bin/python3 -I -X pycache_prefix=/var/cache/slurm-mapa/pycache -c \
        'import sys; sys.path.insert(0, "/opt/slurm-mapa"); from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))' "$@"
}

# Prometheus (Debian's package) beside slurmctld, as http://prometheus:9090 (compose.yml's alias of
# this container): it scrapes every node's mapa-agent (config/prometheus.yml) and evaluates the
# example alert rules (slurm_mapa/data/contrib/prometheus/mapa-alerts.yml, mounted under
# /opt/slurm-mapa/contrib). Like the releaser it comes back when it dies; its database is the
# container's own, gone with it.
start_prometheus() {
    if ! command -v prometheus >/dev/null; then
        log "no prometheus in this image (scripts/cluster build installs it); no metrics scraping"
        return
    fi
    install -d -o prometheus -g prometheus /var/lib/prometheus/mapa
    (
        set +e
        while true; do
            runuser -u prometheus -- prometheus --config.file="$MAPA/config/prometheus.yml" \
                --storage.tsdb.path=/var/lib/prometheus/mapa --web.listen-address=0.0.0.0:9090 --log.level=warn
            log "prometheus exited ($?); restarting it"
            sleep 1
        done
    ) &
}

# `mapa release` (docs/directives.md, placement=require), as the mapa-release systemd unit runs it
# but every 5 s instead of 30 (one squeue of the pending jobs per pass): the tests should not wait.
start_releaser() {
    (
        set +e
        while true; do
            mapa release --every 5
            log "mapa release exited ($?); restarting it"
            sleep 1
        done
    ) &
}

# gres.conf for this node's layout in slurm.conf: the preset's Cores= ranges are its sockets (in
# order), and socket k of a node with C cores per socket is Cores=k*C..k*C+C-1 here.
# Arguments: the preset's gres.conf, then slurm.conf and the node name (tests give them).
socket_gres() {
    local gres=$1 conf=${2:-/etc/slurm/slurm.conf} node=${3:-$(uname -n)} sockets per_socket
    sockets=$(sed -n "s/^NodeName=$node .*SocketsPerBoard=\([0-9]*\).*/\1/p" "$conf")
    per_socket=$(sed -n "s/^NodeName=$node .*CoresPerSocket=\([0-9]*\).*/\1/p" "$conf")
    [[ -n $sockets && -n $per_socket ]] || { log "no SocketsPerBoard/CoresPerSocket for $node in slurm.conf"; exit 1; }
    awk -v per="$per_socket" -v sockets="$sockets" '
        { line[NR] = $0; if (match($0, /Cores=[0-9]+(-[0-9]+)?/)) { r = substr($0, RSTART + 6, RLENGTH - 6); split(r, b, "-"); if (!(r in start)) { start[r] = b[1] + 0; ranges[++n] = r } } }
        END {
            for (i = 1; i <= n; i++) { rank[ranges[i]] = 0; for (j = 1; j <= n; j++) if (start[ranges[j]] < start[ranges[i]]) rank[ranges[i]]++ }
            if (n > sockets) { print "socket_gres: " n " Cores= ranges for " sockets " sockets" > "/dev/stderr"; exit 1 }
            for (k = 1; k <= NR; k++) {
                out = line[k]
                if (match(out, /Cores=[0-9]+(-[0-9]+)?/)) {
                    r = substr(out, RSTART + 6, RLENGTH - 6); first = rank[r] * per; last = first + per - 1
                    out = substr(out, 1, RSTART - 1) "Cores=" first (last > first ? "-" last : "") substr(out, RSTART + RLENGTH)
                }
                print out
            }
        }' "$gres"
}

# Docker (cgroup v1, the host's cgroup namespace) mounts each controller's hierarchy read-only at
# /sys/fs/cgroup/<controllers>, showing the container's own cgroup. slurmd's cgroup plugin and
# mapa-agent's device isolation write there, so a node whose cgroup.conf enables the plugin gets
# the same view, writable: each hierarchy is mounted afresh (CAP_SYS_ADMIN, compose.yml), the
# container's own cgroup bound over the read-only mount point, and the whole hierarchy unmounted
# again. Children of the container's cgroup stay inside its limits (compose.yml's device rules).
writable_cgroups() {
    local point options controllers own
    grep -Eqi '^[[:space:]]*CgroupPlugin[[:space:]]*=[[:space:]]*disabled' /etc/slurm/cgroup.conf && return
    [[ -f /sys/fs/cgroup/cgroup.controllers ]] && return  # cgroup v2: nothing to do here
    mkdir -p /run/cgroup-hierarchies
    local mounts entry
    # Read them all first: the loop changes the mount table.
    mapfile -t mounts < <(awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup" && $5 ~ "^/sys/fs/cgroup/" && $NF !~ /name=/) print $5, $NF; break } }' /proc/self/mountinfo)
    for entry in "${mounts[@]}"; do
        read -r point options <<<"$entry"
        controllers=${options##* }
        controllers=$(printf '%s' "$controllers" | tr ',' '\n' | grep -Ev '^(rw|ro)$' | paste -sd, -)
        own=$(awk -F: -v c="$controllers" '$2 == c { print $3 }' /proc/self/cgroup)
        [[ -n $own ]] || { log "no cgroup of this container for $controllers"; continue; }
        mkdir -p "/run/cgroup-hierarchies/$controllers"
        mount -t cgroup -o "$controllers" cgroup "/run/cgroup-hierarchies/$controllers"
        umount "$point" 2>/dev/null || true
        mount --bind "/run/cgroup-hierarchies/$controllers$own" "$point"
        # Only the container's own cgroup stays mounted: nothing may write above it.
        umount "/run/cgroup-hierarchies/$controllers"
    done
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

# The node's topology file as discovery (`mapa topo discover` with NVML or AMD SMI) writes it on a
# real node: the preset's links, and each GPU's device minor, read from the device files gres.conf
# names (the mock ones above). With minor numbers, mapa.toml's isolation = "auto" is fail-open here.
node_topology() {
    local gres=$1 preset=$2
    /usr/bin/python3 -I -c '
import dataclasses, os, re, sys
sys.path.insert(0, "/opt/slurm-mapa")
from slurm_mapa.hardware.topofile import topology_from_toml_text, topology_to_toml
preset, gres = sys.argv[1], sys.argv[2]
files = []
for line in open(gres):
    match = re.search(r"(?:^|\s)File=(\S+)", line.split("#")[0])
    if not match:
        continue
    ranged = re.fullmatch(r"(.*\D)\[(\d+)-(\d+)\]", match.group(1))
    files += [f"{ranged[1]}{i}" for i in range(int(ranged[2]), int(ranged[3]) + 1)] if ranged else [match.group(1)]
topology = topology_from_toml_text(open(preset).read(), source=preset)
minors = tuple(os.minor(os.stat(path).st_rdev) for path in files)
print(topology_to_toml(dataclasses.replace(topology, minor_numbers=minors),
                       comment=f"{os.path.basename(preset)} with the device minors of {gres}, as discovery writes them"))
' "$preset" "$gres" > /etc/slurm/mapa-topology.toml.new && mv /etc/slurm/mapa-topology.toml.new /etc/slurm/mapa-topology.toml
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
        # A controller with no saved state numbers jobs from 1 again: the files of the jobs an
        # earlier controller numbered (outputs, release markers) must not be taken for new ones'.
        if [[ ! -e /var/lib/slurm/slurmctld/job_state ]]; then
            find /shared/jobs -mindepth 1 -delete
        fi
        # job_submit.lua with mapa.toml's [features], as an admin writes it with `mapa job-submit-lua`.
        mapa job-submit-lua /etc/slurm/job_submit.lua --config /etc/slurm/mapa.toml >/dev/null
        start_releaser
        start_prometheus
        exec /usr/sbin/slurmctld -D -i "$@"
        ;;
    slurmd)
        link_config
        : "${MAPA_PRESET:?compute nodes need MAPA_PRESET (the gres_conf/<preset>.gres.conf to use)}"
        gres="$MAPA/gres_conf/$MAPA_PRESET.gres.conf"
        [[ -f $gres ]] || { log "no $gres"; exit 1; }
        rm -f /etc/slurm/gres.conf
        socket_gres "$gres" > /etc/slurm/gres.conf
        make_gpu_devices "$gres"
        node_topology "$gres" "$MAPA/gres_conf/$MAPA_PRESET.toml"
        writable_cgroups
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
