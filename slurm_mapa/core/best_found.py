"""The best placement found when a search runs out of its limit (see :class:`~.search_limit.SearchLimit`):
the better of the best the exact phase found and a greedy placement, improved by swaps while
the rest of the limit lasts.

Owns improved_placement; imports .effbw, .hardware, .patterns, .placement, .search_limit and
.symmetry.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .placement import DIGITS as _DIGITS
from .search_limit import Meter, OutOfWork
from .symmetry import search_symmetry


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


def improved_placement(
    graph: HardwareGraph,
    pool: tuple[int, ...],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: Meter,
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
    except OutOfWork:
        pass
    return search_symmetry(pattern).canonical(tuple(current))

