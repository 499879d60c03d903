"""GPU device isolation: /proc/PID/cgroup texts of both cgroup versions, the v1 rule lines, the v2
BPF program run by a small interpreter, writes to a fake cgroupfs, the agent's isolate requests
with their peer checks, the modes, and (as root, on a host with a v1 devices hierarchy) the kernel."""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from repo_paths import REPO
from fake_node import STEPD, USER, V1_BATCH, FakeProc, _as_task, fake_binary_problem, node, systemd_delegated  # noqa: F401 - node: the fixture

from slurm_mapa.errors import InputError
from slurm_mapa.slurm.agent import client as agent_client
from slurm_mapa.slurm.node_state import journal
from slurm_mapa.slurm.text.decision import parse_decisions
from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.agent.server import PUBLIC_PER_UID, serve, serve_isolation
from slurm_mapa.slurm.config import config_from_text
from slurm_mapa.slurm.admin.install import taskprolog_text
from slurm_mapa.slurm.isolation.isolator import Isolator
from slurm_mapa.slurm.isolation.bpf import device_program, prog_attach_attr, prog_load_attr
from slurm_mapa.slurm.isolation.cgroups import (apply_v1, apply_v2, release_job_v1, v1_allowed_minors, v1_step_minors,
                                                v1_update_writes, v1_writes)
from slurm_mapa.slurm.isolation.rules import (DenyRange, IsolationError, SlurmCgroup, cgroup_mounts, device_rules, gpus_of_step,
                                              parse_proc_cgroup, parse_status, slurm_gpu_list, v1_rule_lines)


# --- /proc/PID/cgroup ---------------------------------------------------------------------------
# V1_BATCH (fake_node.py): a batch task on cgroup v1; V2_STEP: a step's task on cgroup v2.
V2_STEP = "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_3\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        (V1_BATCH, SlurmCgroup(1, "12", "batch", "0", "/slurm/uid_1000/job_12/step_batch", uid=1000)),
        ("6:freezer:/slurm/uid_1000/job_77/step_3\n5:devices:/\n",  # proctrack/cgroup only: no task level
         SlurmCgroup(1, "77", "3", None, "/slurm/uid_1000/job_77/step_3", uid=1000)),
        ("6:freezer:/slurm_node7/uid_0/job_5/step_0+1/task_2\n",  # MULTIPLE_SLURMD prepend, a het component
         SlurmCgroup(1, "5", "0+1", "2", "/slurm_node7/uid_0/job_5/step_0+1", uid=0)),
        ("3:cpuset:/slurm/uid_1000/job_9/step_interactive/task_0\n",
         SlurmCgroup(1, "9", "interactive", "0", "/slurm/uid_1000/job_9/step_interactive", uid=1000)),
        (V2_STEP, SlurmCgroup(2, "12", "0", "3", V2_STEP[3:-1])),
        ("0::/system.slice/slurmstepd.scope/job_12/step_batch/user/task_special\n",
         SlurmCgroup(2, "12", "batch", "special", "/system.slice/slurmstepd.scope/job_12/step_batch/user/task_special")),
        ("0::/system.slice/node1_slurmstepd.scope/job_4/step_extern/user/task_special\n",
         SlurmCgroup(2, "4", "extern", "special", "/system.slice/node1_slurmstepd.scope/job_4/step_extern/user/task_special")),
        # slurmstepd's own cgroup: where a forked task is when the SPANK plugin asks, as root (the
        # uid check keeps it from a TaskProlog's request: a task there is no process of the user)
        ("0::/system.slice/slurmstepd.scope/job_12/step_0/slurm\n",
         SlurmCgroup(2, "12", "0", None, "/system.slice/slurmstepd.scope/job_12/step_0/slurm")),
    ],
)
def test_slurm_cgroup_paths_of_both_versions_name_the_job_and_step(text, expected):
    assert parse_proc_cgroup(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "0::/user.slice/user-1000.slice/session-3.scope\n",  # a login shell
        "0::/system.slice/slurmstepd.scope/job_12/step_0/slurm/x\n",
        "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_0/../../../x\n",
        # Two hierarchies that disagree, neither of them the freezer's (proctrack's, which decides)
        "10:memory:/slurm/uid_1000/job_12/step_0\n7:cpuset:/slurm/uid_1000/job_13/step_0/task_0\n",
        "10:memory:/slurm/uid_1000/job_12/step_0\n7:cpuset:/slurm/uid_1001/job_12/step_0/task_0\n",
        "11:freezer:/slurm/job_12/step_0\n",  # no uid level: not Slurm's v1 layout
        "11:freezer:/slurm/uid_1000/job_12/step_x/task_0\n",
        "11:freezer:/x/job_3/slurm/uid_1000/job_12/step_0\n",  # a Slurm level above Slurm's top directory
        # Hierarchies Slurm's plugin never uses: systemd's own (delegated to each logged-in
        # user under user@UID.service) and pids (security round 5)
        "1:name=systemd:/user.slice/user-1000.slice/user@1000.service/slurm/uid_1000/job_999/step_batch\n",
        "5:pids:/slurm/uid_1000/job_12/step_0\n",
        "garbage\n\n:::\n",
        "",
    ],
)
def test_texts_that_are_no_slurm_task_give_none(text):
    assert parse_proc_cgroup(text) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        # A user's own cgroups, made inside their step's v1 directory (where it is theirs)
        # and named like another job's: the outermost Slurm path is the job (security round 5).
        ("11:freezer:/slurm/uid_1000/job_12/step_0/slurm/uid_1001/job_999/step_batch\n"
         "10:memory:/slurm/uid_1000/job_12/step_0/slurm/uid_1001/job_999/step_batch\n", ("12", "0", None, 1000)),
        ("11:freezer:/slurm/uid_1000/job_12/step_0/task_0/slurm/uid_1000/job_999/step_batch/task_0\n", ("12", "0", "0", 1000)),
        ("11:freezer:/docker/abc/slurm/uid_1000/job_12/step_batch/x/slurm/uid_1000/job_9/step_0\n", ("12", "batch", None, 1000)),
        ("11:freezer:/slurm/uid_1000/job_12/step_batch/mine\n", ("12", "batch", None, 1000)),
        # The freezer (proctrack/cgroup: the job Slurm kills the process with) decides
        ("11:freezer:/slurm/uid_1000/job_12/step_0\n10:memory:/slurm/uid_1000/job_13/step_0/task_0\n", ("12", "0", None, 1000)),
        ("11:freezer:/slurm/uid_1000/job_12/step_0\n10:memory:/slurm/uid_1000/job_12/step_0/task_2\n", ("12", "0", "2", 1000)),
        # systemd's forged line is not read; the task's own lines are
        ("11:freezer:/slurm/uid_1000/job_12/step_batch/x\n"
         "1:name=systemd:/user.slice/user-1000.slice/user@1000.service/slurm/uid_1000/job_999/step_batch\n",
         ("12", "batch", None, 1000)),
    ],
)
def test_a_path_below_a_step_is_that_steps_and_the_freezer_decides(text, expected):
    cgroup = parse_proc_cgroup(text)
    assert (cgroup.job_id, cgroup.step, cgroup.task, cgroup.uid) == expected


def test_status_and_mountinfo_parsers():
    status = "Name:\tslurmstepd\nUmask:\t0022\nState:\tS (sleeping)\nPPid:\t4100\nUid:\t1000\t1000\t1000\t1000\n"
    info = parse_status(4242, status)
    assert (info.pid, info.name, info.ppid, info.uids) == (4242, "slurmstepd", 4100, (1000, 1000, 1000))
    with pytest.raises(ValueError, match="lacks Name, PPid or Uid"):
        parse_status(1, "Name:\tx\n")
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "36 31 0:33 / /sys/fs/cgroup/devices rw,nosuid shared:16 - cgroup cgroup rw,devices\n"
        "37 31 0:34 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw shared:5 - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    assert cgroup_mounts(mountinfo) == ("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")
    assert cgroup_mounts("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n") == (None, "/sys/fs/cgroup")


def test_a_step_gets_the_mapa_gpus_paired_with_slurms_like_the_taskprolog_exports():
    """Issue 24: a step (or a task, whose SLURM_STEP_GPUS Slurm narrows) gets MAPA's GPUs paired
    one to one with the GPUs Slurm gave it, never "the job's first k"."""
    from slurm_mapa.slurm.node_state.job_files import JobMapping

    mapping = JobMapping((4, 7, 6, 5), (0, 1, 2, 3), (7, 6, 5, 4))  # Slurm's 0 is MAPA's 7, 1 is 6, ...
    assert gpus_of_step((4, 7, 6, 5), mapping, "0", "0,1") == (7, 6)
    assert gpus_of_step((4, 7, 6, 5), mapping, "1", "2-3") == (5, 4)  # a concurrent step: the other two
    assert gpus_of_step((4, 7, 6, 5), mapping, "2", "3") == (4,)  # a task of --gpus-per-task=1
    assert gpus_of_step((4, 7, 6, 5), mapping, "3", None) == ()  # --gres=gpu:0: Slurm unset it
    assert gpus_of_step((4, 7, 6, 5), mapping, "batch", None) == (4, 7, 6, 5)
    assert gpus_of_step((4, 7, 6, 5), mapping, "interactive", "0") == (4, 7, 6, 5)
    assert gpus_of_step((4, 7, 6, 5), mapping, "0+1", "1") == (6,)  # a het step's component
    assert gpus_of_step((4, 7, 6, 5), mapping, "0", "0,9") == (4, 7, 6, 5)  # not the job's GPUs here: the job's
    assert gpus_of_step((4, 7, 6, 5), mapping, "0", "0;1") == (4, 7, 6, 5)  # not a GPU list: the job's
    assert gpus_of_step((4, 7), None, "0", "0") == (4, 7)  # an earlier release's job file pairs nothing
    assert slurm_gpu_list("0-2,5") == (0, 1, 2, 5) and slurm_gpu_list("") is None and slurm_gpu_list("GPU-1a2b") is None


# --- the rules ----------------------------------------------------------------------------------
def test_v1_lines_deny_every_other_nvidia_gpu_and_allow_the_jobs():
    lines = v1_rule_lines(device_rules("nvidia", [4, 5]))
    assert len(lines) == 254
    assert [line for name, line in lines if name == "devices.allow"] == ["c 195:4 rwm", "c 195:5 rwm"]
    denied = [line for name, line in lines if name == "devices.deny"]
    assert denied[:3] == ["c 195:0 rwm", "c 195:1 rwm", "c 195:2 rwm"] and denied[-1] == "c 195:253 rwm"
    assert "c 195:254 rwm" not in denied and "c 195:255 rwm" not in denied  # nvidia-modeset, nvidiactl
    amd = v1_rule_lines(device_rules("amd", [129]))
    assert ("devices.allow", "c 226:129 rwm") in amd and ("devices.deny", "c 226:128 rwm") in amd
    assert all(line.startswith("c 226:") and 128 <= int(line.split(":")[1].split()[0]) <= 255 for _, line in amd)
    assert all(name == "devices.deny" for name, _ in v1_rule_lines(device_rules("nvidia", [])))  # no GPUs: none
    with pytest.raises(InputError, match=r"outside 195:0-253"):
        device_rules("nvidia", [255])
    with pytest.raises(InputError, match="expected nvidia or amd"):
        device_rules("intel", [0])


# --- the v2 program, run by an interpreter of exactly the opcodes it may hold --------------------
def run_bpf(program: bytes, dev_type: int, access: int, major: int, minor: int) -> int:
    """Run a BPF_PROG_TYPE_CGROUP_DEVICE program on struct bpf_cgroup_dev_ctx; the verifier's
    rules that matter here are checked too: forward jumps only, r0 set before exit."""
    assert len(program) % 8 == 0 and 0 < len(program) // 8 <= 4096
    ctx = struct.pack("<III", (access << 16) | dev_type, major, minor)
    regs: list[int | str | None] = [None] * 11
    regs[1] = "ctx"
    pc = 0
    while True:
        assert 0 <= pc < len(program) // 8, f"pc {pc} out of the program"
        code, registers, off, imm = struct.unpack_from("<BBhi", program, pc * 8)
        dst, src = registers & 0x0F, registers >> 4
        pc += 1
        if code == 0x61:  # ldxw dst, [src + off]
            assert regs[src] == "ctx" and off in (0, 4, 8)
            regs[dst] = struct.unpack_from("<I", ctx, off)[0]
        elif code == 0x54:  # and32 dst, imm
            regs[dst] = (regs[dst] & imm) & 0xFFFFFFFF  # type: ignore[operator]
        elif code == 0xB7:  # mov64 dst, imm
            regs[dst] = imm
        elif code in (0x15, 0x55, 0x25, 0xA5):  # jeq, jne, jgt, jlt (unsigned) dst, imm
            assert off >= 0, "a backward jump: the verifier refuses loops"
            value = regs[dst]
            assert isinstance(value, int)
            taken = {0x15: value == imm, 0x55: value != imm, 0x25: value > imm, 0xA5: value < imm}[code]
            if taken:
                pc += off
        elif code == 0x95:  # exit
            assert regs[0] in (0, 1), "r0 must be 0 or 1 at exit"
            return regs[0]  # type: ignore[return-value]
        else:
            raise AssertionError(f"opcode {code:#04x} is not one the program may use")


def expected(rules, dev_type, major, minor) -> int:
    return 0 if dev_type == 2 and any(r.major == major and minor in r.denied() for r in rules) else 1


def test_the_program_encodes_instructions_as_the_kernel_reads_them():
    program = device_program(device_rules("nvidia", [1]))
    assert program[:8] == bytes.fromhex("6112000000000000")  # r2 = *(u32 *)(r1 + 0)
    assert program[8:16] == bytes.fromhex("54020000ffff0000")  # w2 &= 0xffff
    assert program[16:24] == bytes.fromhex("6114040000000000")  # r4 = *(u32 *)(r1 + 4)
    assert program[-16:] == bytes.fromhex("b700000001000000" "9500000000000000")  # r0 = 1; exit
    assert program[32:40] == bytes.fromhex("5502") + struct.pack("<h", (len(program) - 16) // 8 - 5) + bytes.fromhex("02000000")


@pytest.mark.parametrize("rules", [
    device_rules("nvidia", [4, 5]),
    device_rules("nvidia", []),
    device_rules("amd", [129, 131]),
    device_rules("nvidia", [0]) + device_rules("amd", [255]),  # two rules: the jumps between them
])
def test_the_program_denies_exactly_what_the_rules_deny(rules):
    program = device_program(rules)
    for major in (1, 195, 226, 510):
        for minor in (*range(0, 260), 4096):
            for dev_type in (1, 2):  # block, char
                assert run_bpf(program, dev_type, 2 | 4, major, minor) == expected(rules, dev_type, major, minor), \
                    (dev_type, major, minor)
    assert run_bpf(program, 2, 1, 195, 255) == 1  # mknod of nvidiactl


def test_the_program_for_a_job_with_gpus_4_and_5():
    program = device_program(device_rules("nvidia", [4, 5]))
    assert run_bpf(program, 2, 6, 195, 4) == 1 and run_bpf(program, 2, 6, 195, 5) == 1
    assert run_bpf(program, 2, 6, 195, 0) == 0 and run_bpf(program, 2, 2, 195, 7) == 0
    assert run_bpf(program, 2, 6, 195, 255) == 1 and run_bpf(program, 2, 6, 195, 254) == 1  # nvidiactl, modeset
    assert run_bpf(program, 2, 6, 1, 3) == 1  # /dev/null
    assert run_bpf(program, 2, 6, 231, 192) == 1  # /dev/infiniband/uverbs0


def test_bpf_attr_layouts():
    load = prog_load_attr(0x1000, 12, 0x2000)
    assert len(load) == 64
    assert struct.unpack_from("<IIQQ", load) == (15, 12, 0x1000, 0x2000)  # BPF_PROG_TYPE_CGROUP_DEVICE
    assert load[48:64] == b"mapa_gpus" + bytes(7)
    assert prog_attach_attr(3, 4) == bytes.fromhex("03000000" "04000000" "06000000" "02000000")  # CGROUP_DEVICE, ALLOW_MULTI


# --- the fake cgroupfs --------------------------------------------------------------------------
def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_v1_creates_the_jobs_cgroup_writes_its_rules_once_and_moves_the_task(tmp_path):
    rules = device_rules("nvidia", [4, 5])
    configured: set = set()
    (tmp_path / "mapa").mkdir()
    (tmp_path / "mapa" / "devices.list").write_text("a *:* rwm\n")  # a host's root cgroup allows all
    where = apply_v1(tmp_path, "12", rules, "batch", None, 4242, configured=configured)
    job = tmp_path / "mapa" / "job_12"
    (job / "devices.list").write_text("a *:* rwm\n")  # what the kernel shows for a default-allow cgroup
    assert where == job and lines(job / "cgroup.procs") == ["4242"]
    assert lines(job / "devices.allow") == ["c 195:4 rwm", "c 195:5 rwm"] and len(lines(job / "devices.deny")) == 252
    apply_v1(tmp_path, "12", rules, "batch", None, 4243, configured=configured)  # a second task
    assert lines(job / "cgroup.procs") == ["4242", "4243"] and len(lines(job / "devices.deny")) == 252
    step = apply_v1(tmp_path, "12", rules, "1", device_rules("nvidia", [4]), 4300, configured=configured)
    assert step == job / "step_1" and lines(step / "cgroup.procs") == ["4300"]
    assert lines(step / "devices.allow") == ["c 195:4 rwm"] and "c 195:5 rwm" in lines(step / "devices.deny")
    problems = release_job_v1(tmp_path, "12")  # the fake's files are no cgroupfs's: nothing can go
    assert [p.split(":")[0] for p in problems] == [str(step), str(job)] and all("Directory not empty" in p for p in problems)
    for directory in (step, job):
        for name in ("cgroup.procs", "devices.allow", "devices.deny", "devices.list"):
            if (directory / name).exists():
                (directory / name).unlink()
    assert release_job_v1(tmp_path, "12") == [] and not job.exists()
    assert release_job_v1(tmp_path, "12") == []  # nothing left: nothing to do


# A Docker container's devices.list (default deny, its allow list), as the kernel prints it.
DOCKER_LIST = """c 1:5 rwm
c 1:3 rwm
c 1:9 rwm
c 1:8 rwm
c 5:0 rwm
c 5:1 rwm
c *:* m
b *:* m
c 1:7 rwm
c 136:* rwm
c 5:2 rwm
c 10:200 rwm
c 195:* rwm
c 226:* rwm
c 511:* rwm
"""


def test_v1_under_an_allow_list_parent_rebuilds_the_list_without_the_denied_gpus():
    writes = v1_writes(DOCKER_LIST, device_rules("nvidia", [1, 5]))
    assert writes[0] == ("devices.deny", "a")
    allowed = [line for name, line in writes if name == "devices.allow"]
    assert all(name == "devices.allow" for name, _ in writes[1:])
    nvidia = sorted(int(line.split(":")[1].split()[0]) for line in allowed if line.startswith("c 195:"))
    assert nvidia == [1, 5, 254, 255]  # the job's GPUs, modeset and nvidiactl
    # Everything else the parent allows stays, wildcards of other majors included.
    assert {"c 1:3 rwm", "c 136:* rwm", "c 226:* rwm", "c 511:* rwm", "c *:* m", "b *:* m"} <= set(allowed)
    amd = [line for name, line in v1_writes(DOCKER_LIST, device_rules("amd", [129])) if line.startswith("c 226:")]
    assert len(amd) == 129 and "c 226:129 rwm" in amd and "c 226:130 rwm" not in amd and "c 226:0 rwm" in amd
    # A specific parent entry for a denied GPU is dropped, one for an allowed GPU kept.
    assert [line for _, line in v1_writes("c 195:3 rw\nc 195:1 rw\n", device_rules("nvidia", [1]))] == ["a", "c 195:1 rw"]
    # A host's root cgroup allows all: the deny lines.
    assert v1_writes("a *:* rwm\n", device_rules("nvidia", [1])) == v1_rule_lines(device_rules("nvidia", [1]))
    with pytest.raises(IsolationError, match="not 'TYPE MAJOR:MINOR ACCESS'"):
        v1_writes("c 195:x rwm\n", device_rules("nvidia", [1]))


def test_v1_refuses_ids_that_are_not_slurms(tmp_path):
    with pytest.raises(IsolationError, match="not a Slurm job and step id"):
        apply_v1(tmp_path, "12/../x", device_rules("nvidia", []), None, None, 1)
    with pytest.raises(IsolationError, match="not a Slurm job and step id"):
        apply_v1(tmp_path, "12", device_rules("nvidia", []), "../0", device_rules("nvidia", []), 1)


def test_v2_attaches_the_jobs_program_once_and_a_smaller_steps_program(tmp_path):
    scope = tmp_path / "system.slice" / "slurmstepd.scope"
    (scope / "job_12" / "step_0" / "user" / "task_3").mkdir(parents=True)
    attached: list[tuple[Path, bytes]] = []
    done: set = set()
    cgroup = parse_proc_cgroup(V2_STEP)
    job_rules = device_rules("nvidia", [4, 5])
    assert apply_v2(tmp_path, cgroup, job_rules, None, lambda d, p: attached.append((d, p)), done) == [scope / "job_12"]
    assert attached == [(scope / "job_12", device_program(job_rules))]
    assert apply_v2(tmp_path, cgroup, job_rules, None, lambda d, p: attached.append((d, p)), done) == []
    step_rules = device_rules("nvidia", [4])
    assert apply_v2(tmp_path, cgroup, job_rules, step_rules, lambda d, p: attached.append((d, p)), done) == \
        [scope / "job_12" / "step_0" / "user"]
    assert attached[-1] == (scope / "job_12" / "step_0" / "user", device_program(step_rules))

    def refused(directory, program):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    with pytest.raises(IsolationError, match="cannot attach the device program to .*job_12: .*not permitted"):
        apply_v2(tmp_path, cgroup, job_rules, None, refused, set())


# --- the agent's isolate requests ---------------------------------------------------------------
def test_the_agent_isolates_the_task_of_a_taskprolog(node):
    agent, proc, cgroupfs, _, _, tmp_path = node
    answer = agent.isolate(os.getpid(), USER, {"SLURM_JOB_ID": "12"})
    job = cgroupfs / "devices" / "mapa" / "job_12"
    assert answer == f"done cgroup-v1 gpus=4,5 job 12 step batch task pid 5000: GPUs 4,5 in {job}"
    assert lines(job / "cgroup.procs") == ["5000"] and lines(job / "devices.allow") == ["c 195:4 rwm", "c 195:5 rwm"]
    assert "isolation: cgroup-v1: gpus=4,5 job 12 step batch task pid 5000: GPUs 4,5" in (tmp_path / "log").read_text()
    # A step of no GPUs (srun --gres=gpu:0: Slurm unset SLURM_STEP_GPUS): its own cgroup, every GPU denied.
    proc.add(5000, "slurmstepd", 4000, USER, V1_BATCH.replace("step_batch", "step_2"), exe=STEPD)
    assert agent.isolate(os.getpid(), USER, {}).startswith("done cgroup-v1 gpus=none job 12 step 2")
    assert lines(job / "step_2" / "cgroup.procs") == ["5000"] and "c 195:4 rwm" in lines(job / "step_2" / "devices.deny")



def test_a_step_daemon_under_the_users_effective_uid_for_a_moment_is_still_roots(node):
    """slurmstepd forks the tasks with the job's user as its effective uid (real and saved uid 0);
    a busy node shows the agent that moment. Only a real or saved uid other than 0 is a user's."""
    agent, proc, *_ = node
    proc.add(4000, "slurmstepd", 1, 0, "", exe=STEPD, uids=(0, USER, 0))
    assert agent.isolate(os.getpid(), USER, {"SLURM_JOB_ID": "12"}).startswith("done cgroup-v1 gpus=4,5 job 12")
    for uids in ((USER, 0, USER), (USER, USER, 0), (0, 0, USER)):  # a setuid program, or one that gave root up
        proc.add(4000, "slurmstepd", 1, 0, "", exe=STEPD, uids=uids)
        answer = agent.isolate(os.getpid(), USER, {"SLURM_JOB_ID": "12"})
        assert "its parent 4000 is no slurmstepd running as root" in answer, (uids, answer)

def test_a_job_without_gpus_is_denied_every_gpu(node):
    agent, proc, cgroupfs, _, _, _ = node
    proc.add(5000, "slurmstepd", 4000, USER, V1_BATCH.replace("job_12", "job_13"), exe=STEPD)
    assert agent.isolate(os.getpid(), USER, {}).startswith("done cgroup-v1 gpus=none job 13 step batch task pid 5000: GPUs none")
    assert len(lines(cgroupfs / "devices" / "mapa" / "job_13" / "devices.deny")) == 254


def test_on_cgroup_v2_the_agent_attaches_programs(node):
    agent, proc, cgroupfs, attached, _, _ = node
    proc.add(5000, "slurmstepd", 4000, USER, V2_STEP, exe=STEPD)
    (cgroupfs / "unified" / V2_STEP[4:-1]).mkdir(parents=True)
    job = cgroupfs / "unified" / "system.slice" / "slurmstepd.scope" / "job_12"
    task = {"SLURM_STEP_GPUS": "0,1"}  # the job file pairs nothing (an earlier release's): the job's GPUs
    assert agent.isolate(os.getpid(), USER, task) == f"done cgroup-v2 gpus=4,5 job 12 step 0: GPUs 4,5 (programs attached to {job})"
    assert agent.isolate(os.getpid(), USER, task) == "done cgroup-v2 gpus=4,5 job 12 step 0: GPUs 4,5"  # once per job
    assert attached == [(job, device_program(device_rules("nvidia", [4, 5])))]


@pytest.mark.parametrize(
    "layout, request_env, reason",
    [
        # The job script itself asks: its parent is the root slurmstepd, no task process of the user.
        ({5001: ("bash", 4000, None, "", "/bin/bash")}, {}, "slurmstepd 4000 \\(uids 0/0\\) is no task of uid"),
        # A process that only calls itself slurmstepd (prctl PR_SET_NAME).
        ({5000: ("slurmstepd", 4000, None, V1_BATCH, "/home/u/fake")}, {}, "slurmstepd 4000 \\(uids 0/0\\) is no task of uid"),
        # The task is in no Slurm job cgroup (proctrack/linuxproc, task/affinity).
        ({5000: ("slurmstepd", 4000, None, "0::/system.slice/slurmd.service\n", STEPD)}, {}, "is in no Slurm job cgroup"),
        # The task's parent is no slurmstepd.
        ({4000: ("bash", 1, 0, "", "/bin/bash")}, {}, "its parent 4000 is no slurmstepd"),
        # The request names another job than the task's cgroup.
        ({}, {"SLURM_JOB_ID": "99"}, "the request says job '99', but task 5000 is in job 12's cgroup"),
        # A job with no record on this node.
        ({5000: ("slurmstepd", 4000, None, V1_BATCH.replace("job_12", "job_14"), STEPD)}, {}, "job 14 has no job file and no Prolog mark"),
    ],
)
def test_requests_the_agent_refuses(node, layout, request_env, reason):
    agent, proc, cgroupfs, _, configure, tmp_path = node
    for pid, (name, ppid, uid, cgroup, exe) in layout.items():
        proc.add(pid, name, ppid, USER if uid is None else uid, cgroup, exe)
    answer = agent.isolate(os.getpid(), USER, request_env)
    assert answer.startswith("done failed-open ")
    assert re.search(reason, answer), answer
    assert not (cgroupfs / "devices" / "mapa").exists()
    assert "runs without it (isolation = \"fail-open\")" in (tmp_path / "log").read_text()
    configure("fail-closed")
    answer = agent.isolate(os.getpid(), USER, request_env)
    assert answer.startswith("error ") and re.search(reason, answer)
    assert "as isolation = \"fail-closed\"" in (tmp_path / "log").read_text()


def test_another_users_request_is_refused(node):
    agent, *_ = node
    assert "is no task of uid 4321" in agent.isolate(os.getpid(), 4321, {})


def test_isolation_off_does_nothing(node):
    agent, _, cgroupfs, _, configure, _ = node
    configure("off")
    assert agent.isolate(os.getpid(), USER, {}) == "done off"
    assert not (cgroupfs / "devices" / "mapa").exists()


def test_a_read_only_cgroupfs_fails_open_and_says_why(node):
    agent, _, cgroupfs, _, _, _ = node
    (cgroupfs / "devices" / "mapa").write_text("not a directory")  # mkdir fails as on a read-only cgroupfs
    answer = agent.isolate(os.getpid(), USER, {})
    assert answer.startswith("done failed-open cannot set up the devices cgroup") and "job_12" in answer


def test_a_failure_is_noted_for_the_jobs_admin_comment_once(node):
    agent, proc, cgroupfs, _, configure, tmp_path = node
    (cgroupfs / "devices" / "mapa").write_text("not a directory")
    agent.isolate(os.getpid(), USER, {})
    note = tmp_path / "journal" / "12.isolation"
    entry = journal.parse_entry(note.read_bytes())
    assert entry.node == "dgx1" and entry.record.startswith("isolation=failed-open why=cannot_set_up_the_devices_cgroup")
    note.unlink()
    agent.isolate(os.getpid(), USER, {})  # the job's next task: logged, not noted again
    assert not note.exists()
    configure("fail-closed")
    assert agent.isolate(os.getpid(), USER, {}).startswith("error ")
    assert journal.parse_entry(note.read_bytes()).record.startswith("isolation=refused why=cannot_set_up")
    # Before the kernel named the job (the asking process is no task), there is no job to note.
    proc.add(5000, "slurmstepd", 4000, USER, V1_BATCH.replace("job_12", "job_15"), exe="/home/u/fake")
    agent.isolate(os.getpid(), USER, {})
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == ["12.isolation"]


def test_the_note_reaches_the_admin_comment_after_the_decision(node):
    from slurm_mapa.slurm.agent.background import Background
    from fake_slurm import FakeSlurm

    agent, _, cgroupfs, _, _, tmp_path = node
    (cgroupfs / "devices" / "mapa").write_text("not a directory")
    slurm = FakeSlurm()
    agent.make_runner = lambda timeout: slurm
    agent.isolate(os.getpid(), USER, {})
    background = Background(agent, "dgx1")
    # The note alone: the decision is not recorded and not in the journal, so it is dropped (logged).
    assert background.flush_records() == 1 and slurm.admin == {}
    assert "has no decision of node dgx1 to note isolation=failed-open" in (tmp_path / "log").read_text()
    # As it happens: the Prolog's decision waits in the journal (written before the task starts).
    agent.noted.clear()
    journal.write(tmp_path / "journal", "12", journal.Entry("dgx1", 1, "mapa:topology=ring sensitive=yes # dgx1=4,5 policy=preserve"))
    agent.isolate(os.getpid(), USER, {})
    slurm.calls.clear()
    assert background.flush_records() == 2 and list((tmp_path / "journal").iterdir()) == []
    # Both waiting at once (a burst keeps the records loop behind): one read, one update.
    assert [call[1:3] for call in slurm.calls] == [["--json", "show"], ["update", "job=12"]], slurm.calls
    recorded = parse_decisions(slurm.admin["12"])["dgx1"]
    assert (recorded.gpus, recorded.isolation) == ((4, 5), "failed-open")
    assert recorded.why.startswith("cannot_set_up_the_devices_cgroup") and " " not in recorded.why
    # A later write of the same decision (the Prolog's entry retried) does not erase the note.
    journal.write(tmp_path / "journal", "12", journal.Entry("dgx1", 1, "mapa:topology=ring sensitive=yes # dgx1=4,5 policy=preserve"))
    assert background.flush_records() == 1 and parse_decisions(slurm.admin["12"])["dgx1"].isolation == "failed-open"


def test_a_note_waits_while_its_decision_is_in_the_journal(node, tmp_path):
    from slurm_mapa.slurm.config import load_hook_config
    from slurm_mapa.slurm.hooks.admin_comment import flush_note
    from fake_slurm import FakeSlurm

    config, _ = load_hook_config({"MAPA_CONFIG": str(tmp_path / "mapa.toml")})
    journal.write(config.journal, "12", journal.Entry("dgx1", 1, "mapa:topology=ring sensitive=yes # dgx1=4,5 policy=preserve"))
    note = journal.Entry("dgx1", 0, "isolation=failed-open why=x")
    slurm, logs = FakeSlurm(), []
    assert flush_note(config, "12", note, slurm, logs.append) is False and slurm.admin == {}
    assert flush_note(config, "12", journal.Entry("dgx1", 0, "isolation=maybe"), slurm, logs.append) is True
    assert "not an isolation note; dropped" in logs[-1]


@pytest.mark.parametrize("node_count", [1, 2, None])
def test_a_note_reads_its_write_back_only_for_a_job_of_several_nodes(node, tmp_path, node_count):
    """A one-node job's AdminComment has no other writer to race: its note is one read and one update.
    A multi-node job's (or one whose record gives no node count) is read back until the other
    nodes' decisions are there or the settle bound passes (here the other node never writes)."""
    from slurm_mapa.slurm.config import load_hook_config
    from slurm_mapa.slurm.hooks import admin_comment
    from fake_slurm import FakeSlurm

    config, _ = load_hook_config({"MAPA_CONFIG": str(tmp_path / "mapa.toml")})
    slurm = FakeSlurm()
    slurm.admin["12"] = "mapa:topology=ring sensitive=yes # dgx1=4,5 policy=preserve"
    if node_count is not None:
        slurm.node_counts["12"] = node_count
    note = journal.Entry("dgx1", 0, "isolation=failed-open why=x")
    assert admin_comment.flush_note(config, "12", note, slurm, lambda line: None) is True
    shows = [call for call in slurm.calls if call[1:3] == ["--json", "show"]]
    updates = [call for call in slurm.calls if call[1] == "update"]
    assert len(updates) == 1, slurm.calls
    if node_count == 1:
        assert len(shows) == 1, slurm.calls
    else:
        assert 2 <= len(shows) <= admin_comment.MULTI_NODE_READS, slurm.calls
    assert parse_decisions(slurm.admin["12"])["dgx1"].isolation == "failed-open"


def test_auto_isolates_only_where_the_topology_names_the_device_files(node, tmp_path):
    """isolation = "auto" (the default): fail-open on a node whose topology file has minor_numbers
    (discovery from NVML or AMD SMI writes them), off where it is a preset or nvidia-smi text."""
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.hardware.topofile import graph_to_toml
    from slurm_mapa.slurm.config import HookConfig
    from slurm_mapa.slurm.isolation.isolator import effective_mode

    discovered = tmp_path / "dgx1-discovered.toml"
    discovered.write_text(graph_to_toml(preset("dgx1-v100"), minor_numbers=list(range(8))))
    config = HookConfig(nodes=(("dgx1", str(discovered)), ("dgx2", "dgx1-v100")))
    assert effective_mode(config, "dgx1") == ("fail-open", f"auto: node dgx1's topology {discovered} names each GPU's device file")
    mode, why = effective_mode(config, "dgx2")
    assert mode == "off" and "names no device minor numbers" in why
    assert effective_mode(config, "gpu7") == ("off", "auto: no [nodes] entry of mapa.toml matches node gpu7")
    broken = HookConfig(nodes=(("dgx1", str(tmp_path / "gone.toml")),))
    assert effective_mode(broken, "dgx1")[0] == "off"
    assert effective_mode(HookConfig(isolation="fail-closed"), "any") == ("fail-closed", 'isolation = "fail-closed" in mapa.toml')
    # The agent follows it: the node fixture's dgx1 is the preset, so auto answers off there.
    agent, proc, cgroupfs, _, configure, _ = node
    configure("auto")
    assert agent.isolate(os.getpid(), USER, {}) == "done off"
    (tmp_path / "mapa.toml").write_text((tmp_path / "mapa.toml").read_text().replace('"dgx*" = "dgx1-v100"', f'"dgx*" = "{discovered}"'))
    assert agent.isolate(os.getpid(), USER, {}).startswith("done cgroup-v1 gpus=4,5 job 12 step batch")


def test_config_accepts_only_the_four_modes():
    assert config_from_text("", validate=False).isolation == "auto"
    assert config_from_text('isolation = "off"\n', validate=False).isolation == "off"
    assert config_from_text('isolation = "fail-closed"\n', validate=False).isolation == "fail-closed"
    with pytest.raises(InputError, match='isolation must be "auto" .*"off", "fail-open" .* got "on"'):  # TOML's spelling
        config_from_text('isolation = "on"\n', validate=False)
    with pytest.raises(InputError, match="isolation must be a string"):
        config_from_text("isolation = true\n", validate=False)


# --- over the socket, and the TaskProlog --------------------------------------------------------
@pytest.fixture
def isolation_server(node):
    agent, *_ , tmp_path = node
    server = serve_isolation(str(tmp_path / "isolate" / "isolate.sock"), agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, node
    server.shutdown()
    server.server_close()


def test_the_isolation_socket_is_open_to_everyone_and_takes_only_isolate(isolation_server):
    server, (agent, proc, cgroupfs, _, configure, tmp_path) = isolation_server
    path = tmp_path / "isolate" / "isolate.sock"
    for pid, name, ppid, exe in ((os.getpid(), "python3", 5001, sys.executable), (5001, "sh", 5000, "/bin/dash")):
        proc.add(pid, name, ppid, os.getuid(), V1_BATCH, exe=exe)  # the socket tells the agent this test's own uid
    proc.add(5000, "slurmstepd", 4000, os.getuid(), V1_BATCH, exe=STEPD)
    assert oct(path.stat().st_mode & 0o777) == "0o666" and oct(path.parent.stat().st_mode & 0o777) == "0o755"
    assert agent_client.isolate(str(path), {"SLURM_JOB_ID": "12"}) == (0, "export MAPA_ISOLATION=cgroup-v1\nexport MAPA_ISOLATED_GPUS=4,5")
    assert lines(cgroupfs / "devices" / "mapa" / "job_12" / "cgroup.procs") == ["5000"]
    hook = agent_client.ask_agent("prolog", {"SLURM_JOB_ID": "12"}, str(path))
    assert hook == "done failed-open bad request: unknown hook kind 'prolog' (accepted: isolate)"
    configure("fail-closed")
    assert agent_client.isolate(str(path), {"SLURM_JOB_ID": "99"})[0] == agent_client.REFUSED
    assert agent_client.isolate(str(tmp_path / "none.sock"), {}) == (agent_client.FALL_BACK, None)


def test_the_spank_plugins_request_isolates_the_asking_task_itself(node):
    """The root-side trigger (spank_mapa_isolate.c): the task process asks, as root, before it drops
    to the user and before the TaskProlog; the request carries nothing but its kind."""
    agent, proc, cgroupfs, attached, _, tmp_path = node
    if os.getuid() != 0:
        pytest.fail("the root socket answers only uid 0: run the suite as root, as CI does")
    me = os.getpid()  # the socket names this test's process: it plays the task, still root
    proc.add(me, "slurmstepd", 4000, 0, V1_BATCH.replace("/step_batch/task_0", "/step_batch"), exe=STEPD)
    server = serve(str(tmp_path / "agent" / "agent.sock"), agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(tmp_path / "agent" / "agent.sock"))
            conn.sendall(b"MAPA1 isolate 0\n")
            answer = conn.makefile("rb").readline().decode()
    finally:
        server.shutdown()
        server.server_close()
    job = cgroupfs / "devices" / "mapa" / "job_12"
    assert answer == f"done cgroup-v1 gpus=4,5 job 12 step batch task pid {me}: GPUs 4,5 in {job}\n"
    assert lines(job / "cgroup.procs") == [str(me)]
    # v2: the forked task is still in slurmstepd's own cgroup (step_S/slurm); the job's program goes on job_J.
    proc.add(me, "slurmstepd", 4000, 0, V2_STEP.replace("/user/task_3", "/slurm"), exe=STEPD)
    (cgroupfs / "unified" / "system.slice" / "slurmstepd.scope" / "job_12" / "step_0" / "slurm").mkdir(parents=True)
    assert agent.isolate(me, 0, {}).startswith("done cgroup-v2 gpus=4,5 job 12 step 0: GPUs 4,5 (programs attached to ")
    assert [d.name for d, _ in attached] == ["job_12"]
    # A root process that is no task (its parent is no slurmstepd) is refused like any other.
    proc.add(4001, "bash", 1, 0, "", exe="/bin/bash")
    proc.add(me, "slurmstepd", 4001, 0, V1_BATCH, exe=STEPD)
    assert "is no task process: its parent 4001 is no slurmstepd" in agent.isolate(me, 0, {})


class CannedAgent(Agent):
    def __init__(self, answer):
        super().__init__("/nonexistent/mapa.toml", node="dgx1")
        self.answer = answer
        self.asked = 0

    def job_of(self, pid, uid=None):
        return "55"  # the TaskProlog's task: admitted

    def isolate(self, pid, uid, env, public=False):
        self.asked += 1
        return self.answer


TASK_START = "8765432"  # the fake task process's start time (field 22 of its /proc/PID/stat)


def task_record(step="batch", gpus="2,3,6", job="55", start=TASK_START, state="cgroup-v1"):
    """The record mapa-agent writes for a task the SPANK plugin's request isolated (task_records.py)."""
    return f"MAPA1 job={job} step={step} start={start} state={state} gpus={gpus}\n"


def lay_out_task(tmp_path, record, step):
    """A fake /proc for the TaskProlog: its parent (this test process, $PPID) is a task process
    started at TASK_START, in step ``step``'s cgroups; and the agent's ``record`` of it, or none."""
    proc = tmp_path / "proc"
    (proc / str(os.getpid())).mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", *["0"] * 17, TASK_START, "0"]  # fields 3 to 23: field 22 is the start time
    (proc / str(os.getpid()) / "stat").write_text(f"{os.getpid()} (slurm stepd) x) {' '.join(fields)}\n")
    (proc / "self").mkdir(exist_ok=True)
    (proc / "self" / "cgroup").write_text(f"11:freezer:/slurm/uid_1000/job_55/step_{step}\n"
                                          f"10:memory:/slurm/uid_1000/job_55/step_{step}/task_0\n")
    records = tmp_path / "iso" / "tasks"
    records.mkdir(parents=True, exist_ok=True)
    if record is None:
        (records / str(os.getpid())).unlink(missing_ok=True)
    else:
        (records / str(os.getpid())).write_text(record)
    return proc


def run_taskprolog(tmp_path, isolation, answer, socket_there=True, job_file="MAPA_GPUS=6,2,3\n", scope="step", agent=None,
                   record=None, **env):
    """The TaskProlog `mapa hooks` writes, with an agent that answers ``answer``, run by this test
    process as its task process (``record``: the agent's record of that task, see lay_out_task)."""
    (tmp_path / "jobs").mkdir(exist_ok=True)
    if job_file is not None:
        (tmp_path / "jobs" / "55").write_text(job_file)
    sock = tmp_path / "iso" / "isolate.sock"
    proc = lay_out_task(tmp_path, record, env.get("SLURM_STEP_ID", "batch"))
    script = taskprolog_text(str(tmp_path / "jobs"), "nvidia", isolation, sys.executable, str(REPO), scope)
    script = script.replace("ISOLATE_SOCKET=/run/slurm-mapa-isolate/isolate.sock\n", f"ISOLATE_SOCKET={sock}\n")
    script = script.replace("PROC=/proc\n", f"PROC={proc}\n")
    (tmp_path / "taskprolog").write_text(script)
    server = None
    if socket_there:
        server = serve_isolation(str(sock), agent or CannedAgent(answer))
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return subprocess.run(["/bin/sh", str(tmp_path / "taskprolog")], env={"SLURM_JOB_ID": "55", "PATH": "/usr/bin:/bin", **env},
                              capture_output=True, text=True, check=False, timeout=60)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


CUDA_LINES = ["export CUDA_VISIBLE_DEVICES=6,2,3", "export GPU_DEVICE_ORDINAL=6,2,3", "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
              "export MAPA_GPUS=6,2,3", "export MAPA_SLURM_JOB_GPUS=", "export MAPA_SLURM_STEP_GPUS=",
              "export SLURM_JOB_GPUS=2,3,6", "export SLURM_STEP_GPUS=2,3,6"]


def test_taskprolog_asks_for_isolation_and_exports_its_state(tmp_path):
    done = run_taskprolog(tmp_path, "fail-open", "done cgroup-v1 gpus=2,3,6 job 55 step batch task pid 1: GPUs 6,2,3 in /x")
    # Isolated, CUDA sees only GPUs 2, 3 and 6, as 0, 1 and 2 (bus order): MAPA's order in those numbers.
    isolated = ["export CUDA_VISIBLE_DEVICES=2,0,1", "export GPU_DEVICE_ORDINAL=2,0,1", *CUDA_LINES[2:]]
    assert (done.returncode, done.stdout.splitlines()) == (0, ["export MAPA_ISOLATION=cgroup-v1", "export MAPA_ISOLATED_GPUS=2,3,6",
                                                               *isolated])
    failed = run_taskprolog(tmp_path, "fail-open", "done failed-open cannot set up the devices cgroup")
    assert (failed.returncode, failed.stdout.splitlines()) == (0, ["export MAPA_ISOLATION=failed-open", *CUDA_LINES])


def test_taskprolog_after_the_spank_plugin_isolated_the_task(tmp_path):
    """The agent's record of the task (written as root when the SPANK plugin's request isolated
    it): with no answer of its own the TaskProlog numbers the selected GPUs among those the record
    names, and it unsets the plugin's variables so that no job submitted from the task inherits them."""
    alone = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, record=task_record(),
                           MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    ranked = ["export CUDA_VISIBLE_DEVICES=2,0,1", "export GPU_DEVICE_ORDINAL=2,0,1", *CUDA_LINES[2:]]
    assert alone.stdout.splitlines() == ["unset MAPA_SPANK_ISOLATION", "unset MAPA_SPANK_GPUS", "export MAPA_ISOLATION=cgroup-v1",
                                         "export MAPA_ISOLATED_GPUS=2,3,6", *ranked]
    # A plugin of an earlier release (no MAPA_SPANK_GPUS) leaves no record: the variable alone
    # is no proof, so with no answer of its own the task runs as unisolated (fail-open).
    step = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, MAPA_SPANK_ISOLATION="cgroup-v1", SLURM_STEP_GPUS="0",
                          SLURM_STEP_ID="1")
    assert "export MAPA_ISOLATION=failed-open" in step.stdout.splitlines() and "cgroup-v1" not in step.stdout
    # The record names what the step may open: the task's GPUs ranked among those.
    paired = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, record=task_record("1", "3,6"),
                            MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="3,6",
                            SLURM_STEP_GPUS="2", SLURM_STEP_ID="1", job_file="MAPA_GPUS=6,2,3\nSLURM_GPUS=0,1,2\nPAIRED_GPUS=2,3,6\n")
    assert "export CUDA_VISIBLE_DEVICES=1" in paired.stdout.splitlines() and "export SLURM_STEP_GPUS=6" in paired.stdout
    assert "unset MAPA_SPANK_GPUS" in paired.stdout.splitlines()
    # Its own answer (what the agent isolated the task to) wins: only GPU 6 there, rank 0.
    own = run_taskprolog(tmp_path, "fail-open", "done cgroup-v1 gpus=6 job 55 step 1 ...", MAPA_SPANK_ISOLATION="cgroup-v1",
                         SLURM_STEP_GPUS="2", SLURM_STEP_ID="1", job_file="MAPA_GPUS=6,2,3\nSLURM_GPUS=0,1,2\nPAIRED_GPUS=2,3,6\n")
    assert "export CUDA_VISIBLE_DEVICES=0" in own.stdout.splitlines()
    # Off or failed open at the plugin: nothing is assumed (the variable decides nothing: without
    # an answer the task is unisolated), and the variable goes all the same.
    off = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, MAPA_SPANK_ISOLATION="off")
    assert off.stdout.splitlines() == ["unset MAPA_SPANK_ISOLATION", "export MAPA_ISOLATION=failed-open", *CUDA_LINES]


def test_taskprolog_asks_nothing_more_when_the_spank_plugin_isolated_the_step(tmp_path):
    """Issue 41: the plugin (root) has isolated the task to its step's GPUs and named them: under
    isolation_scope "step" the TaskProlog's own request would get the same answer, so no Python
    starts and the agent is not asked; the task is told what it may open all the same. Under
    "task" the request narrows the task to its own GPUs, so it is made."""
    job_file = "MAPA_GPUS=6,2,3\nSLURM_GPUS=0,1,2\nPAIRED_GPUS=2,3,6\n"
    spank = {"MAPA_SPANK_ISOLATION": "cgroup-v1", "MAPA_SPANK_GPUS": "3,6", "SLURM_STEP_GPUS": "2", "SLURM_STEP_ID": "1"}
    agent = CannedAgent("done cgroup-v1 gpus=6 job 55 step 1 ...")
    step = run_taskprolog(tmp_path, "fail-open", None, job_file=job_file, agent=agent, record=task_record("1", "3,6"), **spank)
    assert agent.asked == 0, step.stdout
    assert step.returncode == 0 and {"export MAPA_ISOLATION=cgroup-v1", "export MAPA_ISOLATED_GPUS=3,6",
                                     "export CUDA_VISIBLE_DEVICES=1", "export SLURM_STEP_GPUS=6"} <= set(step.stdout.splitlines())
    task = run_taskprolog(tmp_path, "fail-open", None, job_file=job_file, scope="task", agent=agent, record=task_record("1", "3,6"),
                          **spank)
    assert agent.asked == 1, task.stdout
    assert {"export MAPA_ISOLATED_GPUS=6", "export CUDA_VISIBLE_DEVICES=0"} <= set(task.stdout.splitlines())
    # The plugin's answer said off, or named no GPUs (an earlier release), or no record of the
    # agent's backs what the variables say: the TaskProlog asks.
    for plugin in ({"MAPA_SPANK_ISOLATION": "off"}, {"MAPA_SPANK_ISOLATION": "cgroup-v1"}, spank):
        before = agent.asked
        run_taskprolog(tmp_path, "fail-open", None, job_file=job_file, agent=agent, **plugin)
        assert agent.asked == before + 1, plugin
    # A scope that is neither is refused when the hooks are written.
    with pytest.raises(InputError, match="isolation_scope"):
        taskprolog_text("/run/x", "auto", "fail-open", sys.executable, str(REPO), "node")


def test_taskprolog_fails_the_task_when_the_agent_refuses(tmp_path):
    done = run_taskprolog(tmp_path, "fail-open", "error not isolated")  # the agent's config says fail-closed
    assert done.returncode == 1
    assert done.stdout.splitlines() == ["print mapa: GPU isolation failed, the task does not start: error not isolated"]


def test_taskprolog_without_an_agent_follows_its_mode(tmp_path):
    opened = run_taskprolog(tmp_path, "fail-open", None, socket_there=False)
    # Issue 36: the task says it runs unisolated (it said nothing before).
    assert (opened.returncode, opened.stdout.splitlines()) == (0, ["export MAPA_ISOLATION=failed-open", *CUDA_LINES])
    closed = run_taskprolog(tmp_path, "fail-closed", None, socket_there=False)
    assert closed.returncode == 1 and "no mapa-agent answered" in closed.stdout


def test_taskprolog_text_refuses_isolation_without_a_python(tmp_path):
    assert "ISOLATION=off\n" in taskprolog_text("/run/x")
    with pytest.raises(InputError, match="needs the Python"):
        taskprolog_text("/run/x", "auto", "fail-open")
    with pytest.raises(InputError, match="isolation 'on'"):
        taskprolog_text("/run/x", "auto", "on", sys.executable, str(REPO))
    with pytest.raises(InputError, match="must be absolute"):
        taskprolog_text("/run/x", "auto", "fail-open", "python3", str(REPO))


# --- the kernel ---------------------------------------------------------------------------------
def _v1_devices_root() -> Path | None:
    try:
        devices, _ = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None
    if devices is None or os.geteuid() != 0 or not os.access(devices, os.W_OK):
        return None
    return Path(devices)


@pytest.mark.skipif(_v1_devices_root() is None, reason="needs root and a writable cgroup v1 devices hierarchy")
def test_on_a_real_v1_devices_hierarchy_other_gpus_fail_with_eperm(tmp_path):
    devices = _v1_devices_root()
    assert devices is not None
    for minor in (0, 1, 255):
        os.mknod(tmp_path / f"nvidia{minor}", 0o666 | 0o020000, os.makedev(195, minor))
    probe = ("import os, sys; sys.stdin.readline()\n"
             "for name in sys.argv[1:]:\n"
             "    try: os.close(os.open(name, os.O_RDWR))\n"
             "    except OSError as e: print(name.rsplit('/', 1)[1], e.errno)\n")
    child = subprocess.Popen([sys.executable, "-c", probe, *(str(tmp_path / f"nvidia{m}") for m in (0, 1, 255))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    base = f"mapa-test-{os.getpid()}"
    try:
        where = apply_v1(devices, "999999", device_rules("nvidia", [1]), None, None, child.pid, base=base)
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
        child.wait()
    try:
        # Denied: EPERM from the devices cgroup. Allowed: the open reaches the (absent) driver: ENXIO.
        assert out.splitlines() == [f"nvidia0 {errno.EPERM}", f"nvidia1 {errno.ENXIO}", f"nvidia255 {errno.ENXIO}"]
        assert where == devices / base / "job_999999"
    finally:
        for _ in range(50):  # the killed child leaves the cgroup a moment later
            if release_job_v1(devices, "999999", base) == []:
                break
            time.sleep(0.1)
        os.rmdir(devices / base)


# --- the SPANK plugin, built as an admin builds it ------------------------------------------------
def test_mapa_spank_plugin_builds_a_plugin_slurm_can_load(tmp_path, capsys):
    """`mapa spank-plugin` compiles the bundled C source against the Slurm headers (scripts/test
    installs Debian's libslurm-dev) and prints the plugstack.conf line; the object has the hook and
    the symbols Slurm's plugin loader reads."""
    import ctypes

    from slurm_mapa.cli import main as mapa_main

    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.fail("the Slurm headers are missing: apt-get install -y libslurm-dev (scripts/test does)")
    target = tmp_path / "lib" / "spank_mapa_isolate.so"
    assert mapa_main(["spank-plugin", str(target), "--mode", "fail-closed"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"optional {target} fail-closed"
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    plugin = ctypes.CDLL(str(target), mode=os.RTLD_LAZY)  # Slurm's symbols resolve inside slurmstepd only
    assert hasattr(plugin, "slurm_spank_task_init_privileged")
    assert (ctypes.c_char * 13).in_dll(plugin, "plugin_name").value == b"mapa_isolate"
    assert (ctypes.c_char * 6).in_dll(plugin, "plugin_type").value == b"spank"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["spank-plugin", "relative/x.so"], "give an absolute path ending in .so"),
        (["spank-plugin", "/tmp/x.txt"], "give an absolute path ending in .so"),
        (["spank-plugin", "{tmp}/x.so", "--cc", "/bin/false"], "/bin/false failed on .*spank_mapa_isolate.c \\(it needs the Slurm headers"),
        (["spank-plugin", "{tmp}/x.so", "--cc", "/nonexistent/cc"], "cannot run the compiler '/nonexistent/cc'"),
    ],
)
def test_mapa_spank_plugin_says_what_went_wrong(tmp_path, capsys, argv, message):
    from slurm_mapa.cli import main as mapa_main

    assert mapa_main([part.replace("{tmp}", str(tmp_path)) for part in argv]) != 0
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "x.so").exists()


def test_mapa_hooks_writes_what_auto_comes_to_on_the_node(tmp_path, capsys):
    from slurm_mapa.cli import main as mapa_main
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.hardware.topofile import graph_to_toml

    discovered = tmp_path / "discovered.toml"
    discovered.write_text(graph_to_toml(preset("dgx1-v100"), minor_numbers=list(range(8))))
    config = tmp_path / "mapa.toml"
    config.write_text(f'jobs_dir = "{tmp_path}/jobs"\n[nodes]\n"dgx1" = "{discovered}"\n"dgx2" = "dgx1-v100"\n')
    for node, mode in (("dgx1", "fail-open"), ("dgx2", "off")):
        assert mapa_main(["hooks", str(tmp_path / node), "--config", str(config), "--node", node]) == 0
        assert f"ISOLATION={mode}\n" in (tmp_path / node / "mapa-taskprolog").read_text()
        assert f"isolation: {mode} (auto: node {node}'s topology" in capsys.readouterr().err


def test_mapa_hooks_warns_when_no_nodes_entry_names_the_node(tmp_path, capsys):
    """Issue 39: the hooks are written (exit 0), and the admin is told that every job there falls
    back to Slurm's GPUs, as mapa doctor's FAIL says, with the fix."""
    from slurm_mapa.cli import main as mapa_main

    config = tmp_path / "mapa.toml"
    config.write_text(f'jobs_dir = "{tmp_path}/jobs"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "gpu7"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"WARNING: no [nodes] entry of {config} matches node gpu7: every job")
    assert 'add "gpu7" = ' in warnings[0]
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "dgx3"]) == 0
    assert "WARNING: no [nodes]" not in capsys.readouterr().err


def test_the_package_warning_is_a_warning_line_with_its_fix(tmp_path):
    from slurm_mapa.slurm.admin.install import package_warning

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)
    line = package_warning(shared)
    assert line.startswith(f"WARNING: root will import slurm-mapa from {shared}, which others could change")
    assert "chmod -R go-w" in line
    os.chmod(shared, 0o755)
    assert package_warning(shared) is None


# --- security round 3: what the root side trusts, and the public socket under a flood -----------
def test_slurmstepd_binary_problem_trusts_only_roots_own_file(tmp_path):
    from slurm_mapa.slurm.isolation.cgroups import slurmstepd_binary_problem

    home = tmp_path / "home"
    home.mkdir()
    os.chmod(tmp_path, 0o755)
    real = home / "slurmstepd"
    real.write_bytes(b"\x7fELF")
    os.chmod(real, 0o755)
    link = tmp_path / "exe"
    os.symlink(real, link)
    assert slurmstepd_binary_problem(link) is None  # root's, 755, in root's directories
    os.chmod(real, 0o775)
    assert "only root may write" in slurmstepd_binary_problem(link)
    os.chmod(real, 0o755)
    os.chown(real, 1000, 1000)  # a user's copy of slurmstepd
    assert "only root may write" in slurmstepd_binary_problem(link)
    os.chown(real, 0, 0)
    os.chown(home, 1000, 1000)  # root's file in a user's directory: the user can swap it
    assert "not in root's directories" in slurmstepd_binary_problem(link)
    os.chown(home, 0, 0)
    os.symlink("/bin/sh", tmp_path / "sh-exe")
    assert "not a slurmstepd" in slurmstepd_binary_problem(tmp_path / "sh-exe")
    assert "cannot read" in slurmstepd_binary_problem(tmp_path / "missing")


DELEGATED = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job_999/step_0/user/task_0\n"
DELEGATED_SCOPE = "0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_999/step_0/user/task_0\n"


def test_a_task_forged_in_a_delegated_cgroup_subtree_is_refused_and_noted_nowhere(node):
    """Security round 3: a user's own process under user@UID.service, in cgroups named like
    Slurm's and running a copy of slurmstepd, once got isolated as a task of job 999 and wrote
    isolation=failed-open into job 999's AdminComment. Every layer now refuses it alone."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "999").write_text("MAPA_GPUS=0\n")
    # 1. The path is no Slurm job's: the cgroups above the job are not slurmstepd's scope.
    assert parse_proc_cgroup(DELEGATED) is None
    proc.add(5000, "slurmstepd", 4000, USER, DELEGATED, exe=STEPD)
    assert "is in no Slurm job cgroup" in agent.isolate(os.getpid(), USER, {})
    # 2. Named like Slurm's scope, run by a fake task whose parent is the user's own process.
    proc.add(5000, "slurmstepd", 4001, USER, DELEGATED_SCOPE, exe="/home/u/slurmstepd")
    proc.add(4001, "slurmstepd", 1, USER, DELEGATED_SCOPE, exe="/home/u/slurmstepd")
    assert "does not run under a Slurm task" in agent.isolate(os.getpid(), USER, {})
    proc.add(5000, "slurmstepd", 4001, USER, DELEGATED_SCOPE, exe=STEPD)  # the real program, run by the user
    proc.add(4001, "slurmstepd", 1, USER, DELEGATED_SCOPE, exe=STEPD)
    answer = agent.isolate(os.getpid(), USER, {})
    assert "is no task process: its parent 4001 is no slurmstepd running as root (uids 1000/1000)" in answer, answer
    # 3. Even under a root slurmstepd (as if one could be had), the cgroups are the user's.
    proc.add(5000, "slurmstepd", 4000, USER, DELEGATED_SCOPE, exe=STEPD)
    scope = cgroupfs / "unified" / "user.slice" / "user-1000.slice" / "user@1000.service"
    (scope / "slurmstepd.scope" / "job_999" / "step_0" / "user" / "task_0").mkdir(parents=True)
    os.chown(scope, 1000, 1000)
    answer = agent.isolate(os.getpid(), USER, {})
    assert "belongs to uid 1000, not root: no Slurm job's cgroup" in answer, answer
    assert not (tmp_path / "journal").exists() or not any((tmp_path / "journal").iterdir())
    log = (tmp_path / "log").read_text()
    assert "job 999" not in log.replace("job_999", "")  # nothing was done or noted for job 999
    # 4. The public socket's admission does not charge it to job 999's share either (issue 36).
    assert agent.job_of(5000, USER) is None
    os.chown(scope, 0, 0)
    assert agent.job_of(5000, USER) == "999"  # root's cgroups all the way up: Slurm's own


def test_a_freed_place_of_a_job_goes_to_any_uid_waiting_on_that_job():
    """Issue 36: requests charged to a job (the per-job share) that its own user's tasks wait for;
    a freed place of that job lets in whoever waits on it, not only the uid that freed it."""
    from slurm_mapa.slurm.agent.server import PublicAdmission

    admission = PublicAdmission(per_uid=4, per_job=1, queue_per_uid=4, queue_total=8)
    assert admission.arrive(1001, "999", "intruder") == "run"
    assert admission.arrive(1000, "999", "victim") == "wait"
    assert admission.finish(1001, "999") == (1000, "999", "victim")
    assert admission.finish(1000, "999") is None


def test_a_task_of_a_job_unknown_here_asks_for_its_adoption_at_once(node):
    """A job whose Prolog never marked it holds GPUs the ledger does not know; its first task's
    isolate request (a local signal) makes the agent's next reconcile pass, which adopts it, run now."""
    import types

    agent, proc, *_ = node
    agent.background = types.SimpleNamespace(reconcile_soon=threading.Event(), wake=threading.Event())
    proc.add(5000, "slurmstepd", 4000, USER, V1_BATCH.replace("job_12", "job_14"), exe=STEPD)
    assert "job 14 has no job file and no Prolog mark" in agent.isolate(os.getpid(), USER, {})
    assert agent.background.reconcile_soon.is_set()
    agent.background.reconcile_soon.clear()
    proc.add(5000, "slurmstepd", 4000, USER, V1_BATCH, exe=STEPD)
    assert agent.isolate(os.getpid(), USER, {}).startswith("done cgroup-v1")
    assert not agent.background.reconcile_soon.is_set()


def test_log_limiter_lets_a_burst_through_then_one_line_per_interval():
    from slurm_mapa.slurm.agent.server import LogLimiter

    now = [0.0]
    limiter = LogLimiter(burst=3, interval=10.0, clock=lambda: now[0])
    lines = [limiter.line(1000, f"bad {i}") for i in range(100)]
    assert lines[:3] == ["bad 0", "bad 1", "bad 2"] and lines[3:] == [None] * 97
    assert limiter.line(2000, "other user") == "other user"  # another caller keeps its own lines
    now[0] = 10.0
    assert limiter.line(1000, "bad 100") == "bad 100 (97 more like it not logged)"
    assert limiter.line(1000, "bad 101") is None


def test_public_admission_limits_each_user_and_job_and_queues_the_rest():
    from slurm_mapa.slurm.agent.server import PublicAdmission

    now = [0.0]
    admission = PublicAdmission(per_uid=3, per_job=2, queue_per_uid=2, queue_total=3, clock=lambda: now[0])
    assert [admission.arrive(1000, "7", f"r{i}") for i in range(5)] == ["run", "run", "wait", "wait", "refuse"]
    assert admission.arrive(1000, "8", "x") == "run"  # another job of the user: its third place
    assert admission.arrive(1000, "8", "y") == "refuse"  # the user's places are taken and its queue is full
    assert admission.arrive(2000, "9", "z") == "run"  # another user is not held up by it
    assert admission.arrive(2000, "9", "w") == "run"
    assert admission.arrive(2000, "9", "v") == "wait" and admission.arrive(3000, "5", "u") == "run"
    assert admission.arrive(3000, "5", "t") == "run" and admission.arrive(3000, "5", "s") == "refuse"  # 3 waiting in all
    assert admission.finish(1000, "8") is None  # job 7 is at its own limit: r2 keeps waiting
    assert admission.finish(1000, "7") == (1000, "7", "r2")  # the next of the same job takes the freed place
    now[0] = 11.0
    assert sorted(admission.expired(10.0)) == ["r3", "v"]  # their clients gave up
    assert admission.finish(1000, "7") is None


@pytest.fixture
def reachable_isolation_server(node):
    """The isolate socket where another user can reach it (pytest's tmp_path is root's alone)."""
    import shutil
    import tempfile

    agent = node[0]
    where = Path(tempfile.mkdtemp(prefix="mapa-isolate-"))
    os.chmod(where, 0o755)
    server = serve_isolation(str(where / "isolate" / "isolate.sock"), agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, where / "isolate" / "isolate.sock", node
    server.shutdown()
    server.server_close()
    shutil.rmtree(where, ignore_errors=True)


def _flooder(sock_path, uid, count, hold, payload=None):
    """A process of user ``uid`` that opens ``count`` connections to the isolate socket; with
    ``payload``, sends it on each and closes; else holds them all open until its stdin closes."""
    code = (
        "import os, socket, sys\n"
        f"os.setgid({uid}); os.setuid({uid})\n"
        "print(os.getpid(), flush=True); sys.stdin.readline()\n"
        "held = []\n"
        "made = 0\n"
        f"for _ in range({count}):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    s.settimeout(2)\n"
        "    try:\n"
        f"        s.connect({str(sock_path)!r})\n"
        "        made += 1\n"
        f"        payload = {payload!r}\n"
        "        if payload is not None:\n"
        "            s.sendall(payload); s.close()\n"
        "        else:\n"
        "            held.append(s)\n"
        "    except OSError:\n"
        "        s.close()\n"
        "print('flooded', made, flush=True)\n"
        + ("sys.stdin.readline()\n" if hold else "")
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


@pytest.mark.parametrize("with_a_job", [False, True, "forged"])
def test_a_users_flood_of_the_isolate_socket_leaves_other_tasks_answered(reachable_isolation_server, with_a_job):
    """Security round 3 (high): 128 connections held open by one user once took every handler, so
    each TaskProlog's request went unanswered (fail-open: every task on the node ran unisolated).
    Now a caller that is no task costs no thread, and a user with a job gets at most its share.
    Round 5 ("forged"): a user with no job, in cgroups named like job 12's in the subtrees systemd
    delegated to them (name=systemd, memory), was counted against job 12's share."""
    if os.getuid() != 0:
        pytest.fail("the flooding user is made with setuid: run the suite as root, as CI does")
    server, path, (agent, proc, cgroupfs, _, _, tmp_path) = reachable_isolation_server
    threads_before = threading.active_count()  # other tests in this worker may have left some
    child, child_pid = _flooder(path, 4242, 400, hold=True)
    try:
        if with_a_job == "forged":
            forged = "slurm/uid_4242/job_12/step_batch"
            proc.add(child_pid, "python3", 1, 4242, f"10:memory:{systemd_delegated(cgroupfs, 'memory', 4242, forged)}\n"
                     f"1:name=systemd:{systemd_delegated(cgroupfs, 'name=systemd', 4242, forged)}\n", slurmd=False)
        elif with_a_job:  # the flooder is a process of one of its own jobs
            proc.add(child_pid, "python3", 1, 4242, V1_BATCH.replace("uid_1000/job_12", "uid_4242/job_77"))
        child.stdin.write("go\n")
        child.stdin.flush()
        flooded, made = child.stdout.readline().split()
        assert flooded == "flooded" and int(made) >= 100
        for pid, name, ppid, exe in ((os.getpid(), "python3", 5001, sys.executable), (5001, "sh", 5000, "/bin/dash")):
            proc.add(pid, name, ppid, os.getuid(), V1_BATCH, exe=exe)
        proc.add(5000, "slurmstepd", 4000, os.getuid(), V1_BATCH, exe=STEPD)
        started = time.monotonic()
        assert agent_client.isolate(str(path), {"SLURM_JOB_ID": "12"}) == (0, "export MAPA_ISOLATION=cgroup-v1\nexport MAPA_ISOLATED_GPUS=4,5")
        assert time.monotonic() - started < 5.0  # answered while the flood still holds its connections
        assert threading.active_count() - threads_before <= PUBLIC_PER_UID  # the flood holds at most its user's share of threads
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    if with_a_job is not True:  # each of its connections was closed at once, with no thread spent on it
        deadline = time.monotonic() + 10
        while server.turned_away < int(made) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.turned_away == int(made)


def test_a_flood_of_bad_requests_costs_roots_log_a_few_lines(reachable_isolation_server):
    if os.getuid() != 0:
        pytest.fail("the flooding user is made with setuid: run the suite as root, as CI does")
    server, path, (agent, proc, _, _, _, tmp_path) = reachable_isolation_server
    child, child_pid = _flooder(path, 4242, 1000, hold=False, payload=b"MAPA1 nonsense 0\n")
    proc.add(child_pid, "python3", 1, 4242, V1_BATCH.replace("uid_1000/job_12", "uid_4242/job_77"))
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().split()[0] == "flooded"
    child.stdin.close()
    child.wait(timeout=30)
    time.sleep(0.5)  # the last requests' handlers finish
    log = (tmp_path / "log").read_text().splitlines()
    refused = [line for line in log if "uid 4242" in line]
    assert 1 <= len(refused) <= 10, refused[-3:]


# --- issue 24: steps and tasks ----------------------------------------------------------------------
def _as_spank_then_taskprolog(proc, step, task):
    """The test process as the task itself asking as root (the SPANK plugin), then as a TaskProlog."""
    me = os.getpid()
    text = V1_BATCH.replace("step_batch/task_0", f"step_{step}/task_{task}").replace("step_batch", f"step_{step}")

    def as_spank():
        proc.add(me, "slurmstepd", 4000, 0, text.replace(f"/task_{task}", ""), exe=STEPD)  # not in its task cgroup yet

    def as_taskprolog():
        _as_task(proc, text)

    return as_spank, as_taskprolog


def test_concurrent_steps_are_isolated_to_the_mapa_gpus_paired_with_slurms(node):
    """Two concurrent steps of a 4-GPU job (srun --exact --gres=gpu:2 ... &): Slurm gave them 0,1
    and 2,3; each step's cgroup holds MAPA's paired GPUs, never the other step's."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5,6,7\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=7,6,5,4\n")
    job = cgroupfs / "devices" / "mapa" / "job_12"
    for step, slurm, mapa in (("0", "0,1", ("7", "6")), ("1", "2,3", ("5", "4"))):
        as_spank, as_taskprolog = _as_spank_then_taskprolog(proc, step, "0")
        as_spank()
        answer = agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": slurm})
        assert answer.startswith(f"done cgroup-v1 gpus={','.join(mapa)} job 12 step {step}"), answer
        allowed = {line.split(":")[1].split()[0] for line in lines(job / f"step_{step}" / "devices.allow")}
        assert allowed == set(mapa)
        as_taskprolog()  # a task of the step, narrowed by --gpus-per-task=1 to Slurm's first: it may open the step's
        answer = agent.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": slurm.split(",")[0]})
        assert answer.startswith(f"done cgroup-v1 gpus={','.join(mapa)} job 12 step {step}"), answer
    assert not set(lines(job / "step_0" / "devices.allow")) & set(lines(job / "step_1" / "devices.allow"))


def test_per_task_scope_isolates_each_task_to_its_own_gpu(node):
    agent, proc, cgroupfs, _, configure, tmp_path = node
    (tmp_path / "mapa.toml").write_text((tmp_path / "mapa.toml").read_text().replace('isolation = "fail-open"\n',
                                                                                    'isolation = "fail-open"\nisolation_scope = "task"\n'))
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5,6,7\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=7,6,5,4\n")
    step_dir = cgroupfs / "devices" / "mapa" / "job_12" / "step_3"
    for task, slurm, mapa in (("0", "0", "7"), ("1", "1", "6")):
        as_spank, as_taskprolog = _as_spank_then_taskprolog(proc, "3", task)
        as_spank()
        agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": "0,1"})
        as_taskprolog()
        answer = agent.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": slurm})
        assert answer.startswith(f"done cgroup-v1 gpus={mapa} job 12 step 3"), answer
        assert lines(step_dir / f"task_{task}" / "cgroup.procs") == ["5000"]
        assert [line for line in lines(step_dir / f"task_{task}" / "devices.allow") if line.startswith("c 195:")
                and int(line.split(":")[1].split()[0]) < 8] == [f"c 195:{mapa} rwm"]
    assert {line.split(":")[1].split()[0] for line in lines(step_dir / "devices.allow")} == {"6", "7"}


def test_a_plugin_of_an_earlier_release_isolates_at_the_jobs_level(node):
    """A request from root without MAPA_STEP_ENV (an earlier plugin sends nothing of the step) must
    not take a step for one of no GPUs."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5,6,7\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=7,6,5,4\n")
    as_spank, _ = _as_spank_then_taskprolog(proc, "0", "0")
    as_spank()
    assert agent.isolate(os.getpid(), 0, {}).startswith("done cgroup-v1 gpus=4,5,6,7 job 12 step 0")


def test_taskprolog_of_a_job_without_a_job_file_ranks_slurms_gpus_when_isolated(tmp_path):
    """A job whose Prolog was killed runs on Slurm's GPUs, which the agent isolates it to (from the
    mark): CUDA then numbers those from 0, so the TaskProlog exports ranks, not node indices."""
    (tmp_path / "jobs").mkdir()
    done = run_taskprolog(tmp_path, "fail-open", "done cgroup-v1 gpus=1,5 job 55 step 0 ...", job_file=None,
                          SLURM_STEP_GPUS="5", SLURM_STEP_ID="0")
    assert done.stdout.splitlines()[-2:] == ["export CUDA_VISIBLE_DEVICES=1", "export GPU_DEVICE_ORDINAL=1"]
    off = run_taskprolog(tmp_path, "fail-open", "done off", job_file=None, SLURM_STEP_GPUS="5", SLURM_STEP_ID="0")
    assert off.stdout.splitlines() == ["export MAPA_ISOLATION=off"]


# --- Slurm 26.05: cgroup v2 job directories named by the SLUID ----------------------------------------
# As Slurm 26.05 lays them out (src/plugins/cgroup/v2/cgroup_v2.c; the SLUID is "s" and 13 Crockford
# base32 characters, src/common/sluid.c): no job_J in the path.
V2_SLUID = "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_2\n"


def test_a_sluid_job_directory_is_a_slurm_task_path_whose_job_a_mark_names(node):
    from slurm_mapa.slurm.node_state.job_files import Mark, job_of_sluid, mark_text, parse_mark, write_mark

    cgroup = parse_proc_cgroup(V2_SLUID)
    assert (cgroup.version, cgroup.job_id, cgroup.sluid, cgroup.step, cgroup.task) == (2, "", "sEKNKTV3WPV500", "0", "2")
    assert parse_proc_cgroup(V2_SLUID.replace("sEKNKTV3WPV500", "sEKNKTV3WPV5I0")) is None  # I is no Crockford digit
    assert parse_mark(mark_text(Mark(5, 6, (1, 2), "sEKNKTV3WPV500")).encode()) == Mark(5, 6, (1, 2), "sEKNKTV3WPV500")
    assert parse_mark(b"pid=5 start=6 slurm=1,2\n") == Mark(5, 6, (1, 2), "")  # 24.11: no SLUID
    agent, proc, cgroupfs, attached, _, tmp_path = node
    write_mark(tmp_path / "jobs", "12", Mark(0, 0, (4, 5), "sEKNKTV3WPV500"))
    assert job_of_sluid(tmp_path / "jobs", "sEKNKTV3WPV500") == "12" and job_of_sluid(tmp_path / "jobs", "s00000000000000") is None
    proc.add(5000, "slurmstepd", 4000, USER, V2_SLUID, exe=STEPD)
    (cgroupfs / "unified" / V2_SLUID[4:-1]).mkdir(parents=True)
    answer = agent.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": "0,1"})
    assert answer.startswith("done cgroup-v2 gpus=4,5 job 12 step 0"), answer
    assert attached[0][0] == cgroupfs / "unified" / "system.slice" / "slurmstepd.scope" / "sEKNKTV3WPV500"
    # A SLUID no mark names: no job to isolate to, and none noted.
    proc.add(5000, "slurmstepd", 4000, USER, V2_SLUID.replace("sEKNKTV3WPV500", "s1111111111111"), exe=STEPD)
    (cgroupfs / "unified" / "system.slice" / "slurmstepd.scope" / "s1111111111111" / "step_0" / "user" / "task_2").mkdir(parents=True)
    assert "no Prolog mark here names SLUID s1111111111111" in agent.isolate(os.getpid(), USER, {})


def test_the_prolog_and_its_wrapper_keep_the_jobs_sluid_in_the_mark(tmp_path):
    from slurm_mapa.slurm.config import HookConfig
    from slurm_mapa.slurm.hooks.prolog import run_prolog
    from slurm_mapa.slurm.node_state.job_files import mark_path, parse_mark

    config = HookConfig(ledger=tmp_path / "l.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log", nodes=(("dgx*", "dgx1-v100"),))
    env = {"SLURM_JOB_ID": "31", "SLURMD_NODENAME": "dgx1", "SLURM_JOB_GPUS": "", "SLURM_JOB_SLUID": "sEKNKTV3WPV500"}
    run_prolog(env, config, lambda argv: "", [].append)  # a CPU-only job: its mark is all it leaves
    assert parse_mark(mark_path(config.jobs_dir, "31").read_bytes()).sluid == "sEKNKTV3WPV500"
    run_prolog(env | {"SLURM_JOB_ID": "32", "SLURM_JOB_SLUID": "s;rm -rf /"}, config, lambda argv: "", [].append)
    assert parse_mark(mark_path(config.jobs_dir, "32").read_bytes()).sluid == ""


def test_taskprolog_gives_a_task_whose_list_names_no_gpu_of_its_step_the_steps(tmp_path):
    """--gres-flags=allow-task-sharing: Slurm numbers each task's list from 0 within the step, so
    "0" of a step Slurm gave 2 and 3 names no GPU of the step; the task gets its step's GPUs."""
    job = "MAPA_GPUS=6,2,3,1\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=2,3,6,1\n"
    shared = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, MAPA_SPANK_ISOLATION="cgroup-v1",
                            MAPA_SPANK_GPUS="1,6", SLURM_STEP_GPUS="0", SLURM_STEP_ID="2", job_file=job, record=task_record("2", "1,6"))
    assert "export SLURM_STEP_GPUS=1,6" in shared.stdout.splitlines() and "export CUDA_VISIBLE_DEVICES=0,1" in shared.stdout
    bound = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, MAPA_SPANK_ISOLATION="cgroup-v1",
                           MAPA_SPANK_GPUS="1,6", SLURM_STEP_GPUS="3", SLURM_STEP_ID="2", job_file=job, record=task_record("2", "1,6"))
    assert "export SLURM_STEP_GPUS=1" in bound.stdout.splitlines() and "export CUDA_VISIBLE_DEVICES=0" in bound.stdout


# --- issue 36: isolation across agent restarts, and v1 paths users make ------------------------------
def test_an_existing_v1_cgroup_is_brought_to_its_rules_per_device_never_with_a():
    rules = device_rules("nvidia", [1, 5])
    # Configured before (default deny, the job's GPUs and the rest of its parent's list): nothing to write.
    configured = "c 1:3 rwm\nc *:* m\nc 195:1 rwm\nc 195:5 rwm\nc 195:254 rwm\n"
    assert v1_update_writes(configured, rules) == []
    # Holding a GPU it must not, by an exact entry, and lacking a kept one: one write each.
    assert v1_update_writes("c 195:1 rwm\nc 195:7 rw\n", rules) == [("devices.allow", "c 195:5 rwm"),
                                                                     ("devices.deny", "c 195:7 rwm")]
    # Default allow (the kernel shows no exceptions): the per-minor lines, which converge.
    assert v1_update_writes("a *:* rwm\n", rules) == v1_writes("a *:* rwm\n", rules)
    # A wildcard that opens denied GPUs: only a rebuild can narrow it.
    assert v1_update_writes(DOCKER_LIST, rules) is None
    assert all(line != "a" for writes in (v1_update_writes(configured, rules), v1_update_writes("a *:* rwm\n", rules))
               for _, line in writes)
    assert v1_allowed_minors(configured, rules[0]) == (1, 5)
    assert v1_allowed_minors("a *:* rwm\n", rules[0]) is None and v1_allowed_minors(DOCKER_LIST, rules[0]) is None


def test_an_agent_restart_keeps_a_steps_task_in_its_steps_gpus(node):
    """The agent restarts while a 1-GPU step of a 2-GPU job runs (its SPANK request made its v1
    cgroup). A later TaskProlog request of the step finds the step's GPUs in the kernel's list of
    that cgroup, not in the dead agent's memory, and the task stays in the step's cgroup."""
    agent, proc, cgroupfs, attached, _, tmp_path = node
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5\nSLURM_GPUS=0,1\nPAIRED_GPUS=4,5\n")
    as_spank, as_taskprolog = _as_spank_then_taskprolog(proc, "3", "0")
    as_spank()
    assert agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": "1"}).startswith("done cgroup-v1 gpus=5 ")
    job = cgroupfs / "devices" / "mapa" / "job_12"
    # What the kernel lists for the two cgroups under a container's allow list.
    (job / "devices.list").write_text("c 1:3 rwm\nc 195:4 rwm\nc 195:5 rwm\n")
    (job / "step_3" / "devices.list").write_text("c 1:3 rwm\nc 195:5 rwm\n")
    restarted = Agent(agent.config_path, node="dgx1", isolator=Isolator(agent.isolator.proc, agent.isolator.mountinfo,
                                                                        attach=agent.isolator.attach,
                                                                        binary_problem=fake_binary_problem))
    as_taskprolog()
    answer = restarted.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": "1"})
    assert answer.startswith(f"done cgroup-v1 gpus=5 job 12 step 3 task pid 5000: GPUs 5 in {job / 'step_3'}"), answer
    assert lines(job / "step_3" / "cgroup.procs")[-1] == "5000"
    # The restarted agent wrote nothing that needs an empty cgroup ("devices.deny a").
    assert "a" not in lines(job / "devices.deny") + lines(job / "step_3" / "devices.deny")


def test_a_task_in_cgroups_its_user_made_inside_their_step_is_its_own_jobs(node):
    """Where a v1 step's directory is the job's user's, they can make .../slurm/uid_V/job_J/...
    inside it and move their task there: the agent must not take that for job J's task. What lies
    below a step is that step's (security round 5: refusing it let the task run unisolated)."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    (tmp_path / "jobs" / "999").write_text("MAPA_GPUS=0,1\n")
    nested = V1_BATCH.replace("/slurm/uid_1000/job_12/step_batch", "/slurm/uid_1000/job_12/step_batch/slurm/uid_1001/job_999/step_batch")
    _as_task(proc, nested)
    answer = agent.isolate(os.getpid(), USER, {})
    assert answer.startswith("done cgroup-v1 gpus=4,5 job 12 step batch"), answer
    assert not (cgroupfs / "devices" / "mapa" / "job_999").exists()
    assert agent.job_of(5000) == "12"  # counted against its own job's share
    # Another user's uid_ level, not nested: refused too.
    other = V1_BATCH.replace("uid_1000", "uid_1001")
    _as_task(proc, other)
    answer = agent.isolate(os.getpid(), USER, {})
    assert answer.startswith("done failed-open") and "a cgroup of uid 1001's jobs" in answer, answer


def _whitelisted_v1_base(devices: Path, name: str) -> Path:
    """A cgroup like a container's: default deny, allowing /dev/null, mknod, and every NVIDIA minor."""
    base = devices / name
    base.mkdir()
    for target, line in (("devices.deny", "a"), ("devices.allow", "c 1:3 rwm"), ("devices.allow", "c *:* m"),
                         ("devices.allow", "c 195:* rwm")):
        (base / target).write_text(line + "\n")
    return base


@pytest.mark.skipif(_v1_devices_root() is None, reason="needs root and a writable cgroup v1 devices hierarchy")
def test_on_a_real_v1_hierarchy_a_restarted_agent_isolates_a_job_whose_step_has_its_cgroup(tmp_path):
    """The kernel refuses ``devices.deny a`` on a cgroup with children: an agent that restarted
    while a step ran (its own cgroup below the job's) must configure the job's per device."""
    devices = _v1_devices_root()
    assert devices is not None
    name = f"mapa-test-restart-{os.getpid()}"
    base = _whitelisted_v1_base(devices, name)
    sleeper = [sys.executable, "-c", "import sys; sys.stdin.readline()"]
    step_task = subprocess.Popen(sleeper, stdin=subprocess.PIPE)
    later_task = subprocess.Popen(sleeper, stdin=subprocess.PIPE)
    job_rules, step_rules = device_rules("nvidia", [1, 2]), device_rules("nvidia", [2])
    try:
        step = apply_v1(devices, "4242", job_rules, "0", step_rules, step_task.pid, base=name, configured=set())
        assert step == base / "job_4242" / "step_0"
        # The agent restarts (nothing in memory) and a task of the job's batch step asks.
        where = apply_v1(devices, "4242", job_rules, "batch", None, later_task.pid, base=name, configured=set())
        assert where == base / "job_4242"
        assert v1_allowed_minors((base / "job_4242" / "devices.list").read_text(), job_rules[0]) == (1, 2)
        assert v1_step_minors(devices, "4242", "0", job_rules[0], base=name) == (2,)
        assert str(later_task.pid) in (base / "job_4242" / "cgroup.procs").read_text().split()
    finally:
        for child in (step_task, later_task):
            child.kill()
            child.wait()
        for _ in range(50):
            if release_job_v1(devices, "4242", name) == []:
                break
            time.sleep(0.1)
        os.rmdir(base)


def test_slurm_gpu_list_is_bounded_while_it_parses():
    """Issue 36 (low): one 1.8 KB SLURM_STEP_GPUS of ranges was expanded before it was bounded."""
    import tracemalloc

    from slurm_mapa.slurm.isolation.rules import slurm_gpu_list

    assert slurm_gpu_list("0-3,5,7-8") == (0, 1, 2, 3, 5, 7, 8)
    assert slurm_gpu_list("3-1") == ()  # an empty range names nothing
    assert slurm_gpu_list("0-255") == tuple(range(256)) and slurm_gpu_list("0-256") is None
    hostile = ",".join(["0-9999"] * 256)
    assert slurm_gpu_list(hostile) is None
    # Stops at the first range past the bound: no list of millions of numbers is ever built.
    tracemalloc.start()
    try:
        slurm_gpu_list(hostile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000, peak


def test_tasks_started_while_no_agent_answered_are_isolated_by_the_next_sweep_and_noted(node):
    """Issue 36: a job started while its node's agent was down ran unisolated and nothing said so.
    The agent's sweep (at its start, then with each reconcile pass) finds the job's task processes
    outside its devices cgroup from /proc, moves them in, and journals isolation=failed-open for the
    AdminComment. Processes already in the job's cgroups, root's, and unknown jobs' stay put."""
    agent, proc, cgroupfs, _, _, tmp_path = node
    proc.add(6000, "python3", 5000, USER, V1_BATCH)  # a task of job 12, never isolated
    proc.add(6001, "python3", 5000, USER, V1_BATCH.replace("12:devices:/system.slice/slurmd.service",
                                                          "12:devices:/mapa/job_12/step_batch"))  # isolated already
    proc.add(6002, "slurmstepd", 1, 0, V1_BATCH, exe=STEPD)  # root's: Slurm's daemon
    proc.add(6003, "python3", 1, 1001, V1_BATCH.replace("uid_1000/job_12", "uid_1001/job_77"))  # a job unknown here
    moved = agent.sweep_isolation()
    job = cgroupfs / "devices" / "mapa" / "job_12"
    # 6000, and the fixture's own processes of job 12 (the test's, its TaskProlog, its task)
    assert moved == {"12": 4} and "6000" in lines(job / "cgroup.procs")
    assert not {"6001", "6002", "6003"} & set(lines(job / "cgroup.procs"))
    assert not (cgroupfs / "devices" / "mapa" / "job_77").exists()
    assert lines(job / "devices.allow") == ["c 195:4 rwm", "c 195:5 rwm"]
    notes = [entry.record for _, entry in journal_notes(tmp_path)]
    assert any("isolation=failed-open why=" in record for record in notes), notes
    assert "started while no mapa-agent answered" in (tmp_path / "log").read_text()
    configure = node[4]
    configure("off")
    assert agent.sweep_isolation() == {}  # isolation off: nothing is moved


def journal_notes(tmp_path):
    from slurm_mapa.slurm.config import load_hook_config
    from slurm_mapa.slurm.node_state import NodeState

    config, _ = load_hook_config({"MAPA_CONFIG": str(tmp_path / "mapa.toml")}, validate=False)
    state = NodeState.of(config)
    found = []
    for name, _, _ in state.pending_records():
        entry = state.take_record(name)
        if entry is not None:
            found.append((name, entry))
    return found


def test_a_second_request_never_moves_a_task_to_a_wider_cgroup(node):
    """Issue 36 (low): with isolation_scope = "task" on v1, a task isolated to its own GPU could ask
    again (a user's --task-prolog runs after the site's TaskProlog, before exec) naming its step's
    whole set, and was moved up to the step's cgroup. A task is never moved up."""
    agent, proc, cgroupfs, _, configure, tmp_path = node
    text = (tmp_path / "mapa.toml").read_text().replace('isolation = "fail-open"\n', 'isolation = "fail-open"\nisolation_scope = "task"\n')
    (tmp_path / "mapa.toml").write_text(text)
    (tmp_path / "jobs" / "12").write_text("MAPA_GPUS=4,5,6,7\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=4,5,6,7\n")
    as_spank, as_taskprolog = _as_spank_then_taskprolog(proc, "1", "0")
    as_spank()
    assert agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": "0,1"}).startswith("done cgroup-v1 gpus=4,5 ")
    as_taskprolog()
    first = agent.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": "0"})
    task_dir = cgroupfs / "devices" / "mapa" / "job_12" / "step_1" / "task_0"
    assert first.startswith(f"done cgroup-v1 gpus=4 job 12 step 1 task pid 5000: GPUs 4 in {task_dir}"), first
    # The kernel now shows the task in its task cgroup (the fake /proc is updated as the kernel would).
    moved = (V1_BATCH.replace("step_batch/task_0", "step_1/task_0").replace("step_batch", "step_1")
             .replace("12:devices:/system.slice/slurmd.service", "12:devices:/mapa/job_12/step_1/task_0"))
    _as_task(proc, moved)
    second = agent.isolate(os.getpid(), USER, {"SLURM_STEP_GPUS": "0,1"})  # names the whole step
    assert "kept: a task is never moved to a wider cgroup" in second and second.startswith("done cgroup-v1 gpus=4 "), second
    assert "5000" not in lines(task_dir.parent / "cgroup.procs")  # the task was never written into the step's cgroup
