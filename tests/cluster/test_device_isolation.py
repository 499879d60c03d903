"""Device isolation in a real Slurm (issue 14): with cgroups on (the production profile of the mini
cluster) and isolation = "fail-open" in mapa.toml (set here on the DGX nodes), every task opens
only the GPUs MAPA chose for it. A permitted open of a mock GPU fails with ENXIO (no driver behind it), a denied one with EPERM
(the device cgroup): that is how the jobs below tell the two apart."""

from __future__ import annotations

import re
import time

import pytest

from slurm_mapa.core.order import prefix_order
from slurm_mapa.hardware.nvidia_smi_format import fake_uuid
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.text.decision import parse_decisions

pytestmark = pytest.mark.cluster

# Prints what its batch step may open, waits for the test's go, then does the same in an srun step
# of one GPU (fewer than the job's) and lists the GPUs as the (mock) driver shows them.
PROBE = r"""
for i in $(seq 0 7); do
  python3 -c "
import errno, os, sys
try:
    os.open('/dev/nvidia$i', os.O_RDWR)
except OSError as e:
    print(errno.errorcode[e.errno])
    sys.exit(0)
print('OPENED')
" | sed "s/^/$1 $i /"
done
echo "$1 cvd=$CUDA_VISIBLE_DEVICES mapa=$MAPA_GPUS isolation=$MAPA_ISOLATION"
MAPA_PRESET=dgx1-v100 nvidia-smi -L | sed "s/^/$1 smi /"
"""
JOB = """#!/bin/bash
#SBATCH --gres=gpu:{gpus}
#MAPA topology=ring sensitive={sensitive}
cat > /shared/jobs/probe-$SLURM_JOB_ID.sh <<'PROBE'
{probe}
PROBE
bash /shared/jobs/probe-$SLURM_JOB_ID.sh batch
for _ in $(seq 600); do [ -e /shared/jobs/go-$SLURM_JOB_ID ] && break; sleep 0.2; done
srun --gres=gpu:1 -n1 bash /shared/jobs/probe-$SLURM_JOB_ID.sh step
"""


HOOKS = ("import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; "
         "sys.exit(main(sys.argv[1:]))")


def _write_hooks(cluster, node: str) -> None:
    """`mapa hooks` again, as an admin must after changing isolation (the TaskProlog holds the mode)."""
    cluster.exec(node, ["/usr/bin/python3", "-I", "-X", "pycache_prefix=/var/cache/slurm-mapa/pycache", "-c", HOOKS,
                        "hooks", "/usr/local/sbin", "--python", "/usr/bin/python3", "--config", "/etc/slurm/mapa.toml",
                        "--pycache-prefix", "/var/cache/slurm-mapa/pycache", "--client", "/usr/local/lib/slurm-mapa/mapa-hook-client"])


@pytest.fixture(scope="module", autouse=True)
def _isolation_on(cluster):
    """isolation = "fail-open" on the DGX nodes for this module (what the shipped "auto" comes to
    there, said explicitly); the shipped config afterwards."""
    for node in ("dgx1", "dgx2"):
        base = cluster.exec(node, ["cat", "/etc/slurm-mapa/config/mapa.toml"]).stdout
        assert 'isolation = "auto"\n' in base
        cluster.exec(node, ["sh", "-c", "cat > /etc/slurm/mapa.toml"], input=base.replace('isolation = "auto"\n', 'isolation = "fail-open"\n'))
        _write_hooks(cluster, node)
    yield
    for node in ("dgx1", "dgx2"):
        cluster.exec(node, ["install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml"])
        _write_hooks(cluster, node)


def _submit(cluster, gpus: int, sensitive: str, node: str = "dgx1") -> int:
    return cluster.sbatch(JOB.format(gpus=gpus, sensitive=sensitive, probe=PROBE.strip()), "-w", node)


def _wait_output(cluster, jobid: int, marker: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.exec("slurmctld", ["cat", f"{cluster.job_dir}/{jobid}.out"], check=False).stdout
        if marker in out:
            return out
        if time.monotonic() > deadline:
            raise cluster.Error(f"job {jobid} printed no {marker!r}: {out!r}")
        time.sleep(0.5)


def _seen(out: str, where: str) -> tuple[dict[int, str], tuple[int, ...], str, list[str], str]:
    """(GPU -> errno name or OPENED, MAPA's GPUs, CUDA_VISIBLE_DEVICES, UUIDs listed, isolation state)."""
    opens = {int(m.group(1)): m.group(2) for m in re.finditer(rf"^{where} (\d) (\w+)$", out, re.M)}
    info = re.search(rf"^{where} cvd=(\S*) mapa=(\S*) isolation=(\S*)$", out, re.M)
    assert info, out
    uuids = re.findall(rf"^{where} smi GPU \d+: .* \(UUID: (\S+)\)$", out, re.M)
    return opens, tuple(int(g) for g in info.group(2).split(",") if g), info.group(1), uuids, info.group(3)


def _check_isolated(out: str, where: str, allowed: tuple[int, ...]) -> None:
    opens, _, cvd, uuids, state = _seen(out, where)
    assert state == "cgroup-v1", out
    assert opens == {gpu: ("ENXIO" if gpu in allowed else "EPERM") for gpu in range(8)}, out
    # The driver shows the allowed GPUs, numbered from 0 in bus order; CUDA_VISIBLE_DEVICES names
    # them by that number, in MAPA's pattern order.
    assert uuids == [fake_uuid("dgx1-v100", gpu) for gpu in sorted(allowed)], out
    assert [uuids[int(rank)] for rank in cvd.split(",")] == [fake_uuid("dgx1-v100", gpu) for gpu in allowed], out


def _dcgm_mapping(cluster, node: str) -> dict[str, str]:
    out = cluster.exec(node, ["sh", "-c", "cd /run/dcgm-job-mapping && for f in *; do printf '%s:' \"$f\"; tr '\\n' ' ' < \"$f\"; echo; done"],
                       check=False).stdout
    return {name: "".join(f"{job}\n" for job in jobs.split()) for name, _, jobs in (line.partition(":") for line in out.splitlines())}


def test_each_task_opens_only_its_gpus_and_two_jobs_never_each_others(cluster):
    first = _submit(cluster, 3, "yes")
    second = _submit(cluster, 2, "no")
    outs = {jobid: _wait_output(cluster, jobid, "batch smi") for jobid in (first, second)}
    mapa = {}
    for jobid, out in outs.items():
        _, gpus, _, _, _ = _seen(out, "batch")
        assert gpus, out
        mapa[jobid] = gpus
        _check_isolated(out, "batch", gpus)
    assert not set(mapa[first]) & set(mapa[second])
    # dcgm-exporter's job mapping names the same GPUs (mapa-agent writes it after each start).
    deadline = time.monotonic() + 20
    want = {str(gpu): "".join(f"{job}\n" for job in (first, second) if gpu in mapa[job]) for gpu in range(8)}
    while (mapping := _dcgm_mapping(cluster, "dgx1")) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert mapping == want, (mapping, mapa)
    # slurmd restarts (as systemd would bring it back); a new step is isolated all the same.
    cluster.exec("dgx1", ["pkill", "-x", "slurmd"])
    cluster.wait_node("dgx1", lambda s: "IDLE" in s or "MIXED" in s or "ALLOCATED" in s, timeout=60, what="back")
    for jobid in (first, second):
        cluster.run("touch", f"{cluster.job_dir}/go-{jobid}")
    for jobid in (first, second):
        out = _wait_output(cluster, jobid, "step smi")
        # A 1-GPU step: Slurm gives it the job's lowest GPU, whose pair is the first of MAPA's in
        # core/order.py's order (docs/users.md, "What each rank sees").
        _check_isolated(out, "step", prefix_order(preset("dgx1-v100"), mapa[jobid])[:1])
        cluster.wait_state(jobid, "COMPLETED", timeout=60)
    # The Epilog removed the jobs' device cgroups.
    left = cluster.exec("dgx1", ["sh", "-c", "ls /sys/fs/cgroup/devices/mapa 2>/dev/null"], check=False).stdout.split()
    assert not {f"job_{first}", f"job_{second}"} & set(left), left


def test_a_job_runs_unisolated_and_says_why_when_the_cgroups_cannot_be_written(cluster):
    node = "dgx2"
    cluster.exec(node, ["mount", "-o", "remount,ro,bind", "/sys/fs/cgroup/devices"])
    try:
        jobid = _submit(cluster, 2, "yes", node)
        out = _wait_output(cluster, jobid, "batch smi")
        opens, gpus, cvd, _, state = _seen(out, "batch")
        assert state == "failed-open", out
        assert set(opens.values()) == {"ENXIO"}, out  # every GPU: nothing was isolated
        assert [int(g) for g in cvd.split(",")] == list(gpus), out  # indices, not ranks
        log = cluster.exec(node, ["cat", "/var/log/slurm-mapa.log"]).stdout
        assert re.search(r"isolation: the task of process \d+ \(uid \d+\) runs without it \(isolation = \"fail-open\"\): \S", log), log[-2000:]
        # The AdminComment says it too: mapa-agent adds it to the node's decision while the job runs.
        deadline = time.monotonic() + 30
        while "isolation=" not in (record := cluster.job(jobid).get("admin_comment", "")) and time.monotonic() < deadline:
            time.sleep(0.5)
        decision = parse_decisions(record)[node]
        assert decision.gpus == gpus and decision.isolation == "failed-open", record
        assert "Read-only_file_system" in decision.why, record
        cluster.run("touch", f"{cluster.job_dir}/go-{jobid}")
        cluster.wait_state(jobid, "COMPLETED", timeout=90)
        # sacct keeps it.
        cluster.wait_sacct(jobid, ("AdminComment",), AdminComment=lambda v: "isolation=failed-open why=" in v)
    finally:
        cluster.exec(node, ["mount", "-o", "remount,rw,bind", "/sys/fs/cgroup/devices"], check=False)


def test_the_spank_plugin_isolates_a_task_whose_taskprolog_never_asks(cluster):
    """The root-side trigger: with the TaskProlog's socket out of the job's reach (as when a user
    makes the TaskProlog skip its request), every task still opens only its step's GPUs, because
    spank_mapa_isolate.so asked mapa-agent as root before the task dropped to the user."""
    node = "dgx1"
    # The job's user cannot connect any more (a socket takes write permission to connect); the
    # agent's task records beside it stay readable, as the TaskProlog trusts only those.
    cluster.exec(node, ["chmod", "600", "/run/slurm-mapa-isolate/isolate.sock"])
    try:
        jobid = _submit(cluster, 3, "yes", node)
        out = _wait_output(cluster, jobid, "batch smi")
        opens, gpus, cvd, uuids, state = _seen(out, "batch")
        assert state == "cgroup-v1", out  # from the agent's record of the plugin's request, as the TaskProlog got no answer
        assert opens == {gpu: ("ENXIO" if gpu in gpus else "EPERM") for gpu in range(8)}, out
        assert [uuids[int(rank)] for rank in cvd.split(",")] == [fake_uuid("dgx1-v100", gpu) for gpu in gpus], out
        cluster.run("touch", f"{cluster.job_dir}/go-{jobid}")
        # The 1-GPU step is held to its own GPU: the plugin sent the step's SLURM_STEP_GPUS (Slurm's
        # lowest of the job's), and the agent isolated the step to MAPA's GPU paired with it, the
        # first of the job's in core/order.py's order.
        step_out = _wait_output(cluster, jobid, "step smi")
        step_opens, _, step_cvd, step_uuids, _ = _seen(step_out, "step")
        paired = prefix_order(preset("dgx1-v100"), gpus)[0]
        agent_log = cluster.exec(node, ["sh", "-c", f"grep -a 'job {jobid}\\|isolat' /var/log/slurm-mapa.log | tail -n 20"], check=False).stdout
        assert step_opens == {gpu: ("ENXIO" if gpu == paired else "EPERM") for gpu in range(8)}, (step_out, agent_log)
        assert step_cvd == "0" and step_uuids[0] == fake_uuid("dgx1-v100", paired)
        cluster.wait_state(jobid, "COMPLETED", timeout=60)
    finally:
        cluster.exec(node, ["chmod", "666", "/run/slurm-mapa-isolate/isolate.sock"], check=False)


# A 4-GPU job whose 2-GPU step (its own step cgroup below the job's) runs across a restart of the
# node's mapa-agent; after the restart a 1-GPU step and the batch step probe again.
RESTART_JOB = """#!/bin/bash
#SBATCH --gres=gpu:4 -N1 -n2
#MAPA topology=ring sensitive=yes
cat > /shared/jobs/probe-$SLURM_JOB_ID.sh <<'PROBE'
{probe}
PROBE
P=/shared/jobs/probe-$SLURM_JOB_ID.sh
srun --exact -n1 --gres=gpu:2 bash -c "bash $P held; while [ ! -e /shared/jobs/go-$SLURM_JOB_ID ]; do sleep 0.2; done; bash $P held-after" &
for _ in $(seq 600); do [ -e /shared/jobs/go-$SLURM_JOB_ID ] && break; sleep 0.2; done
srun --exact -n1 --gres=gpu:1 bash $P later
bash $P batch-after
wait
"""


def test_an_agent_restart_while_a_step_runs_leaves_every_later_step_isolated(cluster):
    """Issue 36: mapa-agent is killed (a crash, an upgrade) while a job's smaller step runs in a
    cgroup of its own; the agent the entrypoint brings back must isolate the job's later steps
    from the kernel's state, not fail open because its memory is empty."""
    node = "dgx1"
    jobid = cluster.sbatch(RESTART_JOB.format(probe=PROBE.strip()), "-w", node)
    out = _wait_output(cluster, jobid, "held smi")
    _, gpus, _, _, _ = _seen(out, "held")
    held_opens, _, _, _, held_state = _seen(out, "held")
    assert held_state == "cgroup-v1" and sorted(g for g, e in held_opens.items() if e == "ENXIO") != list(range(8)), out
    # The agent itself, not the entrypoint's loop that restarts it.
    cluster.exec(node, ["pkill", "-KILL", "-f", "^/usr/bin/python3 .*slurm_mapa.slurm.agent.service import main"])
    deadline = time.monotonic() + 60
    time.sleep(0.5)
    while cluster.exec(node, ["grep", "-q", "/run/slurm-mapa-agent/agent.sock", "/proc/net/unix"], check=False).returncode != 0:
        assert time.monotonic() < deadline, "the entrypoint did not restart mapa-agent"
        time.sleep(0.2)
    cluster.run("touch", f"{cluster.job_dir}/go-{jobid}")
    out = _wait_output(cluster, jobid, "batch-after smi")
    out = _wait_output(cluster, jobid, "held-after smi")
    log = cluster.exec(node, ["sh", "-c", "grep -a 'isolation' /var/log/slurm-mapa.log | tail -n 20"], check=False).stdout
    job_gpus = parse_decisions(cluster.job(jobid).get("admin_comment", ""))[node].gpus
    for where in ("later", "batch-after", "held-after"):
        opens, _, _, _, state = _seen(out, where)
        assert state == "cgroup-v1", (where, out, log)
        allowed = {gpu for gpu, result in opens.items() if result == "ENXIO"}
        assert set(opens.values()) <= {"ENXIO", "EPERM"} and allowed <= set(job_gpus), (where, out, log)
    assert len({g for g, e in _seen(out, "later")[0].items() if e == "ENXIO"}) == 1, (out, log)
    assert {g for g, e in _seen(out, "batch-after")[0].items() if e == "ENXIO"} == set(job_gpus), (out, log)
    assert "failed-open" not in out, (out, log)
    cluster.wait_state(jobid, "COMPLETED", timeout=60)


# Security round 5. The attacker's own --task-prolog (run as alice in the task, before exec, after
# the SPANK plugin and the site's TaskProlog isolated it) moves the task into a cgroup of its own
# below its step in Slurm's hierarchies (lines the agent once ignored), and into cgroups named like
# the victim's job in subtrees "systemd delegated" to alice (name=systemd and memory, made by the
# test as root and owned by alice, as user@2001.service's are on a v1 host); then it asks the
# isolate socket again, and the task probes what it may open.
ATTACK_PROLOG = """#!/bin/sh
task=$PPID
while IFS=: read -r id controllers path; do
    case "$path" in */slurm*/uid_*/job_*/step_*) ;; *) continue ;; esac
    [ "$controllers" = memory ] && continue
    step=/slurm${path#*/slurm}
    step=${step%%/task_*}
    dir=/sys/fs/cgroup/$controllers$step/mine
    # Debian's Slurm 24.11.5 and 26.05.5 keep a v1 step's directory root's: the move is refused there.
    mkdir "$dir" 2>/dev/null || { echo "print attack: slurm's step is not mine: $dir"; continue; }
    if [ "$controllers" = cpuset ]; then
        cat "${dir%/mine}/cpuset.cpus" > "$dir/cpuset.cpus"; cat "${dir%/mine}/cpuset.mems" > "$dir/cpuset.mems"
    fi
    echo $task > "$dir/cgroup.procs" || echo "print attack: could not move into $dir"
done < /proc/$task/cgroup
for forged in {forged}; do echo $task > "$forged/cgroup.procs" || echo "print attack: could not move into $forged"; done
while IFS= read -r line; do echo "print cgroup $line"; done < /proc/$task/cgroup
client=$(sed -n 's/^MAPA_CLIENT=//p' /usr/local/sbin/mapa-taskprolog)
answer=$(SLURM_JOB_ID={victim} /usr/bin/python3 -I -S "$client" isolate /run/slurm-mapa-isolate/isolate.sock < /dev/null 2>&1)
echo "print answer $(echo $answer)"
"""
ATTACK_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2
#MAPA topology=ring sensitive=yes
cat > /shared/jobs/probe-$SLURM_JOB_ID.sh <<'PROBE'
{probe}
PROBE
cat > /shared/jobs/attack-$SLURM_JOB_ID.sh <<'ATTACK'
{attack}
ATTACK
chmod 755 /shared/jobs/attack-$SLURM_JOB_ID.sh
srun --gres=gpu:2 -n1 --task-prolog=/shared/jobs/attack-$SLURM_JOB_ID.sh bash /shared/jobs/probe-$SLURM_JOB_ID.sh attack
"""


def test_a_users_forged_systemd_cgroups_and_own_step_subcgroups_keep_it_in_its_own_jobs_gpus(cluster):
    node = "dgx1"
    victim = cluster.sbatch("#!/bin/bash\n#SBATCH --gres=gpu:2\n#MAPA topology=ring sensitive=yes\nsleep 300\n", "-w", node,
                            user="bob")
    cluster.wait_state(victim, "RUNNING", timeout=60)
    systemd_mount = "/run/mapa-test-systemd"
    # systemd's own hierarchy, writable (Docker mounts it read-only), with alice's delegated subtree
    # in it and in the memory hierarchy: what a login session of alice's gives her on such a host.
    cluster.exec(node, ["sh", "-c", f"mkdir -p {systemd_mount} && (mountpoint -q {systemd_mount} || "
                                    f"mount -t cgroup -o none,name=systemd cgroup {systemd_mount})"])
    own = cluster.exec(node, ["sh", "-c", "sed -n 's/^[0-9]*:name=systemd://p' /proc/self/cgroup"]).stdout.strip()
    service = "user.slice/user-2001.slice/user@2001.service"
    services = [f"{systemd_mount}{own.rstrip('/')}/{service}", f"/sys/fs/cgroup/memory/{service}"]
    forged = [f"{top}/slurm/uid_2001/job_{victim}/step_batch" for top in services]
    attacker = None
    try:
        for top, path in zip(services, forged):
            cluster.exec(node, ["sh", "-c", f"mkdir -p '{path}' && chown -R alice: '{top}'"])
        attack = ATTACK_PROLOG.replace("{forged}", " ".join(forged)).replace("{victim}", str(victim))
        attacker = cluster.sbatch(ATTACK_JOB.format(probe=PROBE.strip(), attack=attack.strip()), "-w", node)
        out = _wait_output(cluster, attacker, "attack smi")
        assert "attack: could not" not in out, out  # every move was made: the attack really happened
        assert re.search(rf"^cgroup \d+:name=systemd:.*/user@2001\.service/slurm/uid_2001/job_{victim}/step_batch$", out, re.M), out
        for hierarchy in ("freezer", "cpuset"):  # below its own step, where a Slurm lets the user make cgroups
            assert (f"slurm's step is not mine: /sys/fs/cgroup/{hierarchy}/" in out
                    or re.search(rf"^cgroup \d+:{hierarchy}:.*/slurm[^/]*/uid_2001/job_{attacker}/step_0/mine$", out, re.M)), out
        # MAPA's GPUs for the attacker as its task saw them (its job file: a job this short may end
        # before its AdminComment record is written), the victim's from its record (it runs on).
        opens, mine, _, _, _ = _seen(out, "attack")
        record = cluster.wait_job(victim, lambda record: node in parse_decisions(record.get("admin_comment", "")),
                                  timeout=60, what="its decision in the AdminComment")
        theirs = parse_decisions(record["admin_comment"])[node].gpus
        assert mine and theirs and not set(mine) & set(theirs), (mine, theirs, out)
        assert opens == {gpu: ("ENXIO" if gpu in mine else "EPERM") for gpu in range(8)}, out
        cluster.wait_state(attacker, "COMPLETED", timeout=60)
        assert "isolation=" not in cluster.job(victim).get("admin_comment", "")  # nothing noted into the victim's record
    finally:
        cluster.run("scancel", str(victim), *([str(attacker)] if attacker is not None else []))
        # The cgroups the attack made below the attacker's steps keep Slurm from removing them.
        cleanup = "".join(f"find {top} -depth -type d -exec rmdir {{}} + ; " for top in services)
        if attacker is not None:
            cleanup += f"find /sys/fs/cgroup/*/slurm/uid_2001/job_{attacker} -depth -type d -exec rmdir {{}} + ; "
        cluster.exec(node, ["sh", "-c", cleanup + f"umount {systemd_mount}; true"], check=False)
