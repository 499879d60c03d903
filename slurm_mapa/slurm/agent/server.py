"""mapa-agent's sockets: the strict request protocol, the root-only socket the hook wrappers ask
on and the public one the TaskProlog's isolate requests come on, with the admission rules that
keep a flood from any one user or job from holding the agent (agent/service.py runs the requests).
"""

from __future__ import annotations

import os
import select
import socket
import socketserver
import stat
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...errors import InputError
from .client import ISOLATE, ISOLATE_KEYS, KEYS, KINDS, MAX_HEADER_BYTES, MAX_REQUEST_BYTES, MAX_VALUE_BYTES, PING
from ..text.commands import is_job_id

if TYPE_CHECKING:
    from .roles import HookService

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
# Each waiting request holds its connection's descriptor: with the listen backlog, the handlers and
# the metrics endpoint, the total stays well under systemd's default 1,024 descriptors (the unit
# raises LimitNOFILE too), so a flood can never leave the agent unable to accept the Prologs'.
PUBLIC_QUEUE_TOTAL = 512
QUEUED_MAX_AGE_S = 10.0  # the client's own deadline (client.ISOLATE_TIMEOUT_S): older ones gave up
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
            kind, env = read_request(conn, self.server.request_read_timeout, KINDS + (ISOLATE, PING), KEYS + ISOLATE_KEYS)
            if kind == PING:
                if env:
                    raise InputError("a ping request carries no variables")
                conn.sendall(b"done ping\n")
                return
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

    def finish(self, uid: int, job: str) -> tuple[int, str, object] | None:
        """One request of ``uid``/``job`` is done; the next waiting request that the freed places
        let in (it is counted as active and is the caller's to handle), as (uid, job, request), or
        None: first the same uid's, then another uid's waiting on the same job (whose share was
        freed: a job's tasks may run as several uids' requests reach it, and a caller charged to a
        job must never keep that job's own tasks waiting). (Requests that waited past their
        client's deadline are taken out by ``expired``.)"""
        with self.lock:
            for counts, key in ((self.active_uid, uid), (self.active_job, job)):
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]
            candidates = [uid] + [other for other in self.waiting if other != uid]
            for waiting_uid in candidates:
                queue = self.waiting.get(waiting_uid, [])
                for position, (_, waiting_job, request) in enumerate(queue):
                    if (waiting_uid == uid or waiting_job == job) and self._fits(waiting_uid, waiting_job):
                        del queue[position]
                        self.waiting_total -= 1
                        if not queue:
                            del self.waiting[waiting_uid]
                        self._start(waiting_uid, waiting_job)
                        return waiting_uid, waiting_job, request
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

    def __init__(self, path: str, agent: "HookService", max_handlers: int = MAX_HANDLERS, public: bool = False,
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
            job = self.agent.job_of(pid, uid)
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
        uid, job, waiting = following
        with self.admitted_lock:
            self.admitted[id(waiting)] = (uid, job)
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


def serve(socket_path: str, agent: "HookService", max_handlers: int = MAX_HANDLERS) -> AgentServer:
    """A server bound to ``socket_path`` (mode 600 in a root-only directory); call serve_forever on it."""
    path = Path(socket_path)
    prepare_socket_dir(path)
    old_umask = os.umask(0o077)
    try:
        server = AgentServer(str(path), agent, max_handlers)
    finally:
        os.umask(old_umask)
    return server


def serve_isolation(socket_path: str, agent: "HookService", max_handlers: int = MAX_HANDLERS) -> AgentServer:
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


