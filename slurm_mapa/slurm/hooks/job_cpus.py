"""The job's CPUs on this node, from the cpuset cgroup Slurm made for it, when the Prolog runs in it.

With ``PrologFlags=RunInJob`` (Slurm 23.11 and later) slurmd runs the Prolog in the job's extern
step, so the Prolog's processes are in ``<prepend>/uid_U/job_J/step_extern`` (cgroup v1) or
``<scope>/job_J/step_extern/...`` (v2), and the job level's cpuset already holds the CPUs Slurm
allocated on the node. Checked on Slurm 24.11.5 in the mini cluster: during the Prolog of a
2-GPU job on socket 0, ``cpuset.cpus`` of ``slurm_dgx1/uid_2001/job_21`` read ``0``. With
``PrologFlags=Alloc`` or ``Alloc,Contain`` the job's cgroup does not exist yet when the Prolog runs
(checked the same way), and the caller takes the CPU affinity of Slurm's GPUs instead
(core.affinity.cpus_of_slurms_gpus).

These are Linux CPU ids, the numbering of the topology's ``cpu_affinity`` (nvidia-smi's), so they
compare with it directly; Slurm's abstract ``CPU_IDs`` would not. :func:`cpuset_file` is pure;
:func:`read_job_cpus` reads ``/proc/PID/cgroup``, the mount table and one cgroup file, each
bounded, and answers None on anything unexpected.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import trusted_files as trusted

MAX_PROC_BYTES = 65536
MAX_MOUNTINFO_BYTES = 1 << 20
MAX_CPUSET_BYTES = 65536
_V1_JOB = re.compile(r"(?P<job_dir>.*/uid_[0-9]+/job_(?P<job>[0-9]+))(?:/step_[^/]+(?:/.*)?)?")
# Slurm 26.05 names the v2 job directory by the job's SLUID (src/plugins/cgroup/v2/cgroup_v2.c).
_V2_JOB = re.compile(r"(?P<job_dir>.*/(?:job_(?P<job>[0-9]+)|(?P<sluid>s[0-9A-HJKMNP-TV-Z]{13})))(?:/step_[^/]+(?:/.*)?)?")
_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes a blank in a path as \040


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _mount(mountinfo: str, version: int) -> tuple[str, str] | None:
    """(root within the hierarchy, mount point) of the cpuset v1 hierarchy or the cgroup2 mount."""
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if (version == 1 and tail[0] == "cgroup" and "cpuset" in tail[2].split(",")) or (version == 2 and tail[0] == "cgroup2"):
            return _unescape(fields[3]), _unescape(fields[4])
    return None


def cpuset_file(proc_cgroup: str, mountinfo: str, job_id: str, sluid: str = "") -> Path | None:
    """The file holding job ``job_id``'s CPUs for a process whose /proc/PID/cgroup is
    ``proc_cgroup``: v1 ``<cpuset mount>/.../job_J/cpuset.cpus``, v2 ``.../job_J/cpuset.cpus.effective``;
    None when the process is in no cgroup of that job (the Prolog does not run in the job)."""
    found: tuple[int, str] | None = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not hierarchy.isdigit():
            continue
        if "cpuset" in controllers.split(","):
            match = _V1_JOB.fullmatch(path)
            if match and match["job"] == job_id:
                found = (1, match["job_dir"])
                break  # a hybrid host: Slurm's v1 cpuset wins over systemd's v2 line
        elif hierarchy == "0" and controllers == "" and found is None:
            match = _V2_JOB.fullmatch(path)
            if match and ((match["job"] or "") == job_id or (sluid and match["sluid"] == sluid)):
                found = (2, match["job_dir"])
    if found is None or ".." in found[1].split("/"):
        return None
    version, job_dir = found
    mount = _mount(mountinfo, version)
    if mount is None:
        return None
    root, point = mount
    root = root.rstrip("/")
    if root and job_dir != root and not job_dir.startswith(root + "/"):
        return None  # the job's cgroup is outside what is mounted here
    relative = job_dir[len(root):].lstrip("/")
    return Path(point) / relative / ("cpuset.cpus" if version == 1 else "cpuset.cpus.effective")


def read_job_cpus(pid: int, job_id: str, proc: Path = Path("/proc"),
                  mountinfo: Path = Path("/proc/self/mountinfo"), sluid: str = "") -> frozenset[int] | None:
    """The CPUs of job ``job_id`` (SLUID ``sluid``, Slurm 25.11+) on this node when process ``pid``
    (the Prolog, or the agent's client of it) runs in the job's cgroup; None otherwise, or when
    anything cannot be read."""
    from ...core.affinity import parse_cpu_ids  # the engine: loaded for the decision anyway

    try:
        text = trusted.read_bytes(proc / str(pid) / "cgroup", MAX_PROC_BYTES).decode("utf-8", "replace")
        table = trusted.read_bytes(mountinfo, MAX_MOUNTINFO_BYTES).decode("utf-8", "replace")
        where = cpuset_file(text, table, job_id, sluid)
        if where is None:
            return None
        cpus = parse_cpu_ids(trusted.read_bytes(where, MAX_CPUSET_BYTES).decode("ascii").strip())
    except (OSError, ValueError):
        return None
    return cpus or None
