"""The Prolog: choose a job's GPUs on this node and record them (epilog.py releases them).

Run by slurmd as root with no PATH, through the wrappers `mapa hooks` writes (see docs/admin.md),
either in-process or inside the node's mapa-agent (agent/service.py):

    Prolog=/usr/local/sbin/mapa-prolog-wrapper     PrologFlags=Alloc
    Epilog=/usr/local/sbin/mapa-epilog-wrapper
    TaskProlog=/usr/local/sbin/mapa-taskprolog

They fail open, and safe: whatever goes wrong (no topology, a bad config, an unreadable ledger,
a slow or hanging scontrol, non-UTF-8 text), the job still gets GPUs that no other live job
uses whenever such GPUs exist, the reason goes to the log and the job's AdminComment, and the
hook exits 0 within its time budget. A Prolog that exits non-zero would drain the node and hold
the job. How the Prolog stays safe when it is killed at any point:

1. it first marks the job (mark_job: its pid and start time, and Slurm's GPUs), then reads the
   node's topology (read_node);
2. then, under the ledger lock and with local files only, records a provisional choice
   (record_provisional): Slurm's GPUs if no job uses them, else the lowest free ones;
3. then, outside the lock, reads the directive (read_directive: the job comment, else the batch
   script) and searches (choose: the policy on the free healthy GPUs, a pure function);
4. commits the search's choice under the lock if the free GPUs did not change meanwhile
   (decide_and_commit; else it searches again while its budget lasts, and otherwise keeps the
   provisional choice);
5. and records the decision for the job's AdminComment (record_decision).

Which jobs still run is learnt off the start path (reconcile.py). The rest of the Prolog's
parts: budget.py (the time budget), job_context.py (the job as slurmd describes it),
node_graph.py (the node's topology), admin_comment.py (the decision in the job's AdminComment).
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ...errors import MapaError
from ..config import HookConfig, hook_logger, load_hook_config
from ..node_state import ClaimTaken, Holding, Ledger, Mark, NodeState, mark_for
from ..text.commands import CommandFailed, Log, RunCommand, Runner, batch_script_argv
from ..text.decision import Decision, affinity_token
from .admin_comment import flush_entry, journal_decision
from .budget import COMMIT_RESERVE_S, Budget, search_within, within_budget
from .job_context import PrologContext, context_from_env
from .node_graph import load_graph
from .gpu_health import gpu_health_probe, healthy_gpus_check, held_gpus_check, note_held
from ..isolation.cgroups import jobs_with_cgroups
from .reconcile import MAX_ADOPTED_PER_PASS, adopt_jobs, reconcile_if_due

if TYPE_CHECKING:  # the engine is imported when a decision is made, after the job is marked
    from ...core.hardware import HardwareGraph
    from ..text.directive import Directive


# --- the Prolog -----------------------------------------------------------------------------


def read_directive(ctx: PrologContext, config: HookConfig, run: RunCommand, log: Log) -> tuple["Directive", str]:
    """The job's directive and where it came from: the job comment, else the batch script, else
    the site default.

    With job_submit.lua installed (``job_submit_lua = true``) every directive is in the comment
    (``mapa:...`` or the user's text then `` [mapa:...]``), so nothing is asked of slurmctld;
    only a comment so long that the plugin had no room left sends the Prolog to the script.
    """
    from ..text.directive import MAX_LINE_CHARS, directive_in_comment, parse_directive, parse_directive_lines

    from_comment = directive_in_comment(ctx.env_comment)
    if from_comment is not None:
        return from_comment, "comment"
    if config.job_submit_lua and len(ctx.env_comment) <= MAX_LINE_CHARS // 2:
        return parse_directive(config.default_directive), "default"
    try:
        from_script = parse_directive_lines(run(batch_script_argv(config.scontrol, ctx.job_id)))
        if from_script is not None:
            return from_script, "script"
    except CommandFailed as error:
        log(f"job {ctx.job_id}: no batch script ({error}); using the site default")
    return parse_directive(config.default_directive), "default"


def fallback_gpus(slurm_gpus: tuple[int, ...], free: tuple[int, ...], held: Sequence[int] = (),
                  held_out: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """Slurm's own indices when no job holds them, else the lowest free ones.

    When fewer are free than the job needs (only when jobs really do share GPUs), all the free
    ones and then Slurm's own, then the GPUs held by the fewest jobs (``held``: one entry per
    holding job), so the sharing stays as small as it can be. GPUs ``held_out`` of new jobs
    (``mapa gpu hold``) come after every other free one, so one is given only when too few others are free.
    """
    wanted = len(slurm_gpus)
    if set(slurm_gpus) <= set(free) - held_out:
        return slurm_gpus
    free = tuple(g for g in free if g not in held_out) + tuple(g for g in free if g in held_out)
    if len(free) >= wanted:
        return free[:wanted]
    chosen = list(free)
    load = Counter(held)
    for gpu in sorted(slurm_gpus, key=lambda g: (load.get(g, 0), g)) + sorted(load, key=lambda g: (load[g], g)):
        if len(chosen) == wanted:
            break
        if gpu not in chosen:
            chosen.append(gpu)
    return tuple(chosen)


def choose(
    ctx: PrologContext,
    config: HookConfig,
    graph: "HardwareGraph | None",
    directive: "Directive",
    ledger: Ledger,
    size: int,
    problem: str,
    unhealthy: frozenset[int] = frozenset(),
    search_seconds: float | None = None,
    held_out: frozenset[int] = frozenset(),
) -> Decision:
    """The pure decision: the policy's choice on the free healthy GPUs not ``held_out``, or the fail-open fallback
    (which takes held-out GPUs last). ``search_seconds``: how long its searches may take together
    (core.search.SearchLimit); past it the best found is taken and the record says how far from the optimum it can be (``gap=``)."""
    free = ledger.free(size, unhealthy | held_out)
    running = ledger.running_groups()
    if graph is not None and not problem:
        try:
            from ...core.affinity import cpus_of_slurms_gpus, select_with_affinity
            from ...core.server_models import out_of_range
            from ...core.explain import reported_allocation
            from ...core.policies import Allocation, select
            from ...core.search import SearchLimit
            from ...hardware.gres import format_cpu_list
            from ...hardware.load import resolve_model
            from ..text.directive import to_request

            request = to_request(directive, len(ctx.slurm_gpus))
            model = resolve_model(config.model_for(ctx.node), graph)
            # One end for every search of this decision (the affinity rule may search twice, and a
            # collective's set is re-ordered after): the decision, not each search, gets the time.
            limit = (SearchLimit(seconds=search_seconds, clock=time.monotonic, until=time.monotonic() + search_seconds)
                     if search_seconds else None)
            job_cpus = None
            if config.affinity_mode != "ignore":
                job_cpus = ctx.job_cpus if ctx.job_cpus is not None else cpus_of_slurms_gpus(graph, ctx.slurm_gpus)
            if job_cpus is None:
                result = select(config.policy, graph, free, request, model, config.configured_policies(), running, limit)
            else:
                result, _ = select_with_affinity(
                    config.policy, graph, free, request, job_cpus, config.affinity_mode,
                    max_loss=config.affinity_max_loss, model=model, configured=config.configured_policies(), running=running,
                    limit=limit,
                )
            if isinstance(result, Allocation):
                p = reported_allocation(graph, request, result, model, limit).placement  # a collective's set, in its best order
                return Decision(
                    ctx.node, p.gpus, result.policy, p.effective_bandwidth, p.aggregated_bandwidth, p.preserved_bandwidth,
                    free=free, running=running, slurm_gpus=ctx.slurm_gpus,
                    affinity=affinity_token(config.affinity_mode, config.affinity_max_loss) if job_cpus is not None else "",
                    job_cpus=format_cpu_list(set(ctx.job_cpus)) if job_cpus is not None and ctx.job_cpus is not None else "",
                    model=model.name, extrapolated=bool(out_of_range(model, graph, p.gpus, request.pattern)), gap=p.gap,
                )
            problem = "ledger-has-too-few-free-gpus"
        except (MapaError, OSError) as error:
            problem = "bad-directive-or-model: " + str(error)
    return fallback_decision(ctx, ledger, size, problem, ledger.free(size, unhealthy), running, held_out)


def fallback_decision(
    ctx: PrologContext, ledger: Ledger, size: int, problem: str, free: tuple[int, ...] | None = None, running=None,
    held_out: frozenset[int] = frozenset(),
) -> Decision:
    free = ledger.free(size) if free is None else free
    running = ledger.running_groups() if running is None else running
    held = [g for holding in ledger.holdings.values() for g in holding.gpus]
    token = problem.split(":")[0].strip().replace(" ", "-") or "unknown"
    return Decision(ctx.node, fallback_gpus(ctx.slurm_gpus, free, held, held_out), "fallback", fallback=token, free=free, running=running,
                    slurm_gpus=ctx.slurm_gpus)


def paired_order(graph: "HardwareGraph | None", gpus: tuple[int, ...]) -> tuple[int, ...]:
    """MAPA's GPUs in the order they are paired with Slurm's ascending indices (core/order.py):
    what Slurm hands a step or a task first is what MAPA links best."""
    if graph is None:
        return gpus
    from ...core.order import prefix_order

    return prefix_order(graph, gpus)


def size_without_topology(ctx: PrologContext, config: HookConfig) -> int:
    """The node's GPU count when its topology cannot be read: every GPU Slurm, a job file, a mark
    or the device files show exists (more free GPUs to choose from means less sharing)."""
    return NodeState.of(config).gpu_count_seen(at_least=max(ctx.slurm_gpus) + 1)


MAX_CLAIM_RACES = 8  # a claim lost to a Prolog without the lock is rare; more in a row means a stuck node


def spread(job_id: str, gpus: Sequence[int]) -> tuple[int, ...]:
    """``gpus`` in an order of this job's own, so Prologs choosing without the lock rarely meet."""
    return tuple(sorted(gpus, key=lambda gpu: zlib.crc32(f"{job_id}:{gpu}".encode())))


DECISION_SEARCH_S = 0.2  # the searches of one decision; past it, the best found and its proven gap (docs/engine.md)


def search_seconds(budget: Budget) -> float:
    """How long the searches of this decision may take together: DECISION_SEARCH_S, less when the
    budget is nearly spent (the search, the commit and the record must all fit)."""
    return max(min(DECISION_SEARCH_S, budget.for_step(budget.left()) / 4), 0.01)


MIN_CLAIM_WAIT_S = 0.5  # without the lock, how long at least to wait for enough GPUs to come free
CLAIM_RETRY_S = 0.01


def record_provisional(
    ctx: PrologContext, config: HookConfig, size: int, budget: Budget, log: Log, mark: Mark | None = None,
    unknown: list[str] | None = None, held_out: frozenset[int] = frozenset(),
) -> tuple[int, ...] | None:
    """Step 2: a safe choice made from local files only, recorded before anything slow happens.
    None when a newer run of the job's Prolog owns the job (NodeState.owns). ``unknown``: see
    NodeState.current. The lock is waited for until the commit reserve of ``budget``; without it,
    GPUs are claimed until the budget's end (MIN_CLAIM_WAIT_S at least)."""
    state = NodeState.of(config)
    ledger_file = state.ledger(size)
    # The jobs the kernel shows here (their Slurm cgroups), read before the lock: one the files do
    # not know is asked about before choosing (NodeState.current's ``unknown``).
    seen = jobs_with_cgroups() if unknown is not None else frozenset()
    try:
        with ledger_file.locked(timeout=max(budget.for_step(budget.left()), 0.1)):
            if mark is not None and not state.owns(ctx.job_id, mark):
                return None
            for _ in range(MAX_CLAIM_RACES):
                if unknown is not None:
                    unknown.clear()
                ledger, ended, _ = state.current(ledger_file, size, ctx.job_id, log, slurm_gave=ctx.slurm_gpus,
                                                  unknown=unknown, seen_jobs=seen)
                decision = fallback_decision(ctx, ledger, size, "provisional", held_out=held_out)
                try:
                    state.commit(ledger_file, ledger, ctx.job_id, Holding(decision.gpus, "provisional", time.time(), "choosing"), log,
                                 ctx.slurm_gpus, ended=ended)
                except ClaimTaken:
                    continue  # the claim is in the files now: read them again
                state.forget_ended(ended, [], None, log, ctx.job_id)
                return decision.gpus
            raise TimeoutError("Prologs without the lock kept claiming the GPUs this one chose")
    except TimeoutError:
        # The lock was not free for the whole wait: a holder is stuck (it is held for milliseconds
        # otherwise). Choose from what the files say and write only the job file (the next Prolog
        # that gets the lock enters it into the ledger): Slurm's own GPUs if no job uses them
        # (Slurm never gives one GPU to two live jobs), else free ones in an order of this job's own.
        # Each GPU is claimed by creating a file, so no two Prologs ever take the same one. The
        # files change while this Prolog reads them (others commit and free GPUs): while claims
        # fall short, read them again and claim from the new free set. Too few free is passing:
        # Slurm never gives more GPUs than the node has, but a lock holder that moves its job
        # from the provisional GPUs to its final ones claims the new ones before it lets the old
        # ones go, so for a moment its job holds more than Slurm gave it. Sharing is the last
        # resort, once the budget is spent.
        wanted = len(ctx.slurm_gpus)
        gpus: tuple[int, ...] = ()
        claim_started = time.monotonic()
        claim_deadline = claim_started + max(budget.left() - 0.1, MIN_CLAIM_WAIT_S)
        while True:
            ledger, _, _ = state.current(ledger_file, size, ctx.job_id, log, slurm_gave=ctx.slurm_gpus)
            free = tuple(g for g in ledger.free(size) if g not in gpus)
            own = tuple(g for g in ctx.slurm_gpus if g in free)
            order = own + spread(ctx.job_id, set(free) - set(own))
            # Held GPUs (mapa gpu hold) only once the wait is over: an unheld one may come free meanwhile.
            order = tuple(g for g in order if g not in held_out) + (tuple(g for g in order if g in held_out)
                                                                     if time.monotonic() > claim_deadline else ())
            gpus += state.claim(ctx.job_id, order, wanted - len(gpus))
            if len(gpus) == wanted or time.monotonic() > claim_deadline:
                break
            time.sleep(CLAIM_RETRY_S)
        if len(gpus) < wanted:
            # Too few could be claimed. GPUs that no live job holds but whose claims are still there
            # (their jobs ended after the lock got stuck: only a lock holder removes their files)
            # come first; only then GPUs live jobs hold, as few jobs as possible.
            unclaimable = tuple(g for g in ledger.free(size) if g not in gpus)
            gpus = fallback_gpus(ctx.slurm_gpus, gpus + unclaimable, [g for h in ledger.holdings.values() for g in h.gpus], held_out)
            shared = sorted(set(gpus) & ledger.held())
            log(f"job {ctx.job_id}: too few GPUs came free to claim without the lock in {time.monotonic() - claim_started:.1f} s; "
                f"it takes GPUs {','.join(map(str, gpus))}"
                + (f" and SHARES GPUs {','.join(map(str, shared))} with other jobs" if shared else
                   ", some of them claimed by jobs that ended (their files go when a Prolog next holds the lock)"))
        gpus = tuple(sorted(gpus))
        if mark is not None and not state.owns(ctx.job_id, mark):
            if not state.is_marked(ctx.job_id):
                # Its Epilog has been meanwhile: the claims made above would outlive the job,
                # holding GPUs no live job uses until a reconcile pass. (A newer run of its
                # Prolog, whose mark is there, may hold the same claims: they stay.)
                state.release_claims(ctx.job_id)
            return None
        state.write_job_file(ctx.job_id, gpus, ctx.slurm_gpus)
        log(f"job {ctx.job_id}: LEDGER LOCK TIMEOUT ({state.ledger_path}.lock held by a stuck process?); "
            f"gave it GPUs {','.join(map(str, gpus))} that no job file names, without the lock")
        return gpus


def run_prolog(
    env: Mapping[str, str],
    config: HookConfig,
    run: RunCommand,
    log: Log,
    config_problem: str = "",
    unhealthy_gpus: Callable[[], dict[int, tuple[str, ...]]] | None = None,
    still_wanted: Callable[[], bool] | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
    requester_pid: int | None = None,
    budget: Budget | None = None,
) -> Decision | None:
    """The Prolog's phases: mark and read the job and the node; claim a safe provisional choice;
    decide (the directive, the healthy free GPUs, the policy); record the choice and its
    decision record.

    ``still_wanted`` (the agent's) says whether the Prolog that asked is still waiting; if not,
    the search's choice is not written (the provisional one stays, and the wrapper's in-process
    retry decides again). ``defer`` (the agent's) takes the AdminComment write off the job's
    start. ``requester_pid``: the process slurmd started for this Prolog (the agent's client).
    ``budget``: the wall time left (default: the config's prolog_budget from now).
    """
    budget = budget or Budget(config.prolog_budget)
    state = NodeState.of(config)
    ctx, mark = mark_job(env, state, requester_pid or os.getpid())
    if not ctx.slurm_gpus:
        return None  # a CPU-only job: its mark says so, and no Prolog ever needs to ask Slurm about it
    if config.affinity_mode != "ignore":  # exact with PrologFlags=RunInJob; else Slurm's GPUs' CPUs stand in
        from .job_cpus import read_job_cpus

        ctx.job_cpus = read_job_cpus(requester_pid or os.getpid(), ctx.job_id, sluid=ctx.sluid)
    graph, size, problem = read_node(ctx, config, config_problem)
    unknown: list[str] = []
    held_out = held_gpus_check(ctx, state, log)
    provisional = record_provisional(ctx, config, size, budget, log, mark, unknown, held_out)
    if provisional is None:
        log(f"job {ctx.job_id}: a newer run of its Prolog took the job over; this one writes nothing")
        return None
    bounded = within_budget(run, budget, config.command_timeout)
    if unknown:  # rare (an upgrade from a release with other marks): their GPUs are asked for before choosing
        adopt_jobs(f"job {ctx.job_id}", unknown[:MAX_ADOPTED_PER_PASS], size, config, bounded, log, budget)
    unhealthy = healthy_gpus_check(ctx, config, log, unhealthy_gpus, budget)
    try:
        directive, source = read_directive(ctx, config, bounded, log)
    except MapaError as error:
        from ..text.directive import parse_directive

        problem = problem or f"bad-directive: {error}"
        directive, source = parse_directive(""), "none"
    decision = decide_and_commit(ctx, config, state, log, problem, graph, size, directive, source, provisional, unhealthy,
                                 still_wanted, budget, mark, held_out)
    if decision is not None:
        decision = note_held(ctx, decision, held_out, log)
        record_decision(ctx, config, state, bounded, log, directive, source, problem, decision, size, defer, budget)
    return decision


def mark_job(env: Mapping[str, str], state: NodeState, pid: int) -> tuple[PrologContext, Mark]:
    """Phase 1: the job as slurmd describes it, marked as this Prolog's (its pid and Slurm's GPUs)
    before anything else, so a Prolog killed from here on still tells later ones what the job uses."""
    ctx = context_from_env(env)
    state.prepare()
    mark = mark_for(pid, ctx.slurm_gpus, ctx.sluid)
    state.write_mark(ctx.job_id, mark)
    state.clear_ended(ctx.job_id)  # a requeued job runs again under its id
    return ctx, mark


def read_node(ctx: PrologContext, config: HookConfig, problem: str) -> tuple["HardwareGraph | None", int, str]:
    """The node's topology, its GPU count, and the problem that sends the job to the fallback
    (the config's, or a topology that cannot be read: then every GPU the files show counts)."""
    graph: HardwareGraph | None = None
    if not problem:
        try:
            graph = load_graph(config, ctx.node)
        except (MapaError, OSError) as error:
            problem = f"no-topology: {error}"
    size = graph.size if graph is not None else size_without_topology(ctx, config)
    return graph, size, problem


def decide_and_commit(
    ctx: PrologContext,
    config: HookConfig,
    state: NodeState,
    log: Log,
    problem: str,
    graph: "HardwareGraph | None",
    size: int,
    directive: "Directive",
    source: str,
    provisional: tuple[int, ...],
    unhealthy: frozenset[int],
    still_wanted: Callable[[], bool] | None,
    budget: Budget,
    mark: Mark,
    held_out: frozenset[int] = frozenset(),
) -> Decision | None:
    """Phases 3 and 4: search on a snapshot of the free GPUs outside the lock, then commit the
    choice under the lock if the free GPUs did not change meanwhile (else search again while the
    budget lasts, and otherwise keep the provisional choice). None if a newer run of the job's
    Prolog took it over, or the asking Prolog went away: this one then writes nothing more."""
    # Which jobs still run is learnt off the start path (reconcile_node, in mapa-agent); here only
    # the jobs directory says it: .ended files, and Slurm giving a dead Prolog's GPUs again.
    running, listed_at = None, None
    ledger_file = state.ledger(size)
    decision: Decision | None = None
    claim_races = 0
    while decision is None:
        snapshot, _, _ = state.current(ledger_file, size, ctx.job_id, log, running, listed_at, ctx.slurm_gpus)
        try:
            proposal = search_within(budget.for_step(budget.left()),
                                     lambda: choose(ctx, config, graph, directive, snapshot, size, problem, unhealthy,
                                                    search_seconds(budget), held_out))
        except TimeoutError as error:
            proposal = None
            log(f"job {ctx.job_id}: {error}; keeping the provisional choice")
        try:
            with ledger_file.locked(timeout=max(budget.left() - 0.2, 0.1)):
                # Checked under the lock, so that no write can follow a takeover or a client gone meanwhile.
                if not state.owns(ctx.job_id, mark) or (still_wanted is not None and not still_wanted()):
                    log(f"job {ctx.job_id}: a newer run of its Prolog took the job over, or its Prolog went away; this one "
                        f"writes nothing more (the job keeps the provisional GPUs {','.join(map(str, provisional))})")
                    return None
                fresh, ended, leftovers = state.current(ledger_file, size, ctx.job_id, log, running, listed_at, ctx.slurm_gpus)
                unchanged = fresh.free(size, unhealthy) == snapshot.free(size, unhealthy) and fresh.running_groups() == snapshot.running_groups()
                if proposal is not None and unchanged:
                    decision = proposal
                elif proposal is None or budget.for_step(budget.left()) < 0.2 or claim_races >= MAX_CLAIM_RACES:
                    keep = provisional if not set(provisional) & fresh.held() else None
                    decision = fallback_decision(ctx, fresh, size, problem or "prolog-budget-spent", held_out=held_out)
                    if keep is not None:
                        decision = dataclasses.replace(decision, gpus=keep)
                else:
                    continue  # another job took or freed GPUs meanwhile: search again on the new free set
                note = f"directive from {source}" + (f"; {problem}" if problem else "")
                try:
                    state.commit(ledger_file, fresh, ctx.job_id, Holding(decision.gpus, decision.policy, time.time(), note), log,
                                 ctx.slurm_gpus, paired_order(graph, decision.gpus), ended=ended)
                except ClaimTaken as taken:
                    claim_races += 1
                    if claim_races <= MAX_CLAIM_RACES:
                        log(f"job {ctx.job_id}: {taken}; choosing again")
                        decision = None
                        continue
                    log(f"job {ctx.job_id}: {taken}, {claim_races} times; it keeps the provisional GPUs {','.join(map(str, provisional))}")
                    decision = dataclasses.replace(decision, gpus=provisional)
                state.forget_ended(ended, leftovers, listed_at, log, ctx.job_id)
        except TimeoutError:
            log(f"job {ctx.job_id}: LEDGER LOCK TIMEOUT at commit; it keeps the provisional GPUs {','.join(map(str, provisional))}")
            decision = fallback_decision(ctx, Ledger(), size, "ledger-lock-timeout")
            decision = dataclasses.replace(decision, gpus=provisional)
    return decision


def record_decision(
    ctx: PrologContext, config: HookConfig, state: NodeState, run: RunCommand, log: Log, directive: "Directive", source: str,
    problem: str, decision: Decision, size: int, defer: Callable[[Callable[[], None]], None] | None, budget: Budget,
) -> None:
    """The last phase: the decision in the log and in the journal, for the job's AdminComment
    (written by mapa-agent after answering; without an agent, now, within the budget)."""
    log(f"job {ctx.job_id} on {ctx.node}: {decision.text()} (directive {directive.normalised()!r} from {source}; "
        f"Slurm gave {','.join(map(str, ctx.slurm_gpus))})" + (f"; FALLBACK because {problem or decision.fallback}" if decision.fallback else ""))
    entry = journal_decision(ctx, directive, decision, config, log)
    if defer is not None and ctx.nodes_in_job <= 1:
        defer(lambda: None)  # mapa-agent writes the journal's records after answering, off the start path
        return
    # No agent, or a multi-node job: write it now, within the budget (the journal keeps it if
    # slurmctld does not answer). A multi-node job's nodes each rewrite the whole AdminComment and
    # read back until every node's record is there; written after the job started, a job that
    # ends within a second could finish before a lost record is put back (slurmctld takes no update
    # of a finished job), so its nodes settle it while the job waits for their Prologs.
    if entry is not None and flush_entry(config, ctx.job_id, entry, run, log):
        state.forget_record(ctx.job_id)
    if defer is None:
        reconcile_if_due(config, ctx.node, size, run, log, budget)


# --- entry points ---------------------------------------------------------------------------


def prolog_failing_open(
    env: Mapping[str, str],
    config_env: Mapping[str, str],
    make_runner: Callable[[float], RunCommand] = lambda timeout: Runner(timeout=timeout),
    where: str = "",
    spent_before: float = 0.0,
    **agent_options,
) -> None:
    """Load the config and run the Prolog; any error is logged, never raised (a failed Prolog
    drains the node). The one body of the in-process Prolog and of mapa-agent's.

    ``spent_before``: seconds this Prolog already spent before it got here (the wrapper waited
    for the agent, or a first run was killed), taken from the budget, which still leaves
    MIN_BUDGET_S to record a safe choice."""
    config, problem = load_hook_config(config_env)
    log = hook_logger(config.log)
    if problem:
        log(f"config problem, every job falls back: {problem}")
    retry = config_env.get("MAPA_HOOK_RETRY_AFTER_SIGNAL", "")
    if retry.isdigit() and len(retry) < 4:
        log(f"job {str(env.get('SLURM_JOB_ID', ''))[:20]}: the Prolog was killed by signal {retry}; running it once more")
    try:
        budget = Budget(max(config.prolog_budget - spent_before, MIN_BUDGET_S))
        run_prolog(env, config, make_runner(config.command_timeout), log, problem, gpu_health_probe(config), budget=budget,
                   **agent_options)
    except Exception:  # noqa: BLE001 - fail open: never drain the node
        import traceback

        log(f"prolog internal error{where}:\n" + traceback.format_exc())
        record_after_error(env, config, log)


def record_after_error(env: Mapping[str, str], config: HookConfig, log: Log) -> None:
    """After an unexpected error: if the job has no job file yet, give it GPUs no job file names."""
    try:
        ctx = context_from_env(env)
        if not ctx.slurm_gpus or NodeState.of(config).has_job_file(ctx.job_id):
            return
        size = size_without_topology(ctx, config)
        state = NodeState.of(config)
        gpus = record_provisional(ctx, config, size, Budget(config.prolog_budget / 4 + COMMIT_RESERVE_S), log,
                                  held_out=held_gpus_check(ctx, state, log))
        log(f"job {ctx.job_id}: after the error it runs on GPUs {','.join(map(str, gpus))}, which no other job holds if any were free")
    except Exception as error:  # noqa: BLE001 - nothing more can be done safely; the job runs on Slurm's GPUs
        log(f"prolog: could not record a safe choice after the error ({error}); the job runs on Slurm's GPUs")


MIN_BUDGET_S = 2.0


def seconds_since_wrapper_start(env: Mapping[str, str], uptime: Path = Path("/proc/uptime")) -> float:
    """How long ago the wrapper started (its MAPA_WRAPPER_STARTED, seconds since boot); 0 if unknown."""
    started = env.get("MAPA_WRAPPER_STARTED", "")
    try:
        now = float(uptime.read_text().split()[0])
        elapsed = now - float(started) if len(started) < 24 and started.replace(".", "", 1).isdigit() else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0
    return elapsed if 0.0 <= elapsed < 3600.0 else 0.0


def prolog_main() -> int:
    prolog_failing_open(os.environ, os.environ, spent_before=seconds_since_wrapper_start(os.environ))
    return 0
