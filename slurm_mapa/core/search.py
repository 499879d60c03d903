"""The exact candidate search: the best placement of a pattern on the free GPUs of a node.

The hardware graph is complete, so every injective map of pattern vertices to free GPUs is a
match. The search walks those maps depth first:

* GPUs are tried in ascending order at every depth, so placements are met in lexicographic
  order of the GPU sequence (in pattern order). A candidate replaces the incumbent only when its
  score is strictly higher, so among equal scores the lexicographically smallest wins: that is
  the documented tie-break, and it lets the search drop any branch that can at best tie.
* Pattern automorphisms are pruned: only the lexicographically smallest of equivalent
  placements (the lex leader) is visited (see :class:`~.patterns.PatternSymmetry`; the search
  builds it with :func:`~.symmetry.search_symmetry`, which is fast on big patterns).
* With unit edge weights both the effective and the aggregated objective depend only on how
  many pattern edges use each link class. So the count vectors are ranked by objective first, and
  the walk looks for the lex-first placement with exactly the counts of the best vector that has
  one (``_by_class_budgets``); a degree bound discards impossible vectors without walking.
* Weighted patterns fall back to branch and bound: per pending edge, the widest link its placed
  endpoint has to a free GPU; for the model, the best value reachable with the pending edges
  (:func:`~.effbw.best_completion`).
* Interchangeable GPUs (hardware twins, :mod:`.symmetry`) are tried in one order only: a GPU is
  skipped while a lower twin of it is unused, and sets are chosen as "how many of each class".
* A :class:`SearchLimit` (work units, optionally a clock and seconds) bounds the search. When it
  runs out before the optimum is proven, the best placement found is returned with its proven
  ``gap`` (see :class:`Placement`); without a limit the search is exact, as before.

Objectives (each a tuple compared lexicographically, floats rounded to 1e-9):

* ``effective``  - (predicted effective bandwidth, aggregated bandwidth)
* ``aggregated`` - (aggregated bandwidth,)
* ``preserved``  - (preserved bandwidth of the GPUs left free, aggregated bandwidth); the first
  term depends only on the GPU set, so sets are enumerated first (all of them on nodes of up to 20
  GPUs, by branch and bound over twin classes on larger ones) and the placement search runs only
  on the sets that tie for the best preserved bandwidth.

Owns Placement, SearchLimit, best_placement and the objectives; imports .effbw, .hardware,
.patterns and .symmetry.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import combinations
from math import comb, inf
from typing import Callable, Iterable, Sequence

from ..errors import InputError
from .effbw import EffectiveBandwidthModel, best_completion
from .hardware import HardwareGraph
from .patterns import Pattern
from .symmetry import graph_automorphisms, is_twin_canonical, lower_twins, search_symmetry, twin_classes

OBJECTIVES = ("effective", "aggregated", "preserved")
_DIGITS = 9


@dataclass(frozen=True)
class Placement:
    """A pattern placed on GPUs: ``gpus[i]`` runs pattern vertex i."""

    gpus: tuple[int, ...]
    aggregated_bandwidth: float
    link_counts: tuple[int, ...]
    effective_bandwidth: float | None
    preserved_bandwidth: float
    # None: proven optimal (tie-break included). Otherwise the search ran out of its limit, and the
    # optimum of the objective's first term (effective, preserved or aggregated bandwidth, GB/s)
    # is proven to lie in [value, value + gap]. 0.0: that term is proven optimal, but a later term
    # or the tie-break among equals is not.
    gap: float | None = None


@dataclass(frozen=True)
class SearchLimit:
    """How much one decision may search: ``work`` units (search nodes expanded and candidates
    scored; deterministic) and/or ``seconds`` measured with ``clock`` (e.g. time.monotonic). The
    exact search gets :data:`EXACT_SHARE` of either; the rest improves the best found when it
    cannot finish. ``until``: a reading of ``clock`` no search under this limit may run past, so
    that the several searches of one decision share its time."""

    work: int | None = None
    seconds: float | None = None
    clock: Callable[[], float] | None = None
    until: float | None = None

    def __post_init__(self) -> None:
        if self.work is not None and (isinstance(self.work, bool) or not isinstance(self.work, int) or self.work < 1):
            raise InputError(f"search work limit must be a positive integer, got {self.work!r}")
        if self.seconds is not None:
            if self.clock is None:
                raise InputError("a search limit in seconds needs a clock (e.g. time.monotonic)")
            if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not self.seconds > 0:
                raise InputError(f"search limit in seconds must be a positive number, got {self.seconds!r}")


EXACT_SHARE = 0.8
_CLOCK_EVERY = 64  # work units between two looks at the clock


class _OutOfWork(Exception):
    """The limit ran out; ``upper``: a proven upper bound of the objective key's first term (None:
    the caller knows it), ``found``: the best GPUs (a placement or a set) found so far, if any."""

    def __init__(self, upper: float | None = None, found: tuple[int, ...] | None = None) -> None:
        super().__init__("search limit reached")
        self.upper = upper
        self.found = found


class _Meter:
    """Counts work against a SearchLimit: first the exact phase's share, then the rest."""

    def __init__(self, limit: SearchLimit | None) -> None:
        self.clock = limit.clock if limit is not None and limit.seconds is not None else None
        self.seconds = limit.seconds if self.clock is not None else None
        self.start = self.clock() if self.clock is not None else 0.0
        if self.seconds is not None and limit is not None and limit.until is not None:
            self.seconds = max(min(self.seconds, limit.until - self.start), 0.0)
        self.total = inf if limit is None or limit.work is None else limit.work
        self.granted = inf if self.total == inf else max(1, int(self.total * EXACT_SHARE))
        self.left = self.granted
        self.deadline = inf if self.clock is None else self.start + self.seconds * EXACT_SHARE
        self.since_clock = 0
        self.exact = True

    def tick(self, units: int = 1) -> None:
        self.left -= units
        if self.left < 0:
            raise _OutOfWork()
        if self.clock is not None:
            self.since_clock += units
            if self.since_clock >= _CLOCK_EVERY:
                self.since_clock = 0
                if self.clock() > self.deadline:
                    self.left = -1
                    raise _OutOfWork()

    def fallback(self) -> None:
        """Leave the exact phase: the rest of the limit is for improving the best found."""
        if not self.exact:
            return
        self.exact = False
        if self.total != inf:
            self.left = max(0, self.total - (self.granted - max(self.left, 0)))
        if self.clock is not None:
            self.deadline = self.start + self.seconds


def _gap(upper: float, value: float) -> float:
    return max(0.0, round(upper - value, _DIGITS))


def score_placement(
    graph: HardwareGraph, free: Iterable[int], pattern: Pattern, gpus: Sequence[int], model: EffectiveBandwidthModel
) -> Placement:
    """All scores of one placement (the reference the search and the tests agree on)."""
    gpus = tuple(gpus)
    counts = [0] * len(model.class_names)
    aggregated = 0.0
    for (a, b), weight in zip(pattern.edges, pattern.weights):
        link = graph.link(gpus[a], gpus[b])
        aggregated += weight * graph.bandwidths.of(link)
        counts[model.classify(link)] += 1
    left = sorted(set(free) - set(gpus))
    return Placement(
        gpus=gpus,
        aggregated_bandwidth=aggregated,
        link_counts=tuple(counts),
        effective_bandwidth=model.predict(tuple(counts)) if pattern.edges else None,
        preserved_bandwidth=preserved_bandwidth(graph, left),
    )


def preserved_bandwidth(graph: HardwareGraph, free: Iterable[int]) -> float:
    """The paper's Eq. 3: the summed bandwidth of every link among the GPUs that stay free."""
    left = sorted(free)
    return sum(graph.bandwidth(a, b) for i, a in enumerate(left) for b in left[i + 1 :])


def objective_key(objective: str, placement: Placement) -> tuple[float, ...]:
    agg = round(placement.aggregated_bandwidth, _DIGITS)
    if objective == "effective":
        eff = placement.effective_bandwidth
        return (round(eff, _DIGITS) if eff is not None else 0.0, agg)
    if objective == "aggregated":
        return (agg,)
    if objective == "preserved":
        return (round(placement.preserved_bandwidth, _DIGITS), agg)
    raise InputError(f"unknown objective {objective!r} (accepted: {', '.join(OBJECTIVES)})")


def best_placement(
    graph: HardwareGraph,
    free: Iterable[int],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    limit: SearchLimit | None = None,
) -> Placement | None:
    """The exact optimum of ``objective`` over all placements of ``pattern`` on ``free``; None if it does not fit.

    With a ``limit`` the search stops when it is spent: the result is then the best placement found,
    its ``gap`` says how far from the optimum it can be at most (``gap`` None: proven optimal).
    """
    if objective not in OBJECTIVES:
        raise InputError(f"unknown objective {objective!r} (accepted: {', '.join(OBJECTIVES)})")
    free_sorted = tuple(sorted(set(free)))
    for gpu in free_sorted:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
    if pattern.size > len(free_sorted):
        return None
    meter = _Meter(limit)
    if objective == "preserved":
        return _best_preserving(graph, free_sorted, pattern, model, meter)
    try:
        found = _branch_and_bound(graph, free_sorted, pattern, objective, model, meter)
    except _OutOfWork as stop:
        assert stop.upper is not None
        gpus = _improved(graph, free_sorted, pattern, objective, model, meter, stop.found)
        placement = score_placement(graph, free_sorted, pattern, gpus, model)
        return _with_gap(placement, stop.upper, objective_key(objective, placement)[0])
    return score_placement(graph, free_sorted, pattern, found, model) if found is not None else None


def _with_gap(placement: Placement, upper: float, value: float) -> Placement:
    return replace(placement, gap=_gap(upper, value))


def _best_preserving(
    graph: HardwareGraph, free: tuple[int, ...], pattern: Pattern, model: EffectiveBandwidthModel, meter: _Meter
) -> Placement | None:
    k = pattern.size
    try:
        tied = _sets_keeping_most_bandwidth(graph, free, k, meter)
    except _OutOfWork as stop:
        # No proof of the best set: the best set found, in a good order, and the set's gap.
        assert stop.upper is not None and stop.found is not None
        gpus = _improved(graph, stop.found, pattern, "aggregated", model, meter, None)
        placement = score_placement(graph, free, pattern, gpus, model)
        return _with_gap(placement, stop.upper, round(placement.preserved_bandwidth, _DIGITS))
    try:
        if tied is None:
            # Every set ties (e.g. at most one GPU stays free): one search over all of them.
            gpus = _branch_and_bound(graph, free, pattern, "aggregated", model, meter)
        else:
            gpus = _best_on_any_set(graph, tied, pattern, "aggregated", model, meter)
    except _OutOfWork as stop:
        # The preserved bandwidth is proven; the order inside the best sets is not.
        pool = free if tied is None else tuple(sorted(stop.found)) if stop.found is not None else tied[0]
        gpus = _improved(graph, pool, pattern, "aggregated", model, meter, stop.found)
        placement = score_placement(graph, free, pattern, gpus, model)
        return _with_gap(placement, placement.preserved_bandwidth, placement.preserved_bandwidth)
    assert gpus is not None
    return score_placement(graph, free, pattern, gpus, model)


_VECTORISE_ABOVE = 300  # k-subsets; below this plain Python beats numpy's per-call overhead


def _sets_keeping_most_bandwidth(
    graph: HardwareGraph, free: tuple[int, ...], k: int, meter: _Meter
) -> list[tuple[int, ...]] | None:
    """The k-subsets of ``free`` whose removal leaves the most link bandwidth among the rest, in lex
    order, each taking the lowest members of every twin class (see :mod:`.symmetry`); None when
    every k-subset ties."""
    if k >= len(free) - 1:
        return None  # at most one GPU stays free: no link is left whatever is taken
    if graph.size <= _MAX_TABLE_GPUS:
        tied = _all_sets_keeping_most_bandwidth(graph, free, k)
        if len(tied) == comb(len(free), k):
            return None
        return [subset for subset in tied if is_twin_canonical(graph, free, subset)]
    return _SetSearch(graph, free, k, meter).run()


def _all_sets_keeping_most_bandwidth(graph: HardwareGraph, free: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """Every k-subset of ``free``, ranked by what it leaves (nodes of up to 20 GPUs)."""
    if comb(len(free), k) > _VECTORISE_ABOVE:
        return _sets_keeping_most_bandwidth_vectorised(graph, free, k)
    bw = graph.bandwidth_matrix()
    # Taking set S destroys every link with an end in S: sum of row sums minus links inside S.
    row = {a: sum(bw[a][b] for b in free if b != a) for a in free}
    best_loss: float | None = None
    tied: list[tuple[int, ...]] = []
    for subset in combinations(free, k):
        loss = sum(row[a] for a in subset)
        for i, a in enumerate(subset):
            for b in subset[i + 1 :]:
                loss -= bw[a][b]
        loss = round(loss, _DIGITS)
        if best_loss is None or loss < best_loss:
            best_loss, tied = loss, [subset]
        elif loss == best_loss:
            tied.append(subset)
    return tied


_SLACK = 1e-6  # GB/s: values summed in different orders may differ in their last bits


class _SetSearch:
    """Branch and bound for the k GPUs to take that keep the most bandwidth among the rest.

    It picks the smaller side X: the k GPUs taken (value = links inside X minus every link leaving
    a GPU of X, i.e. minus the loss) or the n-k GPUs kept (value = links inside X). Either way the
    value is sum(c[a] for a in X) + w(X), and an upper bound for adding r more GPUs from the
    candidates left is the sum of the r largest c[b] + w(b, X) + (the r-1 widest links of b) / 2,
    as each link inside the new GPUs is counted from both ends. GPUs are walked twin class by twin
    class; a class contributes a prefix of its members (lowest taken, so highest kept), and every
    set that ties for the best is collected.
    """

    def __init__(self, graph: HardwareGraph, free: tuple[int, ...], k: int, meter: _Meter) -> None:
        self.free = free
        self.k = k
        self.meter = meter
        n = len(free)
        bw = graph.bandwidth_matrix()
        self.bw = bw
        self.take_side = k <= n - k
        self.m = k if self.take_side else n - k
        self.total = sum(bw[a][b] for i, a in enumerate(free) for b in free[i + 1 :])
        row = {a: sum(bw[a][b] for b in free if b != a) for a in free}
        self.c = {a: -row[a] if self.take_side else 0.0 for a in free}
        order: list[int] = []
        self.class_end: list[int] = []
        classes = twin_classes(graph, free)
        # Without twins, the graph's automorphisms (a torus's shifts and flips): a set is visited
        # only if each GPU it adds is the lowest its image can be under the automorphisms that
        # fix the GPUs added before; the lex-smallest set of every orbit passes, and the orbits of
        # the sets that tie are added back at the end.
        self.symmetries = list(graph_automorphisms(graph, free)) if all(len(m) == 1 for m in classes) else []
        self.fixing = self.symmetries
        for members in classes:
            ordered = members if self.take_side else tuple(reversed(members))
            order.extend(ordered)
            self.class_end.extend([len(order)] * len(ordered))
        self.order = order
        # half_top[a][r]: half the sum of the r widest links of a to the other free GPUs
        self.half_top: dict[int, list[float]] = {}
        for a in free:
            widths = sorted((bw[a][b] for b in free if b != a), reverse=True)
            sums = [0.0]
            for width in widths[: self.m]:
                sums.append(sums[-1] + width / 2)
            self.half_top[a] = sums
        self.link_to = {a: 0.0 for a in free}
        self.best = -inf
        self.tied: list[tuple[int, ...]] = []  # the chosen side of each set that ties, sorted
        self.chosen: list[int] = []
        self.open_bound = -inf

    def value_to_kept(self, value: float) -> float:
        return self.total + value if self.take_side else value

    def taken_set(self, chosen: list[int]) -> tuple[int, ...]:
        return tuple(sorted(chosen)) if self.take_side else tuple(g for g in self.free if g not in chosen)

    def bound(self, i: int, r: int, value: float) -> float:
        if r == 0:
            return value
        candidates = self.order[i:]
        if len(candidates) < r:
            return -inf
        c, link_to, half_top = self.c, self.link_to, self.half_top
        gains = [c[b] + link_to[b] + half_top[b][r - 1] for b in candidates]
        return value + sum(heapq.nlargest(r, gains))

    def greedy(self) -> None:
        """A first incumbent, so that the walk prunes from the start: add the GPU of largest gain,
        then swap a chosen GPU for another while the best swap gains (at most 2m rounds)."""
        chosen: list[int] = []
        left = list(self.order)
        bw, c = self.bw, self.c
        link = {b: 0.0 for b in self.free}  # bandwidth from each GPU to the chosen ones
        for _ in range(self.m):
            pick = max(left, key=lambda b: c[b] + link[b])
            chosen.append(pick)
            left.remove(pick)
            for b in self.free:
                link[b] += bw[pick][b]
        for _ in range(2 * self.m):
            gain, out_index, in_index = max(
                (c[b] + link[b] - bw[a][b] - c[a] - link[a], i, j) for i, a in enumerate(chosen) for j, b in enumerate(left)
            ) if left else (0.0, -1, -1)
            if round(gain, _DIGITS) <= 0:
                break
            a, b = chosen[out_index], left[in_index]
            chosen[out_index], left[in_index] = b, a
            for x in self.free:
                link[x] += bw[b][x] - bw[a][x]
        self.best = round(self._value_of(chosen), _DIGITS)
        self.incumbent = chosen

    def _value_of(self, chosen: list[int]) -> float:
        bw = self.bw
        chosen = sorted(chosen)
        return sum(self.c[a] for a in chosen) + sum(bw[a][b] for i, a in enumerate(chosen) for b in chosen[i + 1 :])

    def run(self) -> list[tuple[int, ...]]:
        self.greedy()
        try:
            self.visit(0, self.m, 0.0)
        except _OutOfWork:
            upper = max(self.best, round(self.open_bound, _DIGITS))
            found = min(self.taken_set(list(x)) for x in self.tied) if self.tied else self.taken_set(self.incumbent)
            raise _OutOfWork(upper=self.value_to_kept(upper), found=found) from None
        return sorted(self.taken_set(list(x)) for x in self.orbits(self.tied))

    def orbits(self, chosen_sets: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Every image of the given sets under the automorphisms used (they generate the group)."""
        seen = set(chosen_sets)
        queue = list(chosen_sets)
        while queue:
            current = queue.pop()
            for sigma in self.symmetries:
                self.meter.tick()
                image = tuple(sorted(sigma[g] for g in current))
                if image not in seen:
                    seen.add(image)
                    queue.append(image)
        return list(seen)

    def visit(self, i: int, r: int, value: float) -> None:
        try:
            self.meter.tick()
        except _OutOfWork:
            self.open_bound = max(self.open_bound, self.bound(i, r, value))
            raise
        if r == 0:
            if value < self.best - _SLACK:
                return
            # Summed afresh, in one order, so that ties are ties whatever the path to the set.
            key = round(self._value_of(self.chosen), _DIGITS)
            if key > self.best:
                self.best, self.tied = key, []
            if key == self.best:
                self.tied.append(tuple(sorted(self.chosen)))
            return
        if self.bound(i, r, value) < self.best - _SLACK:
            return
        g = self.order[i]
        fixing = self.fixing
        if all(sigma[g] >= g for sigma in fixing):
            link_to, bw_g = self.link_to, self.bw[g]
            gain = self.c[g] + link_to[g]
            for b in self.free:
                link_to[b] += bw_g[b]
            self.chosen.append(g)
            self.fixing = [sigma for sigma in fixing if sigma[g] == g]
            try:
                self.visit(i + 1, r - 1, value + gain)
            except _OutOfWork:
                self.chosen.pop()
                self.fixing = fixing
                for b in self.free:
                    link_to[b] -= bw_g[b]
                # The branch without g (nor the rest of its class) is still to do: bound it.
                self.open_bound = max(self.open_bound, self.bound(self.class_end[i], r, value))
                raise
            self.chosen.pop()
            self.fixing = fixing
            for b in self.free:
                link_to[b] -= bw_g[b]
        # Without g, none of its later twins: a class gives a prefix of its members.
        self.visit(self.class_end[i], r, value)


_MAX_TABLE_GPUS = 20


@lru_cache(maxsize=8)
def _subset_tables(graph: HardwareGraph):
    """Per subset of the node's GPUs (as a bit mask): its inner link bandwidth and its size."""
    import numpy as np

    n = graph.size
    bw = graph.bandwidth_matrix()
    inner = np.zeros(1 << n)
    for v in range(1, n):
        # to_v[low] = bandwidth from v to the GPUs of `low`, for every mask of GPUs below v
        to_v = np.zeros(1 << v)
        for u in range(v):
            to_v[1 << u : 1 << (u + 1)] = to_v[: 1 << u] + bw[v][u]
        inner[1 << v : 1 << (v + 1)] = inner[: 1 << v] + to_v
    masks = np.arange(1 << n, dtype=np.int64)
    sizes = np.zeros(1 << n, dtype=np.int64)
    for v in range(n):
        sizes += (masks >> v) & 1
    return np, masks, sizes, inner


def _sets_keeping_most_bandwidth_vectorised(graph: HardwareGraph, free: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    np, masks, sizes, inner = _subset_tables(graph)
    free_mask = sum(1 << g for g in free)
    candidates = masks[((masks & ~free_mask) == 0) & (sizes == k)]
    kept = np.round(inner[free_mask ^ candidates], _DIGITS)
    winners = candidates[kept == kept.max()]
    tied = [tuple(g for g in free if (int(mask) >> g) & 1) for mask in winners]
    return sorted(tied)


def _branch_and_bound(
    graph: HardwareGraph,
    free: tuple[int, ...],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: _Meter,
) -> tuple[int, ...] | None:
    """Lex-first optimum of ``objective`` ("effective" or "aggregated") over placements on ``free``."""
    return _best_on_any_set(graph, [free], pattern, objective, model, meter)


def _best_on_any_set(
    graph: HardwareGraph,
    gpu_sets: list[tuple[int, ...]],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: _Meter,
) -> tuple[int, ...] | None:
    """The lex-first optimum over placements that lie inside any one of ``gpu_sets``.

    Out of work it raises _OutOfWork with an upper bound of the objective's first term and the
    best placement found so far (if any).
    """
    gpu_sets = [s for s in gpu_sets if len(s) >= pattern.size]
    if not gpu_sets:
        return None
    if not pattern.edges:
        return min(s[: pattern.size] for s in gpu_sets)
    use_model = objective == "effective"
    if any(w != 1.0 for w in pattern.weights):
        found = []
        for gpus in gpu_sets:
            dfs = _Dfs(graph, gpus, pattern, model, use_model=use_model, meter=meter)
            try:
                meter.tick(len(gpus))
                hit = dfs.run(budget=None)
            except _OutOfWork:
                if dfs.best_gpus is not None:
                    found.append((dfs.best_key, tuple(-g for g in dfs.best_gpus), dfs.best_gpus))
                # This set and those not searched yet are bounded as their widest links allow.
                later = gpu_sets[gpu_sets.index(gpus) + 1 :]
                bounds = [_Dfs(graph, other, pattern, model, use_model=use_model, meter=meter).root_bound[0] for other in [gpus, *later]]
                upper = max([key[0] for key, _, _ in found] + bounds)
                raise _OutOfWork(upper=upper, found=max(found)[2] if found else None) from None
            if hit is not None:
                found.append((dfs.leaf_key_of(hit), tuple(-g for g in hit), hit))
        return max(found)[2] if found else None
    return _by_class_budgets(graph, gpu_sets, pattern, objective, model, meter)


def _by_class_budgets(
    graph: HardwareGraph,
    gpu_sets: list[tuple[int, ...]],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: _Meter,
) -> tuple[int, ...] | None:
    """With unit weights both objectives are functions of how many pattern edges use each link class.

    So enumerate the class-count vectors in descending objective, and for each group of equal
    value ask the search for the lex-first placement with exactly those counts. The first group
    that has one holds the optimum. This prunes far harder than a bound on a non-monotone model.
    Every group before the one being searched is refuted, so its value bounds the optimum.
    """
    use_model = objective == "effective"
    cls, class_info = _class_matrix(graph, model, use_model)
    searches = [_Dfs(graph, gpus, pattern, model, use_model=use_model, joint_classes=True, meter=meter) for gpus in gpu_sets]
    present = tuple(sorted(set().union(*(dfs.present_classes for dfs in searches))))
    setting_up = sum(len(gpus) for gpus in gpu_sets)  # charged once a bound is known
    for key, budgets in _ranked_budgets(class_info, present, len(pattern.edges), objective, model):
        found: list[tuple[int, ...]] = []
        try:
            meter.tick(setting_up)
            setting_up = 0
            for dfs in searches:
                for budget in budgets:
                    if dfs.may_fit(budget) and (hit := dfs.run(budget=budget)) is not None:
                        found.append(hit)
        except _OutOfWork:
            raise _OutOfWork(upper=key[0], found=min(found) if found else None) from None
        if found:
            return min(found)
    return None


# --- the best found when the limit runs out ---------------------------------------------------


@lru_cache(maxsize=16)
def _model_classes(graph: HardwareGraph, model: EffectiveBandwidthModel) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(-1 if a == b else model.classify(graph.links[a][b]) for b in graph.gpus) for a in graph.gpus)


class _Scorer:
    """The objective key of a placement ("effective" or "aggregated"), as the search ranks it."""

    def __init__(self, graph: HardwareGraph, pattern: Pattern, objective: str, model: EffectiveBandwidthModel) -> None:
        self.bw = graph.bandwidth_matrix()
        self.use_model = objective == "effective"
        self.cls = _model_classes(graph, model) if self.use_model else None
        self.model = model
        self.edges = tuple(zip(pattern.edges, pattern.weights))

    def key(self, gpus: Sequence[int]) -> tuple[float, ...]:
        bw = self.bw
        agg = 0.0
        for (a, b), weight in self.edges:
            agg += weight * bw[gpus[a]][gpus[b]]
        if not self.use_model:
            return (round(agg, _DIGITS),)
        counts = [0] * len(self.model.class_names)
        cls = self.cls
        for (a, b), _ in self.edges:
            counts[cls[gpus[a]][gpus[b]]] += 1  # type: ignore[index]
        return (round(self.model.predict(tuple(counts)), _DIGITS), round(agg, _DIGITS))


def _greedy_placement(graph: HardwareGraph, pool: tuple[int, ...], pattern: Pattern) -> tuple[int, ...]:
    """Pattern vertices in breadth-first order, each on the unused GPU with the most bandwidth to
    its placed neighbours (a vertex with none: the GPU with the widest links to the pool)."""
    bw = graph.bandwidth_matrix()
    k = pattern.size
    adjacent: list[list[tuple[int, float]]] = [[] for _ in range(k)]
    for (a, b), weight in zip(pattern.edges, pattern.weights):
        adjacent[a].append((b, weight))
        adjacent[b].append((a, weight))
    order: list[int] = []
    seen = [False] * k
    for root in range(k):
        if seen[root]:
            continue
        seen[root] = True
        queue = [root]
        while queue:
            v = queue.pop(0)
            order.append(v)
            for u, _ in adjacent[v]:
                if not seen[u]:
                    seen[u] = True
                    queue.append(u)
    placed = [-1] * k
    left = list(pool)
    for v in order:
        near = [(placed[u], weight) for u, weight in adjacent[v] if placed[u] >= 0]
        if near:
            pick = max(left, key=lambda g: (sum(weight * bw[p][g] for p, weight in near), -g))
        else:
            degree = len(adjacent[v])
            pick = max(left, key=lambda g: (sum(sorted((bw[g][h] for h in pool if h != g), reverse=True)[:degree]), -g))
        placed[v] = pick
        left.remove(pick)
    return tuple(placed)


def _improved(
    graph: HardwareGraph,
    pool: tuple[int, ...],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: _Meter,
    start: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """The best placement on ``pool`` found in what is left of the limit: the better of ``start``
    and a greedy one, then improving swaps (two positions, or a position and an unused GPU of the
    pool) while the limit lasts. Always returns a placement, even with no limit left."""
    meter.fallback()
    scorer = _Scorer(graph, pattern, objective, model)

    def rank(gpus: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[int, ...]]:
        return scorer.key(gpus), tuple(-g for g in gpus)

    candidates = [_greedy_placement(graph, pool, pattern)]
    if start is not None:
        candidates.append(start)
    current = list(max(candidates, key=rank))
    current_rank = rank(tuple(current))
    unused = [g for g in pool if g not in current]
    k = pattern.size
    try:
        improved = True
        while improved:
            improved = False
            for i in range(k):
                for j in range(i + 1, k + len(unused)):
                    meter.tick()
                    trial = list(current)
                    if j < k:
                        trial[i], trial[j] = trial[j], trial[i]
                    else:
                        trial[i] = unused[j - k]
                    trial_rank = rank(tuple(trial))
                    if trial_rank > current_rank:
                        if j >= k:
                            unused[j - k] = current[i]
                        current, current_rank, improved = trial, trial_rank, True
    except _OutOfWork:
        pass
    return search_symmetry(pattern).canonical(tuple(current))


@lru_cache(maxsize=64)
def _class_matrix(graph: HardwareGraph, model: EffectiveBandwidthModel, use_model: bool):
    """Per GPU pair the class the objective can tell apart: (model class, bandwidth) for the
    effective objective, the bandwidth alone for the aggregated one."""
    bw = graph.bandwidth_matrix()
    index_of: dict[tuple[int, float], int] = {}
    cls = [[-1] * graph.size for _ in graph.gpus]
    for a, b in graph.pairs():
        signature = (model.classify(graph.links[a][b]) if use_model else 0, bw[a][b])
        cls[a][b] = cls[b][a] = index_of.setdefault(signature, len(index_of))
    return tuple(tuple(row) for row in cls), tuple(sorted(index_of, key=index_of.__getitem__))


@lru_cache(maxsize=256)
def _ranked_budgets(
    class_info: tuple[tuple[int, float], ...],
    present: tuple[int, ...],
    n_edges: int,
    objective: str,
    model: EffectiveBandwidthModel,
) -> tuple[tuple[tuple[float, ...], tuple[tuple[int, ...], ...]], ...]:
    """Every split of ``n_edges`` over the present classes, grouped by objective value, best first."""
    keyed: dict[tuple[float, ...], list[tuple[int, ...]]] = {}
    for vector in _compositions(n_edges, len(present)):
        budget = [0] * len(class_info)
        for position, count in zip(present, vector):
            budget[position] = count
        agg = round(sum(count * class_info[c][1] for c, count in enumerate(budget)), _DIGITS)
        if objective == "effective":
            model_counts = [0] * len(model.class_names)
            for c, count in enumerate(budget):
                model_counts[class_info[c][0]] += count
            key: tuple[float, ...] = (round(model.predict(tuple(model_counts)), _DIGITS), agg)
        else:
            key = (agg,)
        keyed.setdefault(key, []).append(tuple(budget))
    return tuple((key, tuple(keyed[key])) for key in sorted(keyed, reverse=True))


def _compositions(total: int, parts: int):
    """Every tuple of ``parts`` non-negative ints summing to ``total``."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    if parts == 1:
        yield (total,)
        return
    for first in range(total, -1, -1):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def _component_sizes(gpus: tuple[int, ...], cls, group: set[int]) -> list[int]:
    """Sizes of the components of ``gpus`` joined by links of the classes in ``group``, largest first."""
    left = set(gpus)
    sizes = []
    while left:
        stack = [left.pop()]
        size = 1
        while stack:
            a = stack.pop()
            row = cls[a]
            joined = [b for b in left if row[b] in group]
            for b in joined:
                left.discard(b)
            stack.extend(joined)
            size += len(joined)
        sizes.append(size)
    return sorted(sizes, reverse=True)


@lru_cache(maxsize=256)
def _connectivity(pattern: Pattern) -> tuple[bool, bool]:
    """(connected, bridgeless) of the pattern as a multigraph over its vertices."""
    k = pattern.size
    adjacent: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for index, (a, b) in enumerate(pattern.edges):
        adjacent[a].append((b, index))
        adjacent[b].append((a, index))
    # Iterative DFS with low-links: an edge is a bridge iff low[child] > entry[parent].
    entry = [-1] * k
    low = [0] * k
    bridges = 0
    clock = 0
    entry[0] = low[0] = clock
    stack = [(0, -1, iter(adjacent[0]))]
    while stack:
        v, via, edges = stack[-1]
        for u, index in edges:
            if index == via:
                continue
            if entry[u] < 0:
                clock += 1
                entry[u] = low[u] = clock
                stack.append((u, index, iter(adjacent[u])))
                break
            low[v] = min(low[v], entry[u])
        else:
            stack.pop()
            if stack:
                parent = stack[-1][0]
                low[parent] = min(low[parent], low[v])
                if low[v] > entry[parent]:
                    bridges += 1
    connected = all(e >= 0 for e in entry)
    return connected, connected and bridges == 0


class _Dfs:
    """Depth-first search over lex-leader placements, in lexicographic order.

    With a ``budget`` (edges allowed per link class) it returns the lex-first placement that
    uses exactly that many edges of each class; without one it maximises the objective by branch
    and bound (used for weighted patterns).
    """

    def __init__(
        self,
        graph: HardwareGraph,
        free: tuple[int, ...],
        pattern: Pattern,
        model: EffectiveBandwidthModel,
        *,
        use_model: bool,
        joint_classes: bool = False,
        meter: _Meter,
    ) -> None:
        self.meter = meter
        self.free = free
        self.pattern = pattern
        self.model = model
        self.use_model = use_model
        k = pattern.size
        self.k = k
        bw = graph.bandwidth_matrix()
        self.bw = bw
        if joint_classes:
            self.cls, class_info = _class_matrix(graph, model, use_model)
            self.class_info = list(class_info)
        else:
            # Branch and bound needs only the model classes.
            self.class_info = [(c, 0.0) for c in range(len(model.class_names))] if use_model else [(0, 0.0)]
            self.cls = [[(model.classify(graph.links[a][b]) if use_model else 0) if a != b else -1 for b in graph.gpus] for a in graph.gpus]
        self.present_classes = {self.cls[a][b] for a in free for b in free if a != b}
        self.model_class_of = [signature[0] for signature in self.class_info]
        self.back: list[list[tuple[int, float]]] = [[] for _ in range(k)]
        for (a, b), weight in zip(pattern.edges, pattern.weights):
            self.back[max(a, b)].append((min(a, b), weight))
        self.pending_edges = [sum(len(self.back[v]) for v in range(m, k)) for m in range(k + 1)]
        self.widest_to_free = {a: max((bw[a][b] for b in free if b != a), default=0.0) for a in free}
        self.widest = max(self.widest_to_free.values(), default=0.0)
        self.allowed_model_classes = tuple(sorted({self.model_class_of[c] for c in self.present_classes}))
        sym = search_symmetry(pattern)  # fast to build for big patterns; see .symmetry
        self.sym = sym
        self.automorphisms = sym.automorphisms
        self.twin_prev = sym.twin_prev
        checks: list[set[tuple[int, int]]] = [set() for _ in range(k)]
        for perm in sym.automorphisms:
            first = next(i for i in range(k) if perm[i] != i)
            checks[max(first, perm[first])].add((first, perm[first]))
        self.order_checks = [tuple(sorted(pairs)) for pairs in checks]
        self.needs_leaf_check = bool(sym.automorphisms) and any(p >= 0 for p in sym.twin_prev)
        pairs = [(min(a, b), max(a, b)) for a, b in pattern.edges]
        self.parallel_edges = len(set(pairs)) != len(pairs)
        degree = [0] * k
        for a, b in pairs:
            degree[a] += 1
            degree[b] += 1
        self.pattern_degrees = sorted(degree, reverse=True)
        self._group_capacities: list[tuple[list[int], list[int]]] | None = None
        self._group_cuts: list[tuple[set[int], int]] | None = None
        # Interchangeable GPUs of this set: a GPU is tried only once its lower twin is taken.
        twins = lower_twins(graph, free)
        self.lower_twin = [-1] * (max(free) + 1)
        for gpu in free:
            self.lower_twin[gpu] = twins[gpu]
        self.best_key: tuple[float, ...] | None = None
        self.best_gpus: tuple[int, ...] | None = None

    @property
    def pending_shape(self) -> tuple[list[list[tuple[int, int]]], list[int], list[int]]:
        """Per depth m (vertices 0..m-1 placed): the placed vertices with edges to unplaced ones and
        how many, the number of edges between unplaced vertices, and the most such edges at one
        unplaced vertex."""
        k = self.k
        frontier: list[list[tuple[int, int]]] = []
        inner_edges: list[int] = []
        inner_degree: list[int] = []
        for m in range(k + 1):
            out = [0] * k
            degree = [0] * k
            inner = 0
            for a, b in self.pattern.edges:
                lo, hi = min(a, b), max(a, b)
                if lo < m <= hi:
                    out[lo] += 1
                elif lo >= m:
                    inner += 1
                    degree[a] += 1
                    degree[b] += 1
            frontier.append([(p, out[p]) for p in range(m) if out[p]])
            inner_edges.append(inner)
            inner_degree.append(max(degree, default=0))
        return frontier, inner_edges, inner_degree

    @property
    def root_bound(self) -> tuple[float, ...]:
        """An upper bound of every placement's key on this set: each edge on the widest link."""
        agg = sum(weight * self.widest for (_, weight) in (e for v in self.back for e in v))
        if self.use_model:
            eff = best_completion(self.model, self.allowed_model_classes, (0,) * len(self.model.class_names), self.pending_edges[0])
            return (round(eff, _DIGITS), round(agg, _DIGITS))
        return (round(agg, _DIGITS),)

    @property
    def group_capacities(self) -> list[tuple[list[int], list[int]]]:
        if self._group_capacities is None:
            present = sorted(self.present_classes)
            capacities_of = []
            for bits in range(1, 1 << len(present)):
                group = [c for i, c in enumerate(present) if bits >> i & 1]
                capacities = sorted((sum(1 for b in self.free if b != a and self.cls[a][b] in group) for a in self.free), reverse=True)
                capacities_of.append((group, capacities))
            self._group_capacities = capacities_of
        return self._group_capacities

    @property
    def group_cuts(self) -> list[tuple[set[int], int]]:
        """Per group of classes, how many pattern edges must use a class outside it.

        The GPUs joined by links of the group fall apart into components; the pattern needs at
        least q of them to hold its k vertices (largest first). Cutting a connected pattern into q
        parts cuts at least q-1 edges, a bridgeless one (every edge on a cycle: a ring, a torus)
        at least q, and every cut edge joins two components: a link outside the group.
        """
        if self._group_cuts is None:
            cuts = []
            connected, bridgeless = _connectivity(self.pattern)
            if connected and self.k > 1:
                present = sorted(self.present_classes)
                for bits in range(1, (1 << len(present)) - 1):
                    group = {c for i, c in enumerate(present) if bits >> i & 1}
                    sizes = _component_sizes(self.free, self.cls, group)
                    parts, held = 0, 0
                    for size in sizes:
                        if held >= self.k:
                            break
                        parts, held = parts + 1, held + size
                    if parts >= 2:
                        cuts.append((group, parts if bridgeless else parts - 1))
            self._group_cuts = cuts
        return self._group_cuts

    def may_fit(self, budget) -> bool:
        """A necessary condition: no group of classes is asked for more edges than degrees allow,
        and every group leaves enough edges to the other classes to join its components.

        A pattern vertex of degree d placed on a GPU with c neighbours of the classes in a group
        touches at most min(d, c) edges of the group; pairing the largest degrees with the largest
        capacities bounds the edges of that group from above.
        """
        if any(budget[c] for c in range(len(budget)) if c not in self.present_classes):
            return False
        for group, needed in self.group_cuts:
            if sum(count for c, count in enumerate(budget) if c not in group) < needed:
                return False
        if self.parallel_edges:
            return True
        for group, capacities in self.group_capacities:
            wanted = sum(budget[c] for c in group)
            if wanted and wanted > sum(min(d, c) for d, c in zip(self.pattern_degrees, capacities)) // 2:
                return False
        return True

    def model_counts(self, counts) -> tuple[int, ...]:
        result = [0] * len(self.model.class_names)
        for class_index, count in enumerate(counts):
            result[self.model_class_of[class_index]] += count
        return tuple(result)

    def leaf_key_of(self, gpus: tuple[int, ...]) -> tuple[float, ...]:
        counts = [0] * len(self.class_info)
        agg = 0.0
        for (a, b), weight in zip(self.pattern.edges, self.pattern.weights):
            counts[self.cls[gpus[a]][gpus[b]]] += 1
            agg += weight * self.bw[gpus[a]][gpus[b]]
        if self.use_model:
            return (round(self.model.predict(self.model_counts(counts)), _DIGITS), round(agg, _DIGITS))
        return (round(agg, _DIGITS),)

    def run(self, budget) -> tuple[int, ...] | None:
        k = self.k
        free = self.free
        bw = self.bw
        cls = self.cls
        back = self.back
        twin_prev = self.twin_prev
        lower_twin = self.lower_twin
        tick = self.meter.tick
        placed = [-1] * k
        used = [False] * (max(free) + 1)
        remaining = list(budget) if budget is not None else None
        self.best_key = None
        self.best_gpus = None
        n_classes = len(self.class_info)

        # Placements are injective, so a placement and its image under an automorphism first
        # differ where the automorphism first moves a position, i: the placement is not larger
        # iff placed[i] < placed[perm[i]]. That pair is known once both are placed.
        order_checks = self.order_checks

        # With a budget: can each class still get the edges it is owed? avail[g][c] = unused GPUs
        # of the set that g reaches over class c. An edge from a placed vertex p lands on an
        # unused GPU (distinct vertices, distinct GPUs), so p gives at most min(its pending edges,
        # avail[placed p][c]) edges of class c; an edge between two unplaced vertices joins two
        # unused GPUs, each of which hosts one vertex of at most D such edges.
        capacity_check = remaining is not None and not self.parallel_edges
        if capacity_check:
            frontier, inner_edges, inner_degree = self.pending_shape
            avail = {g: [0] * n_classes for g in free}
            for g in free:
                row, counts_g = cls[g], avail[g]
                for h in free:
                    if h != g:
                        counts_g[row[h]] += 1

        def starved(m: int) -> bool:
            cap_degree = inner_degree[m]
            inner = inner_edges[m]
            for c in range(n_classes):
                owed = remaining[c]  # type: ignore[index]
                if not owed:
                    continue
                cap = 0
                for p, count in frontier[m]:
                    have = avail[placed[p]][c]
                    cap += count if count < have else have
                if inner and cap < owed:
                    ends = 0
                    for g in free:
                        if not used[g]:
                            have = avail[g][c]
                            ends += cap_degree if cap_degree < have else have
                    cap += min(inner, ends // 2)
                if cap < owed:
                    return True
            return False

        def bound_key(m: int, counts: list[int], agg: float) -> tuple[float, ...]:
            agg_bound = agg
            for v in range(m, k):
                for lo, weight in back[v]:
                    agg_bound += weight * (self.widest_to_free[placed[lo]] if lo < m else self.widest)
            if self.use_model:
                eff = best_completion(self.model, self.allowed_model_classes, self.model_counts(counts), self.pending_edges[m])
                return (round(eff, _DIGITS), round(agg_bound, _DIGITS))
            return (round(agg_bound, _DIGITS),)

        def leaf_key(counts: list[int], agg: float) -> tuple[float, ...]:
            if self.use_model:
                return (round(self.model.predict(self.model_counts(counts)), _DIGITS), round(agg, _DIGITS))
            return (round(agg, _DIGITS),)

        def visit(m: int, counts: list[int], agg: float) -> bool:
            """Returns True to stop the whole search (a budgeted search stops at its first hit)."""
            if m == k:
                if self.needs_leaf_check and self.sym.canonical(tuple(placed)) != tuple(placed):
                    return False
                if remaining is not None:
                    self.best_gpus = tuple(placed)
                    return True
                key = leaf_key(counts, agg)
                if self.best_key is None or key > self.best_key:
                    self.best_key = key
                    self.best_gpus = tuple(placed)
                return False
            tick()
            if remaining is None and self.best_key is not None and bound_key(m, counts, agg) <= self.best_key:
                return False
            if capacity_check and starved(m):
                return False
            floor = placed[twin_prev[m]] if twin_prev[m] >= 0 else -1
            edges_here = back[m]
            for gpu in free:
                if gpu <= floor or used[gpu]:
                    continue
                twin = lower_twin[gpu]
                if twin >= 0 and not used[twin]:
                    continue
                new_agg = agg
                ok = True
                taken: list[int] = []
                for lo, weight in edges_here:
                    other = placed[lo]
                    c = cls[other][gpu]
                    if remaining is not None:
                        if remaining[c] == 0:
                            ok = False
                            break
                        remaining[c] -= 1
                        taken.append(c)
                    counts[c] += 1
                    taken.append(-1 - c)
                    new_agg += weight * bw[other][gpu]
                if ok:
                    placed[m] = gpu
                    if all(placed[i] < placed[j] for i, j in order_checks[m]):
                        used[gpu] = True
                        if capacity_check:
                            row = cls[gpu]
                            for h in free:
                                if h != gpu:
                                    avail[h][row[h]] -= 1
                        stop = visit(m + 1, counts, new_agg)
                        if capacity_check:
                            for h in free:
                                if h != gpu:
                                    avail[h][row[h]] += 1
                        used[gpu] = False
                        if stop:
                            placed[m] = -1
                            for t in taken:
                                if t >= 0:
                                    remaining[t] += 1  # type: ignore[index]
                                else:
                                    counts[-1 - t] -= 1
                            return True
                    placed[m] = -1
                for t in taken:
                    if t >= 0:
                        remaining[t] += 1  # type: ignore[index]
                    else:
                        counts[-1 - t] -= 1
            return False

        visit(0, [0] * n_classes, 0.0)
        return self.best_gpus
