"""The Prolog and Epilog: choose a job's GPUs on this node, record them, release them.

Run by slurmd as root with no PATH, through the wrappers `mapa hooks` writes (see docs/admin.md),
either in-process or inside the node's mapa-agent (slurm/agent.py):

    Prolog=/usr/local/sbin/mapa-prolog-wrapper     PrologFlags=Alloc
    Epilog=/usr/local/sbin/mapa-epilog-wrapper
    TaskProlog=/usr/local/sbin/mapa-taskprolog

They fail open: whatever goes wrong (no topology, a bad config, an unreadable ledger, a slow
scontrol), the job still gets GPUs (Slurm's own indices if the ledger has them free, else the
lowest free ones), the reason goes to the log and the job's AdminComment, and the hook exits 0.
A Prolog that exits non-zero would drain the node and hold the job.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..core.effbw import load_model_file, paper_model
from ..core.hardware import HardwareGraph
from ..core.policies import Allocation, select
from ..errors import MapaError
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
)
from .config import HookConfig, hook_logger, load_hook_config
from .decision import Decision, parse_decisions, with_decision
from .directive import Directive, parse_comment, parse_directive, parse_directive_lines, to_request
from .ledger import Holding, Ledger, LedgerCorrupt, LedgerFile, prolog_mark_path

JOB_FILE_MAX_BYTES = 4096
RunCommand = Callable[[Sequence[str]], str]


# --- the Prolog -----------------------------------------------------------------------------


@dataclass
class PrologContext:
    job_id: str
    node: str
    slurm_gpus: tuple[int, ...]
    env_comment: str
    nodes_in_job: int = 1
    admin_comment: str | None = None  # as read while looking for the directive


def context_from_env(env: Mapping[str, str]) -> PrologContext | None:
    """None when the job has no GPUs on this node (nothing to do)."""
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME", "")
    if not is_job_id(job_id) or not node or len(node) > 255:
        raise ValueError(f"SLURM_JOB_ID {job_id!r} / SLURMD_NODENAME {node!r} are not what slurmd sets")
    gpus = parse_gpu_indices(env.get("SLURM_JOB_GPUS", ""))
    if not gpus:
        return None
    nodes = env.get("SLURM_JOB_NUM_NODES", "1")
    return PrologContext(
        job_id=job_id,
        node=node,
        slurm_gpus=gpus,
        env_comment=env.get("SLURM_JOB_COMMENT", "")[:8192],
        nodes_in_job=int(nodes) if nodes.isdigit() else 2,
    )


def read_directive(ctx: PrologContext, config: HookConfig, run: RunCommand, log: Callable[[str], None]) -> tuple[Directive, str]:
    """The job's directive and where it came from: comment, AdminComment, batch script or site default."""
    from_comment = parse_comment(ctx.env_comment)
    if from_comment is not None:
        return from_comment, "comment"
    try:
        job = parse_job_json(run(show_job_argv(config.scontrol, ctx.job_id)))
        admin = job.get("admin_comment") or ""
        ctx.admin_comment = admin if isinstance(admin, str) else ""
        parsed = parse_comment(admin.split("#")[0]) if isinstance(admin, str) else None
        if parsed is not None:
            return parsed, "admin_comment"
        if not job.get("batch_flag", True):
            return parse_directive(config.default_directive), "default"
    except CommandFailed as error:
        log(f"job {ctx.job_id}: scontrol show job failed ({error}); reading the batch script")
    try:
        from_script = parse_directive_lines(run(batch_script_argv(config.scontrol, ctx.job_id)))
        if from_script is not None:
            return from_script, "script"
    except CommandFailed as error:
        log(f"job {ctx.job_id}: no batch script ({error}); using the site default")
    return parse_directive(config.default_directive), "default"


def load_graph(config: HookConfig, node: str) -> HardwareGraph:
    from ..hardware.load import load_topology

    spec = config.topology_for(node)
    if spec is None:
        raise MapaError(f"no [nodes] entry of the config matches node {node!r}")
    return load_topology(spec)


def fallback_gpus(slurm_gpus: tuple[int, ...], free: tuple[int, ...]) -> tuple[int, ...]:
    """Slurm's own indices when the ledger has them all free, else the lowest free ones."""
    if set(slurm_gpus) <= set(free):
        return slurm_gpus
    if len(free) >= len(slurm_gpus):
        return free[: len(slurm_gpus)]
    return slurm_gpus  # the ledger disagrees with Slurm; Slurm's count is the authority


def choose(
    ctx: PrologContext,
    config: HookConfig,
    graph: HardwareGraph | None,
    directive: Directive,
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
            request = to_request(directive, len(ctx.slurm_gpus))
            model = load_model_file(config.model) if config.model else paper_model()
            result = select(config.policy, graph, free, request, model, config.configured_policies(), running)
            if isinstance(result, Allocation):
                p = result.placement
                return Decision(
                    ctx.node, p.gpus, config.policy, p.effective_bandwidth, p.aggregated_bandwidth, p.preserved_bandwidth,
                    free=free, running=running,
                )
            problem = "ledger-has-too-few-free-gpus"
        except (MapaError, OSError) as error:
            problem = "bad-directive-or-model: " + str(error)
    token = problem.split(":")[0].replace(" ", "-") or "unknown"
    return Decision(ctx.node, fallback_gpus(ctx.slurm_gpus, free), "fallback", fallback=token, free=free, running=running)


def job_file_text(gpus: Sequence[int]) -> str:
    return f"MAPA_GPUS={','.join(map(str, gpus))}\n"


def _replace_file(target: Path, text: str) -> None:
    """Write ``target`` whole or not at all (a reader never sees half of it), mode 644."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    tmp.write_text(text)
    os.chmod(tmp, 0o644)  # the TaskProlog reads job files as the job's user
    os.replace(tmp, target)


def write_job_file(jobs_dir: Path, job_id: str, gpus: Sequence[int]) -> None:
    _replace_file(jobs_dir / job_id, job_file_text(gpus))


def read_job_files(jobs_dir: Path, size: int) -> Ledger:
    """Rebuild holdings from the per-job files (used when the ledger file is corrupt)."""
    holdings: dict[str, Holding] = {}
    taken: set[int] = set()
    if not jobs_dir.is_dir():
        return Ledger()
    for path in sorted(jobs_dir.iterdir()):
        if not is_job_id(path.name):
            continue
        try:
            text = path.read_text()[:JOB_FILE_MAX_BYTES]
            gpus = parse_gpu_indices(text.strip().partition("=")[2])
        except (OSError, ValueError):
            continue
        if all(0 <= g < size for g in gpus) and not taken & set(gpus):
            taken |= set(gpus)
            holdings[path.name] = Holding(gpus=gpus, policy="recovered", since=path.stat().st_mtime)
    return Ledger(holdings)


def write_prolog_mark(jobs_dir: Path, job_id: str, pid: int) -> None:
    """Say "this job's Prolog is running, as process ``pid``", so that a concurrent Prolog does not
    take the job for one whose Prolog died (and block the GPUs Slurm counted for it)."""
    _replace_file(prolog_mark_path(jobs_dir, job_id), f"{pid}\n")


def prolog_running(jobs_dir: Path, job_id: str) -> bool:
    """Whether the job's Prolog is still running (its mark names a live process)."""
    try:
        text = prolog_mark_path(jobs_dir, job_id).read_text()[:32].strip()
    except OSError:
        return False
    if not text.isdigit() or int(text) <= 1:
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_prolog_mark(jobs_dir: Path, job_id: str) -> None:
    try:
        prolog_mark_path(jobs_dir, job_id).unlink()
    except OSError:
        pass


def run_prolog(
    env: Mapping[str, str],
    config: HookConfig,
    run: RunCommand,
    log: Callable[[str], None],
    config_problem: str = "",
    unhealthy_gpus: Callable[[], dict[int, tuple[str, ...]]] | None = None,
    still_wanted: Callable[[], bool] | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
    requester_pid: int | None = None,
) -> Decision | None:
    """Choose, record and write the job's GPUs.

    ``still_wanted`` (the agent's) says whether the Prolog that asked is still waiting; if not,
    nothing is written (the next Prolog adopts the job, see adopt_unknown_jobs). ``defer`` (the
    agent's) takes the AdminComment write off the job's start: the agent answers first.
    ``requester_pid``: the process slurmd started for this Prolog (the agent's client), else this one.
    """
    ctx = context_from_env(env)
    if ctx is None:
        return None
    try:
        write_prolog_mark(config.jobs_dir, ctx.job_id, requester_pid or os.getpid())
    except OSError as error:
        log(f"job {ctx.job_id}: cannot write its Prolog mark ({error}); concurrent Prologs may hold its Slurm GPUs meanwhile")
    try:
        return _run_prolog(ctx, config, run, log, config_problem, unhealthy_gpus, still_wanted, defer)
    finally:
        remove_prolog_mark(config.jobs_dir, ctx.job_id)


def _run_prolog(
    ctx: PrologContext,
    config: HookConfig,
    run: RunCommand,
    log: Callable[[str], None],
    config_problem: str,
    unhealthy_gpus: Callable[[], dict[int, tuple[str, ...]]] | None,
    still_wanted: Callable[[], bool] | None,
    defer: Callable[[Callable[[], None]], None] | None,
) -> Decision | None:
    # squeue runs while the directive is read; reaping keeps entries written after it started.
    listing = RunningJobs(run, config.squeue, ctx.node)
    unhealthy: frozenset[int] = frozenset()
    if unhealthy_gpus is not None:
        try:
            problems = unhealthy_gpus()
            unhealthy = frozenset(problems)
            for gpu, reasons in sorted(problems.items()):
                log(f"job {ctx.job_id}: leaving out GPU {gpu}: {'; '.join(reasons)}")
        except Exception as error:  # noqa: BLE001 - a health probe must never stop the job
            log(f"job {ctx.job_id}: GPU health check failed ({error}); using every GPU")
    problem = config_problem
    graph: HardwareGraph | None = None
    if not problem:
        try:
            graph = load_graph(config, ctx.node)
        except (MapaError, OSError) as error:
            problem = f"no-topology: {error}"
    size = graph.size if graph is not None else max([*ctx.slurm_gpus, 0]) + 1
    try:
        directive, source = read_directive(ctx, config, run, log)
    except MapaError as error:
        problem = problem or f"bad-directive: {error}"
        directive, source = parse_directive(""), "none"
    ledger_file = LedgerFile(config.ledger, size)
    with ledger_file.locked(timeout=config.command_timeout * 2):
        try:
            ledger = ledger_file.read()
        except LedgerCorrupt as error:
            log(f"job {ctx.job_id}: ledger {config.ledger} is corrupt ({error}); rebuilding it from {config.jobs_dir}")
            ledger = read_job_files(config.jobs_dir, size)
        ledger = ledger.without([ctx.job_id])  # a requeued or re-run Prolog chooses afresh
        try:
            running, listed_at = listing.result()
            ledger, dead = ledger.reaped(running | {ctx.job_id}, listed_at)
            if dead:
                log(f"job {ctx.job_id}: reaped ledger entries of finished jobs {','.join(dead)}")
            ledger = adopt_unknown_jobs(ctx, ledger, running, size, config, run, log)
        except CommandFailed as error:
            log(f"job {ctx.job_id}: squeue failed ({error}); keeping every ledger entry")
        decision = choose(ctx, config, graph, directive, ledger, size, problem, unhealthy)
        if still_wanted is not None and not still_wanted():
            log(f"job {ctx.job_id}: its Prolog went away before the decision was written; nothing written, the job keeps Slurm's GPUs")
            return None
        note = f"directive from {source}" + (f"; {problem}" if problem else "")
        ledger_file.write(ledger.with_job(ctx.job_id, Holding(decision.gpus, decision.policy, time.time(), note)))
        write_job_file(config.jobs_dir, ctx.job_id, decision.gpus)
    log(f"job {ctx.job_id} on {ctx.node}: {decision.text()} (directive {directive.normalised()!r} from {source}; Slurm gave {','.join(map(str, ctx.slurm_gpus))})"
        + (f"; FALLBACK because {problem}" if decision.fallback else ""))
    if defer is not None:
        defer(lambda: record_decision(ctx, directive, decision, config, run, log))
    else:
        record_decision(ctx, directive, decision, config, run, log)
    return decision


class RunningJobs:
    """``squeue`` for the jobs on a node, run in a thread from the moment it is created."""

    def __init__(self, run: RunCommand, squeue: str, node: str) -> None:
        self._outcome: tuple[set[str], float] | CommandFailed = CommandFailed("squeue did not finish")
        self._thread = threading.Thread(target=self._list, args=(run, squeue, node), daemon=True)
        self._thread.start()

    def _list(self, run: RunCommand, squeue: str, node: str) -> None:
        listed_at = time.time()
        try:
            self._outcome = (parse_job_ids(run(running_jobs_argv(squeue, node))), listed_at)
        except CommandFailed as error:
            self._outcome = error
        except Exception as error:  # noqa: BLE001 - reported like a failed squeue, never lost in the thread
            self._outcome = CommandFailed(f"squeue: {error}")

    def result(self) -> tuple[set[str], float]:
        """The running job ids and when they were asked for; raises CommandFailed."""
        self._thread.join()
        if isinstance(self._outcome, CommandFailed):
            raise self._outcome
        return self._outcome


MAX_ADOPTED_PER_PROLOG = 16
_RUNNING_STATES = {"RUNNING", "CONFIGURING", "SUSPENDED"}


def still_running(record: dict) -> bool:
    """Whether a `scontrol --json show job` record is of a job still using its GPUs (no state: assume so)."""
    state = record.get("job_state")
    if state is None:
        return True
    states = {state} if isinstance(state, str) else set(map(str, state)) if isinstance(state, list) else set()
    return bool(states & _RUNNING_STATES) and "COMPLETING" not in states


def adopt_unknown_jobs(
    ctx: PrologContext, ledger: Ledger, running: set[str], size: int, config: HookConfig, run: RunCommand, log: Callable[[str], None]
) -> Ledger:
    """Enter jobs that run here but are not in the ledger, with the GPUs Slurm gave them.

    That happens when a job's Prolog was killed before it recorded anything, or for jobs that
    started before MAPA was enabled: they use Slurm's indices, so those are not free. A job whose
    Prolog is running right now (started with this one) is left to it.
    """
    unknown = sorted(
        (j for j in running - set(ledger.holdings) - {ctx.job_id} if not prolog_running(config.jobs_dir, j)), key=int
    )
    for job_id in unknown[:MAX_ADOPTED_PER_PROLOG]:
        try:
            record = parse_job_json(run(show_job_argv(config.scontrol, job_id)))
            gpus = slurm_gpus_on_only_node(record)
        except (CommandFailed, ValueError) as error:
            log(f"job {ctx.job_id}: cannot read job {job_id}, which runs here without a ledger entry ({error})")
            continue
        if not still_running(record):
            continue  # it ended after squeue listed it; its Epilog already freed its entry
        if gpus is None:
            log(f"job {ctx.job_id}: job {job_id} runs here without a ledger entry and spans several nodes; not adopted")
            continue
        held = ledger.held()
        usable = tuple(g for g in gpus if 0 <= g < size and g not in held)
        if usable != gpus:
            log(f"job {ctx.job_id}: job {job_id} has Slurm GPUs {gpus} of which {sorted(set(gpus) - set(usable))} are already held")
        ledger = ledger.with_job(job_id, Holding(usable, "slurm", time.time(), "adopted: ran without a MAPA choice"))
        if usable:
            log(f"job {ctx.job_id}: adopted job {job_id} with Slurm's GPUs {','.join(map(str, usable))} (it ran without a MAPA choice)")
    return ledger


def record_decision(
    ctx: PrologContext, directive: Directive, decision: Decision, config: HookConfig, run: RunCommand, log: Callable[[str], None]
) -> None:
    """Add this node's decision to the job's AdminComment, so that sacct keeps it.

    The Prologs of a multi-node job run at once and each rewrites the whole AdminComment, so a
    write can drop another node's decision: for those jobs, read back and write again (merged)
    until ours is there, a few times at most. A one-node job needs one read and one write.
    """
    job_id = ctx.job_id
    admin = ctx.admin_comment
    for attempt in range(4):
        try:
            if attempt:
                time.sleep(0.05 * attempt + random.random() * 0.1)
            if admin is None:
                admin = str(parse_job_json(run(show_job_argv(config.scontrol, job_id))).get("admin_comment") or "")
            recorded = parse_decisions(admin).get(decision.node)
            if recorded is not None and (recorded.gpus, recorded.policy) == (decision.gpus, decision.policy):
                return
            run(admin_comment_argv(config.scontrol, job_id, with_decision(admin, directive, decision)))
            if ctx.nodes_in_job <= 1:
                return
            admin = None  # read back: another node's Prolog may have written at the same time
        except CommandFailed as error:
            log(f"job {job_id}: could not record the decision in AdminComment ({error})")
            return
    log(f"job {job_id}: the AdminComment kept losing this node's decision; gave up after 4 tries")


# --- entry points ---------------------------------------------------------------------------


def prolog_failing_open(
    env: Mapping[str, str],
    config_env: Mapping[str, str],
    make_runner: Callable[[float], RunCommand] = lambda timeout: Runner(timeout=timeout),
    where: str = "",
    **agent_options,
) -> None:
    """Load the config and run the Prolog; any error is logged, never raised (a failed Prolog
    drains the node). The one body of the in-process Prolog and of mapa-agent's."""
    config, problem = load_hook_config(config_env)
    log = hook_logger(config.log)
    if problem:
        log(f"config problem, every job falls back: {problem}")
    try:
        run_prolog(env, config, make_runner(config.command_timeout), log, problem, nvml_health_probe(config), **agent_options)
    except Exception:  # noqa: BLE001 - fail open: never drain the node
        import traceback

        log(f"prolog internal error{where}, job runs on Slurm's GPUs:\n" + traceback.format_exc())


def prolog_main() -> int:
    prolog_failing_open(os.environ, os.environ)
    return 0


def _pid_in_a_job(pid: int) -> bool:
    """Whether a process runs inside a Slurm job (its environment names one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return b"SLURM_JOB_ID=" in handle.read(1 << 16)
    except OSError:
        return True  # gone, or not ours to read: do not blame the GPU


def nvml_health_probe(config: HookConfig) -> Callable[[], dict[int, tuple[str, ...]]] | None:
    """NVML's view of sick GPUs, when the config asks for it and NVML is there."""
    if config.health == "off":
        return None
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return None

    def probe() -> dict[int, tuple[str, ...]]:
        from ..hardware.nvml import health, load_pynvml, nvml_session

        with nvml_session(load_pynvml()) as nvml:
            return health(nvml, job_pids=_pid_in_a_job).problems

    return probe
