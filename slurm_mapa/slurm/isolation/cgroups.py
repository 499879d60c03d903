"""The I/O edges of device isolation: the task process found from the caller's pid (/proc), and
the rules applied to cgroup v1's devices hierarchy or, through bpf.py, to cgroup v2's
job and step cgroups; released at the job's end. Each function takes the root of its file
system, so tests run them on a temporary directory."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Callable, Sequence

from .. import trusted_files as trusted
from .bpf import attach_device_program, device_program
from .rules import (SLURM_V2_PATH, CgroupMount, DenyRange, IsolationError, ProcessInfo, SlurmCgroup, V1TaskLine,
                    cgroup_hierarchies, cgroup_mount_entries, cgroup_mounts, parse_status, v1_mount_of, v1_rule_lines,
                    v1_task_lines, v1_task_of, v2_task_of)


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
        trusted.check_ancestors(Path(target))
    except trusted.UnsafePath as error:
        return f"its program {target[:200]} is not in root's directories ({error})"
    return None


def _is_slurmstepd(proc: Path, info: ProcessInfo, binary_problem: Callable[[Path], str | None]) -> bool:
    """A slurmstepd, by name and by the file it runs (the name alone could be set by anyone)."""
    return info.name == "slurmstepd" and binary_problem(proc / str(info.pid) / "exe") is None


def find_task_process(proc: Path, peer_pid: int, peer_uid: int, mounts: Sequence[CgroupMount],
                      binary_problem: Callable[[Path], str | None] = slurmstepd_binary_problem) -> tuple[ProcessInfo, SlurmCgroup]:
    """The task process a TaskProlog runs for (the nearest ancestor of ``peer_pid`` that is a
    slurmstepd running as ``peer_uid``, child of a slurmstepd running as root) and its Slurm cgroup.

    Slurm 24.11 forks each task from slurmstepd (root), drops to the user and runs the TaskProlog
    from it before exec (src/slurmd/slurmstepd/mgr.c:2337-2365, task.c:450-456). No user can make
    a root slurmstepd the parent of a process of theirs, so a fake task (a copied slurmstepd, in a
    cgroup subtree systemd delegated to the user) fails here. IsolationError otherwise: the caller
    is no TaskProlog, or its task is in no Slurm job cgroup (slurm_cgroup_of, on ``mounts``).
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
    cgroup = slurm_cgroup_of(text, mounts)
    if cgroup is None:
        raise IsolationError(f"task {info.pid} is in no Slurm job cgroup (Slurm needs proctrack/cgroup or task/cgroup "
                             f"for isolation); /proc/{info.pid}/cgroup: {text.strip()[:300]!r}")
    return info, cgroup


def root_owned_up_to(directory: Path, top: Path) -> str | None:
    """Why ``directory`` or a directory above it up to ``top`` (a mount point) is not root's, or
    None when all are: slurmd makes a job's cgroups as root, while a subtree systemd delegates to a
    user (user@UID.service, Delegate=) belongs to that user, who can name cgroups there like
    Slurm's."""
    while True:
        try:
            owner = os.lstat(directory).st_uid
        except OSError as error:
            return f"cannot inspect the cgroup {directory}: {error.strerror}"
        if owner != 0:
            return f"the cgroup {directory} belongs to uid {owner}, not root: no Slurm job's cgroup"
        if directory == top or directory == directory.parent:
            return None
        directory = directory.parent


def v1_line_problem(line: V1TaskLine, mounts: Sequence[CgroupMount]) -> str | None:
    """Why a v1 line naming a Slurm task is not one slurmd made, or None: its hierarchy must be
    mounted here and its ``job_J`` directory, and all above it, root's."""
    found = v1_mount_of(line.controllers, mounts, line.job_path)
    if found is None:
        return f"no mounted {','.join(line.controllers)} hierarchy here shows {line.job_path[:200]!r}"
    mount, directory = found
    return root_owned_up_to(Path(directory), Path(mount.point))


def slurm_cgroup_of(text: str, mounts: Sequence[CgroupMount]) -> SlurmCgroup | None:
    """The Slurm task a /proc/PID/cgroup ``text`` puts its process in, read as Slurm defines it, or
    None when it names none; IsolationError when it names one only through cgroups slurmd did not
    make. v1: only the hierarchies Slurm's plugin uses, only lines whose job directory and
    everything above it belong to root (v1_line_problem), the freezer's line deciding (rules.
    v1_task_of). v2: Slurm's layout, the job's cgroup and everything above it root's."""
    lines = v1_task_lines(text)
    if lines:
        problems = [(line, v1_line_problem(line, mounts)) for line in lines]
        slurms = [line for line, problem in problems if problem is None]
        if not slurms:
            raise IsolationError(f"the Slurm-named v1 cgroups of the process are none of slurmd's: {problems[0][1]}")
        cgroup = v1_task_of(slurms)
        if cgroup is None:
            raise IsolationError("the process is in the v1 cgroups of more than one Slurm task: "
                                 + ", ".join(sorted({line.cgroup.path[:120] for line in slurms})))
        return cgroup
    cgroup = v2_task_of(text)
    unified = next((mount for mount in mounts if mount.version == 2), None)
    if cgroup is not None and unified is not None:
        check_v2_job_cgroup_owner(Path(unified.point), cgroup)
    return cgroup


def read_mounts(mountinfo: Path) -> list[CgroupMount]:
    """The cgroup mounts of a mountinfo file; IsolationError if it cannot be read."""
    try:
        return cgroup_mount_entries(mountinfo.read_bytes()[:_PROC_FILE_LIMIT * 16].decode("utf-8", "replace"))
    except OSError as error:
        raise IsolationError(f"cannot read {mountinfo}: {error}") from None


def jobs_with_cgroups(mountinfo: Path = Path("/proc/self/mountinfo"), older_than_s: float = 10.0,
                      now: float | None = None, limit: int = 4096) -> set[str]:
    """The ids of the jobs whose Slurm job cgroup exists on this node and is at least
    ``older_than_s`` old: the kernel's word that the job runs here, whatever MAPA's files say (a job
    whose Prolog died before its first write left none). Younger ones are left out: their Prolog
    may simply not have marked them yet. v1: ``<hierarchy>/slurm*/uid_U/job_J``; v2:
    ``<cgroup2>/system.slice/*slurmstepd.scope/job_J`` (Slurm 26.05's SLUID directories name no
    job id and are not counted). Never raises: what cannot be read is not counted."""
    import glob
    import time as time_module

    now = time_module.time() if now is None else now
    try:
        hierarchies = cgroup_hierarchies(mountinfo.read_text())
    except OSError:
        return set()
    found: set[str] = set()
    v1_read = False
    for version, root, _ in hierarchies:
        if version == 1 and v1_read:
            continue  # Slurm makes a job's cgroups in every v1 hierarchy it uses: one names them all
        pattern = "slurm*/uid_[0-9]*/job_[0-9]*" if version == 1 else "system.slice/*slurmstepd.scope/job_[0-9]*"
        paths = glob.glob(os.path.join(glob.escape(root), pattern))[:limit]
        if version == 1 and glob.glob(os.path.join(glob.escape(root), "slurm*")):
            v1_read = True
        for path in paths:
            job = path.rsplit("job_", 1)[1]
            if not job.isdigit() or job in found:
                continue
            try:
                if now - os.stat(path).st_ctime < older_than_s:
                    continue
            except OSError:
                continue
            found.add(job)
    return found


def _v2_job_dir(cgroup2_root: Path, cgroup: SlurmCgroup) -> tuple[re.Match, Path]:
    """The task's v2 path matched, and its job's cgroup directory; IsolationError for a path that
    is no Slurm v2 task path."""
    match = SLURM_V2_PATH.fullmatch(cgroup.path)
    if cgroup.version != 2 or match is None or ".." in cgroup.path.split("/"):
        raise IsolationError(f"{cgroup.path!r} is not a Slurm cgroup v2 task path")
    return match, cgroup2_root / match["job_dir"].lstrip("/")


def check_v2_job_cgroup_owner(cgroup2_root: Path, cgroup: SlurmCgroup) -> None:
    """IsolationError unless the task's ``job_J`` cgroup and every cgroup above it belong to root
    (root_owned_up_to)."""
    _, directory = _v2_job_dir(cgroup2_root, cgroup)
    problem = root_owned_up_to(directory, cgroup2_root)
    if problem is not None:
        raise IsolationError(problem)


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
    entries = _list_entries(parent_list)
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


def _list_entries(devices_list: str) -> list[tuple[str, str, str, str]]:
    entries = []
    for line in devices_list.splitlines()[:MAX_DEVICES_LIST_LINES]:
        match = _V1_ENTRY.fullmatch(line.strip())
        if match is None:
            if line.strip():
                raise IsolationError(f"devices.list line {line[:80]!r} is not 'TYPE MAJOR:MINOR ACCESS'")
            continue
        entries.append(match.groups())  # type: ignore[arg-type]
    return entries


def v1_update_writes(own_list: str, rules: Sequence[DenyRange]) -> list[tuple[str, str]] | None:
    """Per-device writes that bring an existing v1 devices cgroup whose ``devices.list`` is
    ``own_list`` to deny what ``rules`` deny and allow the GPUs they keep; [] when it does already.
    Never ``a``: the kernel refuses ``devices.deny a`` on a cgroup that has children (EINVAL), and
    a job's cgroup has its steps' below it when a restarted agent sees it again.

    A default-allow cgroup lists only ``a *:* rwm`` (the kernel does not show its exceptions):
    the rules' lines, which converge whatever it held. A default-deny one lists what it allows:
    deny each exact entry of a denied GPU, allow each kept GPU it lacks. None when a wildcard
    entry that can read or write lets a denied GPU through (the kernel cannot take part of a
    wildcard away): only a rebuild (``deny a``, on a cgroup without children) can narrow it."""
    entries = _list_entries(own_list)
    if ("a", "*", "*", "rwm") in entries:
        return v1_rule_lines(rules)
    writes: list[tuple[str, str]] = []
    for rule in rules:
        for minor in range(rule.first, rule.last + 1):
            covering = [e for e in entries if e[0] in ("a", "c") and e[1] in ("*", str(rule.major))
                        and e[2] in ("*", str(minor))]
            opens = [e for e in covering if set(e[3]) & {"r", "w"}]
            if minor in rule.allowed:
                if not any(set("rw") <= set(e[3]) for e in covering):
                    writes.append(("devices.allow", f"c {rule.major}:{minor} rwm"))
            elif any(e[2] == "*" or e[1] == "*" for e in opens):
                return None
            elif opens:
                writes.append(("devices.deny", f"c {rule.major}:{minor} rwm"))
    return writes


def v1_allowed_minors(own_list: str, rule: DenyRange) -> tuple[int, ...] | None:
    """The minors of ``rule``'s range that a v1 devices cgroup whose ``devices.list`` is
    ``own_list`` lets a process open, or None when the list cannot say (a default-allow cgroup
    lists only ``a *:* rwm``; a wildcard entry covers the range)."""
    entries = _list_entries(own_list)
    if ("a", "*", "*", "rwm") in entries:
        return None
    allowed = []
    for kind, major, minor, access in entries:
        if kind not in ("a", "c") or major not in ("*", str(rule.major)) or not set("rw") <= set(access):
            continue
        if minor == "*" or major == "*":
            return None
        if rule.first <= int(minor) <= rule.last:
            allowed.append(int(minor))
    return tuple(sorted(set(allowed)))


def v1_minors_allowed_in(directory: Path, rule: DenyRange) -> tuple[int, ...] | None:
    """What the v1 devices cgroup ``directory`` lets its processes open of ``rule``'s range, as the
    kernel lists it; None if it cannot be read or its list cannot say (v1_allowed_minors)."""
    try:
        return v1_allowed_minors((directory / "devices.list").read_text(), rule)
    except (OSError, IsolationError):
        return None


def v1_step_minors(devices_root: Path, job_id: str, step: str, rule: DenyRange, base: str = "mapa") -> tuple[int, ...] | None:
    """What a step's v1 devices cgroup, configured before (by this agent before a restart, from
    the SPANK plugin's request), lets its tasks open of ``rule``'s range: the kernel's record of
    the step's GPUs. None if the step has no cgroup of its own or its list cannot say."""
    _, step_dir = v1_directories(devices_root, job_id, step, base)
    return v1_minors_allowed_in(step_dir, rule) if step_dir is not None else None


def _has_child_cgroups(directory: Path) -> bool:
    try:
        return any(entry.is_dir(follow_symlinks=False) for entry in os.scandir(directory))
    except OSError:
        return True  # unknown: take the per-device path, which is safe either way


def _configure_v1(directory: Path, rules: Sequence[DenyRange], created: bool) -> None:
    """Write ``rules`` into the devices cgroup ``directory``. One we just ``created`` starts from
    its parent's list (a cgroupfs has one in every directory; the nearest ancestor's is the same
    thing for a directory tree that imitates one). One that existed (configured before an agent
    restart, or by an agent that died midway) is brought to the rules from what the kernel says
    it allows now, per device (v1_update_writes)."""
    writes = None
    if not created and (directory / "devices.list").exists():
        writes = v1_update_writes((directory / "devices.list").read_text(), rules)
        if writes is None and _has_child_cgroups(directory):
            raise IsolationError(f"the devices cgroup {directory} allows GPUs it must deny through a wildcard entry, "
                                 "and has child cgroups: it cannot be narrowed without emptying them")
    if writes is None:
        ancestor = directory.parent
        while not (ancestor / "devices.list").exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        writes = v1_writes((ancestor / "devices.list").read_text(), rules)
    for name, line in writes:
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
            try:
                directory.mkdir(parents=True)
                created = True
            except FileExistsError:
                created = False
            key = _identity(directory)
            if configured is None or key not in configured:
                _configure_v1(directory, rules, created)
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


