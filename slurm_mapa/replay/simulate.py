"""The event-driven replay simulator: many nodes, honest arrivals, FIFO with head-of-line blocking.

Events are job arrivals (their submit times) and job ends; nothing happens between events. At an
event the queue is scheduled in order: the head starts on the first node (in node order, or its
recorded node with ``pin_nodes``) where the policy finds room, and with ``backfill`` later jobs
may start while the head waits (up to ``backfill_depth`` of them are looked at). Without it the
queue stops at the first job that does not fit, as in the paper's simulator.

Which node a job starts on (first-fit, Slurm's choice, MAPA's node features and weights), how
long a 'require' job holds out and CPU affinity are :class:`~.options.Options`: see :mod:`.options`.

Decisions come from a :class:`~.decider.Decider`, memoised per (topology, policy, free set,
request). Jobs stream through: the simulator keeps the queue, the running jobs and fixed-size
accumulators (a :class:`~.results.RunResult`), never the whole log.

The state of one replay is a :class:`Simulation`: the cluster (free GPUs per node, the index by
free count, the features the nodes publish), the queue, the running jobs and the result; the
event loop's steps are its methods (``finish`` the jobs that end, ``admit`` the arrivals,
``schedule`` the queue, and within it ``try_start`` a job on the nodes ``first_fit_nodes`` or
``chosen_nodes`` pick).

A decision's cost does not grow with the cluster (issue 28): the nodes are indexed by their number
of free GPUs, first-fit takes the first node with room from a heap per count, and on clusters of
``VECTOR_NODES`` nodes or more slurm/prefer/require pick among runs of eligible nodes with array
operations (:func:`.node_pick._pick_vector`, the same choice as :func:`.node_pick.slurm_pick`).
"""
from __future__ import annotations

import heapq
from collections import deque
from math import inf
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core import features as mapa_features
from ..core import peers
from ..core.wait_rule import holding_pays, loss_if_started_now
from .decider import ALL_POLICIES, JUDGE_RANKING, Decider, Decision  # noqa: F401 - JUDGE_RANKING, Decision: this module's callers name them here
from .directives import request_for
from .jobs import Job
from .node_pick import _pick_sorted, _pick_vector, weighted_pick
from .options import INSENSITIVE_CHOICES, NODE_CHOICES, WAIT_RULES, Node, Options, check_options  # noqa: F401 - callers name them here
from .results import Record, RunResult
from .timemodel import TimeModel

# From this many nodes on, the simulator indexes the nodes by free GPUs instead of scanning them.
INDEX_NODES = 32
# From this many nodes on, slurm/prefer/require pick among the nodes with array operations (the
# same choice as :func:`_pick_sorted`, which a smaller cluster uses: a Python loop over a few nodes
# costs less than the array calls).
VECTOR_NODES = 64


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


# A started job's node choices: (node index, decision, round-robin's new device queue or None).
Picks = list[tuple[int, Decision, "tuple[int, ...] | None"]]


class Simulation:
    """The state of one replay of one policy on one cluster, and the event loop's steps.

    The cluster: ``free`` (each node's free GPUs as a mask), ``count`` (their number) and the index
    by count that keeps a decision's cost independent of the cluster's size; the features the
    nodes publish (``has_feature``, refreshed at the start of a scheduling pass). The work: the
    ``queue`` (job, request id), the ``running`` jobs (a heap by end time), the ``wakeups`` of
    'require' wait bounds. The reports: ``result`` and the preserved-bandwidth ``totals``.
    """

    def __init__(self, nodes: Sequence[Node], policy: str, options: Options, decider: Decider) -> None:
        self.nodes, self.policy, self.options, self.decider = nodes, policy, options, decider
        self.result = RunResult(policy, node_choice=options.node_choice, judge=decider.judge_name)
        self.affinity = (options.affinity, float(options.affinity_max_loss)) if options.affinity is not None else None
        self.choice = choice = options.node_choice
        self.by_features = choice in ("prefer", "require")
        self.first_fit = choice == "first-fit"
        self.stateful = policy in peers.STATEFUL
        self.sees_running = decider.sees_running(policy)
        self.n_nodes = n_nodes = len(nodes)
        self.gids = [decider.graph_id(node.graph) for node in nodes]
        self.graphs = [node.graph for node in nodes]
        self.sizes = sizes = [node.graph.size for node in nodes]
        self.free = [(1 << s) - 1 for s in sizes]
        self.rr_queue: list = [tuple(range(s)) for s in sizes] if self.stateful else [None] * n_nodes
        self.by_name = {node.name: i for i, node in enumerate(nodes)}
        self.largest = largest = max(sizes)
        self.total_gpus = sum(sizes)
        self.groups: list[list[int]] = [[] for _ in nodes]  # per node: the masks of its running jobs

        # Preserved bandwidth (Eq. 3) of the free GPUs, node by node and in total, against the best
        # the same numbers of free GPUs could preserve: the fragmentation the reports show.
        self.tables = [decider.preserved_table(g) for g in self.gids]
        self.bests = [decider.best_preserved.get(g) for g in self.gids]
        self.contribution = [t[self.free[i]] if t is not None else 0.0 for i, t in enumerate(self.tables)]
        self.best_contribution = [b[sizes[i]] if b is not None else 0.0 for i, b in enumerate(self.bests)]
        self.totals = [sum(self.contribution), sum(self.best_contribution)]

        self.feature_sizes = tuple(sorted(set(options.feature_sizes))) if options.feature_sizes else tuple(range(2, largest + 1))
        self.smallest_size = self.feature_sizes[0] if self.feature_sizes else None
        self.fleet: dict[int, float | None] = {}  # size -> the fleet's best idle ring, computed when first asked
        self.feature_memo: dict = {}  # (node type, mask, want) -> has the feature: nodes of one type repeat states

        # The index that keeps a decision's cost independent of the cluster's size: the nodes by
        # their number of free GPUs (a set per count, for slurm/prefer/require, which look at every
        # node that can hold the job), and for first-fit a min-heap of node indices per count (lazy:
        # an entry is current while the node still has that count), so the first node in node order
        # with room is found without scanning the others. A small cluster is scanned: on a few
        # nodes that costs less than keeping the index.
        self.count = list(sizes)
        self.indexed = n_nodes >= INDEX_NODES
        self.by_count: list[set[int]] = [set() for _ in range(largest + 1)]
        if self.indexed:
            for i, c in enumerate(self.count):
                self.by_count[c].add(i)
        self.heaps: list[list[int]] = [sorted(b) for b in self.by_count] if self.first_fit and self.indexed else []
        self.nodes_of_size = [sum(1 for s in sizes if s >= g) for g in range(largest + 1)]  # nodes with >= g GPUs
        # node -> its free mask when the scheduling pass began (features are stale in a pass)
        self.changed_in_pass: dict[int, int] = {}
        # Large clusters (slurm/prefer/require): the free counts as an array, and per wanted feature
        # an array of which nodes published it at the start of the pass (refreshed there for the
        # nodes that changed since: ``dirty``).
        self.weighted = options.node_weights
        self.vector = not self.first_fit and not self.weighted and n_nodes >= VECTOR_NODES
        self.count_array = np.array(self.count, dtype=np.int64) if self.vector else None
        self.feature_arrays: dict[tuple[bool, int], np.ndarray] = {}
        self.dirty: set[int] = set()

        # require, wait rule 'cost': what the rule prices a slowdown with, the best ring of the fleet per
        # request, and per scheduling pass the times nodes will have a wanted ring and the jobs holding out
        self.pricing = options.wait_pricing or options.time_model or TimeModel()
        self.fleet_ring: dict[int, float] = {}
        self.ring_times: dict[tuple[bool, int], list[float]] = {}
        self.holding: dict[int, int] = {}
        self.wakeups: list[float] = []  # require: when a job's wait bound ends
        self.woken: set[str] = set()  # the queued jobs with a wait bound set
        self.queue: deque = deque()
        self.running: list = []  # heap of (end, seq, job, picks, start)
        self.seq = 0
        self.last_t: float | None = None
        self.releases = 0  # GPUs freed or wait bounds ended so far: the head may start after one
        self.head_failed_at = -1  # ``releases`` when the current head last failed
        self.head_job: Job | None = None

    # --- node features (prefer, require) ---------------------------------------------------------

    def fleet_best(self, k: int) -> float | None:
        fleet = self.fleet
        if k not in fleet:
            fleet[k] = (mapa_features.fleet_best(self.graphs, (k,), self.decider.feature_model).get(k)
                        if k in self.feature_sizes else None)
        return fleet[k]

    def wanted(self, job: Job) -> tuple[bool, int] | None:
        """(good ring wanted, size) of the feature the job prefers, or None (no preference)."""
        if job.sensitive and job.gpus >= 2:
            return (True, job.gpus) if self.fleet_best(job.gpus) is not None else None
        insensitive = self.options.insensitive
        if insensitive == "best-fit" or self.smallest_size is None:
            return None
        k = self.smallest_size if insensitive == "complement-min" else max(job.gpus, self.smallest_size)
        return (False, k) if self.fleet_best(k) is not None else None

    def has_feature(self, i: int, mask: int, want: tuple[bool, int]) -> bool:
        key = (self.gids[i], mask, want)
        found = self.feature_memo.get(key)
        if found is None:
            good, k = want
            found = self.feature_memo[key] = (
                mapa_features.has_good(self.graphs[i], mask, k, self.fleet[k], self.decider.feature_model,
                                       self.options.feature_threshold) == good)
        return found

    def features_of(self, want: tuple[bool, int], published: dict[int, int]) -> np.ndarray:
        found = self.feature_arrays.get(want)
        if found is None:
            free = self.free
            found = self.feature_arrays[want] = np.array(
                [self.has_feature(i, published.get(i, free[i]), want) for i in range(self.n_nodes)], dtype=bool)
        return found

    def refresh_features(self) -> None:
        """At the start of a pass: the nodes changed since the last one publish their features again."""
        for want, flags in self.feature_arrays.items():
            for i in self.dirty:
                key = (self.gids[i], self.free[i], want)
                found = self.feature_memo.get(key)
                flags[i] = found if found is not None else self.has_feature(i, self.free[i], want)
        self.dirty.clear()

    # --- the cluster's state ---------------------------------------------------------------------

    def account(self, t: float) -> None:
        """The preserved bandwidth and fragmentation areas up to ``t``."""
        last_t, totals, result = self.last_t, self.totals, self.result
        if last_t is not None and t > last_t:
            span = t - last_t
            result.preserved_area += totals[0] * span
            frag = 1.0 - totals[0] / totals[1] if totals[1] > 0 else 0.0
            result.fragmentation_area += frag * span
            result.covered += span
        self.last_t = t

    def set_free(self, i: int, mask: int) -> None:
        self.free[i] = mask
        if self.vector and self.by_features:
            self.dirty.add(i)
        c = mask.bit_count()
        count = self.count
        if c != count[i]:
            if self.indexed:
                by_count = self.by_count
                by_count[count[i]].discard(i)
                by_count[c].add(i)
                if self.first_fit:
                    heap = self.heaps[c]
                    heapq.heappush(heap, i)
                    if len(heap) > 2 * len(by_count[c]) + 32:  # drop the stale entries now and then
                        self.heaps[c] = sorted(by_count[c])
            count[i] = c
            if self.vector:
                self.count_array[i] = c
        table = self.tables[i]
        if table is not None:
            totals = self.totals
            totals[0] -= self.contribution[i]
            self.contribution[i] = table[mask]
            totals[0] += self.contribution[i]
            best = self.bests[i][c]
            totals[1] += best - self.best_contribution[i]
            self.best_contribution[i] = best

    # --- where a job may go ----------------------------------------------------------------------

    def pinned(self, job: Job) -> bool:
        return self.options.pin_nodes and job.nodes == 1 and job.node is not None and job.node in self.by_name

    def fits_ever(self, job: Job) -> bool:
        if self.pinned(job):
            return self.sizes[self.by_name[job.node]] >= job.gpus and job.nodes <= 1
        return job.gpus <= self.largest and self.nodes_of_size[max(job.gpus, 0)] >= job.nodes

    def eligible(self, job: Job) -> list[int]:
        """The candidate nodes with at least the job's GPUs free, in node order."""
        g = job.gpus
        count = self.count
        if self.pinned(job):
            i = self.by_name[job.node]
            return [i] if count[i] >= g else []
        if not self.indexed:
            return [i for i in range(self.n_nodes) if count[i] >= g]
        found: list[int] = []
        for c in range(max(g, 0), self.largest + 1):
            found.extend(self.by_count[c])
        found.sort()
        return found

    def first_with_room(self, g: int) -> int | None:
        """The first node in node order with at least ``g`` free GPUs (the heads of the per-count heaps)."""
        best = None
        count, heaps = self.count, self.heaps
        for c in range(max(g, 0), self.largest + 1):
            heap = heaps[c]
            while heap and count[heap[0]] != c:
                heapq.heappop(heap)
            if heap and (best is None or heap[0] < best):
                best = heap[0]
        return best

    def pick(self, candidates: list[int], needed: int, published: dict[int, int] | None) -> list[int] | None:
        """Slurm's choice among ``candidates`` (node order): the tightest fit, after the lowest weight
        when the nodes publish weights."""
        if not self.weighted:
            return _pick_sorted(candidates, self.count, needed)
        free, tables = self.free, self.tables
        weights = {}
        for i in candidates:
            table = tables[i]
            weights[i] = mapa_features.weight_of_preserved(table[published.get(i, free[i]) if published is not None else free[i]]) if table is not None else 1
        return weighted_pick(candidates, weights, self.count, needed)

    # --- how long a 'require' job holds out (wait rule 'cost') -----------------------------------

    def best_ring(self, rid: int, k: int) -> float:
        """The effective bandwidth Preserve gives the request on an idle node of the fleet's best type
        (the time model's and the wait rule's full speed); 0 when no node type gives one."""
        found = self.fleet_ring.get(rid)
        if found is None:
            values = [self.decider.decide("preserve", gid, (1 << size) - 1, rid)
                      for gid, size in dict.fromkeys(zip(self.gids, self.sizes)) if size >= k]
            found = self.fleet_ring[rid] = max((v[0].effective for v in values if v is not None and v[0].effective is not None),
                                               default=0.0)
        return found

    def ring_wait(self, want: tuple[bool, int], t: float, ahead: int) -> float:
        """Expected seconds until a node publishes ``want`` for the job with ``ahead`` jobs holding out
        for the same ring before it: the running jobs end when they will (the replay knows; Slurm's
        backfill plans with time limits), node by node, until the node has the ring."""
        times = self.ring_times.get(want)
        if times is None:
            ends: dict[int, list[tuple[float, int]]] = {}
            limits = self.options.wait_limits  # > 0: jobs end at their time limits, as Slurm expects
            for end, _, job, picks, start in self.running:
                for i, decision, _ in picks:
                    ends.setdefault(i, []).append((max(start + job.runtime * limits, t) if limits else end, decision.mask))
            times = []
            for i, node_ends in ends.items():
                mask = self.free[i]
                for end, freed in sorted(node_ends):
                    mask |= freed
                    if self.has_feature(i, mask, want):
                        times.append(end)
                        break
            times.sort()
            self.ring_times[want] = times
        if not times:
            return inf
        return times[min(ahead, len(times) - 1)] - t

    def holding_pays(self, job: Job, rid: int, want: tuple[bool, int], fallback: int, t: float) -> bool:
        """Whether ``job`` should hold out for its ring rather than start on ``fallback`` now: the expected
        wait is shorter than the time it would lose there (:mod:`~slurm_mapa.core.wait_rule`, its run
        time priced by ``pricing`` at the bandwidth it would get, against the fleet's best ring)."""
        found = self.decide_on(fallback, rid)
        if found is None:
            return True  # no room there after all: nothing starts now anyway
        now_bw, runtime = found[0].effective, job.runtime
        if self.options.wait_limits:  # as `mapa release` prices it: its time limit, the worst ring free now
            runtime *= self.options.wait_limits
            now_bw = min(d[0].effective for i in self.eligible(job) if (d := self.decide_on(i, rid)) is not None)
        loss = loss_if_started_now(runtime, now_bw, self.best_ring(rid, job.gpus), self.pricing,
                                   len(self.queue) - 1, job.gpus * job.nodes, self.total_gpus)
        if loss <= 0:
            return False
        ahead = self.holding.get(want[1], 0)
        if holding_pays(self.ring_wait(want, t, ahead), loss):
            self.holding[want[1]] = ahead + 1
            return True
        return False

    def decide_on(self, i: int, rid: int):
        """The policy's decision on node ``i`` (and round-robin's new device queue), or None."""
        return self.decider.decide(self.policy, self.gids[i], self.free[i], rid, self.rr_queue[i] if self.stateful else None,
                                   tuple(sorted(self.groups[i])) if self.sees_running else (), self.affinity)

    def first_fit_nodes(self, job: Job, rid: int) -> Picks | None:
        """first-fit: the first nodes in node order where the policy finds room; None: none now."""
        picks: Picks = []
        first = None if not self.indexed or self.pinned(job) or job.nodes > 1 else self.first_with_room(job.gpus)
        found = self.decide_on(first, rid) if first is not None else None
        if found is not None:  # the usual case: the first node with room takes it
            picks.append((first, found[0], found[1]))
        else:  # small cluster, pinned, multi-node, or the policy found no room where the count fits: node order
            for i in self.eligible(job):
                found = self.decide_on(i, rid)
                if found is None:
                    continue
                picks.append((i, found[0], found[1]))
                if len(picks) == job.nodes:
                    break
        return picks if len(picks) >= job.nodes else None

    def chosen_nodes(self, job: Job, rid: int, t: float, published: dict[int, int] | None) -> tuple[Picks, int] | None:
        """slurm / prefer / require: the picks, and 1/-1/0 for preference met/missed/none; None: wait."""
        on_array = self.vector and not self.pinned(job)
        fits = (self.count_array >= job.gpus) if on_array else self.eligible(job)
        want = self.wanted(job) if self.by_features and not self.pinned(job) else None  # a job kept on its recorded node prefers nothing
        outcome = 0
        order = None
        if want is not None:
            assert published is not None
            if on_array:
                order = _pick_vector(fits & self.features_of(want, published), self.count_array, job.nodes)
            else:
                memo, gids, free, good = self.feature_memo, self.gids, self.free, []
                for i in fits:  # has_feature, its memo read here: this runs for every node that fits
                    mask = published.get(i, free[i])
                    found = memo.get((gids[i], mask, want))
                    if found is None:
                        found = self.has_feature(i, mask, want)
                    if found:
                        good.append(i)
                order = self.pick(good, job.nodes, published)
            outcome = 1
            if order is None:
                if self.choice == "require" and want[0]:
                    if self.options.wait_rule == "cost":
                        order = _pick_vector(fits, self.count_array, job.nodes) if on_array else self.pick(fits, job.nodes, published)
                        if order is None or self.holding_pays(job, rid, want, order[0], t):
                            return None
                    elif t - job.submit < self.options.require_wait:
                        if job.id not in self.woken:
                            self.woken.add(job.id)
                            heapq.heappush(self.wakeups, job.submit + self.options.require_wait)
                        return None
                outcome = -1
        if order is None:
            order = _pick_vector(fits, self.count_array, job.nodes) if on_array else self.pick(fits, job.nodes, published)
            if order is None:
                return None
        picks: Picks = []
        for i in order:
            found = self.decide_on(i, rid)
            if found is None:  # the policy found no room although the count fits: no other node is tried
                return None
            picks.append((i, found[0], found[1]))
        return picks, outcome

    # --- the event loop's steps ------------------------------------------------------------------

    def try_start(self, job: Job, rid: int, t: float, published: dict[int, int] | None = None) -> bool:
        """Start ``job`` at ``t`` if the node choice finds it room; whether it started."""
        result = self.result
        outcome = 0
        if self.first_fit:
            picks = self.first_fit_nodes(job, rid)
            if picks is None:
                return False
        else:
            chosen = self.chosen_nodes(job, rid, t, published)
            if chosen is None:
                return False
            picks, outcome = chosen
        if outcome > 0:
            result.preference_met += 1
        elif outcome < 0:
            result.preference_missed += 1
            if self.choice == "require" and job.sensitive and job.gpus >= 2:
                result.relaxed += 1
        result.decisions += 1
        if self.woken:
            self.woken.discard(job.id)  # started: its wait bound is no longer needed (the set stays as small as the queue)
        first = picks[0][1]
        model = self.options.time_model
        # The input's time is the job's time on the best set the fleet offers its size (timemodel).
        runtime = (model.runtime(job.runtime, job.sensitive, job.gpus, first.effective, self.best_ring(rid, job.gpus))
                   if model else job.runtime)
        free = self.free
        for i, decision, new_queue in picks:
            if published is not None and i not in published:
                published[i] = free[i]
            self.set_free(i, free[i] & ~decision.mask)
            if self.sees_running:
                self.groups[i].append(decision.mask)
            if self.stateful:
                self.rr_queue[i] = new_queue
        heapq.heappush(self.running, (t + runtime, self.seq, job, picks, t))
        self.seq += 1
        if self.ring_times:
            self.ring_times.clear()
        return True

    def schedule(self, t: float) -> None:
        """One scheduling pass over the queue, in order (FIFO; with backfill, past a head that waits)."""
        backfill = self.options.backfill
        scanned = 0
        index = 0
        queue = self.queue
        # The features as published at the start of the pass: a node a job started on in this pass
        # keeps its mask from then (changed_in_pass), every other node's is its free mask.
        self.changed_in_pass.clear()
        published = self.changed_in_pass if self.by_features else None
        if self.dirty and self.by_features:
            self.refresh_features()
        self.ring_times.clear()
        self.holding.clear()
        while index < len(queue):
            job, rid = queue[index]
            if index == 0 and self.head_job is job and self.head_failed_at == self.releases and not backfill:
                return  # nothing was freed (and no wait bound ended) since the head last failed
            if self.try_start(job, rid, t, published):
                del queue[index]
                if index == 0:
                    self.head_job = None
                continue
            if index == 0:
                self.head_job, self.head_failed_at = job, self.releases
            if not backfill:
                return
            scanned += 1
            if scanned > self.options.backfill_depth:
                return
            index += 1

    def wake(self, t: float) -> None:
        """The wait bounds that end by ``t``: the head may start now."""
        wakeups = self.wakeups
        while wakeups and wakeups[0] <= t:
            heapq.heappop(wakeups)
            self.releases += 1

    def finish(self, t: float, on_record: Callable[[Record], None] | None) -> None:
        """The jobs that end by ``t`` free their GPUs and are counted in the result."""
        running = self.running
        while running and running[0][0] <= t:
            end, _, job, picks, start = heapq.heappop(running)
            for i, decision, _ in picks:
                self.set_free(i, self.free[i] | decision.mask)
                if self.sees_running:
                    self.groups[i].remove(decision.mask)
            self.releases += 1
            self.result.add_ended(job, picks[0][1], [decision.local for _, decision, _ in picks], start, end)
            if on_record is not None:
                first = picks[0][1]
                on_record(
                    Record(
                        job.id, self.result.label, ",".join(self.nodes[i].name for i, _, _ in picks), job.submit, start, end,
                        first.gpus, job.sensitive, job.shape, first.effective, first.aggregated, first.preserved, job.runtime,
                        first.ranked, first.fast_ring,
                    )
                )

    def admit(self, job: Job) -> None:
        """An arrival joins the queue, unless no node could ever hold it (then it is dropped, counted)."""
        result = self.result
        result.first_submit = min(result.first_submit, job.submit)
        if not self.fits_ever(job):
            reason = "larger than every node" if job.gpus > self.largest or job.nodes > self.n_nodes else "larger than its recorded node"
            result.dropped[reason] = result.dropped.get(reason, 0) + 1
            return
        rid = self.decider.request_id(request_for(job.shape, job.gpus, job.sensitive))
        self.queue.append((job, rid))

    def run(self, jobs: Iterable[Job], on_record: Callable[[Record], None] | None = None,
            on_progress: Callable[[int], None] | None = None) -> RunResult:
        """The event loop: at each arrival, job end or wait bound, in time order, finish, admit, schedule."""
        result = self.result
        arrivals = _reordered(jobs, self.options.reorder_window, result)
        pending = next(arrivals, None)
        seen = 0
        totals = self.totals
        while True:
            next_arrival = pending.submit if pending is not None else inf
            next_end = self.running[0][0] if self.running else inf
            next_wakeup = self.wakeups[0] if self.wakeups else inf
            t = min(next_arrival, next_end, next_wakeup)
            if t == inf:
                result.stuck = len(self.queue)
                break
            self.account(t)
            self.wake(t)
            self.finish(t, on_record)
            while pending is not None and pending.submit <= t:
                job = pending
                pending = next(arrivals, None)
                seen += 1
                if on_progress is not None and seen % 1000 == 0:
                    on_progress(seen)
                self.admit(job)
            self.schedule(t)
            result.series.add(t, totals[0], 1.0 - totals[0] / totals[1] if totals[1] > 0 else 0.0, len(self.queue), len(self.running))
        if on_progress is not None:
            on_progress(seen)
        return result


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
    options = options or Options()
    check_options(policy, nodes, options)
    decider = decider or Decider(options.model, configured=options.configured, extrapolate=options.extrapolate,
                                 judge=options.judge)
    return Simulation(nodes, policy, options, decider).run(jobs, on_record, on_progress)
