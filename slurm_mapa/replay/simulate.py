"""The event-driven replay simulator: many nodes, honest arrivals, FIFO with head-of-line blocking.

Events are job arrivals (their submit times) and job ends; nothing happens between events. At an
event the queue is scheduled in order: the head starts on the first node (in node order, or its
recorded node with ``pin_nodes``) where the policy finds room, and with ``backfill`` later jobs
may start while the head waits (up to ``backfill_depth`` of them are looked at). Without it the
queue stops at the first job that does not fit, as in the paper's simulator.

Which node a job starts on is ``Options.node_choice`` (issue 15, see :func:`.node_pick.slurm_pick`):

* ``first-fit`` - the first node in node order where the policy finds room (the default);
* ``slurm``     - select/cons_tres' choice for equal node weights: among the maximal runs of
  consecutive nodes (node order) that can hold the job, the run with the fewest free resources,
  and in it the node with the fewest (the tightest fit); free GPUs stand for free resources;
* ``prefer``    - the same choice among the nodes whose MAPA features (:mod:`~slurm_mapa.core.features`)
  match what the job prefers, else among all (Slurm's ``--prefer``): a sensitive k-GPU job prefers
  ``mapa_ring<k>``, an insensitive one the complement or nothing (``Options.insensitive``). The
  features are those the agents would have published at the start of the scheduling pass: a job
  started earlier in the same pass does not update them (stale within a pass, as in Slurm);
* ``require``   - sensitive jobs hold out for a node with their feature (``--constraint``) until
  they have waited ``Options.require_wait`` seconds, then prefer it; the simulator wakes at that
  bound so the relaxed job is looked at again even if nothing else happens.

CPU affinity (``Options.affinity``, issue 14 item 4, :mod:`~slurm_mapa.core.affinity`): each job's
CPUs on a node are modelled as cons_tres would give them *if it took the lowest-numbered free GPUs*:
every CPU in those GPUs' affinity (:func:`~slurm_mapa.core.affinity.modelled_job_cpus`); the
simulator does not track which cores are busy. Then the affinity mode (strict, prefer, ignore)
wraps the policy as the Prolog would. ``None`` (the default) leaves affinity out, as before;
``ignore`` decides the same but counts how many jobs got GPUs local to their CPUs. Nodes whose
topology has no CPU affinity count every GPU as local; round-robin's stateful path ignores affinity.

Every decision is memoised per (topology, policy, free set, request): a node has at most 2^n free
sets, so a long log costs a bounded number of searches. The scores kept for a decision are the
reported ones (:func:`~slurm_mapa.core.explain.reported_placement`: one number per GPU set for
collectives); for a job size outside the model's fitted range the effective bandwidth comes from
the link-bound model unless the run asks to extrapolate, and the decision says so. Jobs stream through: the simulator keeps
the queue, the running jobs and fixed-size accumulators (a :class:`~.results.RunResult`), never
the whole log.

A decision's cost does not grow with the cluster (issue 28): the nodes are indexed by their number
of free GPUs, first-fit takes the first node with room from a heap per count, and on clusters of
``VECTOR_NODES`` nodes or more slurm/prefer/require pick among runs of eligible nodes with array
operations (:func:`.node_pick._pick_vector`, the same choice as :func:`.node_pick.slurm_pick`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, replace
from math import inf
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core import features as mapa_features
from ..core import peers
from ..core.affinity import check_settings as check_affinity
from ..core.affinity import decide as affinity_decide
from ..core.affinity import cpus_of_slurms_gpus, gpu_cpus, modelled_job_cpus
from ..core.effbw import EffectiveBandwidthModel, LinkBoundModel
from ..core.model_files import grounded_model
from ..core.explain import reported_placement
from ..core.fast_ring import has_fast_ring
from ..core.hardware import HardwareGraph
from ..core.ahead import AHEAD_POLICIES
from ..core.peers import PEER_POLICIES
from ..core.policies import POLICIES, Allocation, Request, order_within
from ..errors import InputError
from .directives import request_for
from .jobs import Job
from .node_pick import _pick_sorted, _pick_vector
from .results import Record, RunResult
from .timemodel import TimeModel

ALL_POLICIES = {**POLICIES, **PEER_POLICIES, **AHEAD_POLICIES}
NODE_CHOICES = ("first-fit", "slurm", "prefer", "require")
# What an insensitive job (or a 1-GPU one) prefers under prefer/require:
#   complement     - mapa_noring<k> of its own size (mapa_noring<smallest size> for a 1-GPU job)
#   complement-min - mapa_noring<smallest size>: a node with no good ring of any size left
#   best-fit       - nothing: Slurm's tightest fit
INSENSITIVE_CHOICES = ("best-fit", "complement", "complement-min")


# From this many nodes on, the simulator indexes the nodes by free GPUs instead of scanning them.
INDEX_NODES = 32
# From this many nodes on, slurm/prefer/require pick among the nodes with array operations (the
# same choice as :func:`_pick_sorted`, which a smaller cluster uses: a Python loop over a few nodes
# costs less than the array calls).
VECTOR_NODES = 64


# Decider(judge=JUDGE_RANKING): every decision judged by the model that ranked it (the paper's way).
JUDGE_RANKING = "ranking"


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
    effective: float | None  # the judging model's effective bandwidth (Decider.judge): what every report shows
    aggregated: float
    preserved: float
    grounded: bool = False  # judged by the link-bound model instead: the size is outside the judge's fitted range
    extrapolated: bool = False  # judged by the judge outside its fitted range (--extrapolate)
    local: bool | None = None  # GPUs local to the job's modelled CPUs; None: affinity not modelled or the node has none
    ranked: float | None = None  # the ranking model's own prediction (what the policy maximized; eff= in the Prolog's record)
    fast_ring: bool | None = None  # the GPUs hold a ring over fast links only (core.fast_ring); None: not checked


@dataclass
class Options:
    backfill: bool = False
    backfill_depth: int = 64
    time_model: TimeModel | None = None
    pin_nodes: bool = True
    reorder_window: int = 10_000
    model: EffectiveBandwidthModel | None = None
    configured: dict | None = None  # policies built with site settings (preserve-ahead's sizes)
    extrapolate: bool = False  # keep the judge's own predictions outside its fitted range (marked)
    judge: EffectiveBandwidthModel | LinkBoundModel | None = None  # what scores the decisions (None: link-bound); see Decider
    node_choice: str = "first-fit"  # see NODE_CHOICES
    insensitive: str = "complement"  # what insensitive jobs prefer under prefer/require: see INSENSITIVE_CHOICES
    feature_threshold: float = mapa_features.DEFAULT_THRESHOLD
    feature_sizes: tuple[int, ...] | None = None  # ring sizes the nodes publish (None: 2 .. largest node)
    require_wait: float = 3600.0  # seconds a 'require' job holds out for its feature
    affinity: str | None = None  # CPU affinity mode (strict, prefer, ignore); None: not modelled
    affinity_max_loss: float = 0.1  # prefer: the fraction of the value a local choice may give up


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
        judge: EffectiveBandwidthModel | LinkBoundModel | str | None = None,
    ) -> None:
        # ``model``: the ranking model, one for every node (--model, the config's `model`); None:
        # each node type ranked by its own (hardware.load.model_for_topology), as the Prolog ranks.
        # ``judge``: the model that scores every decision for the reports (--judge); None: the
        # link-bound model, which no policy ranks with, so that a choice is not judged by the
        # numbers it maximized (issue 38); JUDGE_RANKING: each node's ranking model (the paper's
        # own way, for reproducing its figures). ``self.feature_model``: what node features price
        # rings with, the ranking model (agent.features does the same).
        self.fixed_model = model
        self.feature_model = model or self.model_for
        self._models: dict[HardwareGraph, EffectiveBandwidthModel] = {}
        self.extrapolate = extrapolate
        self.grounded = grounded
        self.judge = grounded_model() if judge is None else judge
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

    @property
    def judge_name(self) -> str:
        if self.judge == JUDGE_RANKING:
            return f"the ranking model ({self.fixed_model.name})" if self.fixed_model is not None else "each node's ranking model"
        return self.judge.name

    def model_for(self, graph: HardwareGraph) -> EffectiveBandwidthModel:
        """The model that ranks decisions on ``graph``."""
        if self.fixed_model is not None:
            return self.fixed_model
        found = self._models.get(graph)
        if found is None:
            from ..hardware.load import model_for_topology

            found = self._models[graph] = model_for_topology(graph)
        return found

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

    def decide(self, policy: str, gid: int, mask: int, rid: int, queue: tuple[int, ...] | None = None, running: tuple[int, ...] = (),
               affinity: tuple[str, float] | None = None, slurm_gpus: tuple[int, ...] | None = None,
               job_cpus: frozenset[int] | None = None):
        """The decision (or None: does not fit); for round-robin also the new device queue.

        ``running``: the sorted masks of the jobs running on the node, for policies that see them.
        ``affinity``: (mode, max_loss) of the CPU affinity rule, with the job's CPUs modelled from
        the free mask (module docstring), or, given ``slurm_gpus`` (a recorded decision's
        ``slurm=``), from the GPUs Slurm picked, as the Prolog takes them, or given ``job_cpus``
        (its ``cpus=``), those; None: no affinity.
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
                result = order_within(policy, graph, free, picked[0], self._request_list[rid], self.model_for(graph))
                found = self._decision(gid, rid, result.placement, chosen)
                self._store(key, found)
            return found, picked[1]
        key = (gid, policy, mask, rid, running) if affinity is None else (gid, policy, mask, rid, running, affinity, slurm_gpus, job_cpus)
        found = self.memo.get(key)
        if found is not None or key in self.memo:
            return found
        self.searches += 1
        graph = self.graphs[gid]
        request = self._request_list[rid]
        free = tuple(i for i in range(graph.size) if mask >> i & 1)
        new_queue = None
        model = self.model_for(graph)
        if running and self.sees_running(policy):
            groups = tuple(tuple(i for i in range(graph.size) if group >> i & 1) for group in running)

            def run(subset: tuple[int, ...]):
                return self.policies[policy](graph, subset, request, model, running=groups)
        else:
            def run(subset: tuple[int, ...]):
                return self.policies[policy](graph, subset, request, model)
        local = None
        if affinity is None:
            result = run(free)
        else:
            if job_cpus is not None:
                cpus = job_cpus
            elif slurm_gpus is not None:
                cpus = cpus_of_slurms_gpus(graph, slurm_gpus)
            else:
                cpus = modelled_job_cpus(graph, free, request.gpus)
            result, why = affinity_decide(run, graph, free, request, cpus, affinity[0], max_loss=affinity[1], policy=policy)
            local = why.local if gpu_cpus(graph) is not None else None
        if not isinstance(result, Allocation):
            self._store(key, None)
            return None
        used = 0
        for g in result.placement.gpus:
            used |= 1 << g
        decision = self._decision(gid, rid, result.placement, used)
        if local is not None:
            decision = replace(decision, local=local)
        value = (decision, new_queue)
        self._store(key, value)
        return value

    def _decision(self, gid: int, rid: int, placement, used: int) -> Decision:
        """The reported scores of a placement: the set's best order for collectives; its effective
        bandwidth by the judge (by the link-bound model outside a fitted judge's range, unless
        extrapolating), and by the ranking model (``ranked``)."""
        request = self._request_list[rid]
        pattern = request.pattern
        graph = self.graphs[gid]
        key = (gid, used, rid) if pattern.scored_by_set else None
        found = self._reported.get(key) if key is not None else None
        if found is None:
            model = self.model_for(graph)
            shown = reported_placement(graph, pattern, placement, model)
            ranked = shown.effective_bandwidth
            judge = model if self.judge == JUDGE_RANKING else self.judge
            grounded = extrapolated = False
            if isinstance(judge, LinkBoundModel):
                effective = judge.predict(graph, shown.gpus, pattern)
            else:
                effective = ranked if judge is model else reported_placement(graph, pattern, placement, judge).effective_bandwidth
                if effective is not None and not judge.fitted_for(pattern.size):
                    if self.extrapolate:
                        extrapolated = True
                    else:
                        effective = (self.grounded or grounded_model()).predict(graph, shown.gpus, pattern)
                        grounded = True
            fast = has_fast_ring(graph, shown.gpus) if pattern.size >= 2 and pattern.edges else None
            found = (shown.gpus, effective, shown.aggregated_bandwidth, grounded, extrapolated, ranked, fast)
            if key is not None:
                if len(self._reported) >= self.limit:
                    self._reported.clear()
                self._reported[key] = found
        gpus, effective, aggregated, grounded, extrapolated, ranked, fast = found
        return Decision(gpus, used, effective, aggregated, placement.preserved_bandwidth, grounded, extrapolated,
                        ranked=ranked, fast_ring=fast)

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
    if options.node_choice not in NODE_CHOICES:
        raise InputError(f"unknown node choice {options.node_choice!r} (accepted: {', '.join(NODE_CHOICES)})")
    if options.insensitive not in INSENSITIVE_CHOICES:
        raise InputError(f"unknown choice for insensitive jobs {options.insensitive!r} (accepted: {', '.join(INSENSITIVE_CHOICES)})")
    if not 0 < options.feature_threshold <= 1:
        raise InputError(f"feature threshold must be a fraction in (0, 1], got {options.feature_threshold:g}")
    if options.require_wait < 0:
        raise InputError(f"the require wait bound must be 0 or more, got {options.require_wait:g}")
    if options.affinity is not None:
        check_affinity(options.affinity, options.affinity_max_loss)
    affinity = (options.affinity, float(options.affinity_max_loss)) if options.affinity is not None else None
    decider = decider or Decider(options.model, configured=options.configured, extrapolate=options.extrapolate,
                                 judge=options.judge)
    result = RunResult(policy, node_choice=options.node_choice, judge=decider.judge_name)
    choice = options.node_choice
    by_features = choice in ("prefer", "require")
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
    graphs = [node.graph for node in nodes]
    feature_sizes = tuple(sorted(set(options.feature_sizes))) if options.feature_sizes else tuple(range(2, largest + 1))
    smallest_size = feature_sizes[0] if feature_sizes else None
    fleet: dict[int, float | None] = {}  # size -> the fleet's best idle ring, computed when first asked

    def fleet_best(k: int) -> float | None:
        if k not in fleet:
            fleet[k] = mapa_features.fleet_best(graphs, (k,), decider.feature_model).get(k) if k in feature_sizes else None
        return fleet[k]

    def wanted(job: Job) -> tuple[bool, int] | None:
        """(good ring wanted, size) of the feature the job prefers, or None (no preference)."""
        if job.sensitive and job.gpus >= 2:
            return (True, job.gpus) if fleet_best(job.gpus) is not None else None
        if options.insensitive == "best-fit" or smallest_size is None:
            return None
        k = smallest_size if options.insensitive == "complement-min" else max(job.gpus, smallest_size)
        return (False, k) if fleet_best(k) is not None else None

    feature_memo: dict = {}  # (node type, mask, want) -> has the feature: nodes of one type repeat states

    def has_feature(i: int, mask: int, want: tuple[bool, int]) -> bool:
        key = (gids[i], mask, want)
        found = feature_memo.get(key)
        if found is None:
            good, k = want
            found = feature_memo[key] = (
                mapa_features.has_good(graphs[i], mask, k, fleet[k], decider.feature_model, options.feature_threshold) == good)
        return found

    # The index that keeps a decision's cost independent of the cluster's size: the nodes by their
    # number of free GPUs (a set per count, for slurm/prefer/require, which look at every node that
    # can hold the job), and for first-fit a min-heap of node indices per count (lazy: an entry is
    # current while the node still has that count), so the first node in node order with room is
    # found without scanning the others.
    # A small cluster is scanned, as before: on a few nodes that costs less than keeping the index.
    count = [s for s in sizes]
    indexed = n_nodes >= INDEX_NODES
    by_count: list[set[int]] = [set() for _ in range(largest + 1)]
    for i, c in enumerate(count):
        if indexed:
            by_count[c].add(i)
    first_fit = choice == "first-fit"
    heaps: list[list[int]] = [sorted(b) for b in by_count] if first_fit and indexed else []
    nodes_of_size = [sum(1 for s in sizes if s >= g) for g in range(largest + 1)]  # nodes with >= g GPUs
    changed_in_pass: dict[int, int] = {}  # node -> its free mask when the scheduling pass began (features are stale in a pass)
    # Large clusters (slurm/prefer/require): the free counts as an array, and per wanted feature an
    # array of which nodes published it at the start of the pass (refreshed there for the nodes
    # that changed since: ``dirty``).
    vector = choice != "first-fit" and n_nodes >= VECTOR_NODES
    count_array = np.array(count, dtype=np.int64) if vector else None
    feature_arrays: dict[tuple[bool, int], np.ndarray] = {}
    dirty: set[int] = set()

    def features_of(want: tuple[bool, int], published: dict[int, int]) -> np.ndarray:
        found = feature_arrays.get(want)
        if found is None:
            found = feature_arrays[want] = np.array(
                [has_feature(i, published.get(i, free[i]), want) for i in range(n_nodes)], dtype=bool)
        return found

    def refresh_features() -> None:
        """At the start of a pass: the nodes changed since the last one publish their features again."""
        for want, flags in feature_arrays.items():
            for i in dirty:
                key = (gids[i], free[i], want)
                found = feature_memo.get(key)
                flags[i] = found if found is not None else has_feature(i, free[i], want)
        dirty.clear()

    wakeups: list[float] = []  # require: when a job's wait bound ends
    woken: set[str] = set()  # the queued jobs with a wait bound set

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
        if vector and by_features:
            dirty.add(i)
        c = mask.bit_count()
        if c != count[i]:
            if indexed:
                by_count[count[i]].discard(i)
                by_count[c].add(i)
                if first_fit:
                    heap = heaps[c]
                    heapq.heappush(heap, i)
                    if len(heap) > 2 * len(by_count[c]) + 32:  # drop the stale entries now and then
                        heaps[c] = sorted(by_count[c])
            count[i] = c
            if vector:
                count_array[i] = c
        table = tables[i]
        if table is not None:
            totals[0] -= contribution[i]
            contribution[i] = table[mask]
            totals[0] += contribution[i]
            best = bests[i][c]
            totals[1] += best - best_contribution[i]
            best_contribution[i] = best

    def pinned(job: Job) -> bool:
        return options.pin_nodes and job.nodes == 1 and job.node is not None and job.node in by_name

    def fits_ever(job: Job) -> bool:
        if pinned(job):
            return sizes[by_name[job.node]] >= job.gpus and job.nodes <= 1
        return job.gpus <= largest and nodes_of_size[max(job.gpus, 0)] >= job.nodes

    def eligible(job: Job) -> list[int]:
        """The candidate nodes with at least the job's GPUs free, in node order."""
        g = job.gpus
        if pinned(job):
            i = by_name[job.node]
            return [i] if count[i] >= g else []
        if not indexed:
            return [i for i in range(n_nodes) if count[i] >= g]
        found: list[int] = []
        for c in range(max(g, 0), largest + 1):
            found.extend(by_count[c])
        found.sort()
        return found

    def first_with_room(g: int) -> int | None:
        """The first node in node order with at least ``g`` free GPUs (the heads of the per-count heaps)."""
        best = None
        for c in range(max(g, 0), largest + 1):
            heap = heaps[c]
            while heap and count[heap[0]] != c:
                heapq.heappop(heap)
            if heap and (best is None or heap[0] < best):
                best = heap[0]
        return best

    def decide_on(i: int, rid: int):
        return decider.decide(policy, gids[i], free[i], rid, rr_queue[i] if stateful else None,
                              tuple(sorted(groups[i])) if sees_running else (), affinity)

    def chosen_nodes(job: Job, rid: int, t: float, published: dict[int, int] | None) -> tuple[list, int] | None:
        """slurm / prefer / require: the picks, and 1/-1/0 for preference met/missed/none; None: wait."""
        on_array = vector and not pinned(job)
        fits = (count_array >= job.gpus) if on_array else eligible(job)
        want = wanted(job) if by_features and not pinned(job) else None  # a job kept on its recorded node prefers nothing
        outcome = 0
        order = None
        if want is not None:
            assert published is not None
            if on_array:
                order = _pick_vector(fits & features_of(want, published), count_array, job.nodes)
            else:
                good = [i for i in fits if has_feature(i, published.get(i, free[i]), want)]
                order = _pick_sorted(good, count, job.nodes)
            outcome = 1
            if order is None:
                if choice == "require" and want[0] and t - job.submit < options.require_wait:
                    if job.id not in woken:
                        woken.add(job.id)
                        heapq.heappush(wakeups, job.submit + options.require_wait)
                    return None
                outcome = -1
        if order is None:
            order = _pick_vector(fits, count_array, job.nodes) if on_array else _pick_sorted(fits, count, job.nodes)
            if order is None:
                return None
        picks = []
        for i in order:
            found = decide_on(i, rid)
            if found is None:  # the policy found no room although the count fits: no other node is tried
                return None
            picks.append((i, found[0], found[1]))
        return picks, outcome

    def try_start(job: Job, rid: int, t: float, published: dict[int, int] | None = None) -> bool:
        outcome = 0
        if first_fit:
            picks = []
            first = None if not indexed or pinned(job) or job.nodes > 1 else first_with_room(job.gpus)
            found = decide_on(first, rid) if first is not None else None
            if found is not None:  # the usual case: the first node with room takes it
                picks.append((first, found[0], found[1]))
            else:  # small cluster, pinned, multi-node, or the policy found no room where the count fits: node order
                for i in eligible(job):
                    found = decide_on(i, rid)
                    if found is None:
                        continue
                    picks.append((i, found[0], found[1]))
                    if len(picks) == job.nodes:
                        break
            if len(picks) < job.nodes:
                return False
        else:
            chosen = chosen_nodes(job, rid, t, published)
            if chosen is None:
                return False
            picks, outcome = chosen
        if outcome > 0:
            result.preference_met += 1
        elif outcome < 0:
            result.preference_missed += 1
            if choice == "require" and job.sensitive and job.gpus >= 2:
                result.relaxed += 1
        nonlocal seq
        result.decisions += 1
        if woken:
            woken.discard(job.id)  # started: its wait bound is no longer needed (the set stays as small as the queue)
        first = picks[0][1]
        runtime = model.runtime(job.runtime, job.sensitive, job.gpus, first.effective) if model else job.runtime
        end = t + runtime
        for i, decision, new_queue in picks:
            if published is not None and i not in published:
                published[i] = free[i]
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
        # The features as published at the start of the pass: a node a job started on in this pass
        # keeps its mask from then (changed_in_pass), every other node's is its free mask.
        changed_in_pass.clear()
        published = changed_in_pass if by_features else None
        if dirty and by_features:
            refresh_features()
        while index < len(queue):
            job, rid = queue[index]
            if index == 0 and head_job is job and head_failed_at == releases and not options.backfill:
                return  # nothing was freed (and no wait bound ended) since the head last failed
            if try_start(job, rid, t, published):
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
        next_wakeup = wakeups[0] if wakeups else inf
        t = min(next_arrival, next_end, next_wakeup)
        if t == inf:
            result.stuck = len(queue)
            break
        account(t)
        while wakeups and wakeups[0] <= t:
            heapq.heappop(wakeups)
            releases += 1  # a wait bound ended: the head may start now
        while running and running[0][0] <= t:
            end, _, job, picks, start = heapq.heappop(running)
            for i, decision, _ in picks:
                set_free(i, free[i] | decision.mask)
                if sees_running:
                    groups[i].remove(decision.mask)
            releases += 1
            first = picks[0][1]
            localities = [decision.local for _, decision, _ in picks if decision.local is not None]
            if localities:
                if all(localities):
                    result.affinity_local += 1
                else:
                    result.affinity_remote += 1
            result.jobs += 1
            result.last_end = max(result.last_end, end)
            result.wait.add(start - job.submit)
            if job.sensitive and job.gpus >= 2:
                result.wait_sensitive.add(start - job.submit)
            result.runtime.add(end - start)
            if job.sensitive:
                result.runtime_sensitive.add(end - start)
            size = result.size(job.gpus)
            size.jobs += 1
            size.wait.add(start - job.submit)
            if first.effective is not None:
                (result.eff_sensitive if job.sensitive else result.eff_insensitive).add(first.effective)
                (size.eff_sensitive if job.sensitive else size.eff_insensitive).add(first.effective)
            if job.sensitive and first.ranked is not None:
                result.ranked_sensitive.add(first.ranked)
                size.ranked_sensitive.add(first.ranked)
            if job.sensitive and first.fast_ring is not None:
                result.ring_checked += 1
                size.ring_checked += 1
                if first.fast_ring:
                    result.fast_ring += 1
                    size.fast_ring += 1
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
                        job.id, result.label, ",".join(nodes[i].name for i, _, _ in picks), job.submit, start, end,
                        first.gpus, job.sensitive, job.shape, first.effective, first.aggregated, first.preserved, job.runtime,
                        first.ranked, first.fast_ring,
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

