"""GPU isolation on a real cgroup2 hierarchy: Slurm's v2 task cgroups, made as its cgroup/v2 plugin
makes them, and the real BPF device programs attached to them by ``apply_v2``.

Slurm's cgroup/v2 plugin puts a task at ``<scope>/job_J/step_S/user/task_T`` (Slurm 24.11) or, from
Slurm 26.05, at ``<scope>/<SLUID>/step_S/user/task_T`` (src/plugins/cgroup/v2/cgroup_v2.c; the SLUID
is ``s`` and 13 Crockford base32 characters, src/common/sluid.c), every directory root's. Here both
layouts are built under a test directory of the host's cgroup2 mount (on a hybrid v1 host, its
unified mount). Processes are moved into them; the kernel's /proc/PID/cgroup is read with the
project's reader; the job's, a step's and a task's programs are attached; and mock device files
(``c 195:N``, no driver behind them) are opened from inside and outside. An open the programs allow
reaches the absent driver (ENXIO); a denied one fails in the device check (EPERM).

Needs root and a writable cgroup2 mount: skipped without them, failed instead when
``MAPA_REQUIRE_CLUSTER=1`` (CI), so that the check cannot pass there unrun.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_mapa.slurm.isolation.cgroups import apply_v2, check_v2_job_cgroup_owner, read_proc_cgroup, release_job
from slurm_mapa.slurm.isolation.rules import NVIDIA_MAJOR, IsolationError, SlurmCgroup, cgroup_mounts, device_rules, parse_proc_cgroup

MINORS = range(8)  # /dev/nvidia0../dev/nvidia7
JOB_GPUS = (0, 1, 2, 3)  # the job's: 4-7 denied at job_J
STEP_GPUS = (1, 2)  # step 0's: 0 and 3 denied too at step_0/user
TASK_GPUS = (2,)  # task 1 of step 0, with isolation_scope = "task": only 2
# (the job directory's name, the job id parse_proc_cgroup gives, the SLUID it gives)
LAYOUTS = [
    pytest.param("job_4242", "4242", "", id="slurm-24.11-job_J"),
    pytest.param("sEKNKTV3WPV500", "", "sEKNKTV3WPV500", id="slurm-26.05-SLUID"),
]


def _unusable() -> str | None:
    """Why this host cannot run these tests, or None."""
    if os.geteuid() != 0:
        return "needs root (creates cgroups and attaches BPF device programs)"
    try:
        _, unified = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError as error:
        return f"cannot read /proc/self/mountinfo: {error}"
    if unified is None:
        return "no cgroup2 file system is mounted (see /proc/self/mountinfo)"
    if not os.access(unified, os.W_OK):
        return f"the cgroup2 mount {unified} is not writable"
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("MAPA_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"MAPA_REQUIRE_CLUSTER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _char_majors() -> set[int]:
    """The character device majors that have a driver (/proc/devices)."""
    majors, in_char = set(), False
    for line in Path("/proc/devices").read_text().splitlines():
        if line.endswith("devices:"):
            in_char = line.startswith("Character")
        elif in_char and line.split() and line.split()[0].isdigit():
            majors.add(int(line.split()[0]))
    return majors


def _rules(minors, major: int):
    """device_rules("nvidia", minors), moved to ``major`` when 195 has a driver on this host."""
    return tuple(dataclasses.replace(rule, major=major) for rule in device_rules("nvidia", minors))


# Runs in the cgroup it is told (writes its own pid into cgroup.procs first), then opens each file
# and prints {file name: errno, 0 if it opened} and its /proc/self/cgroup.
PROBE = """\
import json, os, sys
if sys.argv[1]:
    with open(sys.argv[1], "w") as procs:
        procs.write(str(os.getpid()))
result = {}
for name in sys.argv[2:]:
    try:
        os.close(os.open(name, os.O_RDWR))
        result[os.path.basename(name)] = 0
    except OSError as error:
        result[os.path.basename(name)] = error.errno
with open("/proc/self/cgroup") as own:
    print(json.dumps({"opens": result, "cgroup": own.read()}))
"""


class Tree:
    """A test directory on the cgroup2 mount; removed, with every cgroup in it, at the end."""

    def __init__(self, unified: Path) -> None:
        self.unified = unified
        self.base = unified / f"mapa-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.children: list[subprocess.Popen] = []

    def sleeper(self, cgroup: Path) -> int:
        """A ``sleep`` moved into ``cgroup``, as slurmstepd moves a task; its pid."""
        child = subprocess.Popen(["sleep", "60"])
        self.children.append(child)
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        return child.pid

    def probe(self, cgroup: Path | None, files) -> dict:
        procs = str(cgroup / "cgroup.procs") if cgroup is not None else ""
        done = subprocess.run([sys.executable, "-c", PROBE, procs, *map(str, files)],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def remove(self) -> list[str]:
        """Kill our children, move anything left out to the mount's root, rmdir bottom-up."""
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
            child.wait()
        problems: list[str] = []
        if not self.base.exists():
            return problems
        deadline = time.monotonic() + 5
        while True:
            problems = []
            for top, _, _ in os.walk(self.base, topdown=False):
                directory = Path(top)
                try:
                    for pid in (directory / "cgroup.procs").read_text().split():
                        try:
                            (self.unified / "cgroup.procs").write_text(pid)
                        except OSError:
                            pass  # gone meanwhile
                    directory.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as error:
                    problems.append(f"{directory}: {error}")
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.05)  # a killed child leaves its cgroup a moment after wait()


@pytest.fixture
def tree():
    reason = _unusable()
    if reason is not None:
        _skip_or_fail(reason)
    _, unified = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    made = Tree(Path(unified))
    try:
        made.base.mkdir()
    except OSError as error:
        _skip_or_fail(f"cannot make a cgroup under the cgroup2 mount {unified}: {error}")
    try:
        yield made
    finally:
        problems = made.remove()
        assert problems == [], f"test cgroups left behind: {problems}"


def _slurm_dirs(tree: Tree, job_dir_name: str) -> tuple[Path, Path]:
    """Slurm's scope and job directory, as cgroup/v2 makes them (root's, mode 755)."""
    scope = tree.base / "system.slice" / "slurmstepd.scope"
    job_dir = scope / job_dir_name
    for directory in (job_dir / "step_0" / "user" / "task_0", job_dir / "step_0" / "user" / "task_1",
                      job_dir / "step_0" / "slurm", job_dir / "step_1" / "user" / "task_0"):
        directory.mkdir(parents=True)
    return scope, job_dir


@pytest.mark.parametrize("job_dir_name, job_id, sluid", LAYOUTS)
def test_a_task_in_slurms_real_v2_cgroup_is_read_and_its_job_cgroup_owner_checked(tree, job_dir_name, job_id, sluid):
    _, job_dir = _slurm_dirs(tree, job_dir_name)
    task_dir = job_dir / "step_0" / "user" / "task_0"
    pid = tree.sleeper(task_dir)
    text = read_proc_cgroup(Path("/proc"), pid)
    cgroup = parse_proc_cgroup(text)
    relative = "/" + str(task_dir.relative_to(tree.unified))
    assert cgroup == SlurmCgroup(2, job_id, "0", "0", relative, sluid), text
    assert tree.unified / cgroup.path.lstrip("/") == task_dir  # the kernel's path is the mount's

    # slurmstepd's own cgroup (where the SPANK plugin's task still is) is read the same way.
    stepd = tree.sleeper(job_dir / "step_0" / "slurm")
    assert parse_proc_cgroup(read_proc_cgroup(Path("/proc"), stepd)) == SlurmCgroup(
        2, job_id, "0", None, "/" + str((job_dir / "step_0" / "slurm").relative_to(tree.unified)), sluid)

    check_v2_job_cgroup_owner(tree.unified, cgroup)  # Slurm's: root's all the way up
    for directory in (job_dir, job_dir.parent.parent):  # the job's cgroup, or one above it, a user's
        os.chown(directory, 1000, 1000)
        try:
            with pytest.raises(IsolationError, match=f"the cgroup {directory} belongs to uid 1000, not root"):
                check_v2_job_cgroup_owner(tree.unified, cgroup)
        finally:
            os.chown(directory, 0, 0)
    check_v2_job_cgroup_owner(tree.unified, cgroup)


@pytest.mark.parametrize("job_dir_name, job_id, sluid", LAYOUTS)
def test_the_real_bpf_programs_deny_other_gpus_with_eperm_in_both_layouts(tree, tmp_path, job_dir_name, job_id, sluid):
    drivers = _char_majors()
    # No driver behind the mock files: an allowed open reaches chrdev_open and fails with ENXIO.
    major = NVIDIA_MAJOR if NVIDIA_MAJOR not in drivers else next(m for m in (*range(240, 255), *range(60, 64))
                                                                   if m not in drivers)
    devices = [tmp_path / f"nvidia{minor}" for minor in MINORS] + [tmp_path / "nvidiactl"]
    for minor, path in zip((*MINORS, 255), devices):
        os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
    files = [*devices, Path("/dev/null")]
    nothing_denied = {**{path.name: errno.ENXIO for path in devices}, "null": 0}
    assert tree.probe(None, files)["opens"] == nothing_denied  # checked before anything is attached

    _, job_dir = _slurm_dirs(tree, job_dir_name)
    step0 = job_dir / "step_0" / "user"
    cgroups = {}
    for where in (step0 / "task_0", step0 / "task_1", job_dir / "step_1" / "user" / "task_0"):
        cgroups[where] = parse_proc_cgroup(read_proc_cgroup(Path("/proc"), tree.sleeper(where)))
        assert cgroups[where] is not None and cgroups[where].sluid == sluid and cgroups[where].job_id == job_id

    attached: set = set()
    job_rules, step_rules = _rules(JOB_GPUS, major), _rules(STEP_GPUS, major)
    # As the agent does: the job's program on job_J (or the SLUID directory) and step 0's on
    # step_0/user, once each; then task 1's (isolation_scope = "task"), and nothing new for step 1.
    assert apply_v2(tree.unified, cgroups[step0 / "task_0"], job_rules, step_rules, attached=attached) == [job_dir, step0]
    assert apply_v2(tree.unified, cgroups[step0 / "task_0"], job_rules, step_rules, attached=attached) == []
    assert apply_v2(tree.unified, cgroups[step0 / "task_1"], job_rules, step_rules, attached=attached,
                    task_rules=_rules(TASK_GPUS, major)) == [step0 / "task_1"]
    assert apply_v2(tree.unified, cgroups[job_dir / "step_1" / "user" / "task_0"], job_rules, None, attached=attached) == []

    def expected(openable):
        return {**{f"nvidia{m}": errno.ENXIO if m in openable else errno.EPERM for m in MINORS},
                "nvidiactl": errno.ENXIO, "null": 0}

    for where, openable in ((step0 / "task_0", STEP_GPUS), (step0 / "task_1", TASK_GPUS),
                            (job_dir / "step_1" / "user" / "task_0", JOB_GPUS)):
        seen = tree.probe(where, files)
        assert parse_proc_cgroup(seen["cgroup"]).path == "/" + str(where.relative_to(tree.unified))
        assert seen["opens"] == expected(openable), where
    # A process outside the job's cgroup still opens every GPU (ENXIO, not EPERM).
    assert tree.probe(tree.base, files)["opens"] == nothing_denied
    assert tree.probe(None, files)["opens"] == nothing_denied

    # The Epilog's release_job does nothing on v2 (the programs go with Slurm's cgroups): on a
    # host with only a cgroup2 mount it reports nothing and leaves the cgroups as they are.
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 23 0:38 / {tree.unified} rw,relatime - cgroup2 cgroup2 rw\n")
    assert release_job(job_id or "4242", mountinfo) == []
    assert tree.probe(step0 / "task_0", files)["opens"] == expected(STEP_GPUS)

    # Slurm removes the job's cgroups at the end of the job, and the programs go with them: the
    # same directories made again (a requeued job) deny nothing, and the agent, which knows
    # cgroups by path and inode, attaches its programs to them afresh.
    for child in tree.children:
        child.kill()
        child.wait()
    tree.children.clear()
    deadline = time.monotonic() + 5
    while True:
        try:
            for top, _, _ in os.walk(job_dir, topdown=False):
                os.rmdir(top)
            break
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert not job_dir.exists()
    (step0 / "task_0").mkdir(parents=True)
    assert tree.probe(step0 / "task_0", files)["opens"] == nothing_denied
    assert apply_v2(tree.unified, cgroups[step0 / "task_0"], job_rules, step_rules, attached=attached) == [job_dir, step0]
    assert tree.probe(step0 / "task_0", files)["opens"] == expected(STEP_GPUS)
