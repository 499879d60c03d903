"""Root's word to the TaskProlog that the SPANK plugin had a task isolated: one small file per task
process, written by mapa-agent, never by the job's user (docs/isolation.md, "The root-side trigger").

The TaskProlog runs as the job's user with the job's environment, so nothing in that environment
may tell it that the task is isolated: srun and sbatch pass the user's own variables to the task,
MAPA_SPANK_ISOLATION included. When the agent has isolated a task for the SPANK plugin's request
(root, in the task process itself, before it drops to the user), it writes
``<isolate socket's directory>/tasks/<task pid>``:

    MAPA1 job=<job id> step=<step> start=<start time> state=<cgroup-v1|cgroup-v2> gpus=<list|none>

``start`` is field 22 of /proc/PID/stat (clock ticks since boot), so a record of a pid that was
reused names another process and matches nothing. The TaskProlog, a child of the task process,
reads ``tasks/$PPID`` and trusts it only if it names its own job, step and its parent's start
time. The directory and the files are root's (0755, 0644): no user can write or replace one.
Records go at the job's Epilog (the agent's) and, for tasks that are gone, at the agent's
periodic pass; both read at most MAX_SCANNED entries.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import trusted_files as trusted

TASKS_DIR_NAME = "tasks"
MAX_SCANNED = 100_000  # entries read per pass: a node never has this many tasks at once
MAX_RECORD_BYTES = 256
STALE_TEMPORARY_S = 60.0  # a temporary file this old was left by an agent that died while writing
_STAT_LIMIT = 4096

# The step as Slurm names its cgroup (rules._STEP); the GPUs as MAPA numbers them.
RECORD = re.compile(r"MAPA1 job=(?P<job>[0-9]{1,20}) step=(?P<step>[0-9]{1,10}(?:\+[0-9]{1,10})?|batch|extern|interactive)"
                    r" start=(?P<start>[0-9]{1,20}) state=(?P<state>cgroup-v[12]) gpus=(?P<gpus>none|[0-9]{1,4}(?:,[0-9]{1,4})*)\n")


@dataclass(frozen=True)
class TaskRecord:
    """What root says of one task process: isolated to ``gpus`` in job ``job_id``'s ``step``."""

    job_id: str
    step: str
    start_time: str
    state: str
    gpus: tuple[int, ...]

    def line(self) -> str:
        gpus = ",".join(map(str, self.gpus)) or "none"
        text = f"MAPA1 job={self.job_id} step={self.step} start={self.start_time} state={self.state} gpus={gpus}\n"
        if parse_record(text) != self:  # never write what the TaskProlog would not read back
            raise ValueError(f"not a task record: {text!r}")
        return text


def parse_record(text: str) -> TaskRecord | None:
    """The record ``text`` holds, or None unless it is exactly one record line."""
    match = RECORD.fullmatch(text)
    if match is None:
        return None
    gpus = () if match["gpus"] == "none" else tuple(int(gpu) for gpu in match["gpus"].split(","))
    return TaskRecord(match["job"], match["step"], match["start"], match["state"], gpus)


def start_time_of(proc: Path, pid: int) -> str:
    """Field 22 of /proc/PID/stat, the process's start time; OSError or ValueError if unreadable.
    The fields are read after the last ") ": the name before it (field 2) may hold anything."""
    with open(proc / str(pid) / "stat", "rb") as handle:
        text = handle.read(_STAT_LIMIT).decode("ascii", "replace")
    _, separator, rest = text.rpartition(") ")
    fields = rest.split()
    if not separator or len(fields) < 20 or not fields[19].isdigit() or len(fields[19]) > 20:
        raise ValueError(f"/proc/{pid}/stat names no start time")
    return fields[19]  # rest begins at field 3


def tasks_dir_of(isolate_socket: str | Path) -> Path:
    """Where the records live: beside the public isolate socket, in the agent's root-owned directory."""
    return Path(isolate_socket).parent / TASKS_DIR_NAME


class TaskRecords:
    """The records of one agent: written for the SPANK plugin's isolated tasks, removed at their
    job's end or when their process is gone. Every path is checked to be root's (or, for tests,
    this user's: trusted_files) before anything is written or removed there."""

    def __init__(self, directory: Path, proc: Path = Path("/proc"), clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.proc = proc  # tests give a fake /proc
        self.clock = clock

    def write(self, pid: int, job_id: str, step: str, state: str, gpus: tuple[int, ...]) -> None:
        """Record that task process ``pid`` is isolated; OSError, UnsafePath or ValueError if not
        written (the TaskProlog then makes its own request)."""
        record = TaskRecord(job_id, step, start_time_of(self.proc, pid), state, gpus)
        trusted.ensure_trusted_dir(self.directory, 0o755)
        trusted.replace_file(self.directory / str(pid), record.line().encode("ascii"), 0o644)

    def remove_job(self, job_id: str) -> int:
        """Remove the records naming job ``job_id`` (its Epilog); how many."""
        return self._remove_where(lambda name, record: record is not None and record.job_id == job_id)

    def remove_gone(self) -> int:
        """Remove the records whose process is gone (or is another one now: its start time
        differs), unreadable ones, and temporary files an interrupted write left; how many."""
        return self._remove_where(self._is_stale)

    def _is_stale(self, name: str, record: TaskRecord | None) -> bool:
        if name.startswith("."):
            try:
                return self.clock() - os.lstat(self.directory / name).st_mtime > STALE_TEMPORARY_S
            except OSError:
                return False
        if record is None or not name.isdigit():
            return True
        try:
            return start_time_of(self.proc, int(name)) != record.start_time
        except (OSError, ValueError):
            return True  # no such process

    def _remove_where(self, doomed: Callable[[str, TaskRecord | None], bool]) -> int:
        if not self._is_roots():
            return 0
        removed = 0
        for name in self._names():
            record = None if name.startswith(".") else self._read(name)
            if doomed(name, record):
                try:
                    trusted.remove(self.directory / name)
                    removed += 1
                except OSError:
                    pass  # removed meanwhile, or not ours to remove: the next pass sees it again
        return removed

    def _is_roots(self) -> bool:
        """Whether the directory exists and only root can change it (none: nothing to remove)."""
        try:
            trusted.check_trusted_dir(self.directory)
        except trusted.UnsafePath:
            return False
        return True

    def _names(self) -> list[str]:
        names: list[str] = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if len(names) >= MAX_SCANNED:
                        break
                    names.append(entry.name)
        except OSError:
            pass
        return names

    def _read(self, name: str) -> TaskRecord | None:
        try:
            data = trusted.read_bytes(self.directory / name, MAX_RECORD_BYTES)
        except OSError:
            return None
        return parse_record(data.decode("ascii", "replace")) if len(data) <= MAX_RECORD_BYTES else None
