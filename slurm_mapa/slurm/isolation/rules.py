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
_V1_PATH = re.compile(r"(?P<base>(?P<above>(?:.*/)?)slurm(?:_[^/]+)?/uid_(?P<uid>[0-9]+)/job_(?P<job>[0-9]+)/step_" + _STEP
                      + r")(?:/task_(?P<task>[0-9]+))?")
# Above Slurm's top directory there is only the host's own layout (a container's /docker/<id>,
# nothing on a bare host). Slurm hands a v1 step's directory to the job's user, who may create
# cgroups in it named like Slurm's (…/step_0/slurm/uid_V/job_999/step_batch) and move their own
# task there: a path with any Slurm level above its Slurm top directory is nobody's task path.
_SLURM_LEVEL = re.compile(r"(?:^|/)(?:slurm(?:_[^/]+)?|uid_[0-9]+|job_[0-9]+|step_[^/]*|task_[^/]*)(?:/|$)")
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
            match = SLURM_V2_PATH.fullmatch(path)
            if match:
                v2 = SlurmCgroup(2, match["job"] or "", match["step"], match["task"], path, match["sluid"] or "")
            continue
        match = _V1_PATH.fullmatch(path)
        if match:
            if _SLURM_LEVEL.search(match["above"]):
                return None  # a cgroup a user made inside their own job's: see _SLURM_LEVEL
            v1.append(SlurmCgroup(1, match["job"], match["step"], match["task"], match["base"], uid=int(match["uid"])))
    if v1:
        if len({(c.job_id, c.step, c.uid) for c in v1}) != 1:
            return None
        with_task = [c for c in v1 if c.task is not None]
        return with_task[0] if with_task else v1[0]
    return v2


def devices_cgroup_path(text: str) -> str | None:
    """The path of the v1 devices hierarchy's line of a /proc/PID/cgroup text, None if none."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if sep and hierarchy.isdigit() and "devices" in controllers.split(","):
            return path
    return None


def mapa_job_cgroup_level(devices_path: str | None, job_id: str, base: str = "mapa") -> tuple[str | None, str | None] | None:
    """Where a v1 devices path sits among job ``job_id``'s MAPA cgroups: (step, task), each None
    above its level ((None, None): the job's own), or None when it is in none of them."""
    match = re.search(rf"/{re.escape(base)}/job_{re.escape(job_id)}(?:/step_([^/]+)(?:/task_([0-9]+))?)?(?:/|$)", devices_path or "")
    return (match[1], match[2]) if match else None


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


def cgroup_hierarchies(mountinfo: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(version, mount point, v1 controllers) of every cgroup hierarchy in a mountinfo text (v1:
    one per mount)."""
    found = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            version = 1 if tail[0] == "cgroup" else 2
            found.append((version, fields[4], tuple(tail[2].split(",")) if version == 1 else ()))
    return found


def cgroup_mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(the v1 devices hierarchy's mount point, the cgroup2 mount point) of a mountinfo text."""
    hierarchies = cgroup_hierarchies(mountinfo)
    devices = next((root for version, root, controllers in hierarchies if version == 1 and "devices" in controllers), None)
    unified = next((root for version, root, _ in hierarchies if version == 2), None)
    return devices, unified


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
