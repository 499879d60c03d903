"""The jobs directory: what each job on this node really uses, kept where the TaskProlog reads it.

Two small files per job, both written whole or not at all (trusted.replace_file):

* ``JOBID``: ``MAPA_GPUS=4,5,7`` - the GPUs the job uses (the TaskProlog exports them); then
  ``SLURM_GPUS=0,1,2`` - the GPUs Slurm gave the job on this node, ascending - and
  ``PAIRED_GPUS=7,4,5`` - MAPA's GPUs in the order of core/order.py. The i-th of Slurm's is the
  i-th of the paired: a step or task Slurm gives GPUs 0 and 2 uses MAPA's 7 and 5, so steps that
  Slurm keeps apart stay apart, and what Slurm hands out first is what MAPA links best. (A file
  with the first line only pairs nothing: its steps get the job's GPUs.) The Prolog writes a
  safe provisional choice first and its final choice later.
* ``.prolog-JOBID``: ``pid=812 start=99123 slurm=0,1`` - the mark every Prolog (CPU-only jobs
  too) writes before anything else: which process runs the Prolog (its pid and start time, so a
  reused pid is not mistaken for it) and which GPUs Slurm gave the job. It stays until the Epilog.

The Prolog wrapper writes a first mark in shell, before any Python starts (slurm/admin/install.py);
the Prolog replaces it with its own.

* ``.claim-GPU``: ``JOBID`` - every GPU a job takes for itself alone is claimed by creating this
  file, which fails if another job holds the claim, before the job file names the GPU. Creating
  a file is atomic, so two Prologs never take the same GPU, with the ledger's lock or without it
  (a Prolog that cannot get the lock chooses from the files and claims its GPUs the same way).
  Removed with the job's other files. GPUs a job shares because too few are free are not claimed.
* ``.ended-JOBID`` (empty): written by the Epilog (its wrapper, in shell) before anything else, and
  removed last. A job with this file has ended, whatever else is left of it: when the Epilog could
  not get the lock or was killed, the next Prolog that holds the lock drops the job's ledger entry
  and files (no call to Slurm needed). A Prolog of the job (a requeued job runs again under its
  id) removes it first.

A job uses the GPUs of its job file, or Slurm's indices when it has none (the TaskProlog then
prints nothing and Slurm's binding stays). So this directory alone says what every job that
started here uses; the ledger is an index over it (plus what the Prolog learnt from Slurm).
Parsing and formatting are pure; the scan is the only reader.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .. import trusted_files as trusted
from ..text.commands import is_job_id, parse_gpu_indices

JOB_FILE_MAX_BYTES = 4096
MARK_MAX_BYTES = 8192
MAX_ENTRIES = 20000  # a node never runs this many jobs; past it the scan stops reading
# Slurm 25.11+ gives every job a SLUID ("s" and 13 Crockford base32 characters, src/common/sluid.c),
# and from 26.05 names the job's cgroup v2 directory by it: the mark keeps it, from the Prolog's
# SLURM_JOB_SLUID, so the agent can tell a task's job from its cgroup path.
SLUID = r"s[0-9A-HJKMNP-TV-Z]{13}"
_MARK = re.compile(r"pid=([0-9]{1,10}) start=([0-9]{1,20}) slurm=([0-9,]*)(?: sluid=(" + SLUID + r"))?")
MARK_PREFIX = ".prolog-"
CLAIM_PREFIX = ".claim-"
ENDED_PREFIX = ".ended-"


@dataclass(frozen=True)
class Mark:
    pid: int  # 0: written for the job by another process (adoption); never live
    start: int  # the process's start time in clock ticks since boot (/proc/PID/stat field 22)
    slurm_gpus: tuple[int, ...]
    sluid: str = ""  # the job's SLUID (Slurm 25.11+), "" when Slurm gave none


@dataclass(frozen=True)
class JobRecords:
    """What the jobs directory holds for one job; None where a file is missing or unreadable."""

    gpus: tuple[int, ...] | None = None  # from the job file
    mark: Mark | None = None
    newest: float = 0.0  # newest modification time of its files
    claimed: tuple[int, ...] = ()  # GPUs it claimed without the lock
    ended: bool = False  # its Epilog has run (its .ended file is there)
    mark_unreadable: bool = False  # a mark is there but is not one mark_text writes (an earlier release's)


def job_file_text(gpus: Sequence[int], slurm_gpus: Sequence[int] = (), paired: Sequence[int] | None = None) -> str:
    """The job file: MAPA's GPUs; with Slurm's GPUs of the same count, the pairing (``paired``: MAPA's
    GPUs in pairing order, default their own order)."""
    text = f"MAPA_GPUS={','.join(map(str, gpus))}\n"
    paired = tuple(gpus) if paired is None else tuple(paired)
    if slurm_gpus and len(set(slurm_gpus)) == len(gpus) and sorted(paired) == sorted(gpus):
        text += f"SLURM_GPUS={','.join(map(str, sorted(set(slurm_gpus))))}\nPAIRED_GPUS={','.join(map(str, paired))}\n"
    return text


@dataclass(frozen=True)
class JobMapping:
    """A job file: MAPA's GPUs, and (empty when the file pairs none) Slurm's ascending with MAPA's paired."""

    gpus: tuple[int, ...]
    slurm: tuple[int, ...] = ()
    paired: tuple[int, ...] = ()

    def mapa_gpus_for(self, slurm_list: Sequence[int]) -> tuple[int, ...] | None:
        """MAPA's GPUs for GPUs Slurm named (a step's or a task's), in pairing order; None when the
        file pairs nothing or Slurm named a GPU it did not give the job here."""
        if not self.slurm:
            return None
        position = {gpu: i for i, gpu in enumerate(self.slurm)}
        if any(gpu not in position for gpu in slurm_list):
            return None
        return tuple(self.paired[i] for i in sorted({position[gpu] for gpu in slurm_list}))


def parse_job_mapping(data: bytes) -> JobMapping:
    """A job file; ValueError unless it is exactly what job_file_text writes."""
    text = data.decode("ascii")
    lines = text.split("\n")
    if len(data) > JOB_FILE_MAX_BYTES or not text.endswith("\n") or len(lines) not in (2, 4) or not lines[0].startswith("MAPA_GPUS="):
        raise ValueError(f"not a job file: {data[:60]!r}")
    gpus = parse_gpu_indices(lines[0][len("MAPA_GPUS="):])
    if not gpus or len(set(gpus)) != len(gpus):
        raise ValueError(f"not a job file: {data[:60]!r}")
    if len(lines) == 2:
        return JobMapping(gpus)
    if not lines[1].startswith("SLURM_GPUS=") or not lines[2].startswith("PAIRED_GPUS="):
        raise ValueError(f"not a job file: {data[:60]!r}")
    slurm = parse_gpu_indices(lines[1][len("SLURM_GPUS="):])
    paired = parse_gpu_indices(lines[2][len("PAIRED_GPUS="):])
    if list(slurm) != sorted(set(slurm)) or len(slurm) != len(gpus) or sorted(paired) != sorted(gpus):
        raise ValueError(f"not a job file (its pairing does not match its GPUs): {data[:80]!r}")
    return JobMapping(gpus, slurm, paired)


def parse_job_file(data: bytes) -> tuple[int, ...]:
    """The GPUs of a job file; ValueError unless it is exactly what job_file_text writes."""
    return parse_job_mapping(data).gpus


def mark_text(mark: Mark) -> str:
    sluid = f" sluid={mark.sluid}" if mark.sluid else ""
    return f"pid={mark.pid} start={mark.start} slurm={','.join(map(str, mark.slurm_gpus))}{sluid}\n"


def is_sluid(text: object) -> bool:
    return isinstance(text, str) and re.fullmatch(SLUID, text) is not None


def parse_mark(data: bytes) -> Mark:
    text = data.decode("ascii")
    match = _MARK.fullmatch(text[:-1]) if len(data) <= MARK_MAX_BYTES and text.endswith("\n") else None
    if match is None:
        raise ValueError(f"not a Prolog mark: {data[:60]!r}")
    return Mark(int(match.group(1)), int(match.group(2)), parse_gpu_indices(match.group(3)), match.group(4) or "")


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read(4096)
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def highest_known_gpu(records: dict[str, JobRecords]) -> int:
    """The highest GPU index any job file or mark names (-1 if none): those GPUs exist."""
    return max((g for r in records.values() for g in (*(r.gpus or ()), *(r.mark.slurm_gpus if r.mark else ()))), default=-1)


def device_count(dev: Path = Path("/dev")) -> int:
    """How many GPUs the node's device files show: NVIDIA's /dev/nvidiaN, or on AMD nodes (the
    amdgpu driver's /dev/kfd) the render nodes /dev/dri/renderD*; 0 where there are none."""
    try:
        nvidia = sum(1 for name in os.listdir(dev) if re.fullmatch(r"nvidia[0-9]{1,4}", name))
        if nvidia or not os.path.exists(dev / "kfd"):
            return nvidia
        return sum(1 for name in os.listdir(dev / "dri") if re.fullmatch(r"renderD[0-9]{1,4}", name))
    except OSError:
        return 0


def mark_for(pid: int, slurm_gpus: tuple[int, ...], sluid: str = "") -> Mark:
    return Mark(pid, process_start_time(pid) or 0, slurm_gpus, sluid if is_sluid(sluid) else "")


def job_of_sluid(jobs_dir: Path, sluid: str) -> str | None:
    """The job whose mark names SLUID ``sluid`` (a task's cgroup v2 directory on Slurm 26.05), None
    when no mark here does. Reads the marks only (root's, 600): a task cannot name another job."""
    if not is_sluid(sluid):
        return None
    try:
        names = [name for name in os.listdir(jobs_dir) if name.startswith(MARK_PREFIX) and is_job_id(name[len(MARK_PREFIX):])]
    except OSError:
        return None
    for name in names[:MAX_ENTRIES]:
        try:
            mark = parse_mark(trusted.read_bytes(Path(jobs_dir) / name, MARK_MAX_BYTES))
        except (OSError, ValueError):
            continue
        if mark.sluid == sluid:
            return name[len(MARK_PREFIX):]
    return None


def mark_is_live(mark: Mark) -> bool:
    """Whether the Prolog the mark names still runs (same pid *and* same start time)."""
    return mark.pid > 1 and mark.start > 0 and process_start_time(mark.pid) == mark.start


def job_file_path(jobs_dir: Path, job_id: str) -> Path:
    return Path(jobs_dir) / job_id


def mark_path(jobs_dir: Path, job_id: str) -> Path:
    return Path(jobs_dir) / f"{MARK_PREFIX}{job_id}"


def write_job_file(jobs_dir: Path, job_id: str, gpus: tuple[int, ...], slurm_gpus: tuple[int, ...] = (),
                   paired: tuple[int, ...] | None = None) -> None:
    # 644: the TaskProlog reads it as the user
    trusted.replace_file(job_file_path(jobs_dir, job_id), job_file_text(gpus, slurm_gpus, paired).encode())


def ended_path(jobs_dir: Path, job_id: str) -> Path:
    return Path(jobs_dir) / f"{ENDED_PREFIX}{job_id}"


def write_ended(jobs_dir: Path, job_id: str) -> None:
    """Say that the job's Epilog runs (kept if it is there already)."""
    trusted.create_file(ended_path(jobs_dir, job_id), b"", mode=0o644)


def clear_ended(jobs_dir: Path, job_id: str) -> None:
    """A Prolog of the job runs (again): an .ended file left by an earlier run no longer holds."""
    trusted.remove(ended_path(jobs_dir, job_id))


def write_mark(jobs_dir: Path, job_id: str, mark: Mark) -> None:
    trusted.replace_file(mark_path(jobs_dir, job_id), mark_text(mark).encode(), mode=0o600)


def write_mark_if_none(jobs_dir: Path, job_id: str, mark: Mark) -> bool:
    """Mark a job for its Prolog's sake (adoption) unless its own Prolog has marked it meanwhile;
    a mark that cannot be read (an earlier release's bare pid, or damaged) is replaced."""
    if trusted.create_file(mark_path(jobs_dir, job_id), mark_text(mark).encode(), mode=0o600):
        return True
    try:
        parse_mark(trusted.read_bytes(mark_path(jobs_dir, job_id), MARK_MAX_BYTES))
    except FileNotFoundError:
        return write_mark_if_none(jobs_dir, job_id, mark)  # removed meanwhile (an Epilog): create it
    except (OSError, ValueError):
        write_mark(jobs_dir, job_id, mark)
        return True
    return False  # a readable mark: its own Prolog's


def claim_path(jobs_dir: Path, gpu: int) -> Path:
    return Path(jobs_dir) / f"{CLAIM_PREFIX}{gpu}"


def claim(jobs_dir: Path, job_id: str, candidates: tuple[int, ...], wanted: int) -> tuple[int, ...]:
    """Claim up to ``wanted`` of ``candidates``, in order, skipping GPUs another job has claimed
    (a claim the job already holds counts: a Prolog run again after a kill takes its GPUs back)."""
    claimed: list[int] = []
    for gpu in candidates:
        if len(claimed) == wanted:
            break
        if trusted.create_file(claim_path(jobs_dir, gpu), f"{job_id}\n".encode(), mode=0o600):
            claimed.append(gpu)
        elif (_read_claim(claim_path(jobs_dir, gpu)) or (None, None))[1] == job_id:
            claimed.append(gpu)
    return tuple(claimed)


def claim_all(jobs_dir: Path, job_id: str, gpus: tuple[int, ...]) -> tuple[int, ...]:
    """Claim every one of ``gpus`` for the job (its own claims count); the GPUs another job has
    claimed, in which case the claims this call made are taken back and the job must choose again."""
    made: list[int] = []
    taken: list[int] = []
    for gpu in gpus:
        if trusted.create_file(claim_path(jobs_dir, gpu), f"{job_id}\n".encode(), mode=0o600):
            made.append(gpu)
            continue
        held = _read_claim(claim_path(jobs_dir, gpu))
        if held is None or held[1] != job_id:  # another job's (an unreadable claim is taken as another's)
            taken.append(gpu)
    if taken:
        for gpu in made:
            trusted.remove(claim_path(jobs_dir, gpu))
    return tuple(taken)


def _is_claim(name: str) -> bool:
    return name.startswith(CLAIM_PREFIX) and name[len(CLAIM_PREFIX):].isdigit()


def _read_claim(path: Path) -> tuple[int, str] | None:
    """(GPU, owning job) of a claim file, None if it is unreadable or not what claim() writes."""
    try:
        owner = trusted.read_bytes(path, 64).decode("ascii")
        gpu = parse_gpu_indices(path.name[len(CLAIM_PREFIX):])[0]
    except (OSError, ValueError, IndexError):
        return None
    return (gpu, owner[:-1]) if owner.endswith("\n") and is_job_id(owner[:-1]) else None


def release_claims(jobs_dir: Path, job_id: str, keep: tuple[int, ...] = ()) -> None:
    """Remove the job's claims, but those on ``keep``. Reads only the claim files (one per GPU
    in use at most): it runs at every commit and Epilog."""
    try:
        names = [name for name in os.listdir(jobs_dir) if _is_claim(name)]
    except FileNotFoundError:
        return
    for name in names:
        held = _read_claim(Path(jobs_dir) / name)
        if held is not None and held[1] == job_id and held[0] not in keep:
            trusted.remove(Path(jobs_dir) / name)


def remove_job(jobs_dir: Path, job_id: str, keep_ended: bool = False) -> None:
    """The job file first: from then on the job's GPUs are Slurm's, which the mark still names.
    The .ended file last, unless ``keep_ended`` (the Epilog could not drop the ledger entry)."""
    trusted.remove(job_file_path(jobs_dir, job_id))
    release_claims(jobs_dir, job_id)
    trusted.remove(mark_path(jobs_dir, job_id))
    if not keep_ended:
        trusted.remove(ended_path(jobs_dir, job_id))


def _job_of(name: str) -> tuple[str, str] | None:
    """(job id, "job", "mark" or "ended") for a name of the jobs directory, None for anything else."""
    if is_job_id(name):
        return name, "job"
    if name.startswith(MARK_PREFIX) and is_job_id(name[len(MARK_PREFIX):]):
        return name[len(MARK_PREFIX):], "mark"
    if name.startswith(ENDED_PREFIX) and is_job_id(name[len(ENDED_PREFIX):]):
        return name[len(ENDED_PREFIX):], "ended"
    return None


def _job_records(jobs_dir: Path, job_id: str, claimed: tuple[int, ...], claimed_at: float) -> JobRecords | None:
    """A job's files, each looked up by its name (a directory listing may miss a name that is being
    renamed over at that moment; a lookup by name finds the old file or the new one, never none)."""
    record = JobRecords(claimed=claimed, newest=claimed_at)
    seen = bool(claimed)
    for kind, path in (("job", job_file_path(jobs_dir, job_id)), ("mark", mark_path(jobs_dir, job_id)), ("ended", ended_path(jobs_dir, job_id))):
        try:
            mtime = os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        except OSError:
            mtime = 0.0
        seen = True
        if kind == "ended":
            record = dataclasses.replace(record, ended=True)  # its time is not the job's: newest stays
            continue
        record = dataclasses.replace(record, newest=max(record.newest, mtime))
        try:
            data = trusted.read_bytes(path, MARK_MAX_BYTES)
            if kind == "job":
                record = dataclasses.replace(record, gpus=parse_job_file(data))
            else:
                record = dataclasses.replace(record, mark=parse_mark(data))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            if kind == "mark":  # its GPUs are unknown here: the next reconcile pass asks Slurm (adoption)
                record = dataclasses.replace(record, mark_unreadable=True)
    return record if seen else None


def scan(jobs_dir: Path, also: Iterable[str] = ()) -> tuple[dict[str, JobRecords], list[tuple[str, float]]]:
    """Every job's records, and the leftover temporary files (name, mtime) of killed writers.

    The listing only says which jobs there are (with ``also``: jobs the caller knows of, the
    ledger's); each job's files are then looked up by name, so a job is never missed because a
    file of its was being replaced while the directory was read."""
    leftovers: list[tuple[str, float]] = []
    job_ids: set[str] = {job for job in also if is_job_id(job)}
    claims: dict[str, list[int]] = {}
    claimed_at: dict[str, float] = {}
    try:
        entries = list(os.scandir(jobs_dir))[:MAX_ENTRIES]
    except FileNotFoundError:
        return {}, leftovers
    for entry in entries:
        parsed = _job_of(entry.name)
        if parsed is not None:
            job_ids.add(parsed[0])
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _is_claim(entry.name):
            held = _read_claim(Path(entry.path))
            if held is not None:
                gpu, owner = held
                claims.setdefault(owner, []).append(gpu)
                claimed_at[owner] = max(claimed_at.get(owner, 0.0), mtime)
                job_ids.add(owner)
        elif entry.name.endswith(".tmp") and entry.name.startswith("."):
            leftovers.append((entry.name, mtime))
    records: dict[str, JobRecords] = {}
    for job_id in job_ids:
        record = _job_records(jobs_dir, job_id, tuple(claims.get(job_id, ())), claimed_at.get(job_id, 0.0))
        if record is not None:
            records[job_id] = record
    return records, leftovers
