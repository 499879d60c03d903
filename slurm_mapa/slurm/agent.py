"""``mapa-agent``: a resident process per node that runs the Prolog and Epilog for the hooks.

A Prolog started cold pays for Python and the engine's imports on every job (about 0.2 s on a
small machine); the agent pays once and keeps topologies and search tables warm. The hook
wrapper asks it through :mod:`slurm_mapa.slurm.agent_client` and runs the hook in-process when
there is no agent, so the agent only makes things faster: the decision, the ledger, the log and
the AdminComment are the same code and the same files either way.

Only root may ask (the socket lives in a root-only directory and the peer's uid is checked), a
request carries only the few SLURM_* variables the hooks read, and it is parsed strictly and
bounded in size and in time (one deadline for the whole request, however slowly it trickles in).
A client that goes away before the decision is written (slurmd killed the Prolog) gets nothing
more written: its job keeps the provisional choice the Prolog recorded first, and the wrapper's
in-process run decides again.

The TaskProlog, as the job's user, asks on a second socket that anyone may use and that takes
only ``isolate`` requests: the agent isolates the asking task's GPU devices (slurm/isolation.py),
judging the caller by its pid and its task's cgroup, never by what the request says.

A burst of Prologs (32 or more jobs allocated at once) queues in a deep listen backlog instead of
falling back; past MAX_HANDLERS concurrent requests a client is told ``error busy`` at once and
runs the hook in-process. The agent answers within the Prolog's configured budget
(``prolog_budget``), well inside the client's ANSWER_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import socket
import socketserver
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from ..errors import InputError, MapaError
from . import jobfiles, spankcheck
from .agent_client import (DEFAULT_SOCKET, ISOLATE, ISOLATE_KEYS, ISOLATE_SOCKET, KEYS, KINDS, MAX_HEADER_BYTES,
                           MAX_REQUEST_BYTES, MAX_VALUE_BYTES)
from .commands import Runner, is_job_id
from .config import HookConfig, hook_logger, load_hook_config
from .epilog import epilog_failing_open
from .hooks import prolog_failing_open
from .isolation import Isolator, IsolationError, effective_mode, job_devices_for

if TYPE_CHECKING:
    from .metrics import AgentMetrics

# One deadline for reading the whole request: a client that trickles a byte every few seconds
# must not hold a thread (a timeout per recv would let it go on for ever).
REQUEST_READ_TIMEOUT_S = 5.0
# Slurm starts the Prologs of jobs allocated together at the same moment; socketserver's default
# backlog (5) made bursts of 16-32 fall back to the slow in-process path.
LISTEN_BACKLOG = 256
# Each request holds a thread; past this many at once the client is told to run the hook itself.
MAX_HANDLERS = 128
# The public isolate socket: requests of one user (one job) handled at once; more wait their turn
# without a thread, up to PUBLIC_QUEUE_PER_UID; past that, and for callers that are no task of a
# Slurm job on this node, the connection is closed at once. So one user's flood takes at most
# PUBLIC_PER_UID of the MAX_HANDLERS threads, and every other user's tasks are answered.
PUBLIC_PER_UID = 16
PUBLIC_PER_JOB = 8
PUBLIC_QUEUE_PER_UID = 256
PUBLIC_QUEUE_TOTAL = 4096
QUEUED_MAX_AGE_S = 10.0  # the client's own deadline (agent_client.ISOLATE_TIMEOUT_S): older ones gave up
# Log lines about refused public requests: LOG_BURST per caller, then one per LOG_INTERVAL_S.
LOG_BURST = 5
LOG_INTERVAL_S = 10.0


def parse_header(line: bytes, kinds: tuple[str, ...] = KINDS) -> tuple[str, int]:
    """``MAPA1 <kind> <length>`` -> (kind, length). Raises InputError naming what was wrong."""
    parts = line.rstrip(b"\n").split(b" ")
    if len(parts) != 3 or parts[0] != b"MAPA1":
        raise InputError(f"request header {line[:MAX_HEADER_BYTES]!r} is not 'MAPA1 <kind> <length>'")
    kind = parts[1].decode("ascii", "replace")
    if kind not in kinds:
        raise InputError(f"unknown hook kind {kind!r} (accepted: {', '.join(kinds)})")
    if not parts[2].isdigit() or int(parts[2]) > MAX_REQUEST_BYTES:
        raise InputError(f"request length {parts[2][:20]!r} is not a number up to {MAX_REQUEST_BYTES}")
    return kind, int(parts[2])


def parse_payload(payload: bytes, keys: tuple[str, ...] = KEYS) -> dict[str, str]:
    """NUL-separated ``KEY=VALUE`` pairs -> an environment holding only the accepted keys."""
    env: dict[str, str] = {}
    if not payload:
        return env
    for pair in payload.split(b"\0"):
        key, eq, value = pair.partition(b"=")
        name = key.decode("ascii", "replace")
        if not eq or name not in keys:
            raise InputError(f"request variable {name[:40]!r} is not accepted (accepted: {', '.join(keys)})")
        if name in env:
            raise InputError(f"request variable {name} given twice")
        if len(value) > MAX_VALUE_BYTES:
            raise InputError(f"request variable {name} is longer than {MAX_VALUE_BYTES} bytes")
        env[name] = value.decode("utf-8", "surrogateescape")
    return env


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def client_still_there(conn: socket.socket) -> bool:
    """False once the client has closed its end (it was killed, or gave up and runs the hook itself)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    if not poller.poll(0):
        return True
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def read_request(conn: socket.socket, timeout: float = REQUEST_READ_TIMEOUT_S, kinds: tuple[str, ...] = KINDS,
                 keys: tuple[str, ...] = KEYS) -> tuple[str, dict[str, str]]:
    """The request's kind and variables, read within ``timeout`` seconds in all; InputError otherwise."""
    deadline = time.monotonic() + timeout

    def receive(size: int) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise InputError(f"request not complete within {timeout:g} s")
        conn.settimeout(left)
        try:
            return conn.recv(size)
        except TimeoutError:
            raise InputError(f"request not complete within {timeout:g} s") from None

    header = b""
    while not header.endswith(b"\n"):
        chunk = receive(1)
        if not chunk or len(header) >= MAX_HEADER_BYTES:
            raise InputError("request header missing or too long")
        header += chunk
    kind, length = parse_header(header, kinds)
    payload = b""
    while len(payload) < length:
        chunk = receive(min(65536, length - len(payload)))
        if not chunk:
            raise InputError(f"request ended after {len(payload)} of {length} bytes")
        payload += chunk
    return kind, parse_payload(payload, keys)


class LogLimiter:
    """At most ``burst`` lines per key, then one per ``interval`` seconds; the lines held back are
    counted and named in the next line let through. Keys are the callers (a uid), so a flood of
    bad requests costs root's log a line every few seconds, and other callers keep theirs."""

    def __init__(self, burst: int = LOG_BURST, interval: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 10000) -> None:
        self.burst, self.interval, self.clock, self.max_keys = burst, interval, clock, max_keys
        self.tokens: dict[object, tuple[float, float, int]] = {}  # key -> (tokens, when, held back)
        self.lock = threading.Lock()

    def line(self, key: object, text: str) -> str | None:
        """The line to log for ``text`` now (with the count held back), or None to hold it back."""
        now = self.clock()
        with self.lock:
            if key not in self.tokens and len(self.tokens) >= self.max_keys:
                self.tokens.clear()
            tokens, when, held = self.tokens.get(key, (float(self.burst), now, 0))
            tokens = min(float(self.burst), tokens + (now - when) / self.interval)
            if tokens < 1.0:
                self.tokens[key] = (tokens, now, held + 1)
                return None
            self.tokens[key] = (tokens - 1.0, now, 0)
        return text + (f" ({held} more like it not logged)" if held else "")

    def say(self, key: object, text: str, log: Callable[[str], None]) -> None:
        """``log`` the line for ``text`` now, unless it is held back (see line)."""
        line = self.line(key, text)
        if line is not None:
            log(line)


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
    ) -> None:
        self.config_path = config_path
        self.node = node or os.uname().nodename.split(".")[0]
        self.isolator = isolator or Isolator()  # tests give one reading a fake /proc
        self.isolated: set[tuple[str, str, str]] = set()  # (job, step, asker) whose isolation was logged
        self.noted: set[tuple[str, str]] = set()  # (job, state) whose failed isolation was journaled
        self.log_errors = log_errors or (lambda text: print(text, file=sys.stderr, flush=True))
        # Prometheus metrics ([metrics] in mapa.toml, slurm/metrics.py): counted in memory, None when off.
        self.metrics = metrics
        self.make_runner = metrics.instrument(run) if metrics is not None else run  # tests give a fake Slurm here
        self.background: Background | None = None  # started by main(); tests drive it directly
        self.public_log = LogLimiter()  # failures of the public socket's requests, per uid

    def run_hook(
        self,
        kind: str,
        env: Mapping[str, str],
        still_wanted: Callable[[], bool],
        defer: Callable[[Callable[[], None]], None] | None = None,
        requester_pid: int | None = None,
    ) -> None:
        config_env = {"MAPA_CONFIG": self.config_path}  # read again for each job: an edit applies at once
        if kind == "prolog":
            prolog_failing_open(env, config_env, self.make_runner, " (in mapa-agent)",
                                still_wanted=still_wanted, defer=defer, requester_pid=requester_pid)
        else:
            epilog_failing_open(env, config_env, " (in mapa-agent)")

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
        mode, _ = effective_mode(config, self.node)
        if mode == "off":
            return "done off"
        job_id = None
        try:
            outcome = self.isolator.isolate(pid, uid, env, job_devices_for(config, self.node), config.isolation_scope,
                                            lambda sluid: jobfiles.job_of_sluid(config.jobs_dir, sluid))
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
            return f"done {outcome.state} {outcome.detail}"
        answer = self._isolation_failed(mode, self._limited(log, uid) if public else log, reason, pid, uid)
        if job_id is not None:
            self.note_isolation(config, log, job_id, "refused" if answer.startswith("error") else "failed-open", reason)
        return answer

    def note_isolation(self, config: HookConfig, log: Callable[[str], None], job_id: str, state: str, reason: str) -> None:
        """Journal a note for the job's AdminComment (its first failure on this node only: every
        task of the job fails alike); the background thread writes it after the decision."""
        from . import journal
        from .decision import why_token

        if (job_id, state) in self.noted:
            return
        if len(self.noted) > 10000:
            self.noted.clear()
        self.noted.add((job_id, state))
        try:
            journal.write(config.journal, journal.note_name(job_id),
                          journal.Entry(self.node, 0, f"isolation={state} why={why_token(reason)}"))
        except (OSError, ValueError, MapaError) as error:
            log(f"job {job_id}: could not journal the isolation note for the AdminComment ({error}); it is in this log only")
            return
        if self.background is not None:
            self.background.wake.set()

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

    def job_of(self, pid: int) -> str | None:
        """The Slurm job whose task cgroup process ``pid`` is in, None if none: the public socket's
        cheap first check (one small /proc read), before a thread or a log line is spent on it."""
        from .isolation import parse_proc_cgroup, read_proc_cgroup

        try:
            cgroup = parse_proc_cgroup(read_proc_cgroup(self.isolator.proc, pid))
        except OSError:
            return None
        return (cgroup.job_id or cgroup.sluid) if cgroup is not None else None

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
            from ..core.policies import all_policies
            from .job_context import context_from_env
            from .node_graph import load_graph
            from .ledger import LedgerFile

            config, _ = load_hook_config({"MAPA_CONFIG": self.config_path}, validate=False)
            self.metrics.policy = config.policy
            ctx = context_from_env(env)
            if not ctx.slurm_gpus:
                return
            try:
                size = load_graph(config, ctx.node).size
            except (MapaError, OSError):
                size = 1 << 16  # no topology: the ledger is only checked against a bound
            holding = LedgerFile(config.ledger, size).read().holdings.get(ctx.job_id)
            if holding is None:
                return
            from .metrics import decision_outcome

            self.metrics.decision(decision_outcome(holding.policy, all_policies()), config.policy,
                                  holding.since - started_wall if holding.since >= started_wall else None,
                                  answered - started, config.prolog_budget)
        except Exception as error:  # noqa: BLE001 - counting must never disturb the agent
            self.log_errors(f"mapa-agent: metrics: could not count the Prolog of job {env.get('SLURM_JOB_ID', '')[:20]}: {error}")

    def warm_up(self, node: str) -> None:
        """Load this node's topology and search tables once, so the first job is as fast as the rest."""
        from ..core.policies import select
        from ..hardware.load import resolve_model
        from .directive import parse_directive, to_request
        from .node_graph import load_graph

        config, problem = load_hook_config({"MAPA_CONFIG": self.config_path})
        if problem:
            return
        graph = load_graph(config, node)
        model = resolve_model(config.model_for(node), graph)
        for text in ("topology=ring sensitive=no", "topology=ring sensitive=yes"):
            for size in range(1, min(graph.size, 3) + 1):
                select(config.policy, graph, range(graph.size), to_request(parse_directive(text), size), model,
                       config.configured_policies())


MAX_RECORD_AGE_S = 7 * 86400  # a record slurmctld has refused for a week is dropped (and logged)
MAX_BACKOFF_S = 300.0
MIN_RECONCILE_GAP_S = 1.0


class Background:
    """mapa-agent's work off the job-start path, in two threads: reconcile passes (one squeue
    listing per ``reconcile_interval``, with jitter, so that the nodes of a cluster do not ask at
    once), and after starts and ends the node's features (``[features]``, when they changed) and
    the journal's AdminComment records (at most ``admin_comment_rate`` per second, retried with
    back-off while slurmctld does not answer)."""

    def __init__(self, agent: "Agent", node: str, clock: Callable[[], float] = time.monotonic) -> None:
        from .features import Publisher

        self.agent = agent
        self.node = node
        self.clock = clock
        self.wake = threading.Event()
        self.stop = threading.Event()
        # Set when a task of a job unknown here asks for isolation (its Prolog never marked it):
        # the next reconcile pass (which adopts it) runs now, not at its interval.
        self.reconcile_soon = threading.Event()
        self.retry_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self.features = Publisher(node)
        from .dcgm import MappingWriter

        self.dcgm_writer = MappingWriter()  # says each problem of the mapping directory once, not every second

    def _config(self):
        config, problem = load_hook_config({"MAPA_CONFIG": self.agent.config_path}, validate=False)
        return config

    def reconcile_once(self) -> bool:
        from .reconcile import reconcile_node

        config = self._config()
        run = self.agent.make_runner(config.command_timeout)
        log = hook_logger(config.log)
        metrics = self.agent.metrics
        listed = reconcile_node(config, self.node, run, metrics.repair_log(log) if metrics is not None else log)
        if self.features.publish(config, run, log, force=True) and metrics is not None:  # slurmctld may have restarted
            metrics.feature_published()
        return listed

    def publish_features(self) -> bool:
        """After starts and ends: publish the node's features if they changed."""
        config = self._config()
        published = self.features.publish(config, self.agent.make_runner(config.command_timeout), hook_logger(config.log))
        if published and self.agent.metrics is not None:
            self.agent.metrics.feature_published()
        return published

    def write_dcgm_mapping(self) -> list[str]:
        """With ``dcgm_job_mapping_dir``: name in dcgm-exporter's job-mapping files the jobs using
        each GPU as the jobs directory says (MAPA's GPUs, else Slurm's for a job MAPA did not
        place); what changed. Each turn of the records loop (at once after a start or an end, else
        every second), so jobs a reconcile pass reaped drop out too; unchanged files stay as they are."""
        from . import dcgm, jobfiles
        from .node_graph import load_graph

        config = self._config()
        if config.dcgm_job_mapping_dir is None:
            self.dcgm_writer.forget()
            return []
        records, _ = jobfiles.scan(config.jobs_dir)
        holdings = {job: record.gpus if record.gpus is not None else record.mark.slurm_gpus
                    for job, record in records.items()
                    if not record.ended and (record.gpus is not None or record.mark is not None)}
        gpu_count = load_graph(config, self.node).size
        result = self.dcgm_writer.write(config.dcgm_job_mapping_dir, dcgm.mapping_files(holdings, gpu_count))
        for line in result.log_lines():  # new problems, and "solved: ..." when one goes away
            self.agent.log_errors(f"mapa-agent: DCGM job mapping: {line}")
        return list(result.changed)

    def flush_records(self) -> int:
        """Write the journal's due records; how many were written or dropped."""
        from . import journal
        from .admin_comment import flush_entry, flush_note

        config = self._config()
        log = hook_logger(config.log)
        run = self.agent.make_runner(config.command_timeout)
        finished = 0
        for name, _, mtime in journal.pending(config.journal):
            if self.stop.is_set():
                break
            if self.retry_at.get(name, 0.0) > self.clock():
                continue
            job_id = journal.job_of(name) or name
            entry = journal.take(config.journal, name)
            if entry is None:
                continue
            started = self.clock()
            if mtime and time.time() - mtime > MAX_RECORD_AGE_S:
                log(f"job {job_id}: its AdminComment record could not be written for a week; dropped: {entry.record}")
                done = True
            else:
                done = (flush_note if name.endswith(journal.NOTE_SUFFIX) else flush_entry)(config, job_id, entry, run, log)
            journal.finish(config.journal, name, done)
            if done:
                finished += 1
                self.retry_at.pop(name, None)
                self.failures.pop(name, None)
            else:
                failures = self.failures[name] = self.failures.get(name, 0) + 1
                self.retry_at[name] = self.clock() + min(MAX_BACKOFF_S, 2.0 ** failures) * random.uniform(0.8, 1.2)
            pause = 1.0 / config.admin_comment_rate - (self.clock() - started)
            if pause > 0:
                self.stop.wait(pause)
        return finished

    def _reconcile_loop(self) -> None:
        while not self.stop.is_set():
            self.reconcile_soon.clear()
            try:
                self.reconcile_once()
                interval = self._config().reconcile_interval
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: reconcile pass failed: {error}")
                interval = 60.0
            self.stop.wait(MIN_RECONCILE_GAP_S)  # however often tasks ask: one squeue a second at most
            self.reconcile_soon.wait(interval * random.uniform(0.75, 1.25))

    def _records_loop(self) -> None:
        from . import journal

        try:
            journal.recover(self._config().journal)
        except Exception as error:  # noqa: BLE001
            self.agent.log_errors(f"mapa-agent: could not recover the journal: {error}")
        while not self.stop.is_set():
            self.wake.wait(1.0)
            self.wake.clear()
            try:
                self.publish_features()  # first: it steers where the next jobs go
            except Exception as error:  # noqa: BLE001 - the next change or pass publishes again
                self.agent.log_errors(f"mapa-agent: publishing node features failed: {error}")
            try:
                self.write_dcgm_mapping()
            except Exception as error:  # noqa: BLE001 - the next turn writes it again
                self.agent.log_errors(f"mapa-agent: writing the DCGM job mapping failed: {error}")
            try:
                self.flush_records()
            except Exception as error:  # noqa: BLE001 - the records stay in the journal
                self.agent.log_errors(f"mapa-agent: writing AdminComment records failed: {error}")

    def start(self) -> None:
        for target in (self._reconcile_loop, self._records_loop):
            threading.Thread(target=target, daemon=True, name=f"mapa-agent {target.__name__}").start()


class _Handler(socketserver.BaseRequestHandler):
    server: "AgentServer"

    def handle(self) -> None:
        conn: socket.socket = self.request
        if self.server.public:
            self.handle_isolate(conn)
            return
        started, started_wall = time.monotonic(), time.time()
        try:
            pid, uid = peer_credentials(conn)
            if uid != 0:
                conn.sendall(b"error only root may ask mapa-agent\n")
                return
            kind, env = read_request(conn, self.server.request_read_timeout, KINDS + (ISOLATE,), KEYS + ISOLATE_KEYS)
            if kind != ISOLATE and not is_job_id(env.get("SLURM_JOB_ID", "")):
                raise InputError(f"SLURM_JOB_ID {env.get('SLURM_JOB_ID', '')[:40]!r} is not a job id (accepted: digits)")
        except (InputError, OSError) as error:
            self.server.agent.log_errors(f"mapa-agent: refused a request: {error}")
            try:
                conn.sendall(f"error {error}\n".encode()[:1024])
            except OSError:
                pass
            return
        if kind == ISOLATE:
            # From root: the SPANK plugin (spank_mapa_isolate.c) in a task process before it
            # drops to the user; the process to isolate is the caller itself.
            answer = self.server.agent.isolate(pid, uid, env)
            try:
                conn.sendall(answer.replace("\n", " ").encode("utf-8", "replace")[:1023] + b"\n")
            except OSError:
                pass
            return
        later: list[Callable[[], None]] = []
        self.server.agent.run_hook(kind, env, lambda: client_still_there(conn), later.append, pid)
        try:
            conn.sendall(b"done\n")
        except OSError:
            pass  # the client is gone; what was written stays consistent
        # After the answer, so the job starts without waiting: the AdminComment record (journaled).
        for action in later:
            try:
                action()
            except Exception as error:  # noqa: BLE001 - the decision is in the ledger and the log already
                self.server.agent.log_errors(f"mapa-agent: deferred work failed: {error}")
        if kind == "prolog":
            self.server.agent.note_prolog(env, started_wall, started)
        if self.server.agent.background is not None:  # a start or an end: records and features
            self.server.agent.background.wake.set()

    def handle_isolate(self, conn: socket.socket) -> None:
        """A TaskProlog's request, from any user: only ``isolate``, judged by the caller's pid."""
        pid = uid = -1
        try:
            pid, uid = peer_credentials(conn)
            _, env = read_request(conn, self.server.request_read_timeout, (ISOLATE,), ISOLATE_KEYS)
        except (InputError, OSError) as error:
            answer = self.server.agent.isolation_failed(f"bad request: {error}", pid, uid)
        else:
            answer = self.server.agent.isolate(pid, uid, env, public=True)
        try:
            conn.sendall(answer.replace("\n", " ").encode("utf-8", "replace")[:1023] + b"\n")
        except OSError:
            pass


class PublicAdmission:
    """Who of the public socket's callers gets a thread now, waits, or is turned away.

    A caller that is no task of a Slurm job on this node is closed at once (the peer's cgroup, one
    /proc read). The rest are limited per uid and per job: past ``per_uid`` (``per_job``) requests
    being handled, a request waits in its uid's queue without a thread, up to ``queue_per_uid``
    (``queue_total`` in all); past that it is closed. Closed, a TaskProlog falls back as its mode
    says (fail-open runs the task, fail-closed fails it): only the flooding user's own tasks."""

    def __init__(self, per_uid: int = PUBLIC_PER_UID, per_job: int = PUBLIC_PER_JOB,
                 queue_per_uid: int = PUBLIC_QUEUE_PER_UID, queue_total: int = PUBLIC_QUEUE_TOTAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_uid, self.per_job = per_uid, per_job
        self.queue_per_uid, self.queue_total = queue_per_uid, queue_total
        self.clock = clock
        self.lock = threading.Lock()
        self.active_uid: dict[int, int] = {}
        self.active_job: dict[str, int] = {}
        self.waiting: dict[int, list[tuple[float, str, object]]] = {}  # uid -> (since, job, request)
        self.waiting_total = 0

    def _fits(self, uid: int, job: str) -> bool:
        return self.active_uid.get(uid, 0) < self.per_uid and self.active_job.get(job, 0) < self.per_job

    def _start(self, uid: int, job: str) -> None:
        self.active_uid[uid] = self.active_uid.get(uid, 0) + 1
        self.active_job[job] = self.active_job.get(job, 0) + 1

    def arrive(self, uid: int, job: str, request: object) -> str:
        """"run" (handle it now: counted as active), "wait" (queued) or "refuse"."""
        with self.lock:
            if self._fits(uid, job):
                self._start(uid, job)
                return "run"
            queue = self.waiting.setdefault(uid, [])
            if len(queue) >= self.queue_per_uid or self.waiting_total >= self.queue_total:
                return "refuse"
            queue.append((self.clock(), job, request))
            self.waiting_total += 1
            return "wait"

    def finish(self, uid: int, job: str) -> tuple[str, object] | None:
        """One request of ``uid``/``job`` is done; the next waiting request of the uid that fits (it
        is counted as active and is the caller's to handle), or None. (Requests that waited past
        their client's deadline are taken out by ``expired``.)"""
        with self.lock:
            for counts, key in ((self.active_uid, uid), (self.active_job, job)):
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]
            queue = self.waiting.get(uid, [])
            for position, (_, waiting_job, request) in enumerate(queue):
                if self._fits(uid, waiting_job):
                    del queue[position]
                    self.waiting_total -= 1
                    if not queue:
                        del self.waiting[uid]
                    self._start(uid, waiting_job)
                    return waiting_job, request
            return None

    def expired(self, max_age: float = QUEUED_MAX_AGE_S) -> list[object]:
        """Take out the waiting requests older than ``max_age`` (their clients have given up)."""
        now, old = self.clock(), []
        with self.lock:
            for uid in list(self.waiting):
                kept = [item for item in self.waiting[uid] if now - item[0] <= max_age]
                old += [item[2] for item in self.waiting[uid] if now - item[0] > max_age]
                self.waiting_total -= len(self.waiting[uid]) - len(kept)
                if kept:
                    self.waiting[uid] = kept
                else:
                    del self.waiting[uid]
        return old


def _discard_unread(conn: socket.socket) -> bytes:
    """Read and drop what the client has sent, without waiting (at most one request's worth);
    the first bytes read (the request's header, for the metrics)."""
    first = b""
    try:
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            chunk = conn.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                break
            first = first or chunk[:MAX_HEADER_BYTES]
    except OSError:
        pass
    return first


class AgentServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    request_read_timeout = REQUEST_READ_TIMEOUT_S

    def __init__(self, path: str, agent: Agent, max_handlers: int = MAX_HANDLERS, public: bool = False,
                 admission: PublicAdmission | None = None) -> None:
        self.agent = agent
        self.public = public  # the TaskPrologs' socket: isolate requests from anyone, nothing else
        self.admission = admission or PublicAdmission()
        self.handler_slots = threading.BoundedSemaphore(max_handlers)
        self.refused: list[tuple[float, socket.socket]] = []  # told busy, closed by service_actions
        self.turned_away = 0  # public requests closed unanswered (no task, or over their user's limit)
        self.admitted: dict[int, tuple[int, str]] = {}  # id(request) -> (uid, job), while counted active
        self.admitted_lock = threading.Lock()
        super().__init__(path, _Handler)

    def _turn_away(self, request: socket.socket, uid: int, why: str) -> None:
        self.turned_away += 1
        self.agent.public_log.say(("turned away", uid), f"mapa-agent: isolate socket: closed a request of uid {uid}: {why}",
                                  self.agent.log_errors)
        self.shutdown_request(request)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        """A thread for the request if fewer than max_handlers run; else ``error busy`` at once.
        On the public socket, first the caller's admission (PublicAdmission)."""
        if self.public:
            try:
                pid, uid = peer_credentials(request)
            except OSError:
                self.shutdown_request(request)
                return
            job = self.agent.job_of(pid)
            if job is None:
                self._turn_away(request, uid, f"process {pid} is no task of a Slurm job on this node")
                return
            verdict = self.admission.arrive(uid, job, request)
            if verdict == "wait":
                return
            if verdict == "refuse":
                self._turn_away(request, uid, f"more than {self.admission.per_uid} requests of this user at once "
                                f"and {self.admission.queue_per_uid} waiting")
                return
            with self.admitted_lock:
                self.admitted[id(request)] = (uid, job)
        self._dispatch(request, client_address)

    def _dispatch(self, request: socket.socket | None, client_address: object) -> None:
        while request is not None:
            if self.handler_slots.acquire(blocking=False):
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    self.handler_slots.release()  # the thread never started
                    self._finished(request)
                    raise
                return
            self.agent.public_log.say("busy", "mapa-agent: too many requests at once; told one client to run its hook itself",
                                      self.agent.log_errors)
            self._refuse_busy(request)
            request = self._finished(request)

    def _refuse_busy(self, request: socket.socket) -> None:
        """Answer ``error busy`` without waiting on the client. The socket is closed a moment later
        (service_actions), once its request has arrived and been discarded: closed with unread data,
        the client would see a reset instead of the answer (it falls back either way)."""
        try:
            request.setblocking(False)
            request.send(b"error busy\n")
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.refused.append((time.monotonic(), request))

    def service_actions(self) -> None:
        """Called by serve_forever between requests: close refused sockets older than 0.2 s."""
        super().service_actions()
        if self.public:
            for stale in self.admission.expired():
                self.shutdown_request(stale)  # type: ignore[arg-type]
        now = time.monotonic()
        while self.refused and (now - self.refused[0][0] > 0.2 or len(self.refused) > MAX_HANDLERS):
            _, request = self.refused.pop(0)
            first = _discard_unread(request)
            if not self.public and self.agent.metrics is not None and first.startswith(b"MAPA1 prolog "):
                self.agent.metrics.refused()  # its wrapper runs the Prolog in-process
            self.shutdown_request(request)

    def server_close(self) -> None:
        for _, request in self.refused:
            request.close()
        self.refused.clear()
        super().server_close()

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        """Handle the request, then (public socket) those of the same user that waited for it."""
        try:
            while request is not None:
                super().process_request_thread(request, client_address)
                request = self._finished(request)
        finally:
            self.handler_slots.release()

    def _finished(self, request: socket.socket) -> socket.socket | None:
        """A public request is done: the next waiting one of its user, now counted active, or None."""
        with self.admitted_lock:
            admitted = self.admitted.pop(id(request), None)
        if admitted is None:
            return None
        following = self.admission.finish(*admitted)
        if following is None:
            return None
        job, waiting = following
        with self.admitted_lock:
            self.admitted[id(waiting)] = (admitted[0], job)
        return waiting  # type: ignore[return-value]


def prepare_socket_dir(path: Path) -> None:
    """The socket's directory exists, belongs to root and is closed to everyone else."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.parent.stat()
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path.parent, 0o700)
        if path.parent.stat().st_uid != os.geteuid():
            raise InputError(f"{path.parent} belongs to another user; mapa-agent needs a directory of its own")
    if path.is_socket() or path.exists():
        path.unlink()


def serve(socket_path: str, agent: Agent, max_handlers: int = MAX_HANDLERS) -> AgentServer:
    """A server bound to ``socket_path`` (mode 600 in a root-only directory); call serve_forever on it."""
    path = Path(socket_path)
    prepare_socket_dir(path)
    old_umask = os.umask(0o077)
    try:
        server = AgentServer(str(path), agent, max_handlers)
    finally:
        os.umask(old_umask)
    return server


def serve_isolation(socket_path: str, agent: Agent, max_handlers: int = MAX_HANDLERS) -> AgentServer:
    """The TaskPrologs' server: ``socket_path`` is mode 666 in a root-owned directory of mode 755,
    so every job's user can ask; it takes isolate requests only."""
    path = Path(socket_path)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    info = path.parent.stat()
    if info.st_uid != os.geteuid():
        raise InputError(f"{path.parent} belongs to another user; mapa-agent needs a directory of its own")
    os.chmod(path.parent, 0o755)
    if path.is_socket() or path.exists():
        path.unlink()
    old_umask = os.umask(0o077)
    try:
        server = AgentServer(str(path), agent, max_handlers, public=True)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o666)
    return server


def log_spank_plugin_problems(config_path: str, environ: Mapping[str, str],
                              running_version_text: Callable[[], str | None] | None = None) -> None:
    """Once at start, into the agent's log: MAPA's SPANK plugin in plugstack.conf that the running
    Slurm would not load (built for another release: slurmstepd skips an optional plugin with only a
    verbose line, and tasks lose their root-side isolation without a word). Never raises."""
    try:
        config, _ = load_hook_config({"MAPA_CONFIG": config_path}, validate=False)
        log = hook_logger(config.log)
        for problem in spankcheck.check_this_node(environ, running_version_text or spankcheck.running_slurm_version_text):
            log(f"WARNING: {problem}")
    except Exception as error:  # noqa: BLE001 - a check that informs must not stop the agent
        print(f"mapa-agent: could not check the SPANK plugin ({error})", file=sys.stderr, flush=True)


def start_metrics(config_path: str, node: str) -> "AgentMetrics | None":
    """With ``[metrics] listen`` in the config: the node's metrics, served there (read once, at
    start). None when off, or when they cannot be served (said on stderr; the agent runs on)."""
    config, problem = load_hook_config({"MAPA_CONFIG": config_path}, validate=False)
    if problem or config.metrics_listen is None:
        return None
    from .metrics import AgentMetrics, read_node_state

    host, port = config.metrics_listen
    try:
        metrics = AgentMetrics(node, config.policy,
                               state=lambda: read_node_state(load_hook_config({"MAPA_CONFIG": config_path}, validate=False)[0], node))
        port = metrics.serve(host, port).server_port
    except ImportError:
        print("mapa-agent: [metrics] listen is set but the prometheus_client module is missing (Debian: "
              "python3-prometheus-client; pip: slurm-mapa[metrics]); no metrics", file=sys.stderr, flush=True)
        return None
    except OSError as error:
        print(f"mapa-agent: cannot serve metrics on {host}:{port} ({error}); no metrics", file=sys.stderr, flush=True)
        return None
    print(f"mapa-agent: metrics on http://{f'[{host}]' if ':' in host else host}:{port}/metrics", file=sys.stderr, flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mapa-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get("MAPA_CONFIG", "/etc/slurm/mapa.toml"), help="the hooks' config (default %(default)s)")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="where to listen (default %(default)s)")
    parser.add_argument("--isolate-socket", default=ISOLATE_SOCKET,
                        help="where TaskPrologs ask for GPU isolation, open to every user (default %(default)s)")
    parser.add_argument("--node", default=os.uname().nodename.split(".")[0], help="this node's Slurm name, for the warm-up (default: the host name)")
    args = parser.parse_args(argv)
    os.umask(0o022)  # whatever started us: nothing the hooks create may be writable by others
    if os.geteuid() != 0:
        print("mapa-agent: must run as root, like the Prolog it replaces", file=sys.stderr)
        return 2
    agent = Agent(args.config, node=args.node, metrics=start_metrics(args.config, args.node))
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
        agent.metrics.features = lambda: agent.background.features.last if agent.background is not None else None
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
