"""The exact candidate search: the best placement of a pattern on the free GPUs of a node.

The hardware graph is complete, so every injective map of pattern vertices to free GPUs is a
match. The search walks those maps depth first:

* GPUs are tried in ascending order at every depth, so placements are met in lexicographic
  order of the GPU sequence (in pattern order). A candidate replaces the incumbent only when its
  score is strictly higher, so among equal scores the lexicographically smallest wins: that is
  the documented tie-break, and it lets the search drop any branch that can at best tie.
* Pattern automorphisms are pruned: only the lexicographically smallest of equivalent
  placements (the lex leader) is visited (see :class:`~.patterns.PatternSymmetry`).
* With unit edge weights both the effective and the aggregated objective depend only on how
  many pattern edges use each link class. So the count vectors are ranked by objective first, and
  the walk looks for the lex-first placement with exactly the counts of the best vector that has
  one (``_by_class_budgets``); a degree bound discards impossible vectors without walking.
* Weighted patterns fall back to branch and bound: per pending edge, the widest link its placed
  endpoint has to a free GPU; for the model, the best value reachable with the pending edges
  (:func:`~.effbw.best_completion`).

Objectives (each a tuple compared lexicographically, floats rounded to 1e-9):

* ``effective``  - (predicted effective bandwidth, aggregated bandwidth)
* ``aggregated`` - (aggregated bandwidth,)
* ``preserved``  - (preserved bandwidth of the GPUs left free, aggregated bandwidth); the first
  term depends only on the GPU set, so sets are enumerated first and the placement search runs
  only on the sets that tie for the best preserved bandwidth.

Owns Placement, best_placement and the objectives; imports .effbw, .hardware and .patterns.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from math import comb
from typing import Iterable, Sequence

from ..errors import InputError
from .effbw import EffectiveBandwidthModel, best_completion
from .hardware import HardwareGraph
from .patterns import Pattern

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
) -> Placement | None:
    """The exact optimum of ``objective`` over all placements of ``pattern`` on ``free``; None if it does not fit."""
    if objective not in OBJECTIVES:
        raise InputError(f"unknown objective {objective!r} (accepted: {', '.join(OBJECTIVES)})")
    free_sorted = tuple(sorted(set(free)))
    for gpu in free_sorted:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
    if pattern.size > len(free_sorted):
        return None
    if objective == "preserved":
        return _best_preserving(graph, free_sorted, pattern, model)
    found = _branch_and_bound(graph, free_sorted, pattern, objective, model)
    return score_placement(graph, free_sorted, pattern, found, model) if found is not None else None


def _best_preserving(
    graph: HardwareGraph, free: tuple[int, ...], pattern: Pattern, model: EffectiveBandwidthModel
) -> Placement | None:
    k = pattern.size
    tied = _sets_keeping_most_bandwidth(graph, free, k)
    if len(tied) == comb(len(free), k):
        # Every set ties (e.g. at most one GPU stays free): one search over all of them.
        gpus = _branch_and_bound(graph, free, pattern, "aggregated", model)
        assert gpus is not None
        return score_placement(graph, free, pattern, gpus, model)
    gpus = _best_on_any_set(graph, tied, pattern, "aggregated", model)
    assert gpus is not None
    return score_placement(graph, free, pattern, gpus, model)


_VECTORISE_ABOVE = 300  # k-subsets; below this plain Python beats numpy's per-call overhead


def _sets_keeping_most_bandwidth(graph: HardwareGraph, free: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """All k-subsets of ``free`` whose removal leaves the most link bandwidth among the rest, in lex order."""
    if comb(len(free), k) > _VECTORISE_ABOVE and graph.size <= _MAX_TABLE_GPUS:
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
) -> tuple[int, ...] | None:
    """Lex-first optimum of ``objective`` ("effective" or "aggregated") over placements on ``free``."""
    return _best_on_any_set(graph, [free], pattern, objective, model)


def _best_on_any_set(
    graph: HardwareGraph,
    gpu_sets: list[tuple[int, ...]],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
) -> tuple[int, ...] | None:
    """The lex-first optimum over placements that lie inside any one of ``gpu_sets``."""
    gpu_sets = [s for s in gpu_sets if len(s) >= pattern.size]
    if not gpu_sets:
        return None
    if not pattern.edges:
        return min(s[: pattern.size] for s in gpu_sets)
    use_model = objective == "effective"
    if any(w != 1.0 for w in pattern.weights):
        found = []
        for gpus in gpu_sets:
            dfs = _Dfs(graph, gpus, pattern, model, use_model=use_model)
            hit = dfs.run(budget=None)
            if hit is not None:
                found.append((dfs.leaf_key_of(hit), tuple(-g for g in hit), hit))
        return max(found)[2] if found else None
    return _by_class_budgets(graph, gpu_sets, pattern, objective, model)


def _by_class_budgets(
    graph: HardwareGraph, gpu_sets: list[tuple[int, ...]], pattern: Pattern, objective: str, model: EffectiveBandwidthModel
) -> tuple[int, ...] | None:
    """With unit weights both objectives are functions of how many pattern edges use each link class.

    So enumerate the class-count vectors in descending objective, and for each group of equal
    value ask the search for the lex-first placement with exactly those counts. The first group
    that has one holds the optimum. This prunes far harder than a bound on a non-monotone model.
    """
    use_model = objective == "effective"
    cls, class_info = _class_matrix(graph, model, use_model)
    searches = [_Dfs(graph, gpus, pattern, model, use_model=use_model, joint_classes=True) for gpus in gpu_sets]
    present = tuple(sorted(set().union(*(dfs.present_classes for dfs in searches))))
    for _key, budgets in _ranked_budgets(class_info, present, len(pattern.edges), objective, model):
        found = [
            hit
            for dfs in searches
            for budget in budgets
            if dfs.may_fit(budget) and (hit := dfs.run(budget=budget)) is not None
        ]
        if found:
            return min(found)
    return None


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
    ) -> None:
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
        sym = pattern.symmetry
        self.sym = sym
        self.automorphisms = sym.automorphisms
        self.twin_prev = sym.twin_prev
        self.needs_leaf_check = bool(sym.automorphisms) and any(p >= 0 for p in sym.twin_prev)
        pairs = [(min(a, b), max(a, b)) for a, b in pattern.edges]
        self.parallel_edges = len(set(pairs)) != len(pairs)
        degree = [0] * k
        for a, b in pairs:
            degree[a] += 1
            degree[b] += 1
        self.pattern_degrees = sorted(degree, reverse=True)
        self._group_capacities: list[tuple[list[int], list[int]]] | None = None

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

    def may_fit(self, budget) -> bool:
        """A necessary condition: no group of classes is asked for more edges than degrees allow.

        A pattern vertex of degree d placed on a GPU with c neighbours of the classes in a group
        touches at most min(d, c) edges of the group; pairing the largest degrees with the largest
        capacities bounds the edges of that group from above.
        """
        if any(budget[c] for c in range(len(budget)) if c not in self.present_classes):
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
        automorphisms = self.automorphisms
        twin_prev = self.twin_prev
        placed = [-1] * k
        used = [False] * (max(free) + 1)
        remaining = list(budget) if budget is not None else None
        best_key: list[tuple[float, ...] | None] = [None]
        best_gpus: list[tuple[int, ...] | None] = [None]
        n_classes = len(self.class_info)

        def lex_leader_prefix(m: int) -> bool:
            for perm in automorphisms:
                for i in range(m):
                    j = perm[i]
                    if j >= m:
                        break
                    if placed[j] != placed[i]:
                        if placed[j] < placed[i]:
                            return False
                        break
            return True

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
                    best_gpus[0] = tuple(placed)
                    return True
                key = leaf_key(counts, agg)
                if best_key[0] is None or key > best_key[0]:
                    best_key[0] = key
                    best_gpus[0] = tuple(placed)
                return False
            if remaining is None and best_key[0] is not None and bound_key(m, counts, agg) <= best_key[0]:
                return False
            floor = placed[twin_prev[m]] if twin_prev[m] >= 0 else -1
            edges_here = back[m]
            for gpu in free:
                if gpu <= floor or used[gpu]:
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
                    if not automorphisms or lex_leader_prefix(m + 1):
                        used[gpu] = True
                        stop = visit(m + 1, counts, new_agg)
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
        return best_gpus[0]
