"""Upgrading, rolling back and disabling slurm-mapa on a running cluster (issue 26), as
docs/admin.md describes them ("Upgrading and rolling back slurm-mapa", "Disabling MAPA").

The mini cluster runs slurm-mapa from one source tree, bind-mounted read-only at /opt/slurm-mapa,
so the "new version" here is a copy of it at a second path: what is tried is the procedure (the
hooks written from another installation while jobs run, and written back), not a change of code.
Every test puts the cluster back as it found it, also when it fails."""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest

from slurm_mapa.slurm.text.decision import parse_decisions
from slurm_mapa.slurm.admin.doctor import parse_show_config, slurm_values
from test_mapa import (AGENT_PROCESS, HOLDING_JOB, JOBS_DIR, _admin_comment, _agent_listening, _assert_ledger_empties,
                       _ensure_agent, _gpu_list, _gpus, _job_file, _log_since, _log_size, _release, _slurm_gpus)

pytestmark = pytest.mark.cluster

NODE = "dgx1"
ORIGINAL = "/opt/slurm-mapa"  # the installation the nodes' entrypoint writes the hooks from
NEXT = "/opt/slurm-mapa-next"  # the "new version" beside it
PYCACHE = "/var/cache/slurm-mapa/pycache"
HOOK_DIR = "/usr/local/sbin"
HOOK_FILES = ("mapa-prolog-wrapper", "mapa-epilog-wrapper", "mapa-taskprolog")
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")

# "Installing the new version": a copy of the package, root's and not group/world-writable (the
# bind mount's files belong to the host's user), as `mapa hooks` wants a package root imports.
INSTALL_COPY = f"""set -e
rm -rf {NEXT} {PYCACHE}{NEXT}
cp -a {ORIGINAL} {NEXT}
chown -R root:root {NEXT}
chmod -R go-w {NEXT}
"""
# The copy and the byte code its hooks left under the cache prefix (which mirrors source paths).
REMOVE_COPY = f"rm -rf {NEXT} {PYCACHE}{NEXT}"


def _mapa_hooks(cluster, node: str, root: str, check: bool = True):
    """`mapa hooks` as the node's entrypoint runs it (write_hooks), with the package at ``root``:
    the wrappers and the TaskProlog then run the package found there."""
    code = f"import sys; sys.path.insert(0, '{root}'); from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))"
    return cluster.exec(node, ["/usr/bin/python3", "-I", "-X", f"pycache_prefix={PYCACHE}", "-c", code,
                               "hooks", HOOK_DIR, "--python", "/usr/bin/python3", "--config", "/etc/slurm/mapa.toml",
                               "--pycache-prefix", PYCACHE, "--client", "/usr/local/lib/slurm-mapa/mapa-hook-client"], check=check)


def _hook_roots(cluster, node: str) -> dict[str, set[str]]:
    """The package roots (/opt/slurm-mapa, or a copy beside it) each hook file names: the
    wrappers' sys.path and agent client, the TaskProlog's agent client (isolation is on here)."""
    return {name: set(re.findall(r"/opt/slurm-mapa[\w.-]*", cluster.exec(node, ["cat", f"{HOOK_DIR}/{name}"]).stdout))
            for name in HOOK_FILES}


def _restart_agent(cluster, node: str, timeout: float = 60) -> None:
    """What `systemctl restart mapa-agent` does, the way the mini cluster can: SIGTERM to the agent
    (as test_mapa.py kills it, there with SIGKILL), and the entrypoint's loop starts it again. The
    loop starts it from /opt/slurm-mapa whatever `mapa hooks` wrote: the agent's own restart is
    tried here; what the upgrade changed is the hooks."""
    _ensure_agent(cluster, node)
    old = set(cluster.exec(node, ["pgrep", "-f", AGENT_PROCESS]).stdout.split())
    cluster.exec(node, ["pkill", "-f", AGENT_PROCESS])
    deadline = time.monotonic() + timeout
    while True:
        now = set(cluster.exec(node, ["pgrep", "-f", AGENT_PROCESS], check=False).stdout.split())
        if now and not now & old:
            break
        if time.monotonic() > deadline:
            raise cluster.Error(f"mapa-agent on {node} was not restarted within {timeout:g} s (was {old}, now {now})")
        time.sleep(0.2)
    _ensure_agent(cluster, node)


def _wait_record(cluster, jobid: int, node: str, timeout: float = 30) -> str:
    """The job's AdminComment once mapa-agent wrote its decision record for ``node`` into it."""
    job = cluster.wait_job(jobid, lambda j: f" # {node}=" in (j.get("admin_comment") or ""), timeout=timeout,
                           what=f"with a MAPA record for {node} in its AdminComment")
    return job["admin_comment"]


def _end_jobs(cluster, node: str, jobs: list[int]) -> None:
    """Release (or else cancel) the jobs and give their Epilogs time to run: on a failure path,
    before the hooks they run are rewritten or removed."""
    for jobid in jobs:
        cluster.exec("slurmctld", ["touch", f"{cluster.job_dir}/release-{jobid}"], check=False)
    for jobid in jobs:
        try:
            cluster.wait_state(jobid, ENDED, timeout=60)
        except cluster.Error:
            cluster.cancel(jobid)
    with contextlib.suppress(AssertionError):
        _assert_ledger_empties(cluster, node, timeout=30)


def test_upgrading_slurm_mapa_keeps_the_running_jobs_and_a_rollback_restores_the_first_installation(cluster):
    """docs/admin.md, "Upgrading and rolling back slurm-mapa", on the mock DGX-1 with a job running."""
    _assert_ledger_empties(cluster, NODE, timeout=60)
    _ensure_agent(cluster, NODE)
    # The premise: the node's three hook files name the installation they were written from.
    assert _hook_roots(cluster, NODE) == {name: {ORIGINAL} for name in HOOK_FILES}
    jobs: list[int] = []
    rolled_back = False
    try:
        first = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", NODE)
        jobs.append(first)
        cluster.wait_state(first, "RUNNING")
        first_gpus = frozenset(_gpus(cluster, first))
        first_record = _wait_record(cluster, first, NODE)
        assert frozenset(parse_decisions(first_record)[NODE].gpus) == first_gpus, first_record

        # The new version beside the old one, and the node's hooks written from it.
        cluster.exec(NODE, ["sh", "-c", INSTALL_COPY])
        written = _mapa_hooks(cluster, NODE, NEXT)
        assert "others could change" not in written.stderr, written.stderr  # the copy is root's alone
        assert _hook_roots(cluster, NODE) == {name: {NEXT} for name in HOOK_FILES}
        _restart_agent(cluster, NODE)

        # A job started under the new hooks gets GPUs the running job does not hold.
        second = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", NODE)
        jobs.append(second)
        cluster.wait_state(second, "RUNNING")
        second_gpus = frozenset(_gpus(cluster, second))
        assert len(second_gpus) == 2 and not first_gpus & second_gpus, (first_gpus, second_gpus)
        second_record = _wait_record(cluster, second, NODE)
        assert frozenset(parse_decisions(second_record)[NODE].gpus) == second_gpus, second_record
        # The running job kept its GPUs (its per-job file, the ledger) and its record.
        assert _job_file(cluster, NODE, first) == first_gpus
        assert _admin_comment(cluster, first) == first_record
        ledger = cluster.ledger_jobs(NODE)
        assert {jobid: frozenset(entry["gpus"]) for jobid, entry in ledger.items()} == {
            str(first): first_gpus, str(second): second_gpus}, ledger

        # Both end; their Epilogs, the new wrappers, free the GPUs; sacct keeps both records.
        _release(cluster, first)
        _release(cluster, second)
        _assert_ledger_empties(cluster, NODE)
        for jobid, record in ((first, first_record), (second, second_record)):
            rec = cluster.wait_sacct(jobid, ("AdminComment", "State"), State="COMPLETED", AdminComment=lambda v: f" # {NODE}=" in v)
            assert rec["AdminComment"] == record, (jobid, rec)

        # Roll back: the hooks from the first installation again, then the new one removed. (The
        # agent runs /opt/slurm-mapa throughout here, so its restart, part of a real rollback, is left out.)
        _mapa_hooks(cluster, NODE, ORIGINAL)
        assert _hook_roots(cluster, NODE) == {name: {ORIGINAL} for name in HOOK_FILES}
        cluster.exec(NODE, ["sh", "-c", REMOVE_COPY])
        rolled_back = True
        assert cluster.exec(NODE, ["test", "-e", NEXT], check=False).returncode != 0

        third = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", NODE)
        jobs.append(third)
        cluster.wait_state(third, "RUNNING")
        third_gpus = frozenset(_gpus(cluster, third))
        assert frozenset(parse_decisions(_wait_record(cluster, third, NODE))[NODE].gpus) == third_gpus
        _release(cluster, third)
        _assert_ledger_empties(cluster, NODE)
        cluster.wait_sacct(third, ("AdminComment", "State"), State="COMPLETED", AdminComment=lambda v: f" # {NODE}=" in v)
    finally:
        if not rolled_back:
            _end_jobs(cluster, NODE, jobs)
            _mapa_hooks(cluster, NODE, ORIGINAL, check=False)
            cluster.exec(NODE, ["sh", "-c", REMOVE_COPY], check=False)
        _ensure_agent(cluster, NODE)


# -- disabling MAPA ------------------------------------------------------------------------------

SHIPPED = "/etc/slurm-mapa/config"  # the read-only bind mount the clusters of both releases share
# slurm.conf and plugstack.conf without MAPA's lines, as local files in place of the links
# (containers/config is shared by both releases' clusters and must not change).
DISABLE = rf"""set -e
for f in slurm.conf plugstack.conf; do
    [ "$(readlink /etc/slurm/$f)" = {SHIPPED}/$f ] || {{ echo "/etc/slurm/$f is not the link to {SHIPPED}/$f" >&2; exit 1; }}
done
sed -E '/^(Prolog|Epilog|TaskProlog)=/d' {SHIPPED}/slurm.conf > /etc/slurm/slurm.conf.new
sed '/spank_mapa_isolate/d' {SHIPPED}/plugstack.conf > /etc/slurm/plugstack.conf.new
chmod 644 /etc/slurm/slurm.conf.new /etc/slurm/plugstack.conf.new
mv -f /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
mv -f /etc/slurm/plugstack.conf.new /etc/slurm/plugstack.conf
"""
RESTORE = (f"rm -f /etc/slurm/slurm.conf.new /etc/slurm/plugstack.conf.new && "
           f"ln -sfn {SHIPPED}/slurm.conf /etc/slurm/slurm.conf && ln -sfn {SHIPPED}/plugstack.conf /etc/slurm/plugstack.conf")
# "systemctl stop mapa-agent" for the entrypoint's restart loop (scripts/mini-cluster-stop-agent, in the
# node through the mounted source): prints the loop's pid; SIGCONT to it starts the agent again.
STOP_AGENT = ["sh", "/opt/slurm-mapa/scripts/mini-cluster-stop-agent"]
MAPA_HOOKS = {"Prolog": [f"{HOOK_DIR}/mapa-prolog-wrapper"], "Epilog": [f"{HOOK_DIR}/mapa-epilog-wrapper"],
              "TaskProlog": [f"{HOOK_DIR}/mapa-taskprolog"]}
NO_HOOKS = {"Prolog": [], "Epilog": [], "TaskProlog": []}
IN_SERVICE = {"IDLE", "MIXED", "ALLOCATED"}  # idle, unless a job runs there
OUT_OF_SERVICE = {"NOT_RESPONDING", "DOWN", "DRAIN", "FAIL", "INVALID_REG", "UNKNOWN", "REBOOT_REQUESTED", "REBOOT_ISSUED"}
DIRECTIVE = "mapa:topology=ring sensitive=yes"  # what job_submit.lua keeps in the comment and AdminComment
# A MAPA job as a user writes it; prints what it got and whether it may open each mock GPU (ENXIO:
# the device cgroup lets it, no driver behind it; EPERM: isolated away), then waits for the test.
DIRECTIVE_JOB = r"""#!/bin/bash
#SBATCH --gres=gpu:2
#MAPA topology=ring sensitive=yes
echo "cvd=${CUDA_VISIBLE_DEVICES-unset}"
echo "slurm=${SLURM_JOB_GPUS-unset}"
echo "mapa=${MAPA_GPUS-unset} ${MAPA_SLURM_JOB_GPUS-unset} ${MAPA_ISOLATION-unset}"
python3 -c '
import errno, os
for i in range(8):
    try:
        os.close(os.open("/dev/nvidia%d" % i, os.O_RDWR))
        print("dev %d OPENED" % i)
    except OSError as e:
        print("dev %d %s" % (i, errno.errorcode[e.errno]))
'
echo probed
for _ in $(seq 1500); do [ -e /shared/jobs/release-$SLURM_JOB_ID ] && exit 0; sleep 0.2; done
exit 3
"""


def _shown_hooks(cluster) -> dict[str, list[str]] | None:
    """The hooks slurmctld's configuration names (`scontrol show config`, Prolog[0]... as 24.11
    and 26.05 print them), None while slurmctld does not answer (it restarts on a reconfigure)."""
    proc = cluster.exec("slurmctld", ["scontrol", "show", "config"], check=False)
    if proc.returncode != 0:
        return None
    conf = parse_show_config(proc.stdout)
    return {key: slurm_values(conf, key) for key in NO_HOOKS}


def _slurmd_nodes(cluster) -> dict[str, tuple[int, set[str]]] | None:
    """Each node's SlurmdStartTime and state flags (None while slurmctld does not answer)."""
    proc = cluster.exec("slurmctld", ["scontrol", "--json", "show", "node"], check=False)
    if proc.returncode != 0:
        return None
    try:
        nodes = json.loads(proc.stdout)["nodes"]
    except (ValueError, KeyError):
        return None
    found = {}
    for node in nodes:
        started = node["slurmd_start_time"]  # a KeyError names the field if this Slurm has none
        if isinstance(started, dict):  # data_parser's {"set": ..., "infinite": ..., "number": ...}
            started = started.get("number") if started.get("set", True) else 0
        found[node["name"]] = (int(started or 0), set(node["state"]))
    return found


def _reconfigure(cluster, hooks: dict[str, list[str]], timeout: float = 90) -> None:
    """`scontrol reconfigure`, then wait until it is live: slurmctld shows ``hooks``, and every
    node's slurmd has restarted and registered again (since Slurm 23.11 a reconfigure restarts
    slurmctld and each slurmd in place; the new slurmd reads the node's slurm.conf afresh and
    registers with a new SlurmdStartTime) and is in service."""
    deadline = time.monotonic() + timeout
    while (before := _slurmd_nodes(cluster)) is None:  # after a failure, slurmctld may be restarting
        if time.monotonic() > deadline:
            raise cluster.Error(f"slurmctld did not answer within {timeout:g} s")
        time.sleep(0.5)
    while (proc := cluster.exec("slurmctld", ["scontrol", "reconfigure"], check=False)).returncode != 0:
        if time.monotonic() > deadline:
            raise cluster.Error(f"scontrol reconfigure failed: {proc.stderr.strip()}")
        time.sleep(0.5)
    shown = nodes = None
    while True:
        shown = _shown_hooks(cluster)
        nodes = _slurmd_nodes(cluster) if shown == hooks else None
        if nodes is not None:
            waiting = [name for name in cluster.nodes
                       if name not in nodes or nodes[name][0] <= before[name][0]
                       or not nodes[name][1] & IN_SERVICE or nodes[name][1] & OUT_OF_SERVICE]
            if not waiting:
                return
        if time.monotonic() > deadline:
            raise cluster.Error(f"the reconfigure was not live after {timeout:g} s: slurmctld shows hooks {shown} "
                                f"(wanted {hooks}); nodes (SlurmdStartTime, state) before {before}, now {nodes}")
        time.sleep(0.5)


def _stop_agents(cluster, loops: dict[str, str]) -> None:
    for node in cluster.nodes:
        _ensure_agent(cluster, node)
        proc = cluster.exec(node, [*STOP_AGENT, AGENT_PROCESS], check=False)
        if proc.stdout.strip().isdigit():
            loops[node] = proc.stdout.strip()  # from here on, the loop is to be continued
        if proc.returncode != 0:
            raise cluster.Error(f"could not stop mapa-agent on {node}: {proc.stderr.strip()}")
    deadline = time.monotonic() + 30
    while listening := [node for node in cluster.nodes if _agent_listening(cluster, node)]:
        if time.monotonic() > deadline:
            raise cluster.Error(f"mapa-agent still listens on {listening} 30 s after SIGTERM")
        time.sleep(0.2)


def test_with_mapa_disabled_a_job_runs_on_slurms_gpus_and_enabling_it_again_brings_mapa_back(cluster):
    """docs/admin.md, "Disabling MAPA": the agents stopped, the hook lines and the SPANK plugin's
    line removed, `scontrol reconfigure`; a job with a #MAPA directive then runs on Slurm's GPUs
    and MAPA leaves no trace of it. Then the same backwards, and MAPA places jobs again."""
    _assert_ledger_empties(cluster, NODE, timeout=60)  # step 1: no job MAPA placed runs there
    containers = ("slurmdbd", "slurmctld", *cluster.nodes)  # every container whose entrypoint links slurm.conf
    shipped = cluster.exec("slurmctld", ["cat", f"{SHIPPED}/slurm.conf"]).stdout
    assert len(re.findall(r"^(?:Prolog|Epilog|TaskProlog)=", shipped, re.M)) == 3, "the shipped slurm.conf names MAPA's three hooks"
    loops: dict[str, str] = {}
    jobid = None
    try:
        # (mapa release on the controller is left running: it acts only on pending
        # placement=require jobs, and there are none here.)
        _stop_agents(cluster, loops)
        for container in containers:
            cluster.exec(container, ["sh", "-c", DISABLE])
        _reconfigure(cluster, NO_HOOKS)

        log_start = _log_size(cluster, NODE)
        jobid = cluster.sbatch(DIRECTIVE_JOB, "-w", NODE)
        cluster.wait_state(jobid, "RUNNING")
        deadline = time.monotonic() + 60
        while "probed" not in (out := cluster.exec("slurmctld", ["cat", f"{cluster.job_dir}/{jobid}.out"], check=False).stdout):
            if time.monotonic() > deadline:
                raise cluster.Error(f"job {jobid} did not print its GPUs: {out!r}")
            time.sleep(0.3)
        # Slurm's GPUs: what scontrol -d show job gives it, in SLURM_JOB_GPUS and (ConstrainDevices=no:
        # node indices) CUDA_VISIBLE_DEVICES; no MAPA variable, every GPU's device file open to it.
        cvd = re.search(r"^cvd=(.*)$", out, re.M).group(1)
        slurm = re.search(r"^slurm=(.*)$", out, re.M).group(1)
        slurm_gpus = _slurm_gpus(cluster, jobid)
        assert re.fullmatch(r"[0-9,-]+", slurm) and re.fullmatch(r"[0-9,-]+", cvd), out
        assert len(slurm_gpus) == 2 and _gpu_list(slurm) == _gpu_list(cvd) == slurm_gpus, (out, slurm_gpus)
        assert re.search(r"^mapa=unset unset unset$", out, re.M), out
        assert dict(re.findall(r"^dev (\d) (\w+)$", out, re.M)) == {str(gpu): "ENXIO" for gpu in range(8)}, out
        # job_submit.lua still checked and kept the directive; no decision record follows it.
        job = cluster.job(jobid)
        assert job.get("admin_comment") == DIRECTIVE and job.get("comment") == DIRECTIVE, (job.get("admin_comment"), job.get("comment"))
        assert parse_decisions(job["admin_comment"]) == {}
        # Nothing of MAPA's on the node: no ledger entry, per-job file or mark, no log line.
        assert str(jobid) not in cluster.ledger_jobs(NODE), cluster.ledger_jobs(NODE)
        files = cluster.exec(NODE, ["ls", "-A", JOBS_DIR], check=False).stdout.split()
        assert not {str(jobid), f".prolog-{jobid}", f".ended-{jobid}"} & set(files), files
        assert f"job {jobid} " not in _log_since(cluster, NODE, log_start)

        _release(cluster, jobid)
        rec = cluster.wait_sacct(jobid, ("AdminComment", "Comment", "State"), State="COMPLETED")
        assert rec["AdminComment"] == DIRECTIVE and rec["Comment"] == DIRECTIVE, rec
        assert f"job {jobid} " not in _log_since(cluster, NODE, log_start)
    finally:
        if jobid is not None:  # ended before MAPA's hooks come back, or the agent would adopt it
            with contextlib.suppress(cluster.Error, KeyError):
                if cluster.state(jobid) not in ENDED:
                    cluster.cancel(jobid)
                    cluster.wait_state(jobid, ENDED, timeout=60)
        # Enabling it again: the links back on every container, the agents started again, reconfigure.
        for container in containers:
            cluster.exec(container, ["sh", "-c", RESTORE], check=False)
        for node, loop in loops.items():
            cluster.exec(node, ["kill", "-CONT", loop], check=False)
        _reconfigure(cluster, MAPA_HOOKS)
        for node in cluster.nodes:
            _ensure_agent(cluster, node)

    # MAPA places jobs again.
    again = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", NODE)
    cluster.wait_state(again, "RUNNING")
    gpus = frozenset(_gpus(cluster, again))
    assert frozenset(parse_decisions(_wait_record(cluster, again, NODE))[NODE].gpus) == gpus
    assert frozenset(cluster.ledger_jobs(NODE)[str(again)]["gpus"]) == gpus
    _release(cluster, again)
    _assert_ledger_empties(cluster, NODE)
