"""A node for the isolation and metrics tests: a fake /proc and cgroupfs, a job 12 on GPUs 4 and 5,
and an agent over them (the ``node`` fixture)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.isolation.isolator import Isolator

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


class FakeProc:
    """A /proc with the processes a test lays out: pid -> (name, ppid, uid, cgroup text, exe)."""

    def __init__(self, root: Path):
        self.root = root

    def add(self, pid, name, ppid, uid, cgroup="", exe="/usr/bin/python3", uids=None):
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
    mountinfo.write_text(f"36 31 0:33 / {cgroupfs}/devices rw - cgroup cgroup rw,devices\n"
                         f"41 31 0:38 / {cgroupfs}/unified rw - cgroup2 cgroup2 rw\n")
    proc = FakeProc(tmp_path / "proc")
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
