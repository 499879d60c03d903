"""MAPA's decision in the job's AdminComment, so that sacct keeps it.

The Prolog journals the record first (node_state's journal) and writes it within its budget, or mapa-agent
does after answering; the isolation outcome is added to the same record later (flush_note).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Callable

from ...errors import MapaError
from ..node_state import Entry, NodeState
from ..text.commands import (CommandFailed, Log, RunCommand, admin_comment_argv, answered_once, job_finished, job_node_count,
                             parse_job_json, show_job_argv, update_target)
from ..config import HookConfig
from ..text.decision import ISOLATION_STATES, Decision, parse_decisions, with_decision
from .job_context import PrologContext

if TYPE_CHECKING:
    from ..text.directive import Directive


def journal_decision(ctx: PrologContext, directive: "Directive", decision: Decision, config: HookConfig, log: Log) -> Entry | None:
    """Keep the AdminComment record on disk until it is written (the journal)."""
    try:
        entry = Entry(ctx.node, ctx.nodes_in_job, f"{directive.as_comment()} # {decision.text()}")
        NodeState.of(config).record(ctx.job_id, entry)
        return entry
    except (OSError, ValueError, MapaError) as error:
        log(f"job {ctx.job_id}: could not journal the decision for the AdminComment ({error}); not recorded")
        return None


def flush_entry(config: HookConfig, job_id: str, entry: Entry, run: RunCommand, log: Log, note: Entry | None = None) -> bool:
    """Write a journal entry's record into the job's AdminComment, with the job's isolation note
    (NodeState.note) in it when one is given. True when the entry is done with (written, already
    there, or never writable: the job is gone, it would not fit); False to try again later
    (slurmctld did not answer)."""
    from ..text.decision import record_directive

    directive = record_directive(entry.record)
    decision = parse_decisions(entry.record).get(entry.node)
    if directive is None or decision is None:
        log(f"job {job_id}: journal entry {entry.record[:80]!r} is not a decision record; dropped")
        return True
    if note is not None:
        fields = dict(token.partition("=")[::2] for token in note.record.split())
        if fields.get("isolation", "") in ISOLATION_STATES and note.node == entry.node:
            decision = dataclasses.replace(decision, isolation=fields["isolation"], why=fields.get("why", ""))
        else:
            log(f"job {job_id}: journal note {note.record[:80]!r} is not an isolation note; dropped")
    ctx = PrologContext(job_id=job_id, node=entry.node, slurm_gpus=(), env_comment="", nodes_in_job=entry.nodes_in_job)
    return record_decision(ctx, directive, decision, config, run, log)


def flush_note(config: HookConfig, job_id: str, entry: Entry, run: RunCommand, log: Log) -> bool:
    """Add an isolation note (NodeState.note) to this node's decision in the job's AdminComment. True
    when done with (written, or never writable), False to try again later: slurmctld did not
    answer, or the decision itself is still in the journal."""
    from ..text.decision import record_directive

    fields = dict(token.partition("=")[::2] for token in entry.record.split())
    state, why = fields.get("isolation", ""), fields.get("why", "")
    if state not in ISOLATION_STATES:
        log(f"job {job_id}: journal note {entry.record[:80]!r} is not an isolation note; dropped")
        return True
    try:
        shown = run(show_job_argv(config.scontrol, job_id))
        job = parse_job_json(shown, job_id)
        admin = job.get("admin_comment") or ""
    except ValueError as error:
        log(f"job {job_id}: could not read the AdminComment for the isolation note ({error}); not recorded")
        return True
    except CommandFailed as error:
        if "Invalid job id" in str(error):
            log(f"job {job_id}: gone; its isolation note ({state}: {why}) stays in this node's log only")
            return True
        return False
    admin = admin if isinstance(admin, str) else ""
    decision, directive = parse_decisions(admin).get(entry.node), record_directive(admin)
    if decision is None or directive is None:
        if NodeState.of(config).record_pending(job_id):
            return False  # the decision goes first; the note follows it
        log(f"job {job_id}: the AdminComment has no decision of node {entry.node} to note isolation={state} in; "
            "it stays in this node's log only")
        return True
    noted = dataclasses.replace(decision, isolation=state, why=why)
    # The agent that noted the failure did not know the job's nodes; the record does. Another node's
    # write can drop this one only in a multi-node job: read back there (and when the count is not
    # given), not for a one-node job (a burst's notes each read 8 times in 3 s before this).
    ctx = PrologContext(job_id=job_id, node=entry.node, slurm_gpus=(), env_comment="", nodes_in_job=job_node_count(job) or 2)
    # Its first read is the one just made (one RPC less per note).
    return record_decision(ctx, directive, noted, config, answered_once(run, {tuple(show_job_argv(config.scontrol, job_id)): shown}), log)


# A multi-node job's Prologs each rewrite the whole AdminComment: a node's write made from a read
# that predates another node's record drops it, also after that node saw its record in place. So
# each node reads back until every node's record is there (or this long has passed), merging its
# own in again whenever it is missing. Bounded in time and in reads (each one is an RPC to
# slurmctld, from every node of the job).
MULTI_NODE_SETTLE_S = 3.0
MULTI_NODE_READS = 8


def record_decision(
    ctx: PrologContext, directive: "Directive", decision: Decision, config: HookConfig, run: RunCommand, log: Log,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Add this node's decision to the job's AdminComment, so that sacct keeps it.

    The AdminComment is read afresh each time, so what an admin wrote there meanwhile is kept
    (with_decision keeps every text that is not MAPA's). The Prologs of a multi-node job run at
    once and each rewrites the whole AdminComment, so a write can drop another node's decision:
    for those jobs, read back and write again (merged) while ours is missing, until every node's
    decision is there or MULTI_NODE_SETTLE_S (MULTI_NODE_READS reads) has passed (then ours is
    there: True; else False, and the journal keeps it).
    """
    job_id = ctx.job_id
    deadline = clock() + MULTI_NODE_SETTLE_S
    attempt = 0
    while True:
        try:
            if attempt:
                sleep(min(0.05 * attempt, 0.3) + random.random() * 0.1)
            attempt += 1
            job = parse_job_json(run(show_job_argv(config.scontrol, job_id)), job_id)
            admin = job.get("admin_comment") or ""
            admin = admin if isinstance(admin, str) else ""
            decisions = parse_decisions(admin)
            recorded = decisions.get(decision.node)
            ours = recorded is not None and (recorded.gpus, recorded.policy) == (decision.gpus, decision.policy) and (
                recorded.isolation == decision.isolation or not decision.isolation)
            settled = clock() > deadline or attempt >= MULTI_NODE_READS
            if ours and (ctx.nodes_in_job <= 1 or len(decisions) >= ctx.nodes_in_job or settled or job_finished(job)):
                return True
            if not ours:
                if job_finished(job):  # slurmctld would refuse the update: not asked
                    log(f"job {job_id}: ended before its AdminComment record was written; the decision stays in this node's log only")
                    return True
                if attempt > 1 and settled:
                    break
                # An array task or het component by a name that changes it alone (update_target).
                run(admin_comment_argv(config.scontrol, update_target(job, job_id), with_decision(admin, directive, decision)))
                if ctx.nodes_in_job <= 1:
                    return True
        except ValueError as error:  # the record would not fit, or the answer is not a job record
            log(f"job {job_id}: could not record the decision in AdminComment ({error}); not recorded")
            return True
        except CommandFailed as error:
            # Refusals that a retry cannot change: the job is gone, or it ended before the record
            # was written (slurmctld takes no update of a finished job's AdminComment).
            if "Invalid job id" in str(error) or "already finished" in str(error):
                log(f"job {job_id}: the AdminComment can no longer be written ({error}); the decision stays in this node's log only")
                return True
            log(f"job {job_id}: could not record the decision in AdminComment yet ({error}); it stays in the journal")
            return False
    log(f"job {job_id}: the AdminComment kept losing this node's decision; trying again later")
    return False
