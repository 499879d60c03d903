"""The node's ledger brought in line with the jobs that really run here.

Local files only, on the start path (node_state.NodeState.current: the ledger with the jobs
directory's marks, job files, claims and .ended files); with Slurm, off it (reconcile_node: one
squeue call lists the node's jobs, jobs no Prolog marked are adopted with Slurm's GPUs, and the entries and files
of jobs that ended without a clean Epilog are dropped). mapa-agent runs a pass every
``reconcile_interval``; without an agent, a Prolog runs one when the last is that old.
"""

from __future__ import annotations

import time
from typing import Sequence

from ...errors import MapaError
from ..config import HookConfig
from ..node_state import LedgerCorrupt, Mark, NodeState
from ..text.commands import (CommandFailed, Log, RunCommand, job_states, parse_job_ids, parse_job_json, reading_jobs_at_once,
                             running_jobs_argv, show_job_argv, slurm_gpus_on_only_node)
from .budget import Budget, within_budget
from .node_graph import load_graph


MAX_ADOPTED_PER_PASS = 64
_RUNNING_STATES = {"RUNNING", "CONFIGURING", "SUSPENDED"}


def still_running(record: dict) -> bool:
    """Whether a `scontrol --json show job` record is of a job still using its GPUs (no state: assume so)."""
    if record.get("job_state") is None:
        return True
    states = job_states(record)
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
    state = NodeState.of(config)
    try:
        known = set(state.read_ledger(size).holdings)
    except LedgerCorrupt:
        known = set()
    records, _ = state.scan()
    unknown = sorted(running - known - state.jobs_told(records), key=int)
    adopt_jobs(who, unknown[:MAX_ADOPTED_PER_PASS], size, config, run, log, budget)
    if len(unknown) > MAX_ADOPTED_PER_PASS:
        log(f"{who}: {len(unknown) - MAX_ADOPTED_PER_PASS} more unknown jobs are left to the next pass")


def adopt_jobs(who: str, jobs: Sequence[str], size: int, config: HookConfig, run: RunCommand, log: Log, budget: Budget) -> None:
    """Ask Slurm for each job's GPUs here and mark it with them (pid 0), unless its own Prolog has
    marked it meanwhile; a job that has ended is left to reaping. The jobs are read in one call
    (in a burst most are jobs whose Prolog slurmd has not started yet, marked by then)."""
    run = reading_jobs_at_once(run, config.squeue, config.scontrol, jobs)
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
        if not NodeState.of(config).mark_if_none(job_id, Mark(0, 0, gpus)):
            continue  # its own Prolog has marked it meanwhile
        if gpus:
            log(f"{who}: adopted job {job_id} with Slurm's GPUs {','.join(map(str, gpus))} (it ran without a MAPA choice)")


def reconcile_node(config: HookConfig, node: str, run: RunCommand, log: Log, budget: Budget | None = None) -> bool:
    """One reconcile pass, off the start path: list the node's jobs (one squeue call), adopt jobs
    no Prolog marked, and under the lock drop the ledger entries and files of jobs that ended
    without a clean Epilog. mapa-agent runs it every ``reconcile_interval``; without an agent,
    a Prolog runs it when the last pass is that old (reconcile_if_due). False if squeue failed."""
    budget = budget or Budget(config.prolog_budget)
    state = NodeState.of(config)
    state.prepare()
    try:
        size = load_graph(config, node).size
    except (MapaError, OSError):
        size = state.gpu_count_seen()
    bounded = within_budget(run, budget, config.command_timeout)
    who = f"reconcile on {node}"
    listed_at = time.time()
    try:
        running = parse_job_ids(bounded(running_jobs_argv(config.squeue, node)))
    except CommandFailed as error:
        log(f"{who}: squeue failed ({error}); keeping every ledger entry until the next pass")
        return False
    adopt_unknown_jobs(who, running, size, config, bounded, log, budget)
    ledger_file = state.ledger(size)
    try:
        with ledger_file.locked(timeout=max(budget.left() - 0.2, 0.1)):
            ledger, ended, leftovers = state.current(ledger_file, size, "", log, running, listed_at)
            try:
                unchanged = ledger_file.read() == ledger
            except LedgerCorrupt:
                unchanged = False
            if not unchanged:
                ledger_file.write(ledger)
            state.forget_ended(ended, leftovers, listed_at, log, who)
    except TimeoutError:
        log(f"{who}: the ledger's lock was not free; reaping waits for the next pass")
    state.touch_reconciled()
    return True


def reconcile_if_due(config: HookConfig, node: str, size: int, run: RunCommand, log: Log, budget: Budget) -> None:
    """Without an agent, the Prolog runs a reconcile pass when none ran for reconcile_interval
    (with an agent, its passes keep the time fresh and no Prolog ever does)."""
    state = NodeState.of(config)
    if time.time() - state.last_reconciled() < config.reconcile_interval or budget.for_step(config.command_timeout) < 0.5:
        return
    state.touch_reconciled()  # the Prologs starting meanwhile leave it to this one
    try:
        reconcile_node(config, node, run, log, budget)
    except (OSError, MapaError) as error:
        log(f"reconcile on {node}: failed ({error})")
