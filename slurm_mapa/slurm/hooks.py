"""The Prolog and Epilog: choose a job's GPUs on this node, record them, release them.

Run by slurmd as root with no PATH, through the wrappers `mapa hooks` writes (see docs/admin.md),
either in-process or inside the node's mapa-agent (slurm/agent.py):

    Prolog=/usr/local/sbin/mapa-prolog-wrapper     PrologFlags=Alloc
    Epilog=/usr/local/sbin/mapa-epilog-wrapper
    TaskProlog=/usr/local/sbin/mapa-taskprolog

They fail open, and safe: whatever goes wrong (no topology, a bad config, an unreadable ledger,
a slow or hanging scontrol, non-UTF-8 text), the job still gets GPUs that no other live job
uses whenever such GPUs exist, the reason goes to the log and the job's AdminComment, and the
hook exits 0 within its time budget. A Prolog that exits non-zero would drain the node and hold
the job. How the Prolog stays safe when it is killed at any point:

1. it first marks the job (jobfiles.Mark: its pid and start time, and Slurm's GPUs);
2. then, under the ledger lock and with local files only, records a provisional choice: Slurm's
   GPUs if no job uses them, else the lowest free ones;
3. then, outside the lock, reads the directive, asks Slurm which jobs run here and searches;
4. and commits the search's choice under the lock if the free GPUs did not change meanwhile
   (else it searches again while its budget lasts, and otherwise keeps the provisional choice).
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import MapaError
from . import jobfiles, journal, paths
from .commands import (
    CommandFailed,
    Runner,
    admin_comment_argv,
    batch_script_argv,
    is_job_id,
    parse_gpu_indices,
    parse_job_ids,
    parse_job_json,
    running_jobs_argv,
    show_job_argv,
    slurm_gpus_on_only_node,
    update_target,
)
from .config import HookConfig, hook_logger, load_hook_config
from .decision import ISOLATION_STATES, Decision, affinity_token, parse_decisions, with_decision
from .ledger import Holding, Ledger, LedgerCorrupt, LedgerFile, reconcile

if TYPE_CHECKING:  # the engine is imported when a decision is made, after the job is marked
    from ..core.hardware import HardwareGraph
    from .directive import Directive

RunCommand = Callable[[Sequence[str]], str]
Log = Callable[[str], None]

# --- the time budget ------------------------------------------------------------------------

COMMIT_RESERVE_S = 1.0  # kept back for the last commit under the lock


class Budget:
    """The Prolog's wall-time budget: every wait and every Slurm call is cut to what is left."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return self.deadline - self.clock()

    def for_step(self, wanted: float) -> float:
        """At most ``wanted`` seconds, never eating into the commit reserve (may be <= 0)."""
        return min(wanted, self.left() - COMMIT_RESERVE_S)


def within_budget(run: RunCommand, budget: Budget, command_timeout: float) -> RunCommand:
    """``run`` with each call's timeout cut to the budget; refuses to start once it is spent."""

    def call(argv: Sequence[str]) -> str:
        timeout = budget.for_step(command_timeout)
        if timeout < 0.05:
            raise CommandFailed(f"{os.path.basename(argv[0])} not run: the Prolog's time budget is spent")
        if isinstance(run, Runner):
            return run(argv, timeout=timeout)
        return run(argv)

    return call


def run_for_at_most(seconds: float, work: Callable[[], Any], when_done: Callable[[], None] = lambda: None) -> Any:
    """``work()``'s result, or TimeoutError after ``seconds`` (the work is left to finish alone).
    ``when_done`` runs once the work has ended, whenever that is (also if it never started)."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome.append((False, error))
        finally:
            when_done()

    thread = threading.Thread(target=target, daemon=True)
    try:
        thread.start()
    except BaseException:
        when_done()
        raise
    thread.join(max(seconds, 0.0))
    if not outcome:
        raise TimeoutError(f"did not finish within {max(seconds, 0.0):.1f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


# A search left behind by a Prolog whose budget ran out runs on until it ends (a Python thread
# cannot be stopped). In mapa-agent, many of them would starve every other thread of the
# interpreter, Prologs holding the ledger's lock included (a 64-GPU soak saw answers take 25 s):
# so at most this many searches run at once, and a Prolog that cannot get a slot within its
# budget keeps its provisional choice.
MAX_CONCURRENT_SEARCHES = 2
_search_slots = threading.BoundedSemaphore(MAX_CONCURRENT_SEARCHES)


def search_within(seconds: float, work: Callable[[], Any], slots: threading.BoundedSemaphore | None = None) -> Any:
    """``work()``'s result, run in a search slot within ``seconds``; TimeoutError otherwise (the
    work, once started, finishes alone and then frees its slot)."""
    slots = slots or _search_slots
    deadline = time.monotonic() + max(seconds, 0.0)
    if not slots.acquire(timeout=max(seconds, 0.0)):
        raise TimeoutError("searches of earlier jobs still run, and no slot came free within the Prolog's budget")
    try:
        return run_for_at_most(deadline - time.monotonic(), work, when_done=slots.release)
    except TimeoutError:
        raise TimeoutError("the search did not finish within the Prolog's budget") from None


# --- the Prolog -----------------------------------------------------------------------------


@dataclass
class PrologContext:
    job_id: str
    node: str
    slurm_gpus: tuple[int, ...]
    env_comment: str
    nodes_in_job: int = 1
    job_cpus: frozenset[int] | None = None  # from the job's cpuset cgroup when the Prolog runs in it (jobcpus.py)
    sluid: str = ""  # SLURM_JOB_SLUID (Slurm 25.11+): names the job's cgroup v2 directory from 26.05


def context_from_env(env: Mapping[str, str]) -> PrologContext:
    """The job as slurmd describes it; ValueError if the variables are not what slurmd sets."""
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME", "")
    if not is_job_id(job_id) or not node or len(node) > 255 or any(c in node for c in "/\0\n \t"):
        raise ValueError(f"SLURM_JOB_ID {job_id[:40]!r} / SLURMD_NODENAME {node[:40]!r} are not what slurmd sets")
    gpus = parse_gpu_indices(env.get("SLURM_JOB_GPUS", ""))
    nodes = env.get("SLURM_JOB_NUM_NODES", "1")
    return PrologContext(
        job_id=job_id,
        node=node,
        slurm_gpus=gpus,
        env_comment=env.get("SLURM_JOB_COMMENT", "")[:8192],
        nodes_in_job=int(nodes) if nodes.isdigit() and len(nodes) < 7 else 2,
        sluid=env.get("SLURM_JOB_SLUID", "") if jobfiles.is_sluid(env.get("SLURM_JOB_SLUID", "")) else "",
    )


def read_directive(ctx: PrologContext, config: HookConfig, run: RunCommand, log: Log) -> tuple["Directive", str]:
    """The job's directive and where it came from: the job comment, else the batch script, else
    the site default.

    With job_submit.lua installed (``job_submit_lua = true``) every directive is in the comment
    (``mapa:...`` or the user's text then `` [mapa:...]``), so nothing is asked of slurmctld;
    only a comment so long that the plugin had no room left sends the Prolog to the script.
    """
    from .directive import MAX_LINE_CHARS, directive_in_comment, parse_directive, parse_directive_lines

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


def load_graph(config: HookConfig, node: str) -> "HardwareGraph":
    from ..hardware.load import load_topology

    spec = config.topology_for(node)
    if spec is None:
        raise MapaError(f"no [nodes] entry of the config matches node {node!r}")
    return load_topology(spec)


def fallback_gpus(slurm_gpus: tuple[int, ...], free: tuple[int, ...], held: Sequence[int] = ()) -> tuple[int, ...]:
    """Slurm's own indices when no job holds them, else the lowest free ones.

    When fewer are free than the job needs (only when jobs really do share GPUs), all the free
    ones and then Slurm's own, then the GPUs held by the fewest jobs (``held``: one entry per
    holding job), so the sharing stays as small as it can be.
    """
    wanted = len(slurm_gpus)
    if set(slurm_gpus) <= set(free):
        return slurm_gpus
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
) -> Decision:
    """The pure decision: the policy's choice on the free healthy GPUs, or the fail-open fallback."""
    free = ledger.free(size, unhealthy)
    running = ledger.running_groups()
    if graph is not None and not problem:
        try:
            from ..core.affinity import cpus_of_slurms_gpus, select_with_affinity
            from ..core.effbw import load_model_file, paper_model
            from ..core.explain import reported_allocation
            from ..core.policies import Allocation, select
            from ..hardware.gres import format_cpu_list
            from .directive import to_request

            request = to_request(directive, len(ctx.slurm_gpus))
            model = load_model_file(config.model) if config.model else paper_model()
            job_cpus = None
            if config.affinity_mode != "ignore":
                job_cpus = ctx.job_cpus if ctx.job_cpus is not None else cpus_of_slurms_gpus(graph, ctx.slurm_gpus)
            if job_cpus is None:
                result = select(config.policy, graph, free, request, model, config.configured_policies(), running)
            else:
                result, _ = select_with_affinity(
                    config.policy, graph, free, request, job_cpus, config.affinity_mode,
                    max_loss=config.affinity_max_loss, model=model, configured=config.configured_policies(), running=running,
                )
            if isinstance(result, Allocation):
                p = reported_allocation(graph, request, result, model).placement  # a collective's set, in its best order
                return Decision(
                    ctx.node, p.gpus, config.policy, p.effective_bandwidth, p.aggregated_bandwidth, p.preserved_bandwidth,
                    free=free, running=running, slurm_gpus=ctx.slurm_gpus,
                    affinity=affinity_token(config.affinity_mode, config.affinity_max_loss) if job_cpus is not None else "",
                    job_cpus=format_cpu_list(set(ctx.job_cpus)) if job_cpus is not None and ctx.job_cpus is not None else "",
                )
            problem = "ledger-has-too-few-free-gpus"
        except (MapaError, OSError) as error:
            problem = "bad-directive-or-model: " + str(error)
    return fallback_decision(ctx, ledger, size, problem, free, running)


def fallback_decision(
    ctx: PrologContext, ledger: Ledger, size: int, problem: str, free: tuple[int, ...] | None = None, running=None
) -> Decision:
    free = ledger.free(size) if free is None else free
    running = ledger.running_groups() if running is None else running
    held = [g for holding in ledger.holdings.values() for g in holding.gpus]
    token = problem.split(":")[0].strip().replace(" ", "-") or "unknown"
    return Decision(ctx.node, fallback_gpus(ctx.slurm_gpus, free, held), "fallback", fallback=token, free=free, running=running,
                    slurm_gpus=ctx.slurm_gpus)


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


class ClaimTaken(Exception):
    """A GPU the Prolog chose was claimed meanwhile by a Prolog that runs without the lock."""


def paired_order(graph: "HardwareGraph | None", gpus: tuple[int, ...]) -> tuple[int, ...]:
    """MAPA's GPUs in the order they are paired with Slurm's ascending indices (core/order.py):
    what Slurm hands a step or a task first is what MAPA links best."""
    if graph is None:
        return gpus
    from ..core.order import prefix_order

    return prefix_order(graph, gpus)


def commit(config: HookConfig, ledger_file: LedgerFile, ledger: Ledger, job_id: str, holding: Holding, log: Log,
           slurm_gpus: tuple[int, ...] = (), paired: tuple[int, ...] | None = None) -> None:
    """Record ``holding`` for ``job_id`` (under the lock): its GPUs claimed, then the job file (what
    the job uses), then the ledger. ClaimTaken, with nothing written, if a GPU was claimed by a
    Prolog without the lock after ``ledger`` was read: the caller reads the files and chooses again."""
    held = ledger.held()
    shared = sorted(set(holding.gpus) & held)
    taken = jobfiles.claim_all(config.jobs_dir, job_id, tuple(g for g in holding.gpus if g not in held))
    if taken:
        raise ClaimTaken(f"GPUs {','.join(map(str, taken))} were claimed meanwhile")
    try:
        new = ledger.with_job(job_id, holding)
    except ValueError:
        log(f"job {job_id}: too few GPUs are free; it SHARES GPUs {','.join(map(str, shared))} with other jobs")
        new = ledger.with_usage(job_id, holding)
    jobfiles.write_job_file(config.jobs_dir, job_id, holding.gpus, slurm_gpus, paired)
    ledger_file.write(new)
    jobfiles.release_claims(config.jobs_dir, job_id, keep=holding.gpus)  # those of an earlier choice


def size_without_topology(ctx: PrologContext, config: HookConfig) -> int:
    """The node's GPU count when its topology cannot be read: every GPU Slurm, a job file, a mark
    or the device files show exists (more free GPUs to choose from means less sharing)."""
    records, _ = jobfiles.scan(config.jobs_dir)
    return max(max(ctx.slurm_gpus) + 1, jobfiles.highest_known_gpu(records) + 1, jobfiles.device_count())


def owns_job(config: HookConfig, job_id: str, mark: jobfiles.Mark) -> bool:
    """Whether the job's mark is still ours: a newer run of its Prolog (the wrapper's in-process
    run after the agent's client was killed, a retry) takes the job over, and this one must then
    write nothing more about it."""
    try:
        return jobfiles.parse_mark(paths.read_bytes(jobfiles.mark_path(config.jobs_dir, job_id), jobfiles.MARK_MAX_BYTES)) == mark
    except (OSError, ValueError):
        return False


MAX_CLAIM_RACES = 8  # a claim lost to a Prolog without the lock is rare; more in a row means a stuck node


def spread(job_id: str, gpus: Sequence[int]) -> tuple[int, ...]:
    """``gpus`` in an order of this job's own, so Prologs choosing without the lock rarely meet."""
    return tuple(sorted(gpus, key=lambda gpu: zlib.crc32(f"{job_id}:{gpu}".encode())))


MIN_CLAIM_WAIT_S = 0.5  # without the lock, how long at least to wait for enough GPUs to come free
CLAIM_RETRY_S = 0.01


def record_provisional(
    ctx: PrologContext, config: HookConfig, size: int, budget: Budget, log: Log, mark: jobfiles.Mark | None = None,
    unknown: list[str] | None = None,
) -> tuple[int, ...] | None:
    """Step 2: a safe choice made from local files only, recorded before anything slow happens.
    None when a newer run of the job's Prolog owns the job (see owns_job). ``unknown``: see
    current_ledger. The lock is waited for until the commit reserve of ``budget``; without it,
    GPUs are claimed until the budget's end (MIN_CLAIM_WAIT_S at least)."""
    ledger_file = LedgerFile(config.ledger, size)
    try:
        with ledger_file.locked(timeout=max(budget.for_step(budget.left()), 0.1)):
            if mark is not None and not owns_job(config, ctx.job_id, mark):
                return None
            for _ in range(MAX_CLAIM_RACES):
                if unknown is not None:
                    unknown.clear()
                ledger, ended, _ = current_ledger(ledger_file, config, size, ctx.job_id, log, slurm_gave=ctx.slurm_gpus,
                                                  unknown=unknown)
                decision = fallback_decision(ctx, ledger, size, "provisional")
                try:
                    commit(config, ledger_file, ledger, ctx.job_id, Holding(decision.gpus, "provisional", time.time(), "choosing"), log,
                           ctx.slurm_gpus)
                except ClaimTaken:
                    continue  # the claim is in the files now: read them again
                forget_ended(config, ended, [], None, log, ctx.job_id)
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
            ledger, _, _ = current_ledger(ledger_file, config, size, ctx.job_id, log, slurm_gave=ctx.slurm_gpus)
            free = tuple(g for g in ledger.free(size) if g not in gpus)
            own = tuple(g for g in ctx.slurm_gpus if g in free)
            gpus += jobfiles.claim(config.jobs_dir, ctx.job_id, own + spread(ctx.job_id, set(free) - set(own)), wanted - len(gpus))
            if len(gpus) == wanted or time.monotonic() > claim_deadline:
                break
            time.sleep(CLAIM_RETRY_S)
        if len(gpus) < wanted:
            # Too few could be claimed. GPUs that no live job holds but whose claims are still there
            # (their jobs ended after the lock got stuck: only a lock holder removes their files)
            # come first; only then GPUs live jobs hold, as few jobs as possible.
            unclaimable = tuple(g for g in ledger.free(size) if g not in gpus)
            gpus = fallback_gpus(ctx.slurm_gpus, gpus + unclaimable, [g for h in ledger.holdings.values() for g in h.gpus])
            shared = sorted(set(gpus) & ledger.held())
            log(f"job {ctx.job_id}: too few GPUs came free to claim without the lock in {time.monotonic() - claim_started:.1f} s; "
                f"it takes GPUs {','.join(map(str, gpus))}"
                + (f" and SHARES GPUs {','.join(map(str, shared))} with other jobs" if shared else
                   ", some of them claimed by jobs that ended (their files go when a Prolog next holds the lock)"))
        gpus = tuple(sorted(gpus))
        if mark is not None and not owns_job(config, ctx.job_id, mark):
            if not os.path.lexists(jobfiles.mark_path(config.jobs_dir, ctx.job_id)):
                # Its Epilog has been meanwhile: the claims made above would outlive the job,
                # holding GPUs no live job uses until a reconcile pass. (A newer run of its
                # Prolog, whose mark is there, may hold the same claims: they stay.)
                jobfiles.release_claims(config.jobs_dir, ctx.job_id)
            return None
        jobfiles.write_job_file(config.jobs_dir, ctx.job_id, gpus, ctx.slurm_gpus)
        log(f"job {ctx.job_id}: LEDGER LOCK TIMEOUT ({config.ledger}.lock held by a stuck process?); "
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
    """Mark the job, record a safe provisional choice, then choose, record and write its GPUs.

    ``still_wanted`` (the agent's) says whether the Prolog that asked is still waiting; if not,
    the search's choice is not written (the provisional one stays, and the wrapper's in-process
    retry decides again). ``defer`` (the agent's) takes the AdminComment write off the job's
    start. ``requester_pid``: the process slurmd started for this Prolog (the agent's client).
    ``budget``: the wall time left (default: the config's prolog_budget from now).
    """
    budget = budget or Budget(config.prolog_budget)
    ctx = context_from_env(env)
    paths.ensure_trusted_dir(config.jobs_dir)
    mark = jobfiles.mark_for(requester_pid or os.getpid(), ctx.slurm_gpus, ctx.sluid)
    jobfiles.write_mark(config.jobs_dir, ctx.job_id, mark)
    jobfiles.clear_ended(config.jobs_dir, ctx.job_id)  # a requeued job runs again under its id
    if not ctx.slurm_gpus:
        return None  # a CPU-only job: its mark says so, and no Prolog ever needs to ask Slurm about it
    if config.affinity_mode != "ignore":  # exact with PrologFlags=RunInJob; else Slurm's GPUs' CPUs stand in
        from .jobcpus import read_job_cpus

        ctx.job_cpus = read_job_cpus(requester_pid or os.getpid(), ctx.job_id, sluid=ctx.sluid)
    problem = config_problem
    graph: HardwareGraph | None = None
    if not problem:
        try:
            graph = load_graph(config, ctx.node)
        except (MapaError, OSError) as error:
            problem = f"no-topology: {error}"
    size = graph.size if graph is not None else size_without_topology(ctx, config)
    unknown: list[str] = []
    provisional = record_provisional(ctx, config, size, budget, log, mark, unknown)
    if provisional is None:
        log(f"job {ctx.job_id}: a newer run of its Prolog took the job over; this one writes nothing")
        return None
    bounded = within_budget(run, budget, config.command_timeout)
    if unknown:  # rare (an upgrade from a release with other marks): their GPUs are asked for before choosing
        adopt_jobs(f"job {ctx.job_id}", unknown[:MAX_ADOPTED_PER_PASS], size, config, bounded, log, budget)
    return _decide_and_commit(ctx, config, bounded, log, problem, graph, size, provisional, unhealthy_gpus, still_wanted, defer,
                              budget, mark)


def _decide_and_commit(
    ctx: PrologContext,
    config: HookConfig,
    run: RunCommand,
    log: Log,
    problem: str,
    graph: "HardwareGraph | None",
    size: int,
    provisional: tuple[int, ...],
    unhealthy_gpus: Callable[[], dict[int, tuple[str, ...]]] | None,
    still_wanted: Callable[[], bool] | None,
    defer: Callable[[Callable[[], None]], None] | None,
    budget: Budget,
    mark: jobfiles.Mark,
) -> Decision | None:
    from .directive import parse_directive

    unhealthy: frozenset[int] = frozenset()
    if unhealthy_gpus is not None:
        try:
            problems = run_for_at_most(budget.for_step(config.command_timeout), unhealthy_gpus)
            unhealthy = frozenset(problems)
            for gpu, reasons in sorted(problems.items()):
                log(f"job {ctx.job_id}: leaving out GPU {gpu}: {'; '.join(reasons)}")
        except Exception as error:  # noqa: BLE001 - a health probe must never stop the job
            log(f"job {ctx.job_id}: GPU health check failed ({error}); using every GPU")
    try:
        directive, source = read_directive(ctx, config, run, log)
    except MapaError as error:
        problem = problem or f"bad-directive: {error}"
        directive, source = parse_directive(""), "none"
    # Which jobs still run is learnt off the start path (reconcile_node, in mapa-agent); here only
    # the jobs directory says it: .ended files, and Slurm giving a dead Prolog's GPUs again.
    running, listed_at = None, None
    ledger_file = LedgerFile(config.ledger, size)
    decision: Decision | None = None
    claim_races = 0
    while decision is None:
        snapshot, _, _ = current_ledger(ledger_file, config, size, ctx.job_id, log, running, listed_at, ctx.slurm_gpus)
        try:
            proposal = search_within(budget.for_step(budget.left()),
                                     lambda: choose(ctx, config, graph, directive, snapshot, size, problem, unhealthy))
        except TimeoutError as error:
            proposal = None
            log(f"job {ctx.job_id}: {error}; keeping the provisional choice")
        try:
            with ledger_file.locked(timeout=max(budget.left() - 0.2, 0.1)):
                # Checked under the lock, so that no write can follow a takeover or a client gone meanwhile.
                if not owns_job(config, ctx.job_id, mark) or (still_wanted is not None and not still_wanted()):
                    log(f"job {ctx.job_id}: a newer run of its Prolog took the job over, or its Prolog went away; this one "
                        f"writes nothing more (the job keeps the provisional GPUs {','.join(map(str, provisional))})")
                    return None
                fresh, ended, leftovers = current_ledger(ledger_file, config, size, ctx.job_id, log, running, listed_at, ctx.slurm_gpus)
                unchanged = fresh.free(size, unhealthy) == snapshot.free(size, unhealthy) and fresh.running_groups() == snapshot.running_groups()
                if proposal is not None and unchanged:
                    decision = proposal
                elif proposal is None or budget.for_step(budget.left()) < 0.2 or claim_races >= MAX_CLAIM_RACES:
                    keep = provisional if not set(provisional) & fresh.held() else None
                    decision = fallback_decision(ctx, fresh, size, problem or "prolog-budget-spent")
                    if keep is not None:
                        decision = dataclasses.replace(decision, gpus=keep)
                else:
                    continue  # another job took or freed GPUs meanwhile: search again on the new free set
                note = f"directive from {source}" + (f"; {problem}" if problem else "")
                try:
                    commit(config, ledger_file, fresh, ctx.job_id, Holding(decision.gpus, decision.policy, time.time(), note), log,
                           ctx.slurm_gpus, paired_order(graph, decision.gpus))
                except ClaimTaken as taken:
                    claim_races += 1
                    if claim_races <= MAX_CLAIM_RACES:
                        log(f"job {ctx.job_id}: {taken}; choosing again")
                        decision = None
                        continue
                    log(f"job {ctx.job_id}: {taken}, {claim_races} times; it keeps the provisional GPUs {','.join(map(str, provisional))}")
                    decision = dataclasses.replace(decision, gpus=provisional)
                forget_ended(config, ended, leftovers, listed_at, log, ctx.job_id)
        except TimeoutError:
            log(f"job {ctx.job_id}: LEDGER LOCK TIMEOUT at commit; it keeps the provisional GPUs {','.join(map(str, provisional))}")
            decision = fallback_decision(ctx, Ledger(), size, "ledger-lock-timeout")
            decision = dataclasses.replace(decision, gpus=provisional)
    log(f"job {ctx.job_id} on {ctx.node}: {decision.text()} (directive {directive.normalised()!r} from {source}; "
        f"Slurm gave {','.join(map(str, ctx.slurm_gpus))})" + (f"; FALLBACK because {problem or decision.fallback}" if decision.fallback else ""))
    entry = journal_decision(ctx, directive, decision, config, log)
    if defer is not None:
        defer(lambda: None)  # mapa-agent writes the journal's records after answering, off the start path
    else:
        # No agent: write it now, within the budget (the journal keeps it if slurmctld does not answer).
        if entry is not None and flush_entry(config, ctx.job_id, entry, run, log):
            journal.remove(config.journal, ctx.job_id)
        reconcile_if_due(config, ctx.node, size, run, log, budget)
    return decision


def journal_decision(ctx: PrologContext, directive: "Directive", decision: Decision, config: HookConfig, log: Log) -> journal.Entry | None:
    """Keep the AdminComment record on disk until it is written (journal.py)."""
    try:
        entry = journal.Entry(ctx.node, ctx.nodes_in_job, f"{directive.as_comment()} # {decision.text()}")
        journal.write(config.journal, ctx.job_id, entry)
        return entry
    except (OSError, ValueError, MapaError) as error:
        log(f"job {ctx.job_id}: could not journal the decision for the AdminComment ({error}); not recorded")
        return None


def flush_entry(config: HookConfig, job_id: str, entry: journal.Entry, run: RunCommand, log: Log) -> bool:
    """Write a journal entry's record into the job's AdminComment. True when the entry is done
    with (written, already there, or never writable: the job is gone, it would not fit); False
    to try again later (slurmctld did not answer)."""
    from .decision import record_directive

    directive = record_directive(entry.record)
    decision = parse_decisions(entry.record).get(entry.node)
    if directive is None or decision is None:
        log(f"job {job_id}: journal entry {entry.record[:80]!r} is not a decision record; dropped")
        return True
    ctx = PrologContext(job_id=job_id, node=entry.node, slurm_gpus=(), env_comment="", nodes_in_job=entry.nodes_in_job)
    return record_decision(ctx, directive, decision, config, run, log)


def flush_note(config: HookConfig, job_id: str, entry: journal.Entry, run: RunCommand, log: Log) -> bool:
    """Add an isolation note (journal.py) to this node's decision in the job's AdminComment. True
    when done with (written, or never writable), False to try again later: slurmctld did not
    answer, or the decision itself is still in the journal."""
    from .decision import record_directive

    fields = dict(token.partition("=")[::2] for token in entry.record.split())
    state, why = fields.get("isolation", ""), fields.get("why", "")
    if state not in ISOLATION_STATES:
        log(f"job {job_id}: journal note {entry.record[:80]!r} is not an isolation note; dropped")
        return True
    try:
        job = parse_job_json(run(show_job_argv(config.scontrol, job_id)), job_id)
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
        if journal.is_pending(config.journal, job_id):
            return False  # the decision goes first; the note follows it
        log(f"job {job_id}: the AdminComment has no decision of node {entry.node} to note isolation={state} in; "
            "it stays in this node's log only")
        return True
    noted = dataclasses.replace(decision, isolation=state, why=why)
    ctx = PrologContext(job_id=job_id, node=entry.node, slurm_gpus=(), env_comment="", nodes_in_job=2)  # 2: read back
    return record_decision(ctx, directive, noted, config, run, log)


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


def record_decision(
    ctx: PrologContext, directive: "Directive", decision: Decision, config: HookConfig, run: RunCommand, log: Log
) -> bool:
    """Add this node's decision to the job's AdminComment, so that sacct keeps it.

    The AdminComment is read afresh each time, so what an admin wrote there meanwhile is kept
    (with_decision keeps every text that is not MAPA's). The Prologs of a multi-node job run at
    once and each rewrites the whole AdminComment, so a write can drop another node's decision:
    for those jobs, read back and write again (merged) until ours is there, a few times at most.
    """
    job_id = ctx.job_id
    for attempt in range(4):
        try:
            if attempt:
                time.sleep(0.05 * attempt + random.random() * 0.1)
            job = parse_job_json(run(show_job_argv(config.scontrol, job_id)), job_id)
            admin = job.get("admin_comment") or ""
            admin = admin if isinstance(admin, str) else ""
            recorded = parse_decisions(admin).get(decision.node)
            if recorded is not None and (recorded.gpus, recorded.policy) == (decision.gpus, decision.policy) and (
                    recorded.isolation == decision.isolation or not decision.isolation):
                return True
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
        if not ctx.slurm_gpus or os.path.lexists(jobfiles.job_file_path(config.jobs_dir, ctx.job_id)):
            return
        size = size_without_topology(ctx, config)
        gpus = record_provisional(ctx, config, size, Budget(config.prolog_budget / 4 + COMMIT_RESERVE_S), log)
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


def _pid_in_a_job(pid: int) -> bool:
    """Whether a process runs inside a Slurm job (its environment names one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return b"SLURM_JOB_ID=" in handle.read(1 << 16)
    except OSError:
        return True  # gone, or not ours to read: do not blame the GPU


def gpu_health_probe(config: HookConfig, kfd: Path = Path("/dev/kfd")) -> Callable[[], dict[int, tuple[str, ...]]] | None:
    """The GPUs to leave out as the driver's library sees them (NVML; AMD SMI on nodes with the
    amdgpu driver's /dev/kfd), when the config asks for it and the library is there."""
    if config.health == "off":
        return None
    if kfd.exists():
        from ..hardware.amd import health_probe

        return health_probe(_pid_in_a_job)
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return None

    def probe() -> dict[int, tuple[str, ...]]:
        from ..hardware.nvml import health, load_pynvml, nvml_session

        with nvml_session(load_pynvml()) as nvml:
            return health(nvml, job_pids=_pid_in_a_job).problems

    return probe
