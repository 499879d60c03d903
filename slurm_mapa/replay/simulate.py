"""The event-driven replay simulator: many nodes, honest arrivals, FIFO with head-of-line blocking.

Events are job arrivals (their submit times) and job ends; nothing happens between events. At an
event the queue is scheduled in order: the head starts on the first node (in node order, or its
recorded node with ``pin_nodes``) where the policy finds room, and with ``backfill`` later jobs
may start while the head waits (up to ``backfill_depth`` of them are looked at). Without it the
queue stops at the first job that does not fit, as in the paper's simulator.

Every decision is memoised per (topology, policy, free set, request): a node has at most 2^n free
sets, so a long log costs a bounded number of searches. The scores kept for a decision are the
reported ones (:func:`~slurm_mapa.core.explain.reported_placement`: one number per GPU set for
collectives); for a job size outside the model's fitted range the effective bandwidth comes from
the link-bound model unless the run asks to extrapolate, and the decision says so. Jobs stream through: the simulator keeps
the queue, the running jobs and fixed-size accumulators, never the whole log.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from math import inf
from typing import Callable, Iterable, Iterator, Sequence

from ..core import peers
from ..core.effbw import EffectiveBandwidthModel, LinkBoundModel, grounded_model, paper_model
from ..core.explain import reported_placement
from ..core.hardware import HardwareGraph
from ..core.ahead import AHEAD_POLICIES
from ..core.peers import PEER_POLICIES
from ..core.policies import POLICIES, Allocation, Request, order_within
from ..errors import InputError
from .directives import request_for
from .jobs import Job
from .stats import Dist, Series
from .timemodel import TimeModel

ALL_POLICIES = {**POLICIES, **PEER_POLICIES, **AHEAD_POLICIES}


def policy_names() -> list[str]:
    return list(ALL_POLICIES)


@dataclass(frozen=True)
class Node:
    name: str
    graph: HardwareGraph


@dataclass(frozen=True)
class Decision:
    gpus: tuple[int, ...]  # pattern order
    mask: int
    effective: float | None
    aggregated: float
    preserved: float
    grounded: bool = False  # effective bandwidth from the link-bound model: the size is outside the model's fitted range
    extrapolated: bool = False  # effective bandwidth from the model outside its fitted range (--extrapolate)


@dataclass
class Options:
    backfill: bool = False
    backfill_depth: int = 64
    time_model: TimeModel | None = None
    pin_nodes: bool = True
    reorder_window: int = 10_000
    model: EffectiveBandwidthModel | None = None
    configured: dict | None = None  # policies built with site settings (preserve-ahead's sizes)
    extrapolate: bool = False  # keep the model's own predictions outside its fitted range (marked)


class Decider:
    """Memoised policy decisions and per-topology tables, shared by every run in one process."""

    def __init__(
        self,
        model: EffectiveBandwidthModel | None = None,
        limit: int = 2_000_000,
        configured: dict | None = None,
        *,
        extrapolate: bool = False,
        grounded: LinkBoundModel | None = None,
    ) -> None:
        self.model = model or paper_model()
        self.extrapolate = extrapolate
        self.grounded = grounded
        self._reported: dict = {}
        self.policies = {**ALL_POLICIES, **(configured or {})}  # configured: preserve-ahead with site sizes
        self.memo: dict = {}
        self.limit = limit
        self.graphs: list[HardwareGraph] = []
        self._graph_index: dict[HardwareGraph, int] = {}
        self.requests: dict[Request, int] = {}
        self._request_list: list[Request] = []
        self.preserved_tables: dict[int, list[float] | None] = {}
        self.best_preserved: dict[int, list[float] | None] = {}
        self.searches = 0
        self.lookups = 0

    def graph_id(self, graph: HardwareGraph) -> int:
        found = self._graph_index.get(graph)
        if found is None:
            found = self._graph_index[graph] = len(self.graphs)
            self.graphs.append(graph)
        return found

    def request_id(self, request: Request) -> int:
        found = self.requests.get(request)
        if found is None:
            found = self.requests[request] = len(self._request_list)
            self._request_list.append(request)
        return found

    def _store(self, key, value) -> None:
        if len(self.memo) >= self.limit:
            self.memo.clear()
        self.memo[key] = value

    def sees_running(self, policy: str) -> bool:
        """Whether ``policy`` looks at the running jobs' GPUs (preserve-ahead's outlook)."""
        return getattr(self.policies[policy], "sees_running", False)

    def decide(self, policy: str, gid: int, mask: int, rid: int, queue: tuple[int, ...] | None = None, running: tuple[int, ...] = ()):
        """The decision (or None: does not fit); for round-robin also the new device queue.

        ``running``: the sorted masks of the jobs running on the node, for policies that see them.
        """
        self.lookups += 1
        if queue is not None:
            picked = peers.round_robin_pick(queue, tuple(i for i in range(self.graphs[gid].size) if mask >> i & 1),
                                            self._request_list[rid].gpus)
            if picked is None:
                return None
            chosen = 0
            for g in picked[0]:
                chosen |= 1 << g
            key = (gid, policy, mask, rid, chosen)
            found = self.memo.get(key)
            if found is None:
                self.searches += 1
                graph = self.graphs[gid]
                free = tuple(i for i in range(graph.size) if mask >> i & 1)
                result = order_within(policy, graph, free, picked[0], self._request_list[rid], self.model)
                found = self._decision(gid, rid, result.placement, chosen)
                self._store(key, found)
            return found, picked[1]
        key = (gid, policy, mask, rid, running)
        found = self.memo.get(key)
        if found is not None or key in self.memo:
            return found
        self.searches += 1
        graph = self.graphs[gid]
        request = self._request_list[rid]
        free = tuple(i for i in range(graph.size) if mask >> i & 1)
        new_queue = None
        if running and self.sees_running(policy):
            groups = tuple(tuple(i for i in range(graph.size) if group >> i & 1) for group in running)
            result = self.policies[policy](graph, free, request, self.model, running=groups)
        else:
            result = self.policies[policy](graph, free, request, self.model)
        if not isinstance(result, Allocation):
            self._store(key, None)
            return None
        used = 0
        for g in result.placement.gpus:
            used |= 1 << g
        decision = self._decision(gid, rid, result.placement, used)
        value = (decision, new_queue)
        self._store(key, value)
        return value

    def _decision(self, gid: int, rid: int, placement, used: int) -> Decision:
        """The reported scores of a placement: the set's best order for collectives, and the
        link-bound model's bandwidth outside the model's fitted range (unless extrapolating)."""
        request = self._request_list[rid]
        pattern = request.pattern
        graph = self.graphs[gid]
        key = (gid, used, rid) if pattern.scored_by_set else None
        found = self._reported.get(key) if key is not None else None
        if found is None:
            shown = reported_placement(graph, pattern, placement, self.model)
            effective = shown.effective_bandwidth
            grounded = extrapolated = False
            if effective is not None and not self.model.fitted_for(pattern.size):
                if self.extrapolate:
                    extrapolated = True
                else:
                    effective = (self.grounded or grounded_model()).predict(graph, shown.gpus, pattern)
                    grounded = True
            found = (shown.gpus, effective, shown.aggregated_bandwidth, grounded, extrapolated)
            if key is not None:
                if len(self._reported) >= self.limit:
                    self._reported.clear()
                self._reported[key] = found
        gpus, effective, aggregated, grounded, extrapolated = found
        return Decision(gpus, used, effective, aggregated, placement.preserved_bandwidth, grounded, extrapolated)

    def preserved_table(self, gid: int) -> list[float] | None:
        """Preserved bandwidth (Eq. 3) of every free mask of a node of up to 16 GPUs."""
        if gid in self.preserved_tables:
            return self.preserved_tables[gid]
        graph = self.graphs[gid]
        n = graph.size
        if n > 16:
            self.preserved_tables[gid] = self.best_preserved[gid] = None
            return None
        bw = graph.bandwidth_matrix()
        table = [0.0] * (1 << n)
        for mask in range(1, 1 << n):
            low = (mask & -mask).bit_length() - 1
            rest = mask & (mask - 1)
            total = table[rest]
            r = rest
            while r:
                b = (r & -r).bit_length() - 1
                total += bw[low][b]
                r &= r - 1
            table[mask] = total
        best = [0.0] * (n + 1)
        for mask in range(1 << n):
            c = mask.bit_count()
            if table[mask] > best[c]:
                best[c] = table[mask]
        self.preserved_tables[gid] = table
        self.best_preserved[gid] = best
        return table


@dataclass
class Record:
    """One finished job of one run (what the per-job CSV holds)."""

    id: str
    policy: str
    node: str
    submit: float
    start: float
    end: float
    gpus: tuple[int, ...]
    sensitive: bool
    shape: str
    effective: float | None
    aggregated: float
    preserved: float
    base_runtime: float

    @property
    def wait(self) -> float:
        return self.start - self.submit

    @property
    def runtime(self) -> float:
        return self.end - self.start


@dataclass
class SizeStats:
    """The results of the jobs of one size (GPUs per node) in one run."""

    jobs: int = 0
    eff_sensitive: Dist = field(default_factory=Dist)
    eff_insensitive: Dist = field(default_factory=Dist)
    wait: Dist = field(default_factory=Dist)
    grounded: int = 0
    extrapolated: int = 0


@dataclass
class RunResult:
    policy: str
    jobs: int = 0
    dropped: dict = field(default_factory=dict)
    eff_sensitive: Dist = field(default_factory=Dist)
    eff_insensitive: Dist = field(default_factory=Dist)
    wait: Dist = field(default_factory=Dist)
    runtime: Dist = field(default_factory=Dist)
    runtime_sensitive: Dist = field(default_factory=Dist)
    preserved_after: Dist = field(default_factory=Dist)
    first_submit: float = inf
    last_end: float = -inf
    preserved_area: float = 0.0
    fragmentation_area: float = 0.0
    covered: float = 0.0
    series: Series = field(default_factory=Series)
    out_of_order: int = 0
    decisions: int = 0
    stuck: int = 0
    by_gpus: dict = field(default_factory=dict)  # GPUs per node -> SizeStats
    grounded: int = 0  # jobs whose effective bandwidth came from the link-bound model
    extrapolated: int = 0  # jobs whose effective bandwidth the model extrapolated (--extrapolate)

    def size(self, gpus: int) -> "SizeStats":
        found = self.by_gpus.get(gpus)
        if found is None:
            found = self.by_gpus[gpus] = SizeStats()
        return found

    @property
    def makespan(self) -> float:
        return max(0.0, self.last_end - self.first_submit) if self.jobs else 0.0

    @property
    def throughput_per_hour(self) -> float:
        return self.jobs / self.makespan * 3600.0 if self.makespan > 0 else 0.0

    @property
    def mean_preserved(self) -> float:
        return self.preserved_area / self.covered if self.covered > 0 else 0.0

    @property
    def mean_fragmentation(self) -> float:
        return self.fragmentation_area / self.covered if self.covered > 0 else 0.0


def _reordered(jobs: Iterable[Job], window: int, result: RunResult) -> Iterator[Job]:
    """Jobs in submit order, allowing them to arrive out of order by up to ``window`` positions."""
    heap: list = []
    seq = 0
    last = -inf
    for job in jobs:
        heapq.heappush(heap, (job.submit, seq, job))
        seq += 1
        if len(heap) > window:
            _, _, out = heapq.heappop(heap)
            if out.submit < last:
                result.out_of_order += 1
                out.submit = last
            last = out.submit
            yield out
    while heap:
        _, _, out = heapq.heappop(heap)
        if out.submit < last:
            result.out_of_order += 1
            out.submit = last
        last = out.submit
        yield out


def simulate(
    jobs: Iterable[Job],
    nodes: Sequence[Node],
    policy: str,
    options: Options | None = None,
    *,
    decider: Decider | None = None,
    on_record: Callable[[Record], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay ``jobs`` (in submit order, or nearly) on ``nodes`` with ``policy``."""
    if policy not in ALL_POLICIES:
        raise InputError(f"unknown policy {policy!r} (accepted: {', '.join(ALL_POLICIES)})")
    if not nodes:
        raise InputError("the simulated cluster has no nodes")
    options = options or Options()
    decider = decider or Decider(options.model, configured=options.configured, extrapolate=options.extrapolate)
    result = RunResult(policy)
    stateful = policy in peers.STATEFUL
    n_nodes = len(nodes)
    gids = [decider.graph_id(node.graph) for node in nodes]
    sizes = [node.graph.size for node in nodes]
    free = [(1 << s) - 1 for s in sizes]
    rr_queue = [tuple(range(s)) for s in sizes] if stateful else [None] * n_nodes
    by_name = {node.name: i for i, node in enumerate(nodes)}
    largest = max(sizes)
    tables = [decider.preserved_table(g) for g in gids]
    bests = [decider.best_preserved.get(g) for g in gids]
    contribution = [t[free[i]] if t is not None else 0.0 for i, t in enumerate(tables)]
    best_contribution = [b[sizes[i]] if b is not None else 0.0 for i, b in enumerate(bests)]
    totals = [sum(contribution), sum(best_contribution)]
    model = options.time_model

    arrivals = _reordered(jobs, options.reorder_window, result)
    pending = next(arrivals, None)
    queue: deque = deque()
    running: list = []
    sees_running = decider.sees_running(policy)
    groups: list[list[int]] = [[] for _ in nodes]  # per node: the masks of its running jobs
    seq = 0
    last_t: float | None = None
    releases = 0
    head_failed_at = -1  # ``releases`` when the current head last failed
    head_job = None
    seen = 0

    def account(t: float) -> None:
        nonlocal last_t
        if last_t is not None and t > last_t:
            span = t - last_t
            result.preserved_area += totals[0] * span
            frag = 1.0 - totals[0] / totals[1] if totals[1] > 0 else 0.0
            result.fragmentation_area += frag * span
            result.covered += span
        last_t = t

    def set_free(i: int, mask: int) -> None:
        free[i] = mask
        table = tables[i]
        if table is not None:
            totals[0] -= contribution[i]
            contribution[i] = table[mask]
            totals[0] += contribution[i]
            best = bests[i][mask.bit_count()]
            totals[1] += best - best_contribution[i]
            best_contribution[i] = best

    def candidates(job: Job) -> list[int]:
        if options.pin_nodes and job.nodes == 1 and job.node is not None and job.node in by_name:
            return [by_name[job.node]]
        return list(range(n_nodes))

    def fits_ever(job: Job) -> bool:
        cands = candidates(job)
        return sum(1 for i in cands if sizes[i] >= job.gpus) >= job.nodes

    def try_start(job: Job, rid: int, t: float) -> bool:
        picks = []
        for i in candidates(job):
            mask = free[i]
            if mask.bit_count() < job.gpus:
                continue
            found = decider.decide(policy, gids[i], mask, rid, rr_queue[i] if stateful else None,
                                   tuple(sorted(groups[i])) if sees_running else ())
            if found is None:
                continue
            picks.append((i, found[0], found[1]))
            if len(picks) == job.nodes:
                break
        if len(picks) < job.nodes:
            return False
        nonlocal seq
        result.decisions += 1
        first = picks[0][1]
        runtime = model.runtime(job.runtime, job.sensitive, job.gpus, first.effective) if model else job.runtime
        end = t + runtime
        for i, decision, new_queue in picks:
            set_free(i, free[i] & ~decision.mask)
            if sees_running:
                groups[i].append(decision.mask)
            if stateful:
                rr_queue[i] = new_queue
        heapq.heappush(running, (end, seq, job, picks, t))
        seq += 1
        return True

    def schedule(t: float) -> None:
        nonlocal head_failed_at, head_job
        scanned = 0
        index = 0
        while index < len(queue):
            job, rid = queue[index]
            if index == 0 and head_job is job and head_failed_at == releases and not options.backfill:
                return  # nothing was freed since the head last failed
            if try_start(job, rid, t):
                del queue[index]
                if index == 0:
                    head_job = None
                continue
            if index == 0:
                head_job, head_failed_at = job, releases
            if not options.backfill:
                return
            scanned += 1
            if scanned > options.backfill_depth:
                return
            index += 1

    while True:
        next_arrival = pending.submit if pending is not None else inf
        next_end = running[0][0] if running else inf
        t = min(next_arrival, next_end)
        if t == inf:
            result.stuck = len(queue)
            break
        account(t)
        while running and running[0][0] <= t:
            end, _, job, picks, start = heapq.heappop(running)
            for i, decision, _ in picks:
                set_free(i, free[i] | decision.mask)
                if sees_running:
                    groups[i].remove(decision.mask)
            releases += 1
            first = picks[0][1]
            result.jobs += 1
            result.last_end = max(result.last_end, end)
            result.wait.add(start - job.submit)
            result.runtime.add(end - start)
            if job.sensitive:
                result.runtime_sensitive.add(end - start)
            size = result.size(job.gpus)
            size.jobs += 1
            size.wait.add(start - job.submit)
            if first.effective is not None:
                (result.eff_sensitive if job.sensitive else result.eff_insensitive).add(first.effective)
                (size.eff_sensitive if job.sensitive else size.eff_insensitive).add(first.effective)
            if first.grounded:
                result.grounded += 1
                size.grounded += 1
            if first.extrapolated:
                result.extrapolated += 1
                size.extrapolated += 1
            result.preserved_after.add(first.preserved)
            if on_record is not None:
                on_record(
                    Record(
                        job.id, policy, ",".join(nodes[i].name for i, _, _ in picks), job.submit, start, end,
                        first.gpus, job.sensitive, job.shape, first.effective, first.aggregated, first.preserved, job.runtime,
                    )
                )
        while pending is not None and pending.submit <= t:
            job = pending
            pending = next(arrivals, None)
            seen += 1
            if on_progress is not None and seen % 1000 == 0:
                on_progress(seen)
            result.first_submit = min(result.first_submit, job.submit)
            if not fits_ever(job):
                reason = "larger than every node" if job.gpus > largest or job.nodes > n_nodes else "larger than its recorded node"
                result.dropped[reason] = result.dropped.get(reason, 0) + 1
                continue
            rid = decider.request_id(request_for(job.shape, job.gpus, job.sensitive))
            queue.append((job, rid))
        schedule(t)
        result.series.add(t, totals[0], 1.0 - totals[0] / totals[1] if totals[1] > 0 else 0.0, len(queue), len(running))
    if on_progress is not None:
        on_progress(seen)
    return result

