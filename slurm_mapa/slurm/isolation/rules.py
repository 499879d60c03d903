"""The pure parts of device isolation: the modes, the Slurm cgroup a process is in (from
/proc/PID/cgroup text), its uids (/proc/PID/status), the cgroup mounts (/proc/self/mountinfo), a
step's GPUs, and the deny rules for a job's GPUs with cgroup v1's lines for them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ...errors import InputError, MapaError


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
_V1_PATH = re.compile(r"(?P<above>(?:.*?/)?)(?P<base>slurm(?:_[^/]+)?/uid_(?P<uid>[0-9]+)/job_(?P<job>[0-9]+)/step_" + _STEP
                      + r")(?:/task_(?P<task>[0-9]+))?(?P<below>/.*)?")
# Above Slurm's top directory there is only the host's own layout (a container's /docker/<id>,
# nothing on a bare host). Where a v1 step's directory is the job's user's (a release or site that
# chowns it; Debian's 24.11.5 and 26.05.5 keep it root's), the user may create
# cgroups in it (…/step_0/slurm/uid_V/job_999/step_batch) and move their own task there: the
# outermost Slurm path names the job, and what lies below a step is still that step's.
_SLURM_LEVEL = re.compile(r"(?:^|/)(?:slurm(?:_[^/]+)?|uid_[0-9]+|job_[0-9]+|step_[^/]*|task_[^/]*)(?:/|$)")
# The v1 hierarchies Slurm's cgroup plugin uses (src/plugins/cgroup/v1/cgroup_v1.c, g_cg_name:
# freezer for proctrack/cgroup, cpuset, memory and devices for task/cgroup, cpuacct for
# jobacct_gather/cgroup). Never a named hierarchy (systemd's name=systemd), which systemd hands
# to each logged-in user under user@UID.service (Delegate=yes), nor pids, blkio and the rest.
SLURM_V1_CONTROLLERS = frozenset({"freezer", "cpuset", "memory", "devices", "cpuacct"})
# v2, also <scope>/job_J/step_S/slurm: slurmstepd's own cgroup, where a forked task still is when
# the SPANK plugin asks (before the parent places it, mgr.c:2414-2439).
# From Slurm 26.05 the v2 job directory is the job's SLUID (cgroup_v2.c; cgroup.conf
# CgroupJobIdPaths=yes, 26.05.2+, brings job_J back): the job is then found by its mark.
SLURM_V2_PATH = re.compile(r"(?P<job_dir>(?:.*/)?(?:[^/]+_)?slurmstepd\.scope/(?:job_(?P<job>[0-9]+)|(?P<sluid>s[0-9A-HJKMNP-TV-Z]{13})))"
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
    uid: int | None = None  # v1: the job's user, from Slurm's uid_U level (v2 paths name none)


@dataclass(frozen=True)
class V1TaskLine:
    """One /proc/PID/cgroup line of a Slurm v1 hierarchy that names a Slurm task path: the
    hierarchy's controllers, the task it names, and the path of its ``job_J`` directory (which
    slurmd creates as root)."""

    controllers: tuple[str, ...]
    cgroup: SlurmCgroup
    job_path: str


def _cgroup_lines(text: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(hierarchy id, controllers, path) of each well-formed /proc/PID/cgroup line."""
    lines = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if sep and hierarchy.isdigit():
            lines.append((hierarchy, tuple(controllers.split(",")) if controllers else (), path))
    return lines


def v1_task_lines(text: str) -> list[V1TaskLine]:
    """The lines of a /proc/PID/cgroup text that put the process in a Slurm task's v1 cgroups, in
    the hierarchies Slurm's plugin uses only (SLURM_V1_CONTROLLERS). A path below a step (a cgroup
    made in the step's directory, where a site lets the job's user do so) is that step's; a path with a
    Slurm level above its outermost Slurm directory is nobody's. Which of these lines slurmd
    really made is for the caller to check (cgroups.slurm_cgroup_of: job_J owned by root)."""
    found = []
    for hierarchy, controllers, path in _cgroup_lines(text):
        if hierarchy == "0" or not set(controllers) & SLURM_V1_CONTROLLERS:
            continue
        match = _V1_PATH.fullmatch(path)
        if match is None or _SLURM_LEVEL.search(match["above"]) or ".." in path.split("/"):
            continue
        step_path = match["above"] + match["base"]
        cgroup = SlurmCgroup(1, match["job"], match["step"], match["task"], step_path, uid=int(match["uid"]))
        found.append(V1TaskLine(controllers, cgroup, step_path.rsplit("/step_", 1)[0]))
    return found


def v1_task_of(lines: Sequence[V1TaskLine]) -> SlurmCgroup | None:
    """The one Slurm task the v1 ``lines`` (each checked as Slurm's) put a process in, or None.
    Slurm's own word on which job a process belongs to is its process tracking: the freezer
    hierarchy's line (proctrack/cgroup) wins where there is one; without it the lines must agree."""
    if not lines:
        return None
    tracked = [line.cgroup for line in lines if "freezer" in line.controllers]
    if len({(c.job_id, c.step, c.uid) for c in tracked}) > 1:
        return None
    chosen = tracked[0] if tracked else lines[0].cgroup
    same = [line.cgroup for line in lines if (line.cgroup.job_id, line.cgroup.step, line.cgroup.uid)
            == (chosen.job_id, chosen.step, chosen.uid)]
    if not tracked and len(same) != len(lines):
        return None
    with_task = [c for c in same if c.task is not None]
    return with_task[0] if with_task else chosen


def v2_task_of(text: str) -> SlurmCgroup | None:
    """The Slurm task the ``0::`` line of a /proc/PID/cgroup text names, or None."""
    for hierarchy, controllers, path in _cgroup_lines(text):
        if hierarchy == "0" and not controllers:
            match = SLURM_V2_PATH.fullmatch(path)
            if match:
                return SlurmCgroup(2, match["job"] or "", match["step"], match["task"], path, match["sluid"] or "")
    return None


def parse_proc_cgroup(text: str) -> SlurmCgroup | None:
    """The Slurm job and step of a /proc/PID/cgroup text, or None if no line is a Slurm task's,
    from the text alone (what the kernel wrote; whether slurmd made those cgroups is
    cgroups.slurm_cgroup_of's question). v1 lines win over the v2 line: on a hybrid host Slurm
    uses v1 and the ``0::`` line is systemd's."""
    lines = v1_task_lines(text)
    return v1_task_of(lines) if lines else v2_task_of(text)


def devices_cgroup_path(text: str) -> str | None:
    """The path of the v1 devices hierarchy's line of a /proc/PID/cgroup text, None if none."""
    return next((path for _, controllers, path in _cgroup_lines(text) if "devices" in controllers), None)


def mapa_job_cgroup_level(devices_path: str | None, job_id: str, base: str = "mapa",
                          devices_root: str = "/") -> tuple[str | None, str | None] | None:
    """Where a v1 devices path sits among job ``job_id``'s MAPA cgroups: (step, task), each None
    above its level ((None, None): the job's own), or None when it is in none of them. Only the
    agent's own directories count, right under the devices hierarchy's mounted root
    (``devices_root``, a container's /docker/<id>): a directory of the same name in a subtree a
    user was delegated is not one."""
    relative = path_below(devices_path or "", devices_root)
    match = re.fullmatch(rf"/{re.escape(base)}/job_{re.escape(job_id)}(?:/step_([^/]+)(?:/task_([0-9]+))?)?", relative or "")
    return (match[1], match[2]) if match else None


def path_below(path: str, root: str) -> str | None:
    """``path`` (a /proc/PID/cgroup path) relative to a mount's ``root`` within its hierarchy, as an
    absolute path under the mount point; None if it lies outside (or has a ".." component)."""
    if ".." in path.split("/") or not path.startswith("/"):
        return None
    if root in ("", "/"):
        return path
    root = root.rstrip("/")
    if path == root:
        return "/"
    return path[len(root):] if path.startswith(root + "/") else None


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


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup file system mounted here, from /proc/self/mountinfo."""

    version: int  # 1 or 2
    point: str  # where it is mounted
    root: str  # the directory of the hierarchy mounted there ("/", or a container's /docker/<id>)
    options: tuple[str, ...]  # v1: its super options (controllers, name=..., rw)


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as a backslash and 3 octal digits."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


def cgroup_mount_entries(mountinfo: str) -> list[CgroupMount]:
    """Every cgroup (v1) and cgroup2 mount of a mountinfo text, in its order."""
    found = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            version = 1 if tail[0] == "cgroup" else 2
            found.append(CgroupMount(version, _unescape_mountinfo(fields[4]), _unescape_mountinfo(fields[3]),
                                     tuple(tail[2].split(",")) if version == 1 else ()))
    return found


def cgroup_hierarchies(mountinfo: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(version, mount point, v1 controllers) of every cgroup hierarchy in a mountinfo text (v1:
    one per mount)."""
    return [(mount.version, mount.point, mount.options) for mount in cgroup_mount_entries(mountinfo)]


def v1_mount_of(controllers: Sequence[str], mounts: Sequence[CgroupMount], path: str) -> tuple[CgroupMount, str] | None:
    """The v1 mount of the hierarchy a /proc/PID/cgroup line's ``controllers`` name that shows
    ``path``, and the path's directory there; None if none does."""
    for mount in mounts:
        if mount.version == 1 and controllers and set(controllers) <= set(mount.options):
            relative = path_below(path, mount.root)
            if relative is not None:
                return mount, mount.point.rstrip("/") + relative
    return None


def cgroup_mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(the v1 devices hierarchy's mount point, the cgroup2 mount point) of a mountinfo text."""
    return mount_points(cgroup_mount_entries(mountinfo))


def mount_points(mounts: Sequence[CgroupMount]) -> tuple[str | None, str | None]:
    """(the v1 devices hierarchy's mount point, the cgroup2 mount point), None where not mounted."""
    devices = next((mount.point for mount in mounts if mount.version == 1 and "devices" in mount.options), None)
    unified = next((mount.point for mount in mounts if mount.version == 2), None)
    return devices, unified


def devices_root(mounts: Sequence[CgroupMount]) -> str:
    """The directory of the v1 devices hierarchy mounted here ("/" on a host, /docker/<id> in a
    container): /proc/PID/cgroup paths of that hierarchy start with it."""
    return next((mount.root for mount in mounts if mount.version == 1 and "devices" in mount.options), "/")


def slurm_gpu_list(text: str | None) -> tuple[int, ...] | None:
    """Slurm's ``SLURM_STEP_GPUS`` value (node-global indices, ``0,2`` or ``0-3``), None if it is
    not one. Slurm 26.05's ``Flags=env_uuid`` puts UUIDs in CUDA_VISIBLE_DEVICES, never here."""
    if text is None or not re.fullmatch(r"[0-9]{1,4}(?:-[0-9]{1,4})?(?:,[0-9]{1,4}(?:-[0-9]{1,4})?){0,255}", text):
        return None
    # Bounded while parsing: a task's variable may name "0-9999" hundreds of times, and the agent
    # must not build millions of numbers for it (other Prologs wait meanwhile).
    gpus: set[int] = set()
    count = 0
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        count += max(0, high - low + 1)
        if count > 256:
            return None
        gpus.update(range(low, high + 1))
    return tuple(sorted(gpus))


def is_numbered_step(step: str) -> bool:
    """An srun step (0, 1, ..., or N+M of a het step), not the batch, interactive or extern one."""
    return re.fullmatch(r"[0-9]+(?:\+[0-9]+)?", step) is not None


def gpus_of_step(job_gpus: Sequence[int], mapping, step: str, slurm_step_gpus: str | None) -> tuple[int, ...]:
    """MAPA's GPUs for the GPUs Slurm gave a step (or a task: Slurm narrows SLURM_STEP_GPUS to the
    task's own under a GPU binding), through the job file's pairing (node_state.JobMapping). The
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
