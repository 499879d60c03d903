"""The node ledger: which job holds which GPUs on this node.

Slurm counts GPUs; MAPA chooses which ones, so the node keeps its own record. The record is a
small JSON file, changed only under an exclusive lock and replaced atomically (write a temporary
file, fsync, rename), so that Prologs starting together never hand out a GPU twice and a Prolog
killed at any instant leaves either the old or the new ledger, never a torn one.

The pure part (:class:`Ledger` and its functions) is separate from the file part
(:class:`LedgerFile`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

MAX_LEDGER_BYTES = 1 << 20
_JOB_ID_CHARS = set("0123456789")


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
        """The GPUs of each job in the ledger (sorted), as preserve-ahead's outlook reads them."""
        return tuple(sorted(tuple(sorted(h.gpus)) for h in self.holdings.values() if h.gpus))

    def free(self, size: int, unusable: Iterable[int] = ()) -> tuple[int, ...]:
        taken = self.held() | set(unusable)
        return tuple(gpu for gpu in range(size) if gpu not in taken)

    def with_job(self, job_id: str, holding: Holding) -> "Ledger":
        overlap = set(holding.gpus) & {g for j, h in self.holdings.items() if j != job_id for g in h.gpus}
        if overlap:
            raise ValueError(f"internal error: GPUs {sorted(overlap)} are already held")
        return Ledger({**self.holdings, job_id: holding})

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


def ledger_from_json(text: str, size: int) -> Ledger:
    """Strictly parse a ledger; anything unexpected raises LedgerCorrupt."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise LedgerCorrupt(f"not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("jobs"), dict):
        raise LedgerCorrupt("expected an object with version 1 and a jobs table")
    holdings: dict[str, Holding] = {}
    seen: set[int] = set()
    for job, entry in data["jobs"].items():
        if not job or not set(job) <= _JOB_ID_CHARS or not isinstance(entry, dict):
            raise LedgerCorrupt(f"bad entry for job {job!r}")
        gpus = entry.get("gpus")
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < size for g in gpus):
            raise LedgerCorrupt(f"job {job}: GPUs {gpus!r} are not indices below {size}")
        if seen & set(gpus) or len(set(gpus)) != len(gpus):
            raise LedgerCorrupt(f"job {job}: GPUs {gpus} are held twice")
        seen |= set(gpus)
        holdings[job] = Holding(
            gpus=tuple(gpus),
            policy=str(entry.get("policy", "")),
            since=float(entry.get("since", 0.0)),
            note=str(entry.get("note", "")),
        )
    return Ledger(holdings)


class LedgerFile:
    """The ledger on disk: ``path`` plus ``path.lock`` for the lock, in a root-owned directory."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = Path(path)
        self.size = size
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def locked(self, timeout: float = 10.0) -> Iterator[None]:
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as error:
                    if error.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        raise TimeoutError(f"could not lock {self.lock_path} within {timeout:g} s") from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def read(self) -> Ledger:
        """The ledger (empty if there is none); LedgerCorrupt if it cannot be trusted."""
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(MAX_LEDGER_BYTES + 1)
        except FileNotFoundError:
            return Ledger()
        if len(raw) > MAX_LEDGER_BYTES:
            raise LedgerCorrupt(f"larger than {MAX_LEDGER_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LedgerCorrupt("not UTF-8") from None
        return ledger_from_json(text, self.size)

    def write(self, ledger: Ledger) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        data = ledger_to_json(ledger).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def prolog_mark_path(jobs_dir: Path, job_id: str) -> Path:
    """Where a running Prolog says so (its process id), next to the per-job files; see hooks.write_prolog_mark."""
    return jobs_dir / f".prolog-{job_id}"
