"""A node for the isolation and metrics tests: a fake /proc and cgroupfs, a job 12 on GPUs 4 and 5,
and an agent over them (the ``node`` fixture)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.isolation.isolator import Isolator
from slurm_mapa.slurm.isolation.rules import v1_task_lines

# A batch task under task/cgroup (ConstrainCores, ConstrainRAMSpace) and proctrack/cgroup, cgroup
# v1 on a systemd host: the devices line is slurmd's, as ConstrainDevices=no leaves it.
V1_BATCH = """\
12:devices:/system.slice/slurmd.service
11:freezer:/slurm/uid_1000/job_12/step_batch
10:memory:/slurm/uid_1000/job_12/step_batch/task_0
7:cpuset:/slurm/uid_1000/job_12/step_batch/task_0
4:cpu,cpuacct:/system.slice/slurmd.service
1:name=systemd:/system.slice/slurmd.service
0::/system.slice/slurmd.service
"""


# The v1 hierarchies of a systemd host, each mounted at <cgroupfs>/<its controllers>, as
# /proc/self/mountinfo lists them (name=systemd is systemd's own, which it delegates to users).
V1_HIERARCHIES = ("devices", "freezer", "memory", "cpuset", "cpu,cpuacct", "name=systemd")


def v1_mountinfo(cgroupfs: Path) -> str:
    return "".join(f"{36 + n} 31 0:{33 + n} / {cgroupfs}/{name} rw - cgroup cgroup rw,{name}\n"
                   for n, name in enumerate(V1_HIERARCHIES))


def slurmd_made(cgroupfs: Path, cgroup_text: str) -> None:
    """The v1 cgroups slurmd makes for a task whose /proc/PID/cgroup is ``cgroup_text``: its
    Slurm step directories in each hierarchy the text names (root's, as the test runs as root)."""
    for line in v1_task_lines(cgroup_text):
        (cgroupfs / ",".join(line.controllers) / line.cgroup.path.lstrip("/")).mkdir(parents=True, exist_ok=True)


class FakeProc:
    """A /proc with the processes a test lays out: pid -> (name, ppid, uid, cgroup text, exe).
    With ``cgroupfs``, each process's Slurm v1 cgroups are made there as slurmd would have
    (``slurmd=False``: a test lays out the directories itself)."""

    def __init__(self, root: Path, cgroupfs: Path | None = None):
        self.root = root
        self.cgroupfs = cgroupfs

    def add(self, pid, name, ppid, uid, cgroup="", exe="/usr/bin/python3", uids=None, slurmd=True):
        if self.cgroupfs is not None and slurmd:
            slurmd_made(self.cgroupfs, cgroup)
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        real, effective, saved = uids or (uid, uid, uid)
        (d / "status").write_text(f"Name:\t{name}\nPPid:\t{ppid}\nUid:\t{real}\t{effective}\t{saved}\t{effective}\n")
        (d / "cgroup").write_text(cgroup)
        if (d / "exe").is_symlink():
            (d / "exe").unlink()
        os.symlink(exe, d / "exe")


STEPD = "/usr/sbin/slurmstepd-wlm"


def fake_binary_problem(exe_link):
    """The fake /proc links to programs this host may lack: Slurm's is STEPD, anything else is not
    (slurmstepd_binary_problem, which stats the real file, is tested on real files below)."""
    return None if os.readlink(exe_link) == STEPD else f"it runs {os.readlink(exe_link)!r}, not a slurmstepd"
USER = 1000  # the job's user (the agent gets it from the socket; these tests pass it)


def _as_task(proc, cgroup_text: str) -> None:
    """The test process as a TaskProlog's client, all three in the cgroups of ``cgroup_text``: this
    process (pid os.getpid()), its TaskProlog's shell (5001) and the task before exec (5000, a
    slurmstepd of the job's user, child of the step's slurmstepd 4000)."""
    proc.add(os.getpid(), "python3", 5001, USER, cgroup_text)
    proc.add(5001, "sh", 5000, USER, cgroup_text, exe="/bin/dash")
    proc.add(5000, "slurmstepd", 4000, USER, cgroup_text, exe=STEPD)


@pytest.fixture
def node(tmp_path):
    """A node: config, jobs directory with job 12 (GPUs 4,5), a fake /proc and cgroupfs, an agent."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5\n")
    (tmp_path / "jobs" / ".prolog-13").write_text("pid=0 start=0 slurm=\n")  # a job without GPUs
    cgroupfs = tmp_path / "cgroupfs"
    (cgroupfs / "devices").mkdir(parents=True)
    (cgroupfs / "devices" / "devices.list").write_text("a *:* rwm\n")  # a host's root cgroup
    (cgroupfs / "unified").mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(v1_mountinfo(cgroupfs) + f"45 31 0:48 / {cgroupfs}/unified rw - cgroup2 cgroup2 rw\n")
    proc = FakeProc(tmp_path / "proc", cgroupfs)
    _as_task(proc, V1_BATCH)  # this test as the TaskProlog's client, the TaskProlog, the task before exec
    proc.add(4000, "slurmstepd", 1, 0, "", exe=STEPD)  # the step's slurmstepd
    attached: list[tuple[Path, bytes]] = []
    agent = Agent(str(tmp_path / "mapa.toml"), node="dgx1",
                  isolator=Isolator(proc.root, mountinfo, attach=lambda d, p: attached.append((d, p)),
                                    binary_problem=fake_binary_problem))

    def configure(mode):
        (tmp_path / "mapa.toml").write_text(
            f'jobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\nledger = "{tmp_path}/ledger.json"\n'
            f'isolation = "{mode}"\n[nodes]\n"dgx*" = "dgx1-v100"\n')

    configure("fail-open")
    return agent, proc, cgroupfs, attached, configure, tmp_path


def systemd_delegated(cgroupfs: Path, hierarchy: str, uid: int, below: str) -> str:
    """A subtree systemd delegated to ``uid`` in a v1 ``hierarchy`` (user@UID.service with
    Delegate=yes: the service's cgroup and everything in it belong to the user), with the user's
    own cgroups ``below`` it (e.g. slurm/uid_U/job_999/step_batch, named like Slurm's); the
    /proc/PID/cgroup path of the deepest."""
    service = f"/user.slice/user-{uid}.slice/user@{uid}.service"
    top = cgroupfs / hierarchy / service.lstrip("/")
    (top / below).mkdir(parents=True, exist_ok=True)
    path = top
    os.chown(path, uid, uid)
    for part in Path(below).parts:
        path = path / part
        os.chown(path, uid, uid)
    return f"{service}/{below}"
