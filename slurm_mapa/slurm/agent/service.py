"""``mapa-agent``: a resident process per node that runs the Prolog and Epilog for the hooks.

A Prolog started cold pays for Python and the engine's imports on every job (about 0.2 s on a
small machine); the agent pays once and keeps topologies and search tables warm. The hook
wrapper asks it through :mod:`slurm_mapa.slurm.agent.client` and runs the hook in-process when
there is no agent, so the agent only makes things faster: the decision, the ledger, the log and
the AdminComment are the same code and the same files either way.

Only root may ask (the socket lives in a root-only directory and the peer's uid is checked), a
request carries only the few SLURM_* variables the hooks read, and it is parsed strictly and
bounded in size and in time (one deadline for the whole request, however slowly it trickles in).
A client that goes away before the decision is written (slurmd killed the Prolog) gets nothing
more written: its job keeps the provisional choice the Prolog recorded first, and the wrapper's
in-process run decides again.

The TaskProlog, as the job's user, asks on a second socket that anyone may use and that takes
only ``isolate`` requests: the agent isolates the asking task's GPU devices (slurm/isolation/),
judging the caller by its pid and its task's cgroup, never by what the request says.

A burst of Prologs (32 or more jobs allocated at once) queues in a deep listen backlog instead of
falling back; past MAX_HANDLERS concurrent requests a client is told ``error busy`` at once and
runs the hook in-process. The agent answers within the Prolog's configured budget
(``prolog_budget``), well inside the client's ANSWER_TIMEOUT_S.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from ...errors import InputError, MapaError, OneLineParser, error_line
from ..node_state import NodeState
from ..isolation import spank_plugin
from .background import Background
from .client import DEFAULT_SOCKET, ISOLATE_SOCKET
from .server import LogLimiter, serve, serve_isolation
from ..text.commands import Runner
from ..config import HookConfig, hook_logger, load_hook_config
from ..hooks.epilog import epilog_failing_open
from ..hooks.prolog import prolog_failing_open
from ..isolation.isolator import Isolator, Outcome, effective_mode, job_devices_for
from ..isolation.rules import IsolationError
from ..isolation.task_records import TaskRecords, tasks_dir_of

MAX_ENDED_JOBS = 4096  # the Epilogs remembered (has_ended): far more than a records loop lags behind
CONFIG_WARNING_INTERVAL_S = 60.0  # a config gone bad while the agent runs: said at most this often


def config_refusal(config_path: str) -> str | None:
    """Why the config at ``config_path`` is one the hooks cannot use (they would fall back to
    Slurm's GPUs for every job), as `mapa hooks` says it: one line naming the file, what is wrong
    (the key, for a key) and what is accepted; None for a usable config."""
    from ..config import load_admin_config

    try:
        load_admin_config(config_path, option="--config")
    except MapaError as error:
        return str(error)
    return None

if TYPE_CHECKING:
    from .metrics import AgentMetrics

class Agent:
    """Runs hooks for requests; the config is read again for each, so an edit applies at once."""

    def __init__(
        self,
        config_path: str,
        log_errors: Callable[[str], None] | None = None,
        run: Callable[[float], Callable[[list[str]], str]] = lambda timeout: Runner(timeout=timeout),
        node: str | None = None,
        isolator: Isolator | None = None,
        metrics: "AgentMetrics | None" = None,
        task_records: TaskRecords | None = None,
    ) -> None:
        self.config_path = config_path
        self.node = node or os.uname().nodename.split(".")[0]
        self.isolator = isolator or Isolator()  # tests give one reading a fake /proc
        self.isolated: set[tuple[str, str, str]] = set()  # (job, step, asker) whose isolation was logged
        self.noted: set[tuple[str, str]] = set()  # (job, state) whose failed isolation was journaled
        self.log_errors = log_errors or (lambda text: print(text, file=sys.stderr, flush=True))
        # Prometheus metrics ([metrics] in mapa.toml, agent/metrics.py): counted in memory, None when off.
        self.metrics = metrics
        self.make_runner = metrics.instrument(run) if metrics is not None else run  # tests give a fake Slurm here
        self.background: Background | None = None  # started by main(); tests drive it directly
        self.public_log = LogLimiter()  # failures of the public socket's requests, per uid
        self.config_log = LogLimiter(burst=1, interval=CONFIG_WARNING_INTERVAL_S)  # a config gone bad (check_config)
        # Root's word to the TaskProlog that the SPANK plugin's request isolated a task (main()
        # keeps them beside the isolate socket; None: none written, every TaskProlog asks itself).
        self.task_records = task_records
        # Jobs whose Epilog this agent ran: slurmctld takes no AdminComment update of a finished job,
        # so a record still waiting for one is not sent (a burst of short jobs; docs/benchmarks.md).
        self._ended: dict[str, None] = {}
        self._ended_lock = threading.Lock()

    def run_hook(
        self,
        kind: str,
        env: Mapping[str, str],
        still_wanted: Callable[[], bool],
        defer: Callable[[Callable[[], None]], None] | None = None,
        requester_pid: int | None = None,
    ) -> None:
        config_env = {"MAPA_CONFIG": self.config_path}  # read again for each job: an edit applies at once
        self.check_config()
        job_id = env.get("SLURM_JOB_ID", "")
        if kind == "prolog":
            with self._ended_lock:
                self._ended.pop(job_id, None)  # a requeued job runs again under its id
            prolog_failing_open(env, config_env, self.make_runner, " (in mapa-agent)",
                                still_wanted=still_wanted, defer=defer, requester_pid=requester_pid)
        else:
            epilog_failing_open(env, config_env, " (in mapa-agent)")
            self._remove_task_records(job_id)
            if job_id.isdigit() and len(job_id) <= 20:
                with self._ended_lock:
                    self._ended[job_id] = None
                    while len(self._ended) > MAX_ENDED_JOBS:
                        del self._ended[next(iter(self._ended))]

    def check_config(self) -> None:
        """Say on stderr (the agent's journal), at most once a minute, that the config went bad
        while the agent runs: the line main() refuses to start with. The hooks fail open on it as
        before (every job gets Slurm's GPUs, its record says bad-config). Never raises."""
        try:
            _, problem = load_hook_config({"MAPA_CONFIG": self.config_path})  # a usable one: reused for a second
            if not problem:
                return
            held = self.config_log.line("config", "")  # "", or " (N more like it not logged)"; None: said this minute
            if held is None:
                return
            why = config_refusal(self.config_path) or problem.removeprefix("bad-config: ")
            self.log_errors(f"mapa-agent: error: {why}; every job on this node gets Slurm's GPUs until it is fixed "
                            f"(said at most once a minute{'; ' + held.strip(' ()') if held else ''})")
        except Exception as error:  # noqa: BLE001 - a warning must not disturb a request
            self.log_errors(f"mapa-agent: could not check {self.config_path}: {error!r}")

    def has_ended(self, job_id: str) -> bool:
        """Whether this agent ran the job's Epilog (since its last Prolog here)."""
        with self._ended_lock:
            return job_id in self._ended

    def isolate(self, pid: int, uid: int, env: Mapping[str, str], public: bool = False) -> str:
        """The answer to a TaskProlog's isolate request from process ``pid`` of user ``uid``
        (``public``: on the socket anyone may use; its failures are logged at a bounded rate)."""
        answer = self._isolate(pid, uid, env, public)
        if self.metrics is not None:
            self.metrics.isolation(answer)
        return answer

    def _isolate(self, pid: int, uid: int, env: Mapping[str, str], public: bool) -> str:
        config, problem = load_hook_config({"MAPA_CONFIG": self.config_path}, validate=False)
        log = hook_logger(config.log)
        if problem:
            log(f"isolation: not applied, the config is unusable ({problem})")
        if uid != 0 and env.get("MAPA_SPANK_CLAIM") == "1":
            # The task's environment said the SPANK plugin had isolated it, but no record of ours
            # says so: a user's own MAPA_SPANK_ISOLATION (or an earlier release's plugin).
            self.public_log.say(("claim", uid), f"isolation: task of process {pid} (uid {uid}) claimed SPANK isolation "
                                "that the agent did not record", log)
        mode, _ = effective_mode(config, self.node)
        if mode == "off":
            return "done off"
        job_id = None
        try:
            outcome = self.isolator.isolate(pid, uid, env, job_devices_for(config, self.node), config.isolation_scope,
                                            NodeState.of(config).job_of_sluid)
        except IsolationError as error:
            reason, job_id = str(error), error.job_id
            if error.unknown_job and self.background is not None:
                # A task of a job with no mark here: the job holds GPUs the ledger does not know.
                # Adopt it now rather than at the next reconcile pass.
                self.background.reconcile_soon.set()
        except InputError as error:
            reason = str(error)
        except Exception as error:  # noqa: BLE001 - a bug must not decide whether the task runs
            reason = f"internal error: {error!r}"
        else:
            asker = "root (the SPANK plugin)" if uid == 0 else "the TaskProlog"
            if (outcome.job_id, outcome.step, asker) not in self.isolated:  # once per step and asker, not per task
                if len(self.isolated) > 10000:
                    self.isolated.clear()
                self.isolated.add((outcome.job_id, outcome.step, asker))
                log(f"isolation: {outcome.state}: {outcome.detail} (asked by {asker})")
            if uid == 0 and env.get("MAPA_STEP_ENV") == "1":
                self._record_task(pid, outcome, log)
            return f"done {outcome.state} {outcome.detail}"
        answer = self._isolation_failed(mode, self._limited(log, uid) if public else log, reason, pid, uid)
        if job_id is not None:
            self.note_isolation(config, log, job_id, "refused" if answer.startswith("error") else "failed-open", reason)
        return answer

    def _record_task(self, pid: int, outcome: Outcome, log: Callable[[str], None]) -> None:
        """Tell the task's TaskProlog, through a file only root can write, that the SPANK plugin's
        request isolated it (its own request would get the same answer under isolation_scope
        "step"). The plugin asks from the task process itself, so ``pid`` is the task's. Only this
        release's plugin (MAPA_STEP_ENV=1) names the step's GPUs; an earlier one's task asks itself."""
        if self.task_records is None or not outcome.state.startswith("cgroup-"):
            return
        try:
            self.task_records.write(pid, outcome.job_id, outcome.step, outcome.state, outcome.gpus)
        except (OSError, ValueError, MapaError) as error:  # its TaskProlog then asks for itself
            self.public_log.say(("task records",), f"isolation: could not record task {pid} of job {outcome.job_id} in "
                                f"{self.task_records.directory} ({error}); its TaskProlog asks the agent itself", log)

    def _remove_task_records(self, job_id: str) -> None:
        """At the job's end (its Epilog): its tasks' records go."""
        if self.task_records is not None and job_id.isdigit():
            try:
                self.task_records.remove_job(job_id)
            except Exception as error:  # noqa: BLE001 - the periodic pass removes them once their tasks are gone
                self.log_errors(f"mapa-agent: could not remove the task records of job {job_id[:20]}: {error}")

    def sweep_task_records(self) -> int:
        """Remove the records of task processes that are gone (Background's periodic pass)."""
        return self.task_records.remove_gone() if self.task_records is not None else 0

    def note_isolation(self, config: HookConfig, log: Callable[[str], None], job_id: str, state: str, reason: str) -> None:
        """Journal a note for the job's AdminComment (its first failure on this node only: every
        task of the job fails alike); the background thread writes it after the decision."""
        from ..node_state import Entry
        from ..text.decision import why_token

        if (job_id, state) in self.noted:
            return
        if len(self.noted) > 10000:
            self.noted.clear()
        self.noted.add((job_id, state))
        try:
            NodeState.of(config).note(job_id, Entry(self.node, 0, f"isolation={state} why={why_token(reason)}"))
        except (OSError, ValueError, MapaError) as error:
            log(f"job {job_id}: could not journal the isolation note for the AdminComment ({error}); it is in this log only")
            return
        if self.background is not None:
            self.background.wake.set()

    def sweep_isolation(self) -> dict[str, int]:
        """Isolate the tasks that started while no agent answered (Isolator.sweep_v1), and say so in
        the log and in each such job's AdminComment (isolation=failed-open: they ran without it
        until now). Run at the agent's start and with every reconcile pass."""
        config, _ = load_hook_config({"MAPA_CONFIG": self.config_path}, validate=False)
        mode, _ = effective_mode(config, self.node)
        if mode == "off":
            return {}
        moved = self.isolator.sweep_v1(job_devices_for(config, self.node))
        log = hook_logger(config.log)
        for job_id, count in sorted(moved.items()):
            reason = (f"{count} process(es) of its tasks started while no mapa-agent answered and ran without isolation "
                      "until the agent moved them into the job's devices cgroup")
            log(f"isolation: job {job_id}: {reason}")
            self.note_isolation(config, log, job_id, "failed-open", reason)
        return moved

    def isolation_failed(self, reason: str, pid: int, uid: int) -> str:
        """The answer to a public isolate request that could not even be read: as the mode says."""
        config, _ = load_hook_config({"MAPA_CONFIG": self.config_path}, validate=False)
        mode, _ = effective_mode(config, self.node)
        if mode == "off":
            return "done off"
        answer = self._isolation_failed(mode, self._limited(hook_logger(config.log), uid), reason, pid, uid)
        if self.metrics is not None:
            self.metrics.isolation(answer)
        return answer

    def _limited(self, log: Callable[[str], None], uid: int) -> Callable[[str], None]:
        return lambda text: self.public_log.say(uid, text, log)

    def job_of(self, pid: int, uid: int | None = None) -> str | None:
        """The Slurm job whose task cgroup process ``pid`` (of ``uid``) is in, None if none: the
        public socket's cheap first check, before a thread or a log line is spent on it. It reads
        the cgroups as the isolator does (cgroups.slurm_cgroup_of: only cgroups slurmd made), so
        that nobody is charged to another job's share: a v1 path of another uid, a v1 or v2 job
        cgroup a user owns (a subtree systemd delegated to them, named like a job's)."""
        from ..isolation.cgroups import read_mounts, read_proc_cgroup, slurm_cgroup_of
        from ..isolation.rules import IsolationError

        try:
            cgroup = slurm_cgroup_of(read_proc_cgroup(self.isolator.proc, pid), read_mounts(self.isolator.mountinfo))
        except (OSError, IsolationError):
            return None
        if cgroup is None:
            return None
        if cgroup.version == 1 and uid not in (None, 0) and cgroup.uid not in (None, uid):
            return None
        return cgroup.job_id or cgroup.sluid

    @staticmethod
    def _isolation_failed(mode: str, log: Callable[[str], None], reason: str, pid: int, uid: int) -> str:
        reason = " ".join(reason.split())[:900]
        if mode == "fail-closed":
            log(f"isolation: refused the task of process {pid} (uid {uid}), as isolation = \"fail-closed\": {reason}")
            return f"error {reason}"
        log(f"isolation: the task of process {pid} (uid {uid}) runs without it (isolation = \"fail-open\"): {reason}")
        return f"done failed-open {reason}"

    def note_prolog(self, env: Mapping[str, str], started_wall: float, started: float) -> None:
        """Count a Prolog the agent ran, once its answer is back with slurmd: its outcome from the
        job's ledger entry (one read of a local file; the decision itself is not changed), how long
        it took, and whether it overran its budget. A CPU-only job, or one whose entry is gone
        already (it ended), is not counted. Never raises."""
        if self.metrics is None:
            return
        answered = time.monotonic()
        try:
            from ...core.policies import all_policies
            from ..hooks.job_context import context_from_env
            from ..hooks.node_graph import load_graph

            config, _ = load_hook_config({"MAPA_CONFIG": self.config_path}, validate=False)
            self.metrics.policy = config.policy
            ctx = context_from_env(env)
            if not ctx.slurm_gpus:
                return
            try:
                size = load_graph(config, ctx.node).size
            except (MapaError, OSError):
                size = 1 << 16  # no topology: the ledger is only checked against a bound
            holding = NodeState.of(config).read_ledger(size).holdings.get(ctx.job_id)
            if holding is None:
                return
            from .metrics import decision_outcome

            self.metrics.decision(decision_outcome(holding.policy, all_policies()), config.policy,
                                  holding.since - started_wall if holding.since >= started_wall else None,
                                  answered - started, config.prolog_budget)
        except Exception as error:  # noqa: BLE001 - counting must never disturb the agent
            self.log_errors(f"mapa-agent: metrics: could not count the Prolog of job {env.get('SLURM_JOB_ID', '')[:20]}: {error}")

    def warm_up(self, node: str) -> None:
        """Load this node's topology and search tables once, so the first job is as fast as the rest;
        compute and store its ring-rate table where none ships (a line says so)."""
        from ...core.policies import select
        from ...hardware.load import resolve_model
        from ..text.directive import parse_directive, to_request
        from ..hooks.node_graph import load_graph
        from ..ring_rate_cache import prepare_table

        config, problem = load_hook_config({"MAPA_CONFIG": self.config_path})
        if problem:
            return
        graph = load_graph(config, node)
        said = prepare_table(graph, config.ring_rates_dir, hook_logger(config.log))
        if said:
            print(f"mapa-agent: {said}", file=sys.stderr, flush=True)
        model = resolve_model(config.model_for(node), graph)
        for text in ("topology=ring sensitive=no", "topology=ring sensitive=yes"):
            for size in range(1, min(graph.size, 3) + 1):
                select(config.policy, graph, range(graph.size), to_request(parse_directive(text), size), model,
                       config.configured_policies())


def log_spank_plugin_problems(config_path: str, environ: Mapping[str, str],
                              running_version_text: Callable[[], str | None] | None = None) -> None:
    """Once at start, into the agent's log: MAPA's SPANK plugin in plugstack.conf that the running
    Slurm would not load (built for another release: slurmstepd skips an optional plugin with only a
    verbose line, and tasks lose their root-side isolation without a word). Never raises."""
    try:
        config, _ = load_hook_config({"MAPA_CONFIG": config_path}, validate=False)
        log = hook_logger(config.log)
        for problem in spank_plugin.check_this_node(environ, running_version_text or spank_plugin.running_slurm_version_text):
            log(f"WARNING: {problem}")
    except Exception as error:  # noqa: BLE001 - a check that informs must not stop the agent
        print(f"mapa-agent: could not check the SPANK plugin ({error})", file=sys.stderr, flush=True)


def start_metrics(config_path: str, node: str) -> "AgentMetrics | None":
    """With ``[metrics] listen`` in the config: the node's metrics, served there (read once, at
    start). None when off, or when they cannot be served (said on stderr; the agent runs on)."""
    config, problem = load_hook_config({"MAPA_CONFIG": config_path}, validate=False)
    if problem or config.metrics_listen is None:
        return None
    from .metrics import AgentMetrics, read_node_gauges

    host, port = config.metrics_listen
    try:
        metrics = AgentMetrics(node, config.policy,
                               state=lambda: read_node_gauges(load_hook_config({"MAPA_CONFIG": config_path}, validate=False)[0], node))
        port = metrics.serve(host, port).server_port
    except ImportError:
        from ...extras import install_hint

        print("mapa-agent: [metrics] listen is set but the prometheus_client module is missing (Debian: "
              f"python3-prometheus-client for the system's Python; or {install_hint('metrics', system_python=False)}); no metrics",
              file=sys.stderr, flush=True)
        return None
    except OSError as error:
        print(f"mapa-agent: cannot serve metrics on {host}:{port} ({error}); no metrics", file=sys.stderr, flush=True)
        return None
    print(f"mapa-agent: metrics on http://{f'[{host}]' if ':' in host else host}:{port}/metrics", file=sys.stderr, flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from ... import version_text

    parser = OneLineParser(prog="mapa-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_text("mapa-agent"))
    parser.add_argument("--config", default=os.environ.get("MAPA_CONFIG", "/etc/slurm/mapa.toml"), help="the hooks' config (default %(default)s)")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="where to listen (default %(default)s)")
    parser.add_argument("--isolate-socket", default=ISOLATE_SOCKET,
                        help="where TaskPrologs ask for GPU isolation, open to every user (default %(default)s)")
    parser.add_argument("--node", default=os.uname().nodename.split(".")[0], help="this node's Slurm name, for the warm-up (default: the host name)")
    try:
        args = parser.parse_args(argv)
    except InputError as error:
        print(error_line("mapa-agent", error), file=sys.stderr)
        return 2
    os.umask(0o022)  # whatever started us: nothing the hooks create may be writable by others
    if os.geteuid() != 0:
        print("mapa-agent: must run as root, like the Prolog it replaces", file=sys.stderr)
        return 2
    # A config the hooks cannot use (missing, not UTF-8, bad TOML, a misspelled key, ...) would have
    # every job on this node fall back to Slurm's GPUs: refuse to start (systemd shows the unit failed).
    refusal = config_refusal(args.config)
    if refusal is not None:
        print(f"mapa-agent: error: {refusal}", file=sys.stderr, flush=True)
        return 2
    agent = Agent(args.config, node=args.node, metrics=start_metrics(args.config, args.node),
                  task_records=TaskRecords(tasks_dir_of(args.isolate_socket)))
    try:
        agent.warm_up(args.node)
    except Exception as error:  # noqa: BLE001 - a cold cache is only slower
        print(f"mapa-agent: warm-up for node {args.node} failed ({error}); continuing cold", file=sys.stderr)
    try:
        server = serve(args.socket, agent)
    except (InputError, OSError) as error:
        print(f"mapa-agent: cannot listen on {args.socket}: {error}", file=sys.stderr)
        return 2
    try:
        isolation_server = serve_isolation(args.isolate_socket, agent)
    except (InputError, OSError) as error:  # the hooks still work; a TaskProlog asking gets no answer
        print(f"mapa-agent: cannot listen on {args.isolate_socket} ({error}); no GPU isolation", file=sys.stderr)
    else:
        threading.Thread(target=isolation_server.serve_forever, daemon=True, name="mapa-agent isolation").start()
    agent.background = Background(agent, args.node)
    if agent.metrics is not None:
        agent.metrics.features = lambda: agent.background.features.published if agent.background is not None else None
        agent.metrics.health = lambda: dict(agent.background.health.healthy) if agent.background is not None else {}
    agent.background.start()
    # In a thread of its own: Slurm's commands (bounded timeouts) must not hold up the start.
    threading.Thread(target=log_spank_plugin_problems, args=(args.config, dict(os.environ)), daemon=True,
                     name="mapa-agent SPANK check").start()
    print(f"mapa-agent: listening on {args.socket} (config {args.config})", file=sys.stderr, flush=True)
    with server:
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
