"""Security round 5: on cgroup v1 and hybrid hosts systemd gives each logged-in user a cgroup
subtree of their own (user@UID.service, Delegate=yes) in its name=systemd hierarchy, and in the
controllers it delegates (memory, cpu, pids). A job's user can name cgroups there like Slurm's and
move a process in; the agent must read a process's job as Slurm defines it: only the hierarchies
Slurm's plugin uses, only cgroups slurmd made (job_J and everything above it root's), what lies
below a step that step's, the freezer deciding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_node import STEPD, USER, V1_BATCH, _as_task, node, systemd_delegated  # noqa: F401 - node: the fixture

from slurm_mapa.slurm.isolation.cgroups import slurm_cgroup_of
from slurm_mapa.slurm.isolation.rules import (CgroupMount, IsolationError, cgroup_mount_entries, mapa_job_cgroup_level,
                                              path_below, v1_mount_of)

# The attacks chown cgroups to a user: the suite runs as root (as CI does), or these fail.


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _moved_into_own_step_and_forged(cgroupfs: Path, uid: int = USER, job: str = "12", victim: str = "999") -> str:
    """A task of ``job`` whose user moved it into a cgroup of their own below its step in every
    Slurm hierarchy (lines the agent ignored before), and into cgroups named like ``victim``'s in
    systemd's hierarchy and in the memory hierarchy systemd delegated to them."""
    forged = f"slurm/uid_{uid}/job_{victim}/step_batch"
    systemd = systemd_delegated(cgroupfs, "name=systemd", uid, forged)
    memory = systemd_delegated(cgroupfs, "memory", uid, forged)
    own = f"/slurm/uid_{uid}/job_{job}/step_batch/mine"
    for hierarchy in ("freezer", "cpuset"):
        (cgroupfs / hierarchy / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return (f"12:devices:/system.slice/slurmd.service\n11:freezer:{own}\n10:memory:{memory}\n7:cpuset:{own}\n"
            f"4:cpu,cpuacct:/system.slice/slurmd.service\n1:name=systemd:{systemd}\n0::/user.slice/user-{uid}.slice\n")


def test_a_task_in_its_own_steps_subcgroup_and_a_forged_systemd_path_gets_its_own_jobs_gpus(node):
    """High: job 12's user once reached job 999's GPUs (and lost their own) this way, through the
    isolate socket and through the sweep, which also wrote a false note into job 999's record."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "999").write_text("MAPA_GPUS=0,1\n")
    text = _moved_into_own_step_and_forged(cgroupfs)
    _as_task(proc, text)
    answer = agent.isolate(os.getpid(), USER, {})
    assert answer.startswith("done cgroup-v1 gpus=4,5 job 12 step batch"), answer
    assert not (cgroupfs / "devices" / "mapa" / "job_999").exists()
    assert agent.job_of(5000, USER) == "12"


def _noted_jobs(tmp_path: Path) -> list[str]:
    """The jobs the agent journaled a note for (their AdminComment records to be)."""
    from slurm_mapa.slurm.config import load_hook_config
    from slurm_mapa.slurm.node_state import NodeState, journal

    config, _ = load_hook_config({"MAPA_CONFIG": str(tmp_path / "mapa.toml")}, validate=False)
    return [journal.job_of(name) for name, _, _ in NodeState.of(config).pending_records()]


def test_the_sweep_confines_such_a_task_to_its_own_job_and_notes_only_that_job(node):
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "999").write_text("MAPA_GPUS=0,1\n")
    proc.add(6000, "python3", 5000, USER, _moved_into_own_step_and_forged(cgroupfs), slurmd=False)
    moved = agent.sweep_isolation()
    assert moved.get("12", 0) >= 1 and "999" not in moved, moved
    assert "6000" in _lines(cgroupfs / "devices" / "mapa" / "job_12" / "cgroup.procs")
    assert not (cgroupfs / "devices" / "mapa" / "job_999").exists()
    assert set(_noted_jobs(tmp_path)) == {"12"}


def test_a_user_with_no_job_in_forged_paths_is_no_task_of_any_job(node):
    """Medium: such a user's connections were counted against job 999's share (its own task then
    got no answer). Now the public socket turns them away: no Slurm job's cgroups hold them."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    forged = "slurm/uid_4242/job_999/step_batch"
    text = (f"10:memory:{systemd_delegated(cgroupfs, 'memory', 4242, forged)}\n"
            f"4:cpu,cpuacct:{systemd_delegated(cgroupfs, 'cpu,cpuacct', 4242, forged)}\n"
            f"1:name=systemd:{systemd_delegated(cgroupfs, 'name=systemd', 4242, forged)}\n")
    proc.add(7000, "python3", 1, 4242, text, slurmd=False)
    assert agent.job_of(7000, 4242) is None
    mounts = cgroup_mount_entries((tmp_path / "mountinfo").read_text())
    with pytest.raises(IsolationError, match="none of slurmd.s: the cgroup .*user@4242.service/slurm/uid_4242/job_999 belongs to uid 4242, not root"):
        slurm_cgroup_of(text, mounts)
    # Had slurmd made them (root's all the way up), the same path would be job 999's.
    for hierarchy in ("memory", "cpu,cpuacct", "name=systemd"):
        for directory in [cgroupfs / hierarchy / "user.slice"] + list((cgroupfs / hierarchy / "user.slice").rglob("*")):
            os.chown(directory, 0, 0)
    assert agent.job_of(7000, 4242) == "999"


def test_a_slurm_path_in_a_hierarchy_not_mounted_here_is_not_believed(node):
    agent, proc, cgroupfs, _, _, tmp_path = node
    proc.add(7001, "python3", 1, USER, "9:blkio,freezer:/slurm/uid_1000/job_12/step_0\n", slurmd=False)
    assert agent.job_of(7001, USER) is None  # no blkio,freezer hierarchy is mounted: nothing to check it by


def test_an_own_step_subcgroup_of_the_devices_hierarchy_named_like_mapas_is_not_mapas():
    """The sweep skips a process already in its job's MAPA devices cgroup: only the agent's own
    directories under the devices hierarchy's mounted root count, not one a user made elsewhere."""
    assert mapa_job_cgroup_level("/mapa/job_12/step_0", "12") == ("0", None)
    assert mapa_job_cgroup_level("/docker/ab/mapa/job_12", "12", devices_root="/docker/ab") == (None, None)
    assert mapa_job_cgroup_level("/user.slice/user-1000.slice/user@1000.service/mapa/job_12", "12") is None
    assert mapa_job_cgroup_level("/slurm/uid_1000/job_12/step_0/mapa/job_12", "12") is None
    assert mapa_job_cgroup_level("/mapa/job_12", "12", devices_root="/docker/ab") is None
    assert mapa_job_cgroup_level("/mapa/job_12/step_0/x", "12") is None


def test_paths_are_read_against_the_mounts_root_as_in_a_container():
    """Docker on v1 (the host's cgroup namespace) mounts a container's own cgroup: mountinfo's root
    is /docker/<id>, and /proc/PID/cgroup paths start with it."""
    mountinfo = ("40 31 0:35 /docker/ab /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n"
                 "41 31 0:36 / /sys/fs/cgroup/cpu\\040x rw - cgroup cgroup rw,cpu,cpuacct\n")
    mounts = cgroup_mount_entries(mountinfo)
    assert mounts[0] == CgroupMount(1, "/sys/fs/cgroup/freezer", "/docker/ab", ("rw", "freezer"))
    assert mounts[1].point == "/sys/fs/cgroup/cpu x"
    assert v1_mount_of(("freezer",), mounts, "/docker/ab/slurm/uid_1/job_2") == (mounts[0], "/sys/fs/cgroup/freezer/slurm/uid_1/job_2")
    assert v1_mount_of(("freezer",), mounts, "/docker/abc/slurm/uid_1/job_2") is None  # another container's
    assert v1_mount_of(("cpuacct", "cpu"), mounts, "/slurm/uid_1/job_2") == (mounts[1], "/sys/fs/cgroup/cpu x/slurm/uid_1/job_2")
    assert v1_mount_of(("memory",), mounts, "/slurm/uid_1/job_2") is None
    assert path_below("/docker/ab/../x", "/docker/ab") is None
    assert path_below("/docker/ab", "/docker/ab") == "/"
