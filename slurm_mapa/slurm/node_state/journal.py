"""The journal of AdminComment records not yet written: how a decision reaches sacct without the
Prolog waiting on slurmctld.

The Prolog writes one small file per job, ``journal_dir/JOBID``, before the job starts::

    node=dgx1 nodes=1
    mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve free=0,1,2,3,4,5,6,7 slurm=0,1 affinity=prefer:0.1 eff=58.925 ...

and mapa-agent writes the record into the job's AdminComment later (:func:`flush`), merged with
what is there (decision.with_decision keeps an admin's text and the other nodes' decisions),
at most ``admin_comment_rate`` writes per second, retrying with back-off while slurmctld does
not answer. The file goes only once the record is in the AdminComment, or cannot ever be (the
job is gone, the record would not fit); it lives on disk (``/var/lib``, not ``/run``), so a
record is not lost when the agent or the node restarts. A later decision for the same job
replaces the file: records are coalesced per job.

When mapa-agent cannot isolate a job's devices (docs/isolation.md) it writes a note beside it,
``journal_dir/JOBID.isolation``, in the same form with ``nodes=0`` and the record
``isolation=failed-open why=<reason>``; it is written the same way, into this node's decision
once that decision is in the AdminComment (admin_comment.flush_note).

Parsing and formatting are pure; the file functions are the only I/O.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .. import trusted_files as trusted
from ..text.commands import is_job_id

ENTRY_MAX_BYTES = 16384
MAX_ENTRIES = 100000  # past this the listing stops reading (a node never has this many unwritten)
_HEADER = re.compile(r"node=([^\s#=]{1,255}) nodes=([0-9]{1,6})")  # a node name decision.with_decision can write


@dataclass(frozen=True)
class Entry:
    node: str
    nodes_in_job: int
    record: str  # the AdminComment record: "mapa:<directive> # NODE=GPUS ..."


def entry_text(entry: Entry) -> str:
    if "\n" in entry.record or not _HEADER.fullmatch(f"node={entry.node} nodes={entry.nodes_in_job}"):
        raise ValueError(f"not a journal entry: {entry!r}")
    return f"node={entry.node} nodes={entry.nodes_in_job}\n{entry.record}\n"


def parse_entry(data: bytes) -> Entry:
    """An entry as entry_text writes it; ValueError for anything else."""
    if len(data) > ENTRY_MAX_BYTES:
        raise ValueError(f"journal entry of {len(data)} bytes (accepted: at most {ENTRY_MAX_BYTES})")
    text = data.decode("utf-8")
    lines = text.split("\n")
    header = _HEADER.fullmatch(lines[0]) if len(lines) == 3 and lines[2] == "" else None
    if header is None or not lines[1]:
        raise ValueError(f"not a journal entry: {data[:80]!r}")
    return Entry(header.group(1), int(header.group(2)), lines[1])


NOTE_SUFFIX = ".isolation"


def note_name(job_id: str) -> str:
    """The journal name of a job's isolation note (a decision entry's name is the job id)."""
    return f"{job_id}{NOTE_SUFFIX}"


def job_of(name: str) -> str | None:
    """The job id of a journal name (a decision entry or a note), None for any other name."""
    job_id = name[: -len(NOTE_SUFFIX)] if name.endswith(NOTE_SUFFIX) else name
    return job_id if is_job_id(job_id) else None


def write(journal_dir: Path, name: str, entry: Entry) -> None:
    """Write the entry ``name`` (a job id, or note_name of one), replacing an older one."""
    if job_of(name) is None:
        raise ValueError(f"not a journal name: {name!r}")
    trusted.ensure_trusted_dir(journal_dir)
    trusted.replace_file(Path(journal_dir) / name, entry_text(entry).encode(), mode=0o600)


def remove(journal_dir: Path, name: str) -> None:
    trusted.remove(Path(journal_dir) / name)


def is_pending(journal_dir: Path, name: str) -> bool:
    """Whether entry ``name`` waits to be written, or is being written now."""
    return any(os.path.lexists(Path(journal_dir) / candidate) for candidate in (name, f"{SENDING_PREFIX}{name}"))


def pending(journal_dir: Path) -> list[tuple[str, Entry | None, float]]:
    """(name, entry or None when unreadable, modification time) of every entry, oldest first, a
    job's decision before its note."""
    found: list[tuple[str, Entry | None, float]] = []
    try:
        scanned = list(os.scandir(journal_dir))[:MAX_ENTRIES]
    except FileNotFoundError:
        return found
    for item in scanned:
        if job_of(item.name) is None:
            continue
        try:
            mtime = item.stat(follow_symlinks=False).st_mtime
            entry: Entry | None = parse_entry(trusted.read_bytes(Path(item.path), ENTRY_MAX_BYTES))
        except (OSError, ValueError):
            entry, mtime = None, 0.0
        found.append((item.name, entry, mtime))
    found.sort(key=lambda item: (item[2], int(job_of(item[0]) or 0), item[0].endswith(NOTE_SUFFIX)))
    return found


SENDING_PREFIX = ".sending-"


def take(journal_dir: Path, name: str) -> Entry | None:
    """Set an entry aside for writing (renamed to .sending-NAME, so that a newer decision for the
    job, written meanwhile, is not lost when this one is done); None if it is gone or unreadable
    (an unreadable one is removed)."""
    sending = Path(journal_dir) / f"{SENDING_PREFIX}{name}"
    try:
        os.rename(Path(journal_dir) / name, sending)
        return parse_entry(trusted.read_bytes(sending, ENTRY_MAX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        trusted.remove(sending)
        return None


def finish(journal_dir: Path, name: str, done: bool) -> None:
    """After a write: drop the entry set aside, or, to try again later, put it back unless a
    newer one for the job arrived meanwhile (which then replaces it)."""
    sending = Path(journal_dir) / f"{SENDING_PREFIX}{name}"
    if not done:
        try:
            os.link(sending, Path(journal_dir) / name)
        except OSError:
            pass  # a newer entry is there: it supersedes this one
    trusted.remove(sending)


def recover(journal_dir: Path) -> None:
    """Entries set aside by an agent that stopped mid-write go back (unless a newer one is there)."""
    try:
        names = [name for name in os.listdir(journal_dir) if name.startswith(SENDING_PREFIX)]
    except FileNotFoundError:
        return
    for name in names:
        entry_name = name[len(SENDING_PREFIX):]
        if job_of(entry_name) is not None:
            finish(journal_dir, entry_name, done=False)
        else:
            trusted.remove(Path(journal_dir) / name)
