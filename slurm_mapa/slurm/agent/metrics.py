"""mapa-agent's Prometheus metrics: what MAPA decides on a node, for the dashboards sites run.

Served by mapa-agent when mapa.toml has ``[metrics] listen = "HOST:PORT"`` (off by default), in
the Prometheus text exposition format, with the maintained ``prometheus_client`` library
(Debian: python3-prometheus-client; pip: the ``metrics`` extra). Every series carries a ``node``
label. docs/admin.md, section "Metrics", says what each one means and which alerts make sense.

Two kinds of series, neither of which costs the job's start anything:

* events (decisions, isolation answers, controller calls, repairs, feature writes) are counted in
  memory by the agent as they happen; a decision is classified from the job's ledger entry after
  the Prolog's answer has gone back to slurmd;
* the node's state (GPUs held and shared, and how fragmented the free GPUs are) is computed when
  Prometheus scrapes, from the ledger file and the core's search (:func:`node_state`), whose
  results :mod:`slurm_mapa.core.features` caches per free set.

The pure parts (:func:`decision_outcome`, :func:`isolation_outcome`, :func:`repairs_in`,
:func:`ring_sizes`) are separate from :class:`AgentMetrics`, the only part that needs
prometheus_client; this module imports it only when metrics are on.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, Mapping

from .peer_owner import peer_of_connection

if TYPE_CHECKING:
    from ...core.hardware import HardwareGraph
    from ..config import HookConfig

DECISION_OUTCOMES = ("mapa", "provisional", "fallback", "refused")
ISOLATION_OUTCOMES = ("isolated", "failed-open", "refused")
REPAIR_KINDS = ("rebuilt", "reaped", "adopted", "prolog-died")
HOLDING_CHOICES = ("mapa", "provisional", "fallback")
COMMANDS = ("scontrol", "squeue", "other")
MAX_RING_SIZE = 8  # the gauge covers k = 2..8 (the paper's job sizes) and the node's own size
# Seconds: a Prolog's budget is 2-20 s (config.MAX_PROLOG_BUDGET_S), a controller call's 60 s at most.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)
# What the ledger's policy field says about a holding, other than a policy's name (hooks/prolog.py, node_state/ledger.py).
_FALLBACK = "fallback"
_SAFE_CHOICES = ("provisional", "recovered", "slurm", "claimed")


def decision_outcome(holding_policy: str, policies: Iterable[str]) -> str:
    """What a job's ledger entry, read after its Prolog answered, says the decision was: ``mapa``
    (a policy chose), ``fallback`` (the fail-open fallback: Slurm's GPUs if free, else the lowest
    free), or ``provisional`` (the safe first choice stayed: the Prolog ran out of budget or time,
    lost its client, or could not take the lock)."""
    if holding_policy in policies:
        return "mapa"
    if holding_policy == _FALLBACK:
        return "fallback"
    return "provisional"


def isolation_outcome(answer: str) -> str | None:
    """The outcome of an isolate answer (agent.Agent.isolate): ``isolated``, ``failed-open``,
    ``refused`` (fail-closed: the task fails), or None (isolation is off)."""
    word = answer.split(" ", 2)[:2]
    if word[0] == "error":
        return "refused"
    if len(word) < 2 or word[1] == "off":
        return None
    return "failed-open" if word[1] == "failed-open" else "isolated"


_REAPED = re.compile(r"reaped the ledger entries and files of jobs that ended: ([0-9,]+)")


def repairs_in(line: str) -> list[tuple[str, int]]:
    """The ledger repairs a reconcile pass's log line reports (reconcile.reconcile_node and what it
    calls): the ledger was rebuilt from the jobs directory, entries of jobs that ended without a
    clean Epilog were reaped, jobs that ran without a mark were adopted, or a job whose Prolog died
    before choosing was entered with Slurm's GPUs."""
    if " is corrupt (" in line and "rebuilding it from" in line:
        return [("rebuilt", 1)]
    reaped = _REAPED.search(line)
    if reaped:
        return [("reaped", len([job for job in reaped.group(1).split(",") if job]))]
    if ": adopted job " in line:
        return [("adopted", 1)]
    if "'s Prolog died before choosing; it runs on Slurm's GPUs" in line:
        return [("prolog-died", 1)]
    return []


def ring_sizes(size: int) -> tuple[int, ...]:
    """The ring sizes the fragmentation gauge covers on a node of ``size`` GPUs: 2..8 and the size."""
    return tuple(sorted({k for k in range(2, MAX_RING_SIZE + 1) if k <= size} | ({size} if size >= 2 else set())))


def command_name(argv: Any) -> str:
    """The label of a Slurm command: scontrol, squeue, or other."""
    try:
        name = os.path.basename(str(argv[0]))
    except (IndexError, TypeError, KeyError):
        return "other"
    return name if name in COMMANDS else "other"


@dataclass(frozen=True)
class NodeGauges:
    """What the ledger says now, and how good the free GPUs still are."""

    size: int
    held: Mapping[str, int]  # choice (HOLDING_CHOICES) -> GPUs held under it
    shared: int  # GPUs held by more than one job (a MAPA choice never overlaps: must stay 0)
    jobs: int  # ledger entries
    free_ring: Mapping[int, float]  # k -> best predicted effective bandwidth of a free k-GPU ring, 0 if none is free (held-out GPUs are not free)
    idle_ring: Mapping[int, float]  # k -> the same with every GPU free
    free_preserved: float  # the paper's Eq. 3 over the free GPUs
    idle_preserved: float  # ... over every GPU
    held_out: frozenset[int] = frozenset()  # GPUs held out of new jobs (mapa gpu hold)


def node_gauges(graph: "HardwareGraph", holdings: Mapping[str, Any], model: Any, policies: Iterable[str],
                held_out: frozenset[int] = frozenset()) -> NodeGauges:
    """The state gauges for a node from its ledger's holdings (job -> ledger.Holding), with the
    core's public search (core.features.best_free, cached per free set; core.search.preserved_bandwidth)."""
    from ...core.features import best_free
    from ...core.search import preserved_bandwidth

    policies = tuple(policies)
    owners: dict[int, int] = {}
    held = dict.fromkeys(HOLDING_CHOICES, 0)
    for holding in holdings.values():
        gpus = [gpu for gpu in holding.gpus if 0 <= gpu < graph.size]
        held[decision_outcome(holding.policy, policies)] += len(gpus)
        for gpu in gpus:
            owners[gpu] = owners.get(gpu, 0) + 1
    # Held-out GPUs are not free: no new job gets them, so they count in no free ring (issue 50).
    free = tuple(gpu for gpu in range(graph.size) if gpu not in owners and gpu not in held_out)
    every = tuple(range(graph.size))
    sizes = ring_sizes(graph.size)
    return NodeGauges(
        size=graph.size,
        held=held,
        shared=sum(1 for count in owners.values() if count > 1),
        jobs=len(holdings),
        free_ring={k: best_free(graph, free, k, model) or 0.0 for k in sizes},
        idle_ring={k: best_free(graph, every, k, model) or 0.0 for k in sizes},
        free_preserved=preserved_bandwidth(graph, free),
        idle_preserved=preserved_bandwidth(graph, every),
        held_out=frozenset(held_out),
    )


def read_node_gauges(config: "HookConfig", node: str) -> NodeGauges:
    """:func:`node_gauges` from the files the hooks use (the topology, the model, the ledger), read
    without the ledger's lock (a read never needs it: the ledger is replaced atomically).
    Raises MapaError, OSError or ledger.LedgerCorrupt when one of them cannot be read."""
    from ...core.policies import all_policies
    from ...hardware.load import resolve_model
    from .snapshot import read_snapshot

    snapshot = read_snapshot(config, node)
    model = resolve_model(config.model_for(node), snapshot.graph)
    return node_gauges(snapshot.graph, snapshot.ledger.holdings, model, all_policies(), snapshot.held_out)


class AgentMetrics:
    """The agent's metrics in a registry of their own (no process or platform series, which
    would carry no ``node`` label). ``state``: returns the node's :class:`NodeGauges` at scrape
    time (raising when it cannot be read: then ``mapa_node_state_ok`` is 0 and the state series
    are left out); ``features``: the node's MAPA features as last published."""

    def __init__(self, node: str, policy: str = "preserve", state: Callable[[], NodeGauges] | None = None,
                 features: Callable[[], tuple[str, ...] | None] = lambda: None,
                 health: Callable[[], Mapping[int, bool]] = dict) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.node = node
        self.policy = policy  # the policy label of refused requests (their decision is not seen here)
        self.registry = CollectorRegistry(auto_describe=True)
        self.state = state
        self.features = features
        self.health = health  # GPU -> healthy at the health sources' last pass (agent/health.py); {}: none read
        self.state_problem = ""
        self.server: Any = None  # the HTTP server, once serve() started it
        r = self.registry
        self.decisions = Counter("mapa_decisions", "Prolog decisions seen by mapa-agent, by outcome and the policy in force",
                                 ["node", "outcome", "policy"], registry=r)
        self.decision_seconds = Histogram(
            "mapa_decision_duration_seconds", "From the agent taking a Prolog's request to the ledger commit of the job's GPUs",
            ["node"], buckets=DURATION_BUCKETS, registry=r)
        self.prolog_seconds = Histogram(
            "mapa_prolog_duration_seconds", "From the agent taking a Prolog's request to its answer",
            ["node"], buckets=DURATION_BUCKETS, registry=r)
        self.overruns = Counter("mapa_prolog_budget_overruns", "Prologs answered after their budget (prolog_budget) was spent",
                                ["node"], registry=r)
        self.isolations = Counter("mapa_isolation_requests", "Isolate requests (one per task, from the TaskProlog or the SPANK "
                                  "plugin) by outcome", ["node", "outcome"], registry=r)
        self.repairs = Counter("mapa_ledger_repairs", "Ledger repairs made by the agent's reconcile passes, by kind",
                               ["node", "kind"], registry=r)
        self.calls = Counter("mapa_controller_calls", "Slurm commands the agent ran (each asks slurmctld)",
                             ["node", "command"], registry=r)
        self.call_failures = Counter("mapa_controller_call_failures", "Slurm commands the agent ran that failed or timed out",
                                     ["node", "command"], registry=r)
        self.call_seconds = Histogram("mapa_controller_call_duration_seconds", "Wall time of the Slurm commands the agent ran",
                                      ["node", "command"], buckets=DURATION_BUCKETS, registry=r)
        self.feature_writes = Counter("mapa_feature_publications", "Times the agent set the node's MAPA features on slurmctld",
                                      ["node"], registry=r)
        # Every series exists from the start, at 0: rate() and alerts see the first event.
        for outcome in DECISION_OUTCOMES:
            self.decisions.labels(node, outcome, policy)
        for outcome in ISOLATION_OUTCOMES:
            self.isolations.labels(node, outcome)
        for kind in REPAIR_KINDS:
            self.repairs.labels(node, kind)
        for command in COMMANDS[:2]:
            self.calls.labels(node, command)
            self.call_failures.labels(node, command)
            self.call_seconds.labels(node, command)
        self.decision_seconds.labels(node)
        self.prolog_seconds.labels(node)
        self.overruns.labels(node)
        self.feature_writes.labels(node)
        r.register(_StateCollector(self))

    # --- events: in memory only ---------------------------------------------------------------

    def decision(self, outcome: str, policy: str, decision_seconds: float | None, prolog_seconds: float,
                 budget_seconds: float) -> None:
        self.decisions.labels(self.node, outcome, policy).inc()
        if decision_seconds is not None and 0.0 <= decision_seconds <= 3600.0:
            self.decision_seconds.labels(self.node).observe(decision_seconds)
        self.prolog_seconds.labels(self.node).observe(prolog_seconds)
        if prolog_seconds > budget_seconds:
            self.overruns.labels(self.node).inc()

    def refused(self) -> None:
        """A Prolog the agent turned away (busy): the wrapper decides in-process, unseen here."""
        self.decisions.labels(self.node, "refused", self.policy).inc()

    def isolation(self, answer: str) -> None:
        outcome = isolation_outcome(answer)
        if outcome is not None:
            self.isolations.labels(self.node, outcome).inc()

    def repair_log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log``, counting the repairs its lines report."""
        def counting(line: str) -> None:
            for kind, count in repairs_in(line):
                self.repairs.labels(self.node, kind).inc(count)
            log(line)

        return counting

    def feature_published(self) -> None:
        self.feature_writes.labels(self.node).inc()

    def instrument(self, make_runner: Callable[[float], Callable[..., str]]) -> Callable[[float], Callable[..., str]]:
        """``make_runner`` whose runners count and time each command (in memory; the call itself
        is the same call, with the same arguments, results and exceptions)."""
        def make(timeout: float) -> Callable[..., str]:
            run = make_runner(timeout)

            def call(argv, *args, **kwargs):
                command = command_name(argv)
                started = time.monotonic()
                try:
                    return run(argv, *args, **kwargs)
                except BaseException:
                    self.call_failures.labels(self.node, command).inc()
                    raise
                finally:
                    self.calls.labels(self.node, command).inc()
                    self.call_seconds.labels(self.node, command).observe(time.monotonic() - started)

            return call

        return make

    # --- exposition ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format (what a scrape gets)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> Any:
        """Serve the metrics on http://HOST:PORT/metrics from a daemon thread; the server (OSError
        when the address cannot be bound). The server is bounded (MetricsServer): idle or slow
        connections cannot exhaust the agent's threads or descriptors, and one user's cannot keep
        the others' scrapes out."""
        import prometheus_client

        if hasattr(prometheus_client, "disable_created_metrics"):
            prometheus_client.disable_created_metrics()  # the *_created series only double the count
        self.server = MetricsServer((host, port), self.exposition)
        threading.Thread(target=self.server.serve_forever, name="mapa-metrics", daemon=True).start()
        return self.server


# The metrics endpoint is reachable by any local user (and whoever the firewall lets in): each
# connection gets a thread only while fewer than METRICS_MAX_CONNECTIONS are open and its peer (a
# local user, or a remote address) holds fewer than METRICS_MAX_PER_PEER of them, so one user
# holding connections open cannot keep Prometheus (another peer) out. Past either bound a
# connection is closed at once: a flood costs its sender the metrics, never the agent its
# descriptors (systemd's default LimitNOFILE is 1,024) or threads. A connection whose request line
# has not arrived METRICS_REQUEST_LINE_DEADLINE_S after it was accepted is closed, and every one
# METRICS_CONNECTION_DEADLINE_S after it was accepted whatever it sends (a scrape takes milliseconds).
METRICS_MAX_CONNECTIONS = 16
METRICS_MAX_PER_PEER = 2
METRICS_REQUEST_LINE_DEADLINE_S = 2.0
METRICS_CONNECTION_DEADLINE_S = 5.0
METRICS_MAX_REQUEST_LINE = 1024
METRICS_WATCHDOG_S = 0.25  # serve_forever's poll: the deadlines are enforced at least this often

class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    server: "MetricsServer"
    protocol_version = "HTTP/1.0"  # one request per connection: no keep-alive holding a slot

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics")
            return
        try:
            body = self.server.exposition()
        except Exception:  # noqa: BLE001 - a scrape answers 500, the agent runs on
            self.send_error(500, "metrics could not be computed")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_one_request(self) -> None:
        # A request line longer than a scrape's is refused before more is read.
        self.raw_requestline = self.rfile.readline(METRICS_MAX_REQUEST_LINE + 1)
        if len(self.raw_requestline) > METRICS_MAX_REQUEST_LINE:
            self.close_connection = True
            return
        if self.raw_requestline.endswith(b"\n"):
            self.server.request_line_read(self.request)
        if not self.raw_requestline or not self.parse_request():
            self.close_connection = True
            return
        if self.command != "GET":
            self.send_error(405, "only GET")
            return
        self.do_GET()
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # a scrape every 30 s must not fill root's log


@dataclass
class OpenConnection:
    """A connection being handled, as the watchdog and the bounds see it."""

    accepted: float  # time.monotonic()
    request: socket.socket
    peer: Hashable
    request_line_read: bool = False


def overdue(connection: OpenConnection, now: float, request_line_deadline: float, deadline: float) -> bool:
    """Whether the watchdog closes ``connection``: its request line is late, or its time is up."""
    age = now - connection.accepted
    return age > deadline or (not connection.request_line_read and age > request_line_deadline)


class MetricsServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """GET /metrics, with at most ``max_connections`` open, at most ``max_per_peer`` of them from
    one peer (``peer_of(client_address, local_address)``: by default the uid owning a loopback
    peer's socket, else its address; see :func:`peer_of_connection`), each closed when its request
    line has not come ``request_line_deadline`` seconds after it was accepted, and ``deadline``
    seconds after it was accepted whatever it sent (a watchdog shuts its socket down, which ends a
    blocked read)."""

    daemon_threads = True
    allow_reuse_address = True
    # A backlog a flood's connections pass through quickly (each is closed on arrival): a scrape's
    # connection waits its turn there rather than being dropped and retried a second later.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], exposition: Callable[[], bytes],
                 max_connections: int = METRICS_MAX_CONNECTIONS, deadline: float = METRICS_CONNECTION_DEADLINE_S,
                 max_per_peer: int = METRICS_MAX_PER_PEER, request_line_deadline: float = METRICS_REQUEST_LINE_DEADLINE_S,
                 peer_of: Callable[[Any, Any], Hashable] = peer_of_connection) -> None:
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.exposition = exposition
        self.max_connections, self.max_per_peer, self.deadline = max_connections, max_per_peer, deadline
        self.request_line_deadline = min(request_line_deadline, deadline)
        self.peer_of = peer_of
        self.open_lock = threading.Lock()
        self.open: dict[int, OpenConnection] = {}
        self.turned_away = 0
        super().__init__(address, _MetricsHandler)
        self.timeout = min(METRICS_WATCHDOG_S, deadline)

    def peer(self, request: Any, client_address: Any) -> Hashable:
        """Who ``request`` is from; its raw address when that cannot be said (never raises)."""
        try:
            return self.peer_of(client_address, request.getsockname())
        except Exception:  # noqa: BLE001 - a strange address or table: bounded like any other peer
            return "address", str(client_address[0] if isinstance(client_address, tuple) and client_address else client_address)

    def full(self, peer: Hashable | None = None) -> bool:
        """Whether a new connection (from ``peer``) would pass a bound. Called under open_lock."""
        if len(self.open) >= self.max_connections:
            return True
        return peer is not None and sum(1 for c in self.open.values() if c.peer == peer) >= self.max_per_peer

    def turn_away(self, request: Any) -> None:
        self.turned_away += 1
        self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.open_lock:
            full = self.full()
        if full:  # no lookup for a connection that cannot be taken anyway
            self.turn_away(request)
            return
        peer = self.peer(request, client_address)
        with self.open_lock:  # (only this thread adds: the bounds still hold)
            full = self.full(peer)
            if not full:
                self.open[id(request)] = OpenConnection(time.monotonic(), request, peer)
        if full:
            self.turn_away(request)
            return
        try:
            request.settimeout(self.deadline)
            super().process_request(request, client_address)
        except BaseException:
            with self.open_lock:
                self.open.pop(id(request), None)
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open.pop(id(request), None)

    def request_line_read(self, request: Any) -> None:
        """The handler has the request line: the connection now runs to its whole deadline."""
        with self.open_lock:
            connection = self.open.get(id(request))
            if connection is not None:
                connection.request_line_read = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out or went away: nothing for root's stderr

    def serve_forever(self, poll_interval: float = METRICS_WATCHDOG_S) -> None:
        super().serve_forever(poll_interval)

    def service_actions(self) -> None:
        """Between accepts: shut down connections past a deadline (their threads then end)."""
        now = time.monotonic()
        with self.open_lock:
            late = [c.request for c in self.open.values() if overdue(c, now, self.request_line_deadline, self.deadline)]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _StateCollector:
    """The node's state, computed when Prometheus scrapes (see AgentMetrics)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        metrics, node = self.metrics, self.metrics.node
        ok = GaugeMetricFamily("mapa_node_state_ok", "1 when the topology, the model and the ledger could be read at this scrape",
                               labels=["node"])
        state = None
        if metrics.state is not None:
            try:
                state = metrics.state()
            except Exception as error:  # noqa: BLE001 - a scrape must answer whatever the files hold
                metrics.state_problem = str(error)[:200]
        ok.add_metric([node], 1.0 if state is not None else 0.0)
        yield ok
        features = metrics.features()
        if features is not None:
            active = GaugeMetricFamily("mapa_node_feature_active", "The node's MAPA features as the agent last published them",
                                       labels=["node", "feature"])
            for name in features:
                active.add_metric([node, name], 1.0)
            yield active
        health = metrics.health()
        if health:
            healthy = GaugeMetricFamily("mapa_gpu_healthy", "1 for a GPU its health source (NVML, AMD SMI) found healthy at "
                                        "its last pass, 0 for one it found a problem on; absent: no source reads it",
                                        labels=["node", "gpu"])
            for gpu in sorted(health):
                healthy.add_metric([node, str(gpu)], 1.0 if health[gpu] else 0.0)
            yield healthy
        if state is None:
            return
        gpus = GaugeMetricFamily("mapa_gpus", "GPUs of the node (its topology)", labels=["node"])
        gpus.add_metric([node], float(state.size))
        yield gpus
        held = GaugeMetricFamily("mapa_gpus_held", "GPUs held by jobs in the node's ledger, by how they were chosen",
                                 labels=["node", "choice"])
        for choice in HOLDING_CHOICES:
            held.add_metric([node, choice], float(state.held.get(choice, 0)))
        yield held
        shared = GaugeMetricFamily("mapa_gpus_shared", "GPUs held by more than one job (must stay 0)", labels=["node"])
        shared.add_metric([node], float(state.shared))
        yield shared
        held_out = GaugeMetricFamily("mapa_gpu_held", "1 for a GPU held out of new jobs (mapa gpu hold), else 0",
                                     labels=["node", "gpu"])
        for gpu in range(state.size):
            held_out.add_metric([node, str(gpu)], 1.0 if gpu in state.held_out else 0.0)
        yield held_out
        jobs = GaugeMetricFamily("mapa_ledger_jobs", "Jobs in the node's ledger", labels=["node"])
        jobs.add_metric([node], float(state.jobs))
        yield jobs
        ring = GaugeMetricFamily("mapa_free_ring_effective_bandwidth_gbps",
                                 "Best predicted effective bandwidth of a k-GPU ring on the free GPUs now (0: fewer than k free)",
                                 labels=["node", "k"])
        idle = GaugeMetricFamily("mapa_idle_ring_effective_bandwidth_gbps",
                                 "Best predicted effective bandwidth of a k-GPU ring on the idle node", labels=["node", "k"])
        for k in sorted(state.free_ring):
            ring.add_metric([node, str(k)], state.free_ring[k])
            idle.add_metric([node, str(k)], state.idle_ring[k])
        yield ring
        yield idle
        preserved = GaugeMetricFamily("mapa_free_preserved_bandwidth_gbps",
                                      "Preserved bandwidth of the free GPUs: the summed bandwidth of the links among them",
                                      labels=["node"])
        preserved.add_metric([node], state.free_preserved)
        yield preserved
        idle_preserved = GaugeMetricFamily("mapa_idle_preserved_bandwidth_gbps", "Preserved bandwidth of the idle node",
                                           labels=["node"])
        idle_preserved.add_metric([node], state.idle_preserved)
        yield idle_preserved
