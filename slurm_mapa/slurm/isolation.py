"""Device isolation owned by MAPA: a job's processes can open only the GPUs MAPA chose for it.

Slurm's own device constraint (cgroup.conf ``ConstrainDevices=yes``) denies the GPUs *Slurm*
picked against, which are not the ones MAPA exports, so MAPA nodes run ``ConstrainDevices=no``
and the node's mapa-agent applies the same kind of rule for MAPA's choice (docs/isolation.md):

* The TaskProlog (the job's user, in a child of the task process before it execs) asks the agent
  over a socket anyone may connect to. The agent believes nothing the request says about which
  job it is: it takes the caller's pid from the socket (SO_PEERCRED), walks up to the task
  process (a forked slurmstepd owned by the caller's uid) and reads the job and step from that
  process's /proc/PID/cgroup, which the kernel writes and Slurm's cgroup plugin chose.
* cgroup v1: the task process is moved into ``<devices>/mapa/job_J`` (and ``.../step_S`` for a
  step using fewer GPUs than the job) whose rules deny the other GPUs; its children inherit it.
* cgroup v2 (no devices controller): a BPF_PROG_TYPE_CGROUP_DEVICE program, built here as bytes,
  is attached with BPF_F_ALLOW_MULTI to Slurm's ``job_J`` cgroup (every process of the job,
  whichever step) and, for a smaller step, to its ``step_S/user`` cgroup.

Like Slurm's rules (src/plugins/task/cgroup/task_cgroup_devices.c), these deny GPU device files
and allow everything else: a whitelist would also have to know InfiniBand's /dev/infiniband/*,
/dev/fuse, gdrcopy and every other device a job may need. Denied: NVIDIA ``c 195:0-253`` but the
job's GPUs (254 is nvidia-modeset, 255 nvidiactl; nvidia-uvm and /dev/nvidia-caps have majors of
their own and stay allowed), AMD ``c 226:128-255`` but the job's render nodes (amdkfd checks the
device cgroup against each GPU's render node, so /dev/kfd needs no rule). The whole range is
denied, not only the files that exist, because nvidia-modprobe (setuid) creates missing
/dev/nvidiaN files on demand.

Pure parts: reading /proc/PID/cgroup, /proc/PID/status and /proc/self/mountinfo text, the v1
rule lines and the v2 program. The I/O edges take the root of each file system (/proc, the
devices hierarchy, the cgroup2 mount) so tests run them on a temporary directory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import InputError, MapaError
from . import paths

MODES = ("auto", "off", "fail-open", "fail-closed")
APPLIED_MODES = ("off", "fail-open", "fail-closed")  # what "auto" comes to on a node

NVIDIA_MAJOR = 195
NVIDIA_GPU_MINORS = (0, 253)  # 254: /dev/nvidia-modeset, 255: /dev/nvidiactl
DRM_MAJOR = 226
RENDER_MINORS = (128, 255)  # /dev/dri/renderD128 on; 0-127 are the card (primary) nodes

# What a /proc/PID/cgroup line names, from Slurm 24.11's cgroup plugins: v1
# <prepend>/uid_U/job_J/step_S[/task_T] (src/plugins/cgroup/v1/xcgroup.c:414-441,
# cgroup_v1.c:361), v2 <scope>/job_J/step_S/user/task_T|task_special (cgroup_v2.c:1773-1822,
# 2552-2555). S is a number, batch, extern, interactive or N+M for a het component
# (log_build_step_id_str, src/common/log.c:1690-1713).
_STEP = r"(?P<step>[0-9]+(?:\+[0-9]+)?|batch|extern|interactive)"
# The directory above uid_U is Slurm's own: "slurm", or "slurm_<node>" with MULTIPLE_SLURMD
# (xcgroup.c's prepend); on v2 the job's parent is slurmstepd's scope, "slurmstepd.scope" or
# "<node>_slurmstepd.scope" (cgroup_v2.c). A directory of another name is no Slurm job's.
_V1_PATH = re.compile(r"(?P<base>(?:.*/)?slurm(?:_[^/]+)?/uid_[0-9]+/job_(?P<job>[0-9]+)/step_" + _STEP
                      + r")(?:/task_(?P<task>[0-9]+))?")
# v2, also <scope>/job_J/step_S/slurm: slurmstepd's own cgroup, where a forked task still is when
# the SPANK plugin asks (before the parent places it, mgr.c:2414-2439).
# From Slurm 26.05 the v2 job directory is the job's SLUID (cgroup_v2.c; cgroup.conf
# CgroupJobIdPaths=yes, 26.05.2+, brings job_J back): the job is then found by its mark.
_V2_PATH = re.compile(r"(?P<job_dir>(?:.*/)?(?:[^/]+_)?slurmstepd\.scope/(?:job_(?P<job>[0-9]+)|(?P<sluid>s[0-9A-HJKMNP-TV-Z]{13})))"
                      r"/step_" + _STEP + r"/(?:user/task_(?P<task>[0-9]+|special)|slurm)")


class IsolationError(MapaError):
    """Isolation could not be applied; the message says why (it is logged and answered).
    ``job_id``: the job, once the kernel's cgroup path has named it (None before).
    ``unknown_job``: the job runs here but left nothing in the jobs directory (no mark)."""

    job_id: str | None = None
    unknown_job: bool = False


@dataclass(frozen=True)
class SlurmCgroup:
    """Where Slurm put a task process, read from its /proc/PID/cgroup."""

    version: int  # 1 or 2
    job_id: str
    step: str  # "0", "batch", "0+1", ...
    task: str | None  # "3", "special" (v2), None (v1 with only step-level cgroups, e.g. freezer)
    path: str  # v2: the task's cgroup, relative to the cgroup2 mount; v1: the step's
    sluid: str = ""  # v2 on Slurm 26.05: the job directory's SLUID (job_id is "" until a mark names it)


def parse_proc_cgroup(text: str) -> SlurmCgroup | None:
    """The Slurm job and step of a /proc/PID/cgroup text, or None if no line is a Slurm task's.

    v1 lines (``N:controllers:/slurm/uid_U/job_J/step_S/task_T``) win over the v2 line: on a
    hybrid host Slurm uses v1 and the ``0::`` line is systemd's. v1 lines that disagree on the
    job or step give None (a process of one job is in one job's cgroups).
    """
    v1: list[SlurmCgroup] = []
    v2: SlurmCgroup | None = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not hierarchy.isdigit():
            continue
        if hierarchy == "0" and controllers == "":
            match = _V2_PATH.fullmatch(path)
            if match:
                v2 = SlurmCgroup(2, match["job"] or "", match["step"], match["task"], path, match["sluid"] or "")
            continue
        match = _V1_PATH.fullmatch(path)
        if match:
            v1.append(SlurmCgroup(1, match["job"], match["step"], match["task"], match["base"]))
    if v1:
        if len({(c.job_id, c.step) for c in v1}) != 1:
            return None
        with_task = [c for c in v1 if c.task is not None]
        return with_task[0] if with_task else v1[0]
    return v2


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    name: str  # /proc/PID/status Name: (the comm, at most 15 characters)
    ppid: int
    uids: tuple[int, int, int]  # real, effective, saved


def parse_status(pid: int, text: str) -> ProcessInfo:
    """The few fields of /proc/PID/status the peer checks need; ValueError if one is missing."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "PPid", "Uid"):
            fields[key] = value.strip()
    try:
        uids = fields["Uid"].split()
        return ProcessInfo(pid, fields["Name"], int(fields["PPid"]), (int(uids[0]), int(uids[1]), int(uids[2])))
    except (KeyError, IndexError, ValueError):
        raise ValueError(f"/proc/{pid}/status lacks Name, PPid or Uid") from None


def cgroup_mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(the v1 devices hierarchy's mount point, the cgroup2 mount point) of a mountinfo text."""
    devices = unified = None
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup" and "devices" in tail[2].split(",") and devices is None:
            devices = fields[4]
        elif tail[0] == "cgroup2" and unified is None:
            unified = fields[4]
    return devices, unified


def slurm_gpu_list(text: str | None) -> tuple[int, ...] | None:
    """Slurm's ``SLURM_STEP_GPUS`` value (node-global indices, ``0,2`` or ``0-3``), None if it is
    not one. Slurm 26.05's ``Flags=env_uuid`` puts UUIDs in CUDA_VISIBLE_DEVICES, never here."""
    if text is None or not re.fullmatch(r"[0-9]{1,4}(?:-[0-9]{1,4})?(?:,[0-9]{1,4}(?:-[0-9]{1,4})?){0,255}", text):
        return None
    gpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        gpus += range(int(first), int(last or first) + 1)
    return tuple(sorted(set(gpus))) if len(gpus) <= 256 else None


def is_numbered_step(step: str) -> bool:
    """An srun step (0, 1, ..., or N+M of a het step), not the batch, interactive or extern one."""
    return re.fullmatch(r"[0-9]+(?:\+[0-9]+)?", step) is not None


def gpus_of_step(job_gpus: Sequence[int], mapping, step: str, slurm_step_gpus: str | None) -> tuple[int, ...]:
    """MAPA's GPUs for the GPUs Slurm gave a step (or a task: Slurm narrows SLURM_STEP_GPUS to the
    task's own under a GPU binding), through the job file's pairing (jobfiles.JobMapping). The
    batch and interactive steps have the job's GPUs; an srun step without SLURM_STEP_GPUS has none
    (Slurm unsets it for a step of no GPUs, src/plugins/gres/common/gres_common.c). Without a pairing
    (a job file of an earlier release) or with GPUs Slurm did not give the job here: the job's."""
    job = tuple(job_gpus)
    if not is_numbered_step(step):
        return job
    if slurm_step_gpus is None:
        return ()
    wanted = slurm_gpu_list(slurm_step_gpus)
    mapped = mapping.mapa_gpus_for(wanted) if mapping is not None and wanted is not None else None
    return job if mapped is None else mapped


@dataclass(frozen=True)
class DenyRange:
    """Deny the character devices ``major:first..last`` except the ``allowed`` minors."""

    major: int
    first: int
    last: int
    allowed: tuple[int, ...]

    def denied(self) -> list[int]:
        return [minor for minor in range(self.first, self.last + 1) if minor not in self.allowed]


def device_rules(vendor: str, minors: Iterable[int]) -> tuple[DenyRange, ...]:
    """The rule that leaves a job only the GPU device files ``minors`` (/dev/nvidiaN numbers, or
    AMD render node numbers) of ``vendor``'s range."""
    if vendor not in ("nvidia", "amd"):
        raise InputError(f"GPU vendor {vendor!r}: expected nvidia or amd")
    allowed = tuple(sorted(set(minors)))
    first, last = NVIDIA_GPU_MINORS if vendor == "nvidia" else RENDER_MINORS
    major = NVIDIA_MAJOR if vendor == "nvidia" else DRM_MAJOR
    outside = [m for m in allowed if not first <= m <= last]
    if outside:
        raise InputError(f"{vendor} GPU device numbers {outside} are outside {major}:{first}-{last}")
    return (DenyRange(major, first, last, allowed),)


def v1_rule_lines(rules: Sequence[DenyRange]) -> list[tuple[str, str]]:
    """(file, line) writes that make a v1 devices cgroup (default allow, as every new one is)
    deny what ``rules`` deny and allow the rest. Allowing the kept minors too makes the writes
    converge: run again on a cgroup with older rules, they never deny a kept GPU, even briefly.
    One line per minor: v1 cannot allow part of a wildcard it denies."""
    writes = []
    for rule in rules:
        for minor in range(rule.first, rule.last + 1):
            target = "devices.allow" if minor in rule.allowed else "devices.deny"
            writes.append((target, f"c {rule.major}:{minor} rwm"))
    return writes


# --- cgroup v2: the BPF_PROG_TYPE_CGROUP_DEVICE program -------------------------------------
# struct bpf_insn {u8 code; u8 dst_reg:4, src_reg:4; s16 off; s32 imm}, little-endian. Only these
# opcodes are emitted (the test's interpreter knows exactly these):
LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W:   dst = *(u32 *)(src + off)
ALU32_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K: dst = (u32)dst & imm
JMP_JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K:   if dst != imm goto pc + 1 + off
JMP_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JMP_JGT_K = 0x25  # BPF_JMP | BPF_JGT | BPF_K (unsigned)
JMP_JLT_K = 0xA5  # BPF_JMP | BPF_JLT | BPF_K (unsigned; Linux 4.14+)
ALU64_MOV_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K: dst = imm
JMP_EXIT = 0x95  # BPF_JMP | BPF_EXIT: return r0
# struct bpf_cgroup_dev_ctx {u32 access_type (type low 16 bits, access high 16); u32 major; u32 minor}
BPF_DEVCG_DEV_CHAR = 2


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(rules: Sequence[DenyRange]) -> bytes:
    """The eBPF program: 0 (deny) for a character device a rule denies, 1 (allow) otherwise.

        r2 = ctx->access_type & 0xffff; r4 = ctx->major; r5 = ctx->minor
        if r2 != CHAR goto allow
        for each rule: if r4 != major || r5 < first || r5 > last goto next
                       if r5 == kept minor goto allow   (for each kept minor)
                       return 0
        next: ...
        allow: return 1
    """
    # Items are instructions or ("jump", code, dst, imm, label); labels are resolved at the end.
    body: list = [insn(LDX_MEM_W, 2, 1, 0), insn(ALU32_AND_K, 2, imm=0xFFFF),
                  insn(LDX_MEM_W, 4, 1, 4), insn(LDX_MEM_W, 5, 1, 8),
                  ("jump", JMP_JNE_K, 2, BPF_DEVCG_DEV_CHAR, "allow")]
    labels: dict[str, int] = {}
    for number, rule in enumerate(rules):
        following = f"rule{number + 1}"
        body += [("jump", JMP_JNE_K, 4, rule.major, following), ("jump", JMP_JLT_K, 5, rule.first, following),
                 ("jump", JMP_JGT_K, 5, rule.last, following)]
        body += [("jump", JMP_JEQ_K, 5, minor, "allow") for minor in rule.allowed]
        body += [insn(ALU64_MOV_K, 0, imm=0), insn(JMP_EXIT)]
        labels[following] = len(body)
    labels["allow"] = len(body)
    body += [insn(ALU64_MOV_K, 0, imm=1), insn(JMP_EXIT)]
    out = []
    for pc, item in enumerate(body):
        if isinstance(item, tuple):
            _, code, dst, imm, label = item
            item = insn(code, dst, off=labels[label] - pc - 1, imm=imm)
        out.append(item)
    return b"".join(out)


# The bpf(2) system call, through ctypes (no compiled helper): numbers from <linux/bpf.h>.
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "riscv64": 280, "s390x": 351}


def prog_load_attr(insns_address: int, insn_count: int, license_address: int, name: bytes = b"mapa_gpus") -> bytes:
    """union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size,
    log_buf, kern_version, prog_flags, prog_name[16]."""
    return struct.pack("<IIQQIIQII16s", BPF_PROG_TYPE_CGROUP_DEVICE, insn_count, insns_address, license_address,
                       0, 0, 0, 0, 0, name[:15])


def prog_attach_attr(cgroup_fd: int, prog_fd: int) -> bytes:
    """union bpf_attr for BPF_PROG_ATTACH: target_fd, attach_bpf_fd, attach_type, attach_flags."""
    return struct.pack("<IIII", cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)


def _bpf(command: int, attr: bytes) -> int:
    number = SYS_BPF.get(platform.machine())
    if number is None:
        raise IsolationError(f"no bpf(2) system call number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(attr, len(attr))
    result = libc.syscall(ctypes.c_long(number), ctypes.c_int(command), buffer, ctypes.c_uint(len(attr)))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def attach_device_program(cgroup_dir: Path, program: bytes) -> None:
    """Load ``program`` and attach it to ``cgroup_dir`` (BPF_F_ALLOW_MULTI: it runs with whatever
    else is attached there or above, Slurm's or systemd's, and a device must pass all of them).
    The attachment holds the program; it goes when the cgroup is removed. Needs root (CAP_BPF and
    CAP_SYS_ADMIN) and Linux 4.15+."""
    code = ctypes.create_string_buffer(program, len(program))
    license_text = ctypes.create_string_buffer(b"GPL")
    prog_fd = -1
    dir_fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        prog_fd = _bpf(BPF_PROG_LOAD, prog_load_attr(ctypes.addressof(code), len(program) // 8,
                                                     ctypes.addressof(license_text)))
        _bpf(BPF_PROG_ATTACH, prog_attach_attr(dir_fd, prog_fd))
    finally:
        os.close(dir_fd)
        if prog_fd >= 0:
            os.close(prog_fd)


# --- I/O edges ------------------------------------------------------------------------------
MAX_ANCESTORS = 8  # the client, the TaskProlog's shell (and a few more if a site wraps it), the task
_PROC_FILE_LIMIT = 65536


def read_process(proc: Path, pid: int) -> ProcessInfo:
    return parse_status(pid, (proc / str(pid) / "status").read_bytes()[:_PROC_FILE_LIMIT].decode("utf-8", "replace"))


def read_proc_cgroup(proc: Path, pid: int) -> str:
    """Process ``pid``'s /proc/PID/cgroup text (bounded); OSError if it cannot be read."""
    with open(proc / str(pid) / "cgroup", "rb") as handle:
        return handle.read(_PROC_FILE_LIMIT).decode("utf-8", "replace")


def slurmstepd_binary_problem(exe_link: Path) -> str | None:
    """Why the program behind ``exe_link`` (a /proc/PID/exe) is not Slurm's slurmstepd, or None.

    The kernel's facts, none of which a user controls: the file the process runs (stat through the
    link reaches its inode, even if renamed since) belongs to root and is writable by nobody else,
    it sits in root's directories, and its name is slurmstepd (Debian's is slurmstepd-wlm). A
    user's copy, or any program renamed with prctl(PR_SET_NAME), fails one of these."""
    try:
        target = os.readlink(exe_link)
        info = os.stat(exe_link)
    except OSError as error:
        return f"cannot read {exe_link}: {error.strerror}"
    if not os.path.isabs(target) or target.endswith(" (deleted)") or not os.path.basename(target).startswith("slurmstepd"):
        return f"it runs {target[:200]!r}, not a slurmstepd"
    if info.st_uid != 0 or stat.S_IMODE(info.st_mode) & 0o022 or not stat.S_ISREG(info.st_mode):
        return f"its program {target[:200]} is not a file of root's that only root may write"
    try:
        paths.check_ancestors(Path(target))
    except paths.UnsafePath as error:
        return f"its program {target[:200]} is not in root's directories ({error})"
    return None


def _is_slurmstepd(proc: Path, info: ProcessInfo, binary_problem: Callable[[Path], str | None]) -> bool:
    """A slurmstepd, by name and by the file it runs (the name alone could be set by anyone)."""
    return info.name == "slurmstepd" and binary_problem(proc / str(info.pid) / "exe") is None


def find_task_process(proc: Path, peer_pid: int, peer_uid: int,
                      binary_problem: Callable[[Path], str | None] = slurmstepd_binary_problem) -> tuple[ProcessInfo, SlurmCgroup]:
    """The task process a TaskProlog runs for (the nearest ancestor of ``peer_pid`` that is a
    slurmstepd running as ``peer_uid``, child of a slurmstepd running as root) and its Slurm cgroup.

    Slurm 24.11 forks each task from slurmstepd (root), drops to the user and runs the TaskProlog
    from it before exec (src/slurmd/slurmstepd/mgr.c:2337-2365, task.c:450-456). No user can make
    a root slurmstepd the parent of a process of theirs, so a fake task (a copied slurmstepd, in a
    cgroup subtree systemd delegated to the user) fails here. IsolationError otherwise: the caller
    is no TaskProlog, or its task is in no Slurm job cgroup.
    """
    pid = peer_pid
    for _ in range(MAX_ANCESTORS):
        try:
            info = read_process(proc, pid)
        except (OSError, ValueError) as error:
            raise IsolationError(f"cannot read process {pid}: {error}") from None
        if _is_slurmstepd(proc, info, binary_problem):
            break
        if info.ppid <= 1:
            raise IsolationError(f"process {peer_pid} does not run under a Slurm task (no slurmstepd among its ancestors)")
        pid = info.ppid
    else:
        raise IsolationError(f"process {peer_pid} does not run under a Slurm task (no slurmstepd within {MAX_ANCESTORS} ancestors)")
    if info.uids[:2] != (peer_uid, peer_uid):
        raise IsolationError(f"slurmstepd {info.pid} (uids {info.uids[0]}/{info.uids[1]}) is no task of uid {peer_uid}: "
                             "a TaskProlog's parent is the task, running as the job's user")
    try:
        parent = read_process(proc, info.ppid)
    except (OSError, ValueError) as error:
        raise IsolationError(f"cannot read process {info.ppid}, parent of task {info.pid}: {error}") from None
    problem = binary_problem(proc / str(parent.pid) / "exe") if parent.name == "slurmstepd" else "its name is not slurmstepd"
    # Root's, by its real and saved uids: slurmstepd runs under the job's effective uid while it
    # forks the tasks (_fork_all_tasks in src/slurmd/slurmstepd/mgr.c drops effective privileges with
    # seteuid, src/slurmd/common/privileges.c), which a busy node shows to the agent; no process a
    # user started has a real uid of 0.
    if problem is not None or parent.uids[0] != 0 or parent.uids[2] != 0:
        raise IsolationError(f"process {info.pid} is no task process: its parent {info.ppid} is no slurmstepd running as root"
                             + (f" ({problem})" if problem else f" (uids {parent.uids[0]}/{parent.uids[1]})"))
    try:
        text = read_proc_cgroup(proc, info.pid)
    except OSError as error:
        raise IsolationError(f"cannot read /proc/{info.pid}/cgroup: {error}") from None
    cgroup = parse_proc_cgroup(text)
    if cgroup is None:
        raise IsolationError(f"task {info.pid} is in no Slurm job cgroup (Slurm needs proctrack/cgroup or task/cgroup "
                             f"for isolation); /proc/{info.pid}/cgroup: {text.strip()[:300]!r}")
    return info, cgroup


def _v2_job_dir(cgroup2_root: Path, cgroup: SlurmCgroup) -> tuple[re.Match, Path]:
    """The task's v2 path matched, and its job's cgroup directory; IsolationError for a path that
    is no Slurm v2 task path."""
    match = _V2_PATH.fullmatch(cgroup.path)
    if cgroup.version != 2 or match is None or ".." in cgroup.path.split("/"):
        raise IsolationError(f"{cgroup.path!r} is not a Slurm cgroup v2 task path")
    return match, cgroup2_root / match["job_dir"].lstrip("/")


def check_v2_job_cgroup_owner(cgroup2_root: Path, cgroup: SlurmCgroup) -> None:
    """IsolationError unless the task's ``job_J`` cgroup and every cgroup above it belong to root:
    Slurm creates them as root, while a subtree systemd delegates to a user (user@UID.service)
    belongs to that user, who could name cgroups there like Slurm's."""
    _, directory = _v2_job_dir(cgroup2_root, cgroup)
    while True:
        try:
            owner = os.lstat(directory).st_uid
        except OSError as error:
            raise IsolationError(f"cannot inspect the cgroup {directory}: {error.strerror}") from None
        if owner != 0:
            raise IsolationError(f"the cgroup {directory} belongs to uid {owner}, not root: no Slurm job's cgroup")
        if directory == cgroup2_root or directory == directory.parent:
            return
        directory = directory.parent


def _write(path: Path, line: str) -> None:
    """One write of one line, as cgroupfs wants (a rule or a pid per write). O_CREAT and O_APPEND
    change nothing on cgroupfs (it refuses to create a file) and make a plain directory record
    every line, as the tests' fake cgroupfs."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


_V1_ENTRY = re.compile(r"([abc]) (\*|[0-9]{1,7}):(\*|[0-9]{1,7}) ([rwm]{1,3})")
MAX_DEVICES_LIST_LINES = 4096


def v1_writes(parent_list: str, rules: Sequence[DenyRange]) -> list[tuple[str, str]]:
    """The writes that configure a new v1 devices cgroup under a parent whose ``devices.list`` is
    ``parent_list``. A parent that allows everything (``a *:* rwm``: the root cgroup of a host)
    gets :func:`v1_rule_lines`. A parent that allows a list (a container, a systemd unit with a
    DevicePolicy, a job cgroup of ours) cannot be narrowed by denying one minor of an allowed
    wildcard (the kernel removes only exactly matching entries), so the child is rebuilt: deny
    all, then allow each of the parent's entries, with a wildcard of a rule's major written out
    minor by minor without the denied ones."""
    entries = []
    for line in parent_list.splitlines()[:MAX_DEVICES_LIST_LINES]:
        match = _V1_ENTRY.fullmatch(line.strip())
        if match is None:
            if line.strip():
                raise IsolationError(f"devices.list line {line[:80]!r} is not 'TYPE MAJOR:MINOR ACCESS'")
            continue
        entries.append(match.groups())
    if ("a", "*", "*", "rwm") in entries:
        return v1_rule_lines(rules)
    by_major = {rule.major: rule for rule in rules}
    writes = [("devices.deny", "a")]
    for kind, major, minor, access in entries:
        rule = by_major.get(int(major)) if kind == "c" and major != "*" else None
        if rule is None:
            writes.append(("devices.allow", f"{kind} {major}:{minor} {access}"))
        elif minor == "*":
            kept = [m for m in range(0, 256) if not rule.first <= m <= rule.last or m in rule.allowed]
            writes += [("devices.allow", f"c {major}:{m} {access}") for m in kept]
        elif not rule.first <= int(minor) <= rule.last or int(minor) in rule.allowed:
            writes.append(("devices.allow", f"{kind} {major}:{minor} {access}"))
    return writes


def _configure_v1(directory: Path, rules: Sequence[DenyRange]) -> None:
    # What the new cgroup starts from: its parent's list (a cgroupfs has one in every directory;
    # the nearest ancestor's is the same thing for a directory tree that imitates one).
    ancestor = directory.parent
    while not (ancestor / "devices.list").exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    for name, line in v1_writes((ancestor / "devices.list").read_text(), rules):
        _write(directory / name, line)


def _identity(directory: Path) -> tuple[str, int]:
    """A cgroup directory's path and inode: a job's cgroup made again (a requeued job, after an
    Epilog that could not remove it) is not taken for the one configured before (cgroupfs inode
    numbers carry a generation: a new directory does not get an old one's)."""
    return str(directory), directory.stat().st_ino


def v1_directories(devices_root: Path, job_id: str, step: str | None, base: str = "mapa") -> tuple[Path, Path | None]:
    if not job_id.isdigit() or (step is not None and not re.fullmatch(r"[0-9a-z+]+", step)):
        raise IsolationError(f"job {job_id!r} step {step!r}: not a Slurm job and step id")
    job_dir = devices_root / base / f"job_{job_id}"
    return job_dir, (job_dir / f"step_{step}" if step is not None else None)


def apply_v1(devices_root: Path, job_id: str, job_rules: Sequence[DenyRange], step: str | None,
             step_rules: Sequence[DenyRange] | None, pid: int, base: str = "mapa",
             configured: set[tuple[str, int]] | None = None, task: str | None = None,
             task_rules: Sequence[DenyRange] | None = None) -> Path:
    """Move ``pid`` into ``<devices_root>/<base>/job_J`` (or its ``step_S`` when the step has
    ``step_rules`` of its own, or ``step_S/task_T`` with ``task_rules``), creating and configuring
    the cgroups first; the cgroup it is in. ``configured``: cgroups written already (_identity),
    not written again."""
    job_dir, step_dir = v1_directories(devices_root, job_id, step if step_rules is not None or task_rules is not None else None, base)
    task_dir = None
    if task_rules is not None and step_dir is not None:
        if task is None or not task.isdigit():
            raise IsolationError(f"task {task!r}: not a Slurm task id")
        task_dir = step_dir / f"task_{task}"
    target = job_dir
    for directory, rules in ((job_dir, job_rules), (step_dir, step_rules if step_rules is not None else job_rules),
                             (task_dir, task_rules)):
        if directory is None or rules is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
            key = _identity(directory)
            if configured is None or key not in configured:
                _configure_v1(directory, rules)
                if configured is not None:
                    configured.add(key)
        except OSError as error:
            raise IsolationError(f"cannot set up the devices cgroup {directory}: {error}") from None
        target = directory
    try:
        _write(target / "cgroup.procs", str(pid))
    except OSError as error:
        raise IsolationError(f"cannot move task {pid} into {target}: {error}") from None
    return target


def apply_v2(cgroup2_root: Path, cgroup: SlurmCgroup, job_rules: Sequence[DenyRange], step_rules: Sequence[DenyRange] | None,
             attach: Callable[[Path, bytes], None] = attach_device_program,
             attached: set[tuple[str, int]] | None = None, task_rules: Sequence[DenyRange] | None = None) -> list[Path]:
    """Attach the job's program to Slurm's ``job_J`` cgroup and, with ``step_rules``, the step's to
    ``step_S/user`` (with ``task_rules``, the task's to ``step_S/user/task_T``); once each
    (``attached``: cgroups done already, by _identity). The cgroups where a program was attached now."""
    match, job_dir = _v2_job_dir(cgroup2_root, cgroup)
    step_user = job_dir / f"step_{match['step']}" / "user"
    if task_rules is not None and (match["task"] is None or not match["task"].isdigit()):
        raise IsolationError(f"{cgroup.path!r} names no task cgroup: no per-task isolation")
    task_dir = step_user / f"task_{match['task']}" if task_rules is not None else None
    done = []
    for directory, rules in ((job_dir, job_rules), (step_user, step_rules), (task_dir, task_rules)):
        if rules is None or directory is None:
            continue
        try:
            key = _identity(directory)
            if attached is not None and key in attached:
                continue
            attach(directory, device_program(rules))
        except OSError as error:
            raise IsolationError(f"cannot attach the device program to {directory}: {error}") from None
        if attached is not None:
            attached.add(key)
        done.append(directory)
    return done


def release_job_v1(devices_root: Path, job_id: str, base: str = "mapa") -> list[str]:
    """Remove the job's v1 devices cgroups (its steps' first); what could not be removed, and why.
    For the Epilog: the job's processes are gone by then, so the cgroups are empty."""
    job_dir, _ = v1_directories(devices_root, job_id, None, base)
    problems = []
    if not job_dir.is_dir():
        return problems
    for child in sorted(job_dir.iterdir()):
        if child.is_dir() and child.name.startswith("step_"):
            try:
                child.rmdir()
            except OSError as error:
                problems.append(f"{child}: {error}")
    try:
        job_dir.rmdir()
    except OSError as error:
        problems.append(f"{job_dir}: {error}")
    return problems


def release_job(job_id: str, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """The Epilog's clean-up: remove job ``job_id``'s v1 devices cgroups, if there are any. On v2
    there is nothing to do: the programs go with Slurm's cgroups. What failed, and why."""
    try:
        devices, _ = cgroup_mounts(mountinfo.read_text())
    except OSError as error:
        return [f"cannot read {mountinfo}: {error}"]
    if devices is None:
        return []
    try:
        return release_job_v1(Path(devices), job_id)
    except IsolationError as error:
        return [str(error)]


# --- what the agent runs for a TaskProlog ------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What an isolate request came to: ``state`` is cgroup-v1, cgroup-v2, off or failed-open."""

    state: str
    job_id: str
    step: str
    detail: str


@dataclass(frozen=True)
class JobDevices:
    vendor: str
    job_gpus: tuple[int, ...]
    minors: Callable[[int], int]
    mapping: "object | None" = None  # jobfiles.JobMapping: Slurm's GPUs paired with MAPA's


class Isolator:
    """Applies isolation for TaskProlog requests; one per agent (it remembers which cgroups it
    configured, and runs one request at a time: the writes are fast, and serialising them keeps
    two tasks of a job from configuring its cgroup at once)."""

    def __init__(self, proc: Path = Path("/proc"), mountinfo: Path = Path("/proc/self/mountinfo"),
                 attach: Callable[[Path, bytes], None] = attach_device_program,
                 binary_problem: Callable[[Path], str | None] = slurmstepd_binary_problem) -> None:
        self.proc = proc
        self.mountinfo = mountinfo
        self.attach = attach
        self.binary_problem = binary_problem  # tests' fake /proc links to a slurmstepd this host lacks
        self.lock = threading.Lock()
        self.configured: set[tuple[str, int]] = set()  # cgroups written or attached to
        # (job, step) -> the step's GPUs, as the SPANK plugin's request (root, before Slurm narrows
        # the environment to each task) said: a TaskProlog's request then knows the whole step's.
        self.steps: dict[tuple[str, str], tuple[int, ...]] = {}

    def isolate(self, peer_pid: int, peer_uid: int, request: Mapping[str, str],
                job_devices: Callable[[str], JobDevices], scope: str = "step",
                job_of_sluid: Callable[[str], str | None] = lambda sluid: None) -> Outcome:
        """Isolate the task of the TaskProlog (or SPANK plugin, uid 0) ``peer_pid``; IsolationError
        says why it could not. ``job_devices``: the job's GPUs and their device numbers, for a job
        id. ``scope``: "step" (every task of a step opens all of the step's GPUs, as CUDA/ROCm IPC
        between ranks needs) or "task" (each task its own, from its TaskProlog's request)."""
        task, cgroup = find_task_process(self.proc, peer_pid, peer_uid, self.binary_problem)
        try:
            mounts = cgroup_mounts(self.mountinfo.read_text())
        except OSError as error:
            raise IsolationError(f"cannot read {self.mountinfo}: {error}") from None
        if cgroup.version == 2 and mounts[1] is not None:
            check_v2_job_cgroup_owner(Path(mounts[1]), cgroup)
        if cgroup.sluid:  # Slurm 26.05: the kernel names the job by its SLUID; the Prolog's mark maps it
            job_id = job_of_sluid(cgroup.sluid)
            if job_id is None:
                raise IsolationError(f"no Prolog mark here names SLUID {cgroup.sluid}, the job of task {task.pid} "
                                     "(its Prolog did not run on this node, or Slurm gave it no SLURM_JOB_SLUID)")
            cgroup = dataclasses.replace(cgroup, job_id=job_id)
        try:
            return self._isolate_task(task, cgroup, request, job_devices, mounts, scope, from_root=peer_uid == 0)
        except IsolationError as error:
            error.job_id = cgroup.job_id  # known from here on: the agent records the failure in the job's AdminComment
            raise

    def _isolate_task(self, task: ProcessInfo, cgroup: SlurmCgroup, request: Mapping[str, str],
                      job_devices: Callable[[str], JobDevices], mounts: tuple[str | None, str | None],
                      scope: str, from_root: bool) -> Outcome:
        claimed = request.get("SLURM_JOB_ID")
        if claimed is not None and claimed != cgroup.job_id:
            raise IsolationError(f"the request says job {claimed!r}, but task {task.pid} is in job {cgroup.job_id}'s cgroup")
        devices = job_devices(cgroup.job_id)
        key = (cgroup.job_id, cgroup.step)
        asked = gpus_of_step(devices.job_gpus, devices.mapping, cgroup.step, request.get("SLURM_STEP_GPUS"))
        with self.lock:
            if from_root and request.get("MAPA_STEP_ENV") == "1":
                # The SPANK plugin: the step's environment, before Slurm narrows it per task.
                if len(self.steps) > 100000:
                    self.steps.clear()
                self.steps[key] = asked
                step, task_gpus = asked, None
            elif from_root:  # a plugin of an earlier release sends nothing of the step: the job's
                step, task_gpus = devices.job_gpus, None
            else:  # a TaskProlog: its task's GPUs, under a binding; the step's from the plugin when it asked
                step = self.steps.get(key)
                if step is None:
                    # No plugin: the step's GPUs are unknown (each task sees its own); the job's
                    # cgroup holds, and a step of no GPUs (the task has none either) none.
                    step = asked if not asked else devices.job_gpus
                elif not set(asked) <= set(step):
                    asked = step  # the task's variables say more than its step has: the step's
                task_gpus = asked if scope == "task" and asked != step else None
            levels = [(None, devices.job_gpus), ("step", step if step != devices.job_gpus else None),
                      ("task", task_gpus)]
            rules = {level: device_rules(devices.vendor, map(devices.minors, gpus)) for level, gpus in levels
                     if gpus is not None}
            openable = task_gpus if task_gpus is not None else step
            gpus = ",".join(map(str, openable)) or "none"
            if len(self.configured) > 100000:  # months of jobs: forget; a cgroup is only written again
                self.configured.clear()
            if cgroup.version == 1:
                if mounts[0] is None:
                    raise IsolationError("Slurm uses cgroup v1 here, but no v1 devices hierarchy is mounted")
                if "task" in rules and cgroup.task is None:
                    raise IsolationError(f"task {task.pid}'s v1 cgroups name no task level: no per-task isolation")
                where = apply_v1(Path(mounts[0]), cgroup.job_id, rules[None], cgroup.step, rules.get("step"), task.pid,
                                 configured=self.configured, task=cgroup.task, task_rules=rules.get("task"))
                return Outcome("cgroup-v1", cgroup.job_id, cgroup.step,
                               f"gpus={gpus} job {cgroup.job_id} step {cgroup.step} task pid {task.pid}: GPUs {gpus} in {where}")
            if mounts[1] is None:
                raise IsolationError("Slurm uses cgroup v2 here, but no cgroup2 file system is mounted")
            done = apply_v2(Path(mounts[1]), cgroup, rules[None], rules.get("step"), self.attach, self.configured,
                            task_rules=rules.get("task"))
            return Outcome("cgroup-v2", cgroup.job_id, cgroup.step, f"gpus={gpus} job {cgroup.job_id} step {cgroup.step}: GPUs {gpus}"
                           + (f" (programs attached to {', '.join(map(str, done))})" if done else ""))


def effective_mode(config, node: str) -> tuple[str, str]:
    """mapa.toml's ``isolation`` on ``node``, and why. "auto" (the default) is "fail-open" where the
    node's topology file names each GPU's device minor (``minor_numbers``, which discovery from
    NVML or AMD SMI writes), and "off" elsewhere: a preset or saved `nvidia-smi topo -m` text does
    not say which /dev/nvidiaN is which GPU, and a wrong guess would deny jobs their own GPUs."""
    from ..hardware.load import load_topology_file

    if config.isolation != "auto":
        return config.isolation, f'isolation = "{config.isolation}" in mapa.toml'
    spec = config.topology_for(node)
    if spec is None:
        return "off", f"auto: no [nodes] entry of mapa.toml matches node {node}"
    try:
        topology = load_topology_file(spec)
    except (OSError, MapaError) as error:
        return "off", f"auto: cannot read node {node}'s topology {spec}: {error}"
    if topology.minor_numbers is None:
        return "off", (f"auto: node {node}'s topology {spec} names no device minor numbers "
                       "(a file from `mapa topo discover` with NVML or AMD SMI does)")
    return "fail-open", f"auto: node {node}'s topology {spec} names each GPU's device file"


def job_devices_for(config, node: str, dev: Path = Path("/dev")) -> Callable[[str], JobDevices]:
    """For a job id: the GPUs the job uses on this node (its job file, else Slurm's GPUs from the
    Prolog's mark, none for a job without GPUs) and their device numbers (the node's topology
    file's ``minor_numbers``, else the index; AMD render nodes 128 + the index)."""
    from ..hardware.load import load_topology_file
    from . import jobfiles

    def lookup(job_id: str) -> JobDevices:
        gpus: tuple[int, ...] | None = None
        mapping = None
        try:
            mapping = jobfiles.parse_job_mapping(jobfiles.job_file_path(config.jobs_dir, job_id).read_bytes())
            gpus = mapping.gpus
        except (OSError, ValueError):
            try:
                gpus = jobfiles.parse_mark(jobfiles.mark_path(config.jobs_dir, job_id).read_bytes()).slurm_gpus
            except (OSError, ValueError):
                error = IsolationError(f"job {job_id} has no job file and no Prolog mark in {config.jobs_dir}: "
                                       "its Prolog did not run on this node")
                error.unknown_job = True
                raise error from None
        spec = config.topology_for(node)
        if spec is None:
            vendor = "amd" if (dev / "kfd").exists() else "nvidia"
            base = RENDER_MINORS[0] if vendor == "amd" else 0
            return JobDevices(vendor, gpus, lambda gpu: base + gpu, mapping)
        try:
            topology = load_topology_file(spec)
        except (OSError, MapaError) as error:
            raise IsolationError(f"cannot read node {node}'s topology {spec}: {error}") from None
        if any(gpu >= topology.graph.size for gpu in gpus):
            raise IsolationError(f"job {job_id}'s GPUs {list(gpus)} are not all among the {topology.graph.size} of {spec}")
        return JobDevices(topology.gpu_vendor, gpus, topology.minor, mapping)

    return lookup
