"""The GPU sets whose removal keeps the most link bandwidth among the GPUs left (the preserved
objective's first term, which depends on the set only, not on the order inside it).

Nodes of up to 20 GPUs rank every k-subset (:func:`all_sets_keeping_most_bandwidth`: in Python for
a few hundred subsets, with a per-node table of every subset's inner bandwidth in numpy beyond);
larger ones use the branch and bound of :class:`SetSearch`.

Owns those two; imports .hardware, .placement, .search_limit and .symmetry.
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from itertools import combinations
from math import comb, inf

from .hardware import HardwareGraph
from .placement import DIGITS as _DIGITS
from .search_limit import Meter, OutOfWork
from .symmetry import graph_automorphisms, twin_classes

_VECTORISE_ABOVE = 300  # k-subsets; below this plain Python beats numpy's per-call overhead


def all_sets_keeping_most_bandwidth(graph: HardwareGraph, free: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
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


class SetSearch:
    """Branch and bound for the k GPUs to take that keep the most bandwidth among the rest.

    It picks the smaller side X: the k GPUs taken (value = links inside X minus every link leaving
    a GPU of X, i.e. minus the loss) or the n-k GPUs kept (value = links inside X). Either way the
    value is sum(c[a] for a in X) + w(X), and an upper bound for adding r more GPUs from the
    candidates left is the sum of the r largest c[b] + w(b, X) + (the r-1 widest links of b) / 2,
    as each link inside the new GPUs is counted from both ends. GPUs are walked twin class by twin
    class; a class contributes a prefix of its members (lowest taken, so highest kept), and every
    set that ties for the best is collected.
    """

    def __init__(self, graph: HardwareGraph, free: tuple[int, ...], k: int, meter: Meter) -> None:
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
            # Adding back the orbits counts against the limit too: running out there leaves the
            # best value proven and the tied sets found so far.
            tied = self.orbits(self.tied)
        except OutOfWork:
            upper = max(self.best, round(self.open_bound, _DIGITS))
            found = min(self.taken_set(list(x)) for x in self.tied) if self.tied else self.taken_set(self.incumbent)
            raise OutOfWork(upper=self.value_to_kept(upper), found=found) from None
        return sorted(self.taken_set(list(x)) for x in tied)

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
        except OutOfWork:
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
            except OutOfWork:
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
