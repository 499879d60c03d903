"""The node ledger: which job holds which GPUs on this node.

Slurm counts GPUs; MAPA chooses which ones, so the node keeps its own record. The record is a
small JSON file, changed only under an exclusive lock held for milliseconds (no Slurm call and
no search runs under it) and replaced atomically (a fresh temporary file, then rename), so
that Prologs starting together never hand out a GPU twice and a Prolog killed at any instant
leaves either the old or the new ledger, never a torn one. It is not fsynced: after a crash of
the machine no job survives, and a torn ledger is rebuilt from the jobs directory (on /run,
empty after a reboot), which is then exactly right.

The ledger is an index over the jobs directory (job_files.py), which says what each job
really uses; :func:`reconcile` brings the two together under the lock. A GPU may be held by two
jobs when they really do share it (a job whose Prolog was killed runs on Slurm's indices): the
ledger then keeps it held until both have ended. Only a MAPA choice must not overlap anything.

The pure part (:class:`Ledger`, :func:`reconcile`) is separate from the file part
(:class:`LedgerFile`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from .. import trusted_files as trusted
from ..text.commands import is_job_id
from .job_files import JobRecords, mark_is_live

MAX_LEDGER_BYTES = 1 << 20
MAX_JSON_DEPTH = 8  # the ledger is three levels deep; anything deeper is not ours


class LedgerCorrupt(ValueError):
    """The ledger file is not what this module writes."""


@dataclass(frozen=True)
class Holding:
    gpus: tuple[int, ...]
    policy: str
    since: float
    note: str = ""


@dataclass(frozen=True)
class Ledger:
    holdings: dict[str, Holding] = field(default_factory=dict)

    def held(self) -> set[int]:
        return {gpu for holding in self.holdings.values() for gpu in holding.gpus}

    def running_groups(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each job in the ledger (sorted), as preserve-ahead's outlook reads them.

        A GPU two jobs share comes free only when both have ended, not when either does, so it is
        left out of every group (and stays held)."""
        shared = self.shared()
        groups = (tuple(sorted(g for g in h.gpus if g not in shared)) for h in self.holdings.values())
        return tuple(sorted(group for group in groups if group))

    def free(self, size: int, unusable: Iterable[int] = ()) -> tuple[int, ...]:
        taken = self.held() | set(unusable)
        return tuple(gpu for gpu in range(size) if gpu not in taken)

    def with_job(self, job_id: str, holding: Holding) -> "Ledger":
        """The ledger with a MAPA choice for ``job_id``; it must not touch a GPU another job holds."""
        overlap = set(holding.gpus) & {g for j, h in self.holdings.items() if j != job_id for g in h.gpus}
        if overlap:
            raise ValueError(f"internal error: GPUs {sorted(overlap)} are already held")
        return self.with_usage(job_id, holding)

    def with_usage(self, job_id: str, holding: Holding) -> "Ledger":
        """The ledger with what ``job_id`` really uses, even where another job uses it too."""
        return Ledger({**self.holdings, job_id: holding})

    def shared(self) -> dict[int, list[str]]:
        """GPUs held by more than one job, with those jobs."""
        owners: dict[int, list[str]] = {}
        for job, holding in sorted(self.holdings.items()):
            for gpu in holding.gpus:
                owners.setdefault(gpu, []).append(job)
        return {gpu: jobs for gpu, jobs in owners.items() if len(jobs) > 1}

    def without(self, job_ids: Iterable[str]) -> "Ledger":
        gone = set(job_ids)
        return Ledger({j: h for j, h in self.holdings.items() if j not in gone})

    def reaped(self, running: Iterable[str], listed_at: float | None = None) -> tuple["Ledger", list[str]]:
        """Drop the entries of jobs that no longer run here; returns the new ledger and the dropped ids.

        ``listed_at``: when the list of running jobs was asked for. An entry written after that
        belongs to a job the list may not know yet, so it is kept.
        """
        alive = set(running)
        dead = sorted(j for j, h in self.holdings.items() if j not in alive and (listed_at is None or h.since < listed_at))
        return self.without(dead), dead


def ledger_to_json(ledger: Ledger) -> str:
    return json.dumps(
        {
            "version": 1,
            "jobs": {
                job: {"gpus": list(h.gpus), "policy": h.policy, "since": h.since, "note": h.note}
                for job, h in sorted(ledger.holdings.items(), key=lambda item: int(item[0]))
            },
        },
        indent=1,
    )


def _json_depth_ok(text: str) -> bool:
    """Whether brackets nest at most MAX_JSON_DEPTH deep (checked before json.loads recurses)."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif char in "]}":
            depth -= 1
    return True


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e12


def ledger_from_json(text: str, size: int) -> Ledger:
    """Strictly parse a ledger; anything unexpected, in any field, raises LedgerCorrupt."""
    if not _json_depth_ok(text):
        raise LedgerCorrupt(f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise LedgerCorrupt(f"not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("jobs"), dict) or set(data) != {"version", "jobs"}:
        raise LedgerCorrupt("expected an object with version 1 and a jobs table, nothing else")
    holdings: dict[str, Holding] = {}
    for job, entry in data["jobs"].items():
        if not is_job_id(job) or not isinstance(entry, dict):
            raise LedgerCorrupt(f"bad entry for job {job[:40]!r}")
        if set(entry) != {"gpus", "policy", "since", "note"}:
            raise LedgerCorrupt(f"job {job}: expected the fields gpus, policy, since, note; got {sorted(map(str, entry))[:8]}")
        gpus = entry["gpus"]
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < size for g in gpus):
            raise LedgerCorrupt(f"job {job}: GPUs {str(gpus)[:60]} are not indices below {size}")
        if len(set(gpus)) != len(gpus):
            raise LedgerCorrupt(f"job {job}: GPUs {gpus} name one GPU twice")
        if not isinstance(entry["policy"], str) or not isinstance(entry["note"], str) or not _is_number(entry["since"]):
            raise LedgerCorrupt(f"job {job}: policy and note must be strings and since a number")
        holdings[job] = Holding(tuple(gpus), entry["policy"][:64], float(entry["since"]), entry["note"][:1024])
    return Ledger(holdings)


def reconcile(
    ledger: Ledger,
    records: Mapping[str, JobRecords],
    size: int,
    running: set[str] | None = None,
    listed_at: float | None = None,
    now: float = 0.0,
    is_live=mark_is_live,
    slurm_gave: Iterable[int] = (),
) -> tuple[Ledger, list[str]]:
    """The ledger brought in line with the jobs directory, and the jobs found to have ended.

    What a job uses: its job file's GPUs; without one, Slurm's GPUs from its mark once its
    Prolog is gone (it was killed: the job runs on Slurm's indices); while its Prolog still runs
    and has written nothing, its ledger entry. A ledger entry whose job left no file at all has
    ended: the Prolog wrapper marks every job before anything names it in the ledger, adoption
    marks the jobs it adds, and only the job's Epilog or reaping removes the mark (an entry written
    by a version before marks existed is dropped too). ``running``: the jobs Slurm lists
    on the node, asked for at ``listed_at``; a job not in it whose records are all older than
    that has ended and is dropped (returned, so the caller removes its files too), as is a job
    whose Epilog has run (its .ended file).
    ``slurm_gave``: the GPUs Slurm just gave the job that is choosing. Slurm never gives one GPU
    to two live jobs (gres/gpu; MAPA nodes use no shards or MPS), so a job whose Prolog is done
    and whose mark names one of them has ended (even when squeue cannot say so). A ``since`` in the future (a clock stepped back, a corrupt entry) is taken as ``now``.
    """
    holdings: dict[str, Holding] = {}
    ended: list[str] = []
    reassigned = set(slurm_gave)
    for job in sorted(set(ledger.holdings) | set(records), key=int):
        held = ledger.holdings.get(job)
        if held is not None and now and held.since > now:
            held = Holding(held.gpus, held.policy, now, held.note)
        record = records.get(job, JobRecords())
        if record.ended or record == JobRecords():
            # Its Epilog ran (and could not finish, or was killed), or it left nothing at all: every
            # job is marked before any entry names it, and only its Epilog or reaping removes the mark.
            ended.append(job)
            continue
        newest = max(min(record.newest, now or record.newest), held.since if held else 0.0)
        if running is not None and job not in running and listed_at is not None and newest < listed_at:
            ended.append(job)
            continue
        if record.mark is not None and reassigned & set(record.mark.slurm_gpus) and not is_live(record.mark):
            ended.append(job)
            continue
        if record.gpus is not None:
            gpus, policy, note = record.gpus, "recovered", "from its job file"
        elif record.mark is not None and not is_live(record.mark):
            gpus, policy, note = record.mark.slurm_gpus, "slurm", "its Prolog died before choosing: runs on Slurm's GPUs"
        elif held is not None:
            gpus, policy, note = held.gpus, held.policy, held.note
        else:
            gpus, policy, note = (), "claimed", "its Prolog runs and has chosen nothing yet"
        gpus = tuple(g for g in gpus if 0 <= g < size)
        gpus += tuple(g for g in record.claimed if g not in gpus and 0 <= g < size)  # claimed without the lock: held too
        if held is not None and held.gpus == gpus:
            holdings[job] = held  # keep what the Prolog recorded about its choice
        elif gpus or record.gpus is not None:
            holdings[job] = Holding(gpus, policy, now or newest, note)
    return Ledger(holdings), ended


def _flock_until(fd: int, deadline: float, message: str) -> None:
    """An exclusive flock on ``fd``, retried until ``deadline`` (monotonic); TimeoutError(message)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                raise TimeoutError(message) from None
            time.sleep(0.005)


# The threads of one process (mapa-agent's handlers) queue on a thread lock per lock file before
# the flock: waiting there costs no CPU, where polling the flock every 5 ms did (a burst of Prologs
# kept the agent busy with it; docs/benchmarks.md, "Job start under a burst"). The flock still
# excludes other processes (in-process hooks, `mapa` commands).
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock(path: Path) -> threading.Lock:
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(str(path), threading.Lock())


class LedgerFile:
    """The ledger on disk: ``path`` plus ``path.lock`` for the lock, in a root-owned directory."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = Path(path)
        self.size = size
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def locked(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold the ledger's lock; TimeoutError after ``timeout`` seconds, UnsafePath if the
        directory is not root's alone (another user could swap the ledger or its lock)."""
        trusted.ensure_trusted_dir(self.path.parent)
        deadline = time.monotonic() + timeout
        in_process = _thread_lock(self.lock_path)
        if not in_process.acquire(timeout=max(0.0, timeout)):
            raise TimeoutError(f"could not lock {self.lock_path} within {timeout:g} s (another thread of this process holds it)")
        try:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
                fd = self._open_replacing_symlink(deadline, timeout)
            try:
                _flock_until(fd, deadline, f"could not lock {self.lock_path} within {timeout:g} s")
                yield
            finally:
                os.close(fd)  # closing drops the lock
        finally:
            in_process.release()

    def _open_replacing_symlink(self, deadline: float, timeout: float) -> int:
        """The lock file, after removing a symlink found in its place (dangling or not: never
        followed; the directory is root's alone), else every Prolog would fail on it and fall back.
        The removal runs under a lock on the directory and only while the name is a symlink, so two
        Prologs repairing at once never remove the file one of them has just made and locked."""
        dir_fd = os.open(self.lock_path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Within the same deadline: anyone may open the directory (mode 755) and flock it.
            _flock_until(dir_fd, deadline, f"could not lock {self.lock_path.parent} within {timeout:g} s "
                         "(to replace a symlink found at the ledger's lock)")
            try:
                if os.path.islink(self.lock_path):
                    os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        finally:
            os.close(dir_fd)  # drops the directory's lock

    def read(self) -> Ledger:
        """The ledger (empty if there is none); LedgerCorrupt if it cannot be trusted."""
        try:
            raw = trusted.read_bytes(self.path, MAX_LEDGER_BYTES)
        except FileNotFoundError:
            return Ledger()
        except OSError as error:  # a symlink or a device planted in its place
            raise LedgerCorrupt(f"unreadable: {error}") from None
        if len(raw) > MAX_LEDGER_BYTES:
            raise LedgerCorrupt(f"larger than {MAX_LEDGER_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LedgerCorrupt("not UTF-8") from None
        return ledger_from_json(text, self.size)

    def write(self, ledger: Ledger) -> None:
        trusted.replace_file(self.path, ledger_to_json(ledger).encode(), mode=0o644)
