"""The job's CPUs from its cpuset cgroup (slurm/jobcpus.py), on literal /proc/PID/cgroup and
mountinfo texts: the first pair as a Prolog saw them in the mini cluster with PrologFlags=RunInJob
(Slurm 24.11.5, a container whose own cgroup is bound over /sys/fs/cgroup/cpuset)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_mapa.slurm.hooks.job_cpus import cpuset_file, read_job_cpus

CONTAINER = "5c50a8db76447857d58bad36d5fa5eaa577bde32543d802703bc483ff20d8755"
IN_JOB_V1 = (f"12:devices:/docker/{CONTAINER}\n"
             f"3:cpuset:/docker/{CONTAINER}/slurm_dgx1/uid_2001/job_20/step_extern\n"
             f"1:name=systemd:/docker/{CONTAINER}\n0::/docker/{CONTAINER}\n")
MOUNTS_V1 = (f"262 293 0:30 /docker/{CONTAINER} /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
             f"264 293 0:31 /docker/{CONTAINER} /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n")
HOST_V1 = "7:cpuset:/slurm/uid_1000/job_44/step_extern\n"
HOST_MOUNTS_V1 = "30 25 0:27 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset\n"
IN_JOB_V2 = "0::/system.slice/slurmstepd.scope/job_9/step_extern/slurm\n"
MOUNTS_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n"


@pytest.mark.parametrize(
    "proc, mounts, job, expected",
    [
        (IN_JOB_V1, MOUNTS_V1, "20", "/sys/fs/cgroup/cpuset/slurm_dgx1/uid_2001/job_20/cpuset.cpus"),
        (HOST_V1, HOST_MOUNTS_V1, "44", "/sys/fs/cgroup/cpuset/slurm/uid_1000/job_44/cpuset.cpus"),
        (IN_JOB_V2, MOUNTS_V2, "9", "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_9/cpuset.cpus.effective"),
        # a hybrid host: Slurm's v1 cpuset wins over systemd's v2 line
        (HOST_V1 + "0::/system.slice/slurmd.service\n", HOST_MOUNTS_V1 + MOUNTS_V2, "44",
         "/sys/fs/cgroup/cpuset/slurm/uid_1000/job_44/cpuset.cpus"),
        # a mount point with a blank, as mountinfo escapes it
        (HOST_V1, "30 25 0:27 / /mnt/cg\\040set rw - cgroup cgroup rw,cpuset\n", "44", "/mnt/cg set/slurm/uid_1000/job_44/cpuset.cpus"),
    ],
)
def test_the_cpuset_file_of_the_job_the_prolog_runs_in(proc, mounts, job, expected):
    assert cpuset_file(proc, mounts, job) == Path(expected)


@pytest.mark.parametrize(
    "proc, mounts, job",
    [
        (IN_JOB_V1, MOUNTS_V1, "21"),  # another job's cgroup: never read
        (f"3:cpuset:/docker/{CONTAINER}\n", MOUNTS_V1, "20"),  # PrologFlags=Alloc: not in the job (seen in the cluster)
        (IN_JOB_V1, MOUNTS_V1.replace(CONTAINER, "other"), "20"),  # the job's cgroup is outside the mounted part
        (IN_JOB_V1, "", "20"),  # no cpuset hierarchy mounted
        ("7:cpuset:/slurm/uid_1000/job_44/../job_45/step_0\n", HOST_MOUNTS_V1, "44"),
        ("7:cpuset:/slurm/job_44/step_0\n", HOST_MOUNTS_V1, "44"),  # no uid level: not Slurm's v1 layout
        ("garbage\n:::\n", HOST_MOUNTS_V1, "44"),
        ("", "", "44"),
    ],
)
def test_no_file_when_the_prolog_is_not_in_the_job(proc, mounts, job):
    assert cpuset_file(proc, mounts, job) is None


def test_read_job_cpus_reads_the_jobs_cpuset(tmp_path):
    proc = tmp_path / "proc"
    (proc / "812").mkdir(parents=True)
    (proc / "812" / "cgroup").write_text(HOST_V1)
    cpuset = tmp_path / "cpuset"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(HOST_MOUNTS_V1.replace("/sys/fs/cgroup/cpuset", str(cpuset)))
    job = cpuset / "slurm" / "uid_1000" / "job_44"
    job.mkdir(parents=True)
    (job / "cpuset.cpus").write_text("0-3,40-43\n")
    assert read_job_cpus(812, "44", proc, mountinfo) == frozenset({0, 1, 2, 3, 40, 41, 42, 43})
    assert read_job_cpus(812, "45", proc, mountinfo) is None  # another job
    assert read_job_cpus(813, "44", proc, mountinfo) is None  # no such process
    for bad in ("", "x\n", "3-1\n", "0-99999\n"):  # empty (Slurm has not set it) or not a CPU list
        (job / "cpuset.cpus").write_text(bad)
        assert read_job_cpus(812, "44", proc, mountinfo) is None, bad
    (job / "cpuset.cpus").unlink()
    (job / "cpuset.cpus").symlink_to(tmp_path / "elsewhere")  # never followed
    (tmp_path / "elsewhere").write_text("0\n")
    assert read_job_cpus(812, "44", proc, mountinfo) is None


def test_on_slurm_26_05_the_jobs_v2_directory_is_found_by_its_sluid():
    """26.05 names the job's cgroup v2 directory by its SLUID; the Prolog knows it from
    SLURM_JOB_SLUID. Another job's SLUID, or none, finds nothing."""
    in_job = "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_extern/slurm\n"
    assert cpuset_file(in_job, MOUNTS_V2, "9", "sEKNKTV3WPV500") == Path(
        "/sys/fs/cgroup/system.slice/slurmstepd.scope/sEKNKTV3WPV500/cpuset.cpus.effective")
    assert cpuset_file(in_job, MOUNTS_V2, "9", "s00000000000000") is None
    assert cpuset_file(in_job, MOUNTS_V2, "9") is None
