"""A node's state, behind one door: every file MAPA keeps on a compute node, and the operations
the hooks, the agent and the admin commands need on them. Nothing outside this package opens
those files or knows their formats; it imports from here only (tests/test_layout.py checks).

The files (their formats are in the modules that write them):

* the jobs directory (``jobs_dir``, on /run; ``job_files.py``): per job, its mark (the Prolog's
  pid and Slurm's GPUs), its job file (the GPUs it uses, what the TaskProlog reads), its claims
  (one file per GPU it holds alone, created atomically) and, once it has ended, an ``.ended``
  marker;
* the ledger (``ledger``, on /var/lib; ``ledger.py``): an index of which job holds which GPUs,
  changed only under its lock, with the time of the last reconcile pass beside it;
* the journal (``journal``; ``journal.py``): the AdminComment records not yet written;
* the held GPUs (``held-gpus.json`` beside the ledger; ``held_gpus.py``): GPUs kept out of every
  new job (``mapa gpu hold``), changed only under the ledger's lock.

Invariants, which tests/slurm/node_state/test_safety.py (randomised kills at every step, stuck locks),
tests/slurm/node_state/test_claim_races.py, tests/core/test_invariant.py and benchmarks/bench_soak.py prove:

1. **No GPU in two live jobs**, unless too few GPUs are free and the job really shares them
   (logged as SHARES): a GPU a job takes alone is claimed first by creating its claim file,
   which fails if another job holds it, with the ledger's lock or without it.
2. **Convergence to the live jobs**: a job that ended (an ``.ended`` marker, Slurm's GPUs handed
   to a new job, or a reconcile pass's squeue listing) loses its ledger entry and files at the
   next lock holder; a job that runs without a mark is adopted with Slurm's GPUs.
3. **Every write is whole or absent** (a new file renamed over the old), through root-owned
   paths only (``trusted_files.py``), so a hook killed at any instant leaves a state the next one
   reads.

Formats are unchanged since 0.1.0: a node upgraded with jobs running keeps them.

May import: the project's ``errors``, ``slurm.trusted_files`` and ``slurm.text``; nothing above.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ... import errors
from .. import trusted_files
from ..text.commands import is_job_id
from . import held_gpus, job_files, journal
from .held_gpus import MAX_REASON_CHARS, GpuHold, HeldCorrupt, reason_problem
from .job_files import (MARK_MAX_BYTES, JobMapping, JobRecords, Mark, device_count, ended_path, highest_known_gpu,
                        is_sluid, mark_for, mark_text)
from .journal import NOTE_SUFFIX, Entry
from .ledger import Holding, Ledger, LedgerCorrupt, LedgerFile, ledger_from_json, ledger_to_json, reconcile

__all__ = [
    "NodeState", "ClaimTaken", "Holding", "Ledger", "LedgerCorrupt", "LedgerFile", "JobMapping", "JobRecords", "Mark", "Entry",
    "NOTE_SUFFIX", "MARK_MAX_BYTES", "mark_for", "mark_text", "ended_path", "is_sluid", "reconcile", "ledger_from_json",
    "ledger_to_json", "device_count", "highest_known_gpu", "GpuHold", "HeldCorrupt", "MAX_REASON_CHARS",
    "reason_problem",
]

Log = Callable[[str], None]


class ClaimTaken(Exception):
    """A GPU the Prolog chose was claimed meanwhile by a Prolog that runs without the lock."""


@dataclass(frozen=True)
class NodeState:
    """The node's state files at the paths of a config (``jobs_dir``, ``ledger``, ``journal``)."""

    jobs_dir: Path
    ledger_path: Path
    journal_dir: Path

    @classmethod
    def of(cls, config) -> "NodeState":
        """The state at a HookConfig's paths."""
        return cls(Path(config.jobs_dir), Path(config.ledger), Path(config.journal))

    # --- the jobs directory -----------------------------------------------------------------

    def prepare(self) -> None:
        """Make the jobs directory if it is missing; UnsafePath if others could change it."""
        trusted_files.ensure_trusted_dir(self.jobs_dir)

    def check_jobs_dir(self) -> bool:
        """Whether the jobs directory exists; UnsafePath if it does and others could change it
        (nothing is ever removed through such a directory)."""
        if not os.path.lexists(self.jobs_dir):
            return False
        trusted_files.check_trusted_dir(self.jobs_dir)
        return True

    def write_mark(self, job_id: str, mark: Mark) -> None:
        job_files.write_mark(self.jobs_dir, job_id, mark)

    def mark_if_none(self, job_id: str, mark: Mark) -> bool:
        """Mark the job unless its own Prolog has; whether this call marked it."""
        return job_files.write_mark_if_none(self.jobs_dir, job_id, mark)

    def read_mark(self, job_id: str) -> Mark:
        """The job's mark; OSError or ValueError if it has none or it cannot be read."""
        return job_files.parse_mark(trusted_files.read_bytes(job_files.mark_path(self.jobs_dir, job_id), MARK_MAX_BYTES))

    def owns(self, job_id: str, mark: Mark) -> bool:
        """Whether the job's mark is still ``mark``: a newer run of its Prolog takes it over."""
        try:
            return self.read_mark(job_id) == mark
        except (OSError, ValueError):
            return False

    def is_marked(self, job_id: str) -> bool:
        return os.path.lexists(job_files.mark_path(self.jobs_dir, job_id))

    def has_job_file(self, job_id: str) -> bool:
        return os.path.lexists(job_files.job_file_path(self.jobs_dir, job_id))

    def job_mapping(self, job_id: str) -> JobMapping:
        """What the job's file says (its GPUs, paired with Slurm's); OSError or ValueError if none."""
        return job_files.parse_job_mapping(job_files.job_file_path(self.jobs_dir, job_id).read_bytes())

    def job_of_sluid(self, sluid: str) -> str | None:
        return job_files.job_of_sluid(self.jobs_dir, sluid)

    def say_ended(self, job_id: str) -> None:
        job_files.write_ended(self.jobs_dir, job_id)

    def clear_ended(self, job_id: str) -> None:
        """A requeued job runs again under its id: it has not ended."""
        job_files.clear_ended(self.jobs_dir, job_id)

    def scan(self, also: Iterable[str] = ()) -> tuple[dict[str, JobRecords], list[tuple[str, float]]]:
        """Every job the jobs directory knows (and those of ``also``), and leftover temporary files."""
        return job_files.scan(self.jobs_dir, also=also)

    def gpus_in_use(self) -> dict[str, tuple[int, ...]]:
        """The GPUs each job that has not ended uses: its job file's, else Slurm's from its mark."""
        records, _ = self.scan()
        return {job: record.gpus if record.gpus is not None else record.mark.slurm_gpus
                for job, record in records.items()
                if not record.ended and (record.gpus is not None or record.mark is not None)}

    def gpu_count_seen(self, at_least: int = 1) -> int:
        """The node's GPU count when its topology cannot be read: every GPU a job file, a mark or
        the device files show exists, and ``at_least``."""
        records, _ = self.scan()
        return max(at_least, highest_known_gpu(records) + 1, device_count())

    # --- claims and choices -------------------------------------------------------------------

    def claim(self, job_id: str, candidates: tuple[int, ...], wanted: int) -> tuple[int, ...]:
        """Claim up to ``wanted`` of ``candidates`` for the job, in order; the ones it got."""
        return job_files.claim(self.jobs_dir, job_id, candidates, wanted)

    def release_claims(self, job_id: str, keep: tuple[int, ...] = ()) -> None:
        job_files.release_claims(self.jobs_dir, job_id, keep=keep)

    def write_job_file(self, job_id: str, gpus: tuple[int, ...], slurm_gpus: tuple[int, ...] = (),
                       paired: tuple[int, ...] | None = None) -> None:
        job_files.write_job_file(self.jobs_dir, job_id, gpus, slurm_gpus, paired)

    def ledger(self, size: int) -> LedgerFile:
        """The ledger of a node of ``size`` GPUs: its lock, read and write."""
        return LedgerFile(self.ledger_path, size)

    def read_ledger(self, size: int) -> Ledger:
        """The ledger as it is on disk (no lock); LedgerCorrupt if it cannot be read."""
        return LedgerFile(self.ledger_path, size).read()

    def commit(self, ledger_file: LedgerFile, ledger: Ledger, job_id: str, holding: Holding, log: Log,
               slurm_gpus: tuple[int, ...] = (), paired: tuple[int, ...] | None = None, ended: Iterable[str] = ()) -> None:
        """Record ``holding`` for ``job_id`` (under the lock): its GPUs claimed, then the job file
        (what the job uses), then the ledger. ClaimTaken, with nothing written, if a GPU was
        claimed by a Prolog without the lock after ``ledger`` was read: the caller reads the
        files and chooses again. ``ended``: the jobs this reading of the files found ended (an
        Epilog killed after its .ended file leaves its claims): their claims go first, or every
        commit would lose to them until the job is reaped."""
        for job in ended:
            job_files.release_claims(self.jobs_dir, job)
        held = ledger.held()
        shared = sorted(set(holding.gpus) & held)
        taken = job_files.claim_all(self.jobs_dir, job_id, tuple(g for g in holding.gpus if g not in held))
        if taken:
            raise ClaimTaken(f"GPUs {','.join(map(str, taken))} were claimed meanwhile")
        try:
            new = ledger.with_job(job_id, holding)
        except ValueError:
            log(f"job {job_id}: too few GPUs are free; it SHARES GPUs {','.join(map(str, shared))} with other jobs")
            new = ledger.with_usage(job_id, holding)
        job_files.write_job_file(self.jobs_dir, job_id, holding.gpus, slurm_gpus, paired)
        ledger_file.write(new)
        job_files.release_claims(self.jobs_dir, job_id, keep=holding.gpus)  # those of an earlier choice

    # --- held GPUs (issue 50) -------------------------------------------------------------------

    def held_path(self) -> Path:
        return held_gpus.held_path(self.ledger_path)

    def held_gpus(self) -> dict[int, GpuHold]:
        """The GPUs held out of new jobs (none without the file); HeldCorrupt if it cannot be trusted."""
        return held_gpus.read_held(self.held_path())

    def update_holds(self, change: Callable[[dict[int, GpuHold]], dict[int, GpuHold] | None],
                     lock_wait: float = 10.0) -> dict[int, GpuHold] | None:
        """Replace the held GPUs by ``change(holds)`` under the ledger's lock, unless it returns None
        (nothing to change); what was written (None: nothing). HeldCorrupt if the file cannot be
        read (it is not replaced); TimeoutError if the lock cannot be had."""
        with self.ledger(1 << 10).locked(timeout=lock_wait):
            after = change(self.held_gpus())
            if after is not None:
                held_gpus.write_held(self.held_path(), after)
            return after

    def set_hold(self, gpu: int, hold: GpuHold | None, lock_wait: float = 10.0) -> GpuHold | None:
        """Hold ``gpu`` (``hold``) or release it (None), under the ledger's lock; the hold it had
        before (None: it was not held). HeldCorrupt if the file cannot be read (it is not replaced:
        the caller says what to do); TimeoutError if the lock cannot be had."""
        with self.ledger(1 << 10).locked(timeout=lock_wait):
            holds = self.held_gpus()
            before = holds.pop(gpu, None)
            if hold is not None:
                holds[gpu] = hold
            if hold is not None or before is not None:
                held_gpus.write_held(self.held_path(), holds)
            return before

    # --- reconciling --------------------------------------------------------------------------

    def current(
        self, ledger_file: LedgerFile, size: int, job_id: str, log: Log, running: set[str] | None = None,
        listed_at: float | None = None, slurm_gave: tuple[int, ...] = (), unknown: list[str] | None = None,
        seen_jobs: set[str] | frozenset[str] = frozenset(),
    ) -> tuple[Ledger, list[str], list[tuple[str, float]]]:
        """The ledger reconciled with the jobs directory, without ``job_id`` (which chooses afresh),
        the jobs found to have ended and leftover temporary files. Local files only: no Slurm call.
        ``unknown``: filled with the jobs whose GPUs the files cannot tell (a mark this release
        cannot read, an earlier release's; and the ``seen_jobs``, which the kernel shows running
        here, that the files and the ledger know nothing of: their Prolog died before its first
        write): they are not forgotten, they are asked about."""
        who = f"job {job_id}" if job_id else "reconcile pass"
        try:
            ledger = ledger_file.read()
        except LedgerCorrupt as error:
            log(f"{who}: ledger {self.ledger_path} is corrupt ({error}); rebuilding it from {self.jobs_dir}")
            ledger = Ledger()
        records, leftovers = self.scan(also=ledger.holdings)
        records.pop(job_id, None)
        before = ledger
        ledger, ended = reconcile(ledger.without([job_id]), records, size, running, listed_at, time.time(), slurm_gave=slurm_gave)
        if unknown is not None:
            unknown += sorted((job for job, record in records.items()
                               if record.mark_unreadable and record.gpus is None and not record.ended and not record.claimed
                               and job not in ledger.holdings and job not in ended), key=int)
            silent = set(seen_jobs) - self.jobs_told(records) - set(ledger.holdings) - set(ended) - {job_id} - set(unknown)
            unknown += sorted(silent, key=int)
        shared = ledger.shared()
        for job, holding in ledger.holdings.items():
            if holding.policy == "slurm" and before.holdings.get(job) != holding:
                with_others = sorted({other for g in holding.gpus for other in shared.get(g, []) if other != job})
                log(f"{who}: job {job}'s Prolog died before choosing; it runs on Slurm's GPUs "
                    f"{','.join(map(str, holding.gpus))}, now held" + (f"; SHARED with job(s) {','.join(with_others)}" if with_others else ""))
        return ledger, ended, leftovers

    def forget_ended(self, ended: list[str], leftovers: list[tuple[str, float]], listed_at: float | None, log: Log,
                     job_id: str) -> None:
        """Remove the files of jobs that have ended (their Epilog was killed) and stale temporary files."""
        for job in ended:
            job_files.remove_job(self.jobs_dir, job)
        if ended:
            who = f"job {job_id}" if is_job_id(job_id) else job_id
            log(f"{who}: reaped the ledger entries and files of jobs that ended: {','.join(ended)}")
        for name, mtime in leftovers:
            if mtime < (listed_at or time.time()) - 60:  # a writer that was killed: none takes a minute
                trusted_files.remove(self.jobs_dir / name)

    def jobs_told(self, records: dict[str, JobRecords]) -> set[str]:
        """The jobs whose files say what they use: a job file, a readable mark, claims or an
        Epilog's .ended. A job whose files cannot be read (an earlier release's mark, a bare pid)
        is not: it is adopted, and its mark replaced by one this release reads."""
        return {job for job, record in records.items()
                if record.gpus is not None or record.mark is not None or record.claimed or record.ended}

    def reconciled_path(self) -> Path:
        return self.ledger_path.with_name(self.ledger_path.name + ".reconciled")

    def touch_reconciled(self) -> None:
        """Note when the last reconcile pass ran (its file's modification time)."""
        try:
            trusted_files.replace_file(self.reconciled_path(), b"", mode=0o644)
        except (OSError, errors.MapaError):
            pass

    def last_reconciled(self) -> float:
        """When the last reconcile pass ran (seconds since the epoch), 0 if never."""
        try:
            return os.stat(self.reconciled_path()).st_mtime
        except OSError:
            return 0.0

    # --- the Epilog -----------------------------------------------------------------------------

    def release(self, job_id: str, log: Log, lock_wait: float) -> None:
        """Remove the job's files and its ledger entry.

        First the job's .ended file (the wrapper writes it too, before Python starts), so that a
        Prolog drops the job's ledger entry and files whatever happens to this Epilog. Then under
        the lock, files first, the ledger entry, and the .ended file last. If the lock cannot be
        had, the files go and the .ended file stays: the next Prolog that holds the lock drops the
        entry."""
        jobs_dir_there = self.check_jobs_dir()  # never remove files through a directory others control
        if jobs_dir_there:
            job_files.write_ended(self.jobs_dir, job_id)
        ledger_file = LedgerFile(self.ledger_path, 1 << 10)
        try:
            with ledger_file.locked(timeout=lock_wait):
                job_files.remove_job(self.jobs_dir, job_id, keep_ended=True)
                try:
                    ledger = ledger_file.read()
                    if job_id in ledger.holdings:
                        ledger_file.write(ledger.without([job_id]))
                        log(f"job {job_id}: released GPUs {','.join(map(str, ledger.holdings[job_id].gpus))}")
                except LedgerCorrupt as error:
                    log(f"job {job_id}: ledger corrupt ({error}); the next Prolog rebuilds it")
                trusted_files.remove(ended_path(self.jobs_dir, job_id))
        except TimeoutError as error:
            job_files.remove_job(self.jobs_dir, job_id, keep_ended=jobs_dir_there)
            log(f"job {job_id}: {error}; removed its files; the next Prolog that gets the lock drops its ledger entry")

    # --- the journal ----------------------------------------------------------------------------

    def record(self, job_id: str, entry: Entry) -> None:
        """Keep a job's AdminComment record until it is written (a later one replaces it)."""
        journal.write(self.journal_dir, job_id, entry)

    def note(self, job_id: str, entry: Entry) -> None:
        """Keep an isolation note for the job's AdminComment, written after its decision."""
        journal.write(self.journal_dir, journal.note_name(job_id), entry)

    def forget_record(self, job_id: str) -> None:
        """The job's record is in its AdminComment."""
        journal.remove(self.journal_dir, job_id)

    def record_pending(self, job_id: str) -> bool:
        return journal.is_pending(self.journal_dir, job_id)

    def pending_records(self) -> list[tuple[str, Entry | None, float]]:
        """The journal's records and notes not yet written: (name, entry, modification time)."""
        return journal.pending(self.journal_dir)

    def take_record(self, name: str) -> Entry | None:
        """Take a record to write it (finish_record says how that went)."""
        return journal.take(self.journal_dir, name)

    def finish_record(self, name: str, done: bool) -> None:
        journal.finish(self.journal_dir, name, done)

    def recover_records(self) -> None:
        """Put back the records a writer that was stopped had taken."""
        journal.recover(self.journal_dir)

    @staticmethod
    def note_of_record(name: str) -> str:
        """The journal name of the isolation note that goes with decision record ``name``."""
        return journal.note_name(name)

    @staticmethod
    def job_of_record(name: str) -> str | None:
        return journal.job_of(name)

    @staticmethod
    def is_note(name: str) -> bool:
        return name.endswith(NOTE_SUFFIX)
