"""The node's ledger brought in line with the jobs that really run here.

Local files only, on the start path (current_ledger: the ledger with the jobs directory's marks,
job files, claims and .ended files); with Slurm, off it (reconcile_node: one squeue call lists
the node's jobs, jobs no Prolog marked are adopted with Slurm's GPUs, and the entries and files
of jobs that ended without a clean Epilog are dropped). mapa-agent runs a pass every
``reconcile_interval``; without an agent, a Prolog runs one when the last is that old.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from ..errors import MapaError
from . import jobfiles, paths
from .budget import Budget, within_budget
from .commands import (CommandFailed, Log, RunCommand, is_job_id, parse_job_ids, parse_job_json, running_jobs_argv,
                       show_job_argv, slurm_gpus_on_only_node)
from .config import HookConfig
from .ledger import Ledger, LedgerCorrupt, LedgerFile, reconcile
from .node_graph import load_graph


def current_ledger(
    ledger_file: LedgerFile, config: HookConfig, size: int, job_id: str, log: Log, running: set[str] | None = None,
    listed_at: float | None = None, slurm_gave: tuple[int, ...] = (), unknown: list[str] | None = None,
) -> tuple[Ledger, list[str], list[tuple[str, float]]]:
    """The ledger reconciled with the jobs directory, without ``job_id`` (which chooses afresh),
    the jobs found to have ended and leftover temporary files. Local files only: no Slurm call.
    ``unknown``: filled with the jobs whose GPUs the files cannot tell (a mark this release cannot
    read, an earlier release's, and nothing else): they are not forgotten, they are asked about."""
    who = f"job {job_id}" if job_id else "reconcile pass"
    try:
        ledger = ledger_file.read()
    except LedgerCorrupt as error:
        log(f"{who}: ledger {config.ledger} is corrupt ({error}); rebuilding it from {config.jobs_dir}")
        ledger = Ledger()
    records, leftovers = jobfiles.scan(config.jobs_dir, also=ledger.holdings)
    records.pop(job_id, None)
    before = ledger
    ledger, ended = reconcile(ledger.without([job_id]), records, size, running, listed_at, time.time(), slurm_gave=slurm_gave)
    if unknown is not None:
        unknown += sorted((job for job, record in records.items()
                           if record.mark_unreadable and record.gpus is None and not record.ended and not record.claimed
                           and job not in ledger.holdings and job not in ended), key=int)
    shared = ledger.shared()
    for job, holding in ledger.holdings.items():
        if holding.policy == "slurm" and before.holdings.get(job) != holding:
            with_others = sorted({other for g in holding.gpus for other in shared.get(g, []) if other != job})
            log(f"{who}: job {job}'s Prolog died before choosing; it runs on Slurm's GPUs "
                f"{','.join(map(str, holding.gpus))}, now held" + (f"; SHARED with job(s) {','.join(with_others)}" if with_others else ""))
    return ledger, ended, leftovers



def forget_ended(config: HookConfig, ended: list[str], leftovers: list[tuple[str, float]], listed_at: float | None, log: Log,
                 job_id: str) -> None:
    """Remove the files of jobs that have ended (their Epilog was killed) and stale temporary files."""
    for job in ended:
        jobfiles.remove_job(config.jobs_dir, job)
    if ended:
        who = f"job {job_id}" if is_job_id(job_id) else job_id
        log(f"{who}: reaped the ledger entries and files of jobs that ended: {','.join(ended)}")
    for name, mtime in leftovers:
        if mtime < (listed_at or time.time()) - 60:  # a writer that was killed: none takes a minute
            paths.remove(Path(config.jobs_dir) / name)


MAX_ADOPTED_PER_PASS = 64
_RUNNING_STATES = {"RUNNING", "CONFIGURING", "SUSPENDED"}


def still_running(record: dict) -> bool:
    """Whether a `scontrol --json show job` record is of a job still using its GPUs (no state: assume so)."""
    state = record.get("job_state")
    if state is None:
        return True
    states = {state} if isinstance(state, str) else set(map(str, state)) if isinstance(state, list) else set()
    return bool(states & _RUNNING_STATES) and "COMPLETING" not in states


def adopt_unknown_jobs(
    who: str, running: set[str], size: int, config: HookConfig, run: RunCommand, log: Log, budget: Budget
) -> None:
    """Mark jobs that run here but left nothing in the jobs directory, with the GPUs Slurm gave them.

    Every Prolog wrapper marks its job, so these are jobs that started before MAPA was enabled,
    or whose wrapper was killed before its first lines. They use Slurm's indices. Asking Slurm
    happens in the reconcile pass (off the start path, outside the lock), a bounded number per
    pass; the mark written for each (pid 0) makes it known to every Prolog, and nothing asks again.
    """
    ledger_file = LedgerFile(config.ledger, size)
    try:
        known = set(ledger_file.read().holdings)
    except LedgerCorrupt:
        known = set()
    records, _ = jobfiles.scan(config.jobs_dir)
    # Known: a job file, a readable mark, claims or an Epilog's .ended say what the job uses. A job
    # whose files cannot be read (an earlier release's mark, a bare pid) is not: it is adopted, and
    # its mark replaced by one this release reads.
    told = {job for job, record in records.items()
            if record.gpus is not None or record.mark is not None or record.claimed or record.ended}
    unknown = sorted(running - known - told, key=int)
    adopt_jobs(who, unknown[:MAX_ADOPTED_PER_PASS], size, config, run, log, budget)
    if len(unknown) > MAX_ADOPTED_PER_PASS:
        log(f"{who}: {len(unknown) - MAX_ADOPTED_PER_PASS} more unknown jobs are left to the next pass")


def adopt_jobs(who: str, jobs: Sequence[str], size: int, config: HookConfig, run: RunCommand, log: Log, budget: Budget) -> None:
    """Ask Slurm for each job's GPUs here and mark it with them (pid 0), unless its own Prolog has
    marked it meanwhile; a job that has ended is left to reaping."""
    for job_id in jobs:
        try:
            record = parse_job_json(run(show_job_argv(config.scontrol, job_id)), job_id)
            gpus = slurm_gpus_on_only_node(record)
        except (CommandFailed, ValueError) as error:
            log(f"{who}: cannot read job {job_id}, which runs here without a mark ({error})")
            if budget.for_step(1.0) <= 0:
                break
            continue
        if not still_running(record):
            continue  # it ended after squeue listed it; its Epilog already freed its entry
        if gpus is None:
            log(f"{who}: job {job_id} runs here without a mark; Slurm's GPUs for it cannot be told "
                "(several nodes, or no readable gres_detail); not adopted")
            continue
        gpus = tuple(g for g in gpus if 0 <= g < size)
        if not jobfiles.write_mark_if_none(config.jobs_dir, job_id, jobfiles.Mark(0, 0, gpus)):
            continue  # its own Prolog has marked it meanwhile
        if gpus:
            log(f"{who}: adopted job {job_id} with Slurm's GPUs {','.join(map(str, gpus))} (it ran without a MAPA choice)")


def reconcile_node(config: HookConfig, node: str, run: RunCommand, log: Log, budget: Budget | None = None) -> bool:
    """One reconcile pass, off the start path: list the node's jobs (one squeue call), adopt jobs
    no Prolog marked, and under the lock drop the ledger entries and files of jobs that ended
    without a clean Epilog. mapa-agent runs it every ``reconcile_interval``; without an agent,
    a Prolog runs it when the last pass is that old (reconcile_if_due). False if squeue failed."""
    budget = budget or Budget(config.prolog_budget)
    paths.ensure_trusted_dir(config.jobs_dir)
    try:
        graph = load_graph(config, node)
        size = graph.size
    except (MapaError, OSError):
        records, _ = jobfiles.scan(config.jobs_dir)
        size = max(jobfiles.highest_known_gpu(records) + 1, jobfiles.device_count(), 1)
    bounded = within_budget(run, budget, config.command_timeout)
    who = f"reconcile on {node}"
    listed_at = time.time()
    try:
        running = parse_job_ids(bounded(running_jobs_argv(config.squeue, node)))
    except CommandFailed as error:
        log(f"{who}: squeue failed ({error}); keeping every ledger entry until the next pass")
        return False
    adopt_unknown_jobs(who, running, size, config, bounded, log, budget)
    ledger_file = LedgerFile(config.ledger, size)
    try:
        with ledger_file.locked(timeout=max(budget.left() - 0.2, 0.1)):
            ledger, ended, leftovers = current_ledger(ledger_file, config, size, "", log, running, listed_at)
            try:
                unchanged = ledger_file.read() == ledger
            except LedgerCorrupt:
                unchanged = False
            if not unchanged:
                ledger_file.write(ledger)
            forget_ended(config, ended, leftovers, listed_at, log, who)
    except TimeoutError:
        log(f"{who}: the ledger's lock was not free; reaping waits for the next pass")
    touch_reconciled(config)
    return True


def reconciled_path(config: HookConfig) -> Path:
    return Path(config.ledger).with_name(Path(config.ledger).name + ".reconciled")


def touch_reconciled(config: HookConfig) -> None:
    """Note when the last reconcile pass ran (its file's modification time)."""
    try:
        paths.replace_file(reconciled_path(config), b"", mode=0o644)
    except (OSError, MapaError):
        pass


def reconcile_if_due(config: HookConfig, node: str, size: int, run: RunCommand, log: Log, budget: Budget) -> None:
    """Without an agent, the Prolog runs a reconcile pass when none ran for reconcile_interval
    (with an agent, its passes keep the time fresh and no Prolog ever does)."""
    try:
        last = os.stat(reconciled_path(config)).st_mtime
    except OSError:
        last = 0.0
    if time.time() - last < config.reconcile_interval or budget.for_step(config.command_timeout) < 0.5:
        return
    touch_reconciled(config)  # the Prologs starting meanwhile leave it to this one
    try:
        reconcile_node(config, node, run, log, budget)
    except (OSError, MapaError) as error:
        log(f"reconcile on {node}: failed ({error})")
