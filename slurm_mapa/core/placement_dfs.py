"""The depth-first walk over placements of a pattern on one GPU set (see :mod:`.search`).

:class:`PlacementDfs` visits lex-leader placements in lexicographic order. With a budget (edges
allowed per link class) it returns the lex-first placement using exactly that many edges of each
class; without one it maximises the objective by branch and bound (weighted patterns).

What it needs of the pattern alone (:class:`PatternShape`) and of the GPU set alone
(:class:`SetTables`: link classes as bit masks, twins, the components and capacities of each group
of classes) is computed once and kept: a replay or a daemon meets the same free sets and patterns
again and again, and one decision searches a set once per budget it tries.

Owns PlacementDfs, PatternShape, SetTables, class_matrix, ranked_budgets and connectivity;
imports .effbw, .hardware, .patterns, .placement, .search_limit and .symmetry.
"""

from __future__ import annotations

from functools import lru_cache

from .effbw import EffectiveBandwidthModel, best_completion
from .hardware import HardwareGraph
from .patterns import Pattern, PatternSymmetry
from .placement import DIGITS as _DIGITS
from .search_limit import Meter
from .symmetry import lower_twins, search_symmetry


@lru_cache(maxsize=64)
def class_matrix(graph: HardwareGraph, model: EffectiveBandwidthModel, use_model: bool):
    """Per GPU pair the class the objective can tell apart: (model class, bandwidth) for the
    effective objective, the bandwidth alone for the aggregated one."""
    bw = graph.bandwidth_matrix()
    index_of: dict[tuple[int, float], int] = {}
    cls = [[-1] * graph.size for _ in graph.gpus]
    for a, b in graph.pairs():
        signature = (model.classify(graph.links[a][b]) if use_model else 0, bw[a][b])
        cls[a][b] = cls[b][a] = index_of.setdefault(signature, len(index_of))
    return tuple(tuple(row) for row in cls), tuple(sorted(index_of, key=index_of.__getitem__))


@lru_cache(maxsize=64)
def _model_class_matrix(graph: HardwareGraph, model: EffectiveBandwidthModel, use_model: bool):
    """Per GPU pair its model class (all 0 without the model): what branch and bound counts."""
    cls = tuple(tuple((model.classify(graph.links[a][b]) if use_model else 0) if a != b else -1 for b in graph.gpus)
                for a in graph.gpus)
    class_info = tuple((c, 0.0) for c in range(len(model.class_names))) if use_model else ((0, 0.0),)
    return cls, class_info


@lru_cache(maxsize=256)
def ranked_budgets(
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


@lru_cache(maxsize=256)
def budget_keys(ranked: tuple[tuple[tuple[float, ...], tuple[tuple[int, ...], ...]], ...]) -> dict[tuple[int, ...], tuple[float, ...]]:
    """Each budget of :func:`ranked_budgets` with its key."""
    return {budget: key for key, budgets in ranked for budget in budgets}


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


@lru_cache(maxsize=256)
def connectivity(pattern: Pattern) -> tuple[bool, bool]:
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


class PatternShape:
    """What the walk needs of a pattern and its search symmetry (``sym``), computed once."""

    def __init__(self, pattern: Pattern, sym: PatternSymmetry) -> None:
        k = pattern.size
        self.k = k
        self.sym = sym
        self.edges = tuple(zip(pattern.edges, pattern.weights))
        # back[v]: the edges from v to lower vertices, (lower vertex, weight); placed before v.
        self.back: list[tuple[tuple[int, float], ...]] = [() for _ in range(k)]
        for (a, b), weight in self.edges:
            self.back[max(a, b)] += ((min(a, b), weight),)
        self.pending_edges = [sum(len(self.back[v]) for v in range(m, k)) for m in range(k + 1)]
        # Placements are injective, so a placement and its image under an automorphism first
        # differ where the automorphism first moves a position, i: the placement is not larger
        # iff placed[i] < placed[perm[i]]. That pair is known once both are placed.
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
        self.degrees = tuple(sorted(degree, reverse=True))
        self.connected, self.bridgeless = connectivity(pattern)
        self.n_edges = len(pattern.edges)
        self.fit_key = (k, self.n_edges, self.connected, self.bridgeless, self.parallel_edges, self.degrees)
        # Per depth m (vertices 0..m-1 placed): the placed vertices with edges to unplaced ones and
        # how many, the number of edges between unplaced vertices, and the most such edges at one
        # unplaced vertex.
        self.frontier: list[tuple[tuple[int, int], ...]] = []
        self.inner_edges: list[int] = []
        self.inner_degree: list[int] = []
        for m in range(k + 1):
            out = [0] * k
            inner_at = [0] * k
            inner = 0
            for a, b in pattern.edges:
                lo, hi = min(a, b), max(a, b)
                if lo < m <= hi:
                    out[lo] += 1
                elif lo >= m:
                    inner += 1
                    inner_at[a] += 1
                    inner_at[b] += 1
            self.frontier.append(tuple((p, out[p]) for p in range(m) if out[p]))
            self.inner_edges.append(inner)
            self.inner_degree.append(max(inner_at, default=0))


_MAX_SHAPES = 256
_shapes: dict[Pattern, PatternShape] = {}


def pattern_shape(pattern: Pattern) -> PatternShape:
    sym = search_symmetry(pattern)  # fast to build for big patterns; see .symmetry
    found = _shapes.get(pattern)
    if found is None or found.sym is not sym:  # a new symmetry (its cache was cleared): build again
        if len(_shapes) >= _MAX_SHAPES:
            _shapes.clear()
        found = _shapes[pattern] = PatternShape(pattern, sym)
    return found


@lru_cache(maxsize=64)
def _class_tables(graph: HardwareGraph, model: EffectiveBandwidthModel, use_model: bool, joint: bool):
    """(cls, class_info, near) of the objective's class matrix; ``near[g][c]``: the GPUs that g
    reaches over class c, as a bit mask (g excluded)."""
    cls, class_info = class_matrix(graph, model, use_model) if joint else _model_class_matrix(graph, model, use_model)
    near = []
    for g in graph.gpus:
        by_class = [0] * len(class_info)
        for h in graph.gpus:
            if h != g:
                by_class[cls[g][h]] |= 1 << h
        near.append(tuple(by_class))
    return cls, class_info, tuple(near)


class SetTables:
    """What the walk needs of one GPU set (``mask``) under one class matrix, computed once per set.

    Classes and groups of classes are bit masks over the class indices.
    """

    def __init__(self, graph: HardwareGraph, free: tuple[int, ...], near: tuple[tuple[int, ...], ...], n_classes: int) -> None:
        self.graph = graph
        self.free = free
        self.near = near
        self.n_classes = n_classes
        mask = 0
        for g in free:
            mask |= 1 << g
        self.mask = mask
        present = 0
        for g in free:
            near_g = near[g]
            for c in range(n_classes):
                if near_g[c] & mask:
                    present |= 1 << c
        self.present_bits = present
        self.absent_bits = ((1 << n_classes) - 1) & ~present
        self.present_classes = frozenset(c for c in range(n_classes) if present >> c & 1)
        # Every non-empty group of the present classes.
        self.groups = tuple(bits for bits in range(1, present + 1) if bits & present == bits)
        twins = lower_twins(graph, free)
        self.lower_twin = [-1] * (max(free) + 1)
        for gpu in free:
            self.lower_twin[gpu] = twins[gpu]
        self._limits: dict[tuple, int] = {}
        self._widest: list[float] | None = None

    def widest_to_free(self) -> list[float]:
        """Per GPU of the set its widest link to another GPU of the set (branch and bound)."""
        if self._widest is None:
            bw = self.graph.bandwidth_matrix()
            widest = [0.0] * (max(self.free) + 1)
            for a in self.free:
                widest[a] = max((bw[a][b] for b in self.free if b != a), default=0.0)
            self._widest = widest
        return self._widest

    def group_limit(self, group: int, shape: PatternShape) -> int:
        """The most pattern edges that can use the classes of ``group`` (computed once per set,
        group and pattern shape).

        Cut: the GPUs joined by links of the group fall apart into components; the pattern needs
        at least q of them to hold its k vertices (largest first). Cutting a connected pattern into
        q parts cuts at least q-1 edges, a bridgeless one (every edge on a cycle: a ring, a torus)
        at least q, and every cut edge joins two components: a link outside the group.
        Degrees: a pattern vertex of degree d placed on a GPU with c neighbours of the classes in
        the group touches at most min(d, c) edges of the group; pairing the largest degrees with
        the largest capacities bounds them from above.
        """
        key = (shape.fit_key, group)
        found = self._limits.get(key)
        if found is not None:
            return found
        mask = self.mask
        reach = {}  # GPU of the set -> the GPUs of the set it reaches over the group's classes
        for g in self.free:
            near_g = self.near[g]
            joined = 0
            for c in range(self.n_classes):
                if group >> c & 1:
                    joined |= near_g[c]
            reach[g] = joined & mask
        limit = shape.n_edges
        if group != self.present_bits and shape.connected and shape.k > 1:
            sizes = []
            left = mask
            while left:
                component = frontier = left & -left
                while frontier:
                    bit = frontier & -frontier
                    frontier ^= bit
                    grown = reach[bit.bit_length() - 1] & ~component
                    component |= grown
                    frontier |= grown
                left &= ~component
                sizes.append(component.bit_count())
            sizes.sort(reverse=True)
            parts, held = 0, 0
            for size in sizes:
                if held >= shape.k:
                    break
                parts, held = parts + 1, held + size
            if parts >= 2:
                limit = shape.n_edges - (parts if shape.bridgeless else parts - 1)
        if not shape.parallel_edges:
            capacities = sorted((reach[g].bit_count() for g in self.free), reverse=True)
            most = sum(min(d, c) for d, c in zip(shape.degrees, capacities)) // 2
            limit = min(limit, most)
        self._limits[key] = limit
        return limit


@lru_cache(maxsize=4096)
def group_sums(budget: tuple[int, ...]) -> tuple[int, ...]:
    """Per group of classes (a bit mask over the class indices) the edges ``budget`` gives its classes."""
    sums = [0] * (1 << len(budget))
    for bits in range(1, len(sums)):
        low = bits & -bits
        sums[bits] = sums[bits ^ low] + budget[low.bit_length() - 1]
    return tuple(sums)


_MAX_SETS = 4096  # set tables kept (about a KiB each): a node's free set meets many requests
_set_tables: dict[tuple, SetTables] = {}


def set_tables(graph: HardwareGraph, free: tuple[int, ...], model: EffectiveBandwidthModel, use_model: bool, joint: bool):
    """(the cached tables of ``free``, cls, class_info) under the class matrix of the objective."""
    cls, class_info, near = _class_tables(graph, model, use_model, joint)
    key = (graph, model, use_model, joint, free)
    found = _set_tables.get(key)
    if found is None:
        if len(_set_tables) >= _MAX_SETS:
            _set_tables.clear()
        found = _set_tables[key] = SetTables(graph, free, near, len(class_info))
    return found, cls, class_info


def clear_caches() -> None:
    """Forget every set's tables (for timings that must compute what depends on the free set afresh)."""
    _set_tables.clear()


class PlacementDfs:
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
        meter: Meter,
    ) -> None:
        self.meter = meter
        self.free = free
        self.pattern = pattern
        self.model = model
        self.use_model = use_model
        self.graph = graph
        self.shape = shape = pattern_shape(pattern)
        self.k = shape.k
        self.bw = graph.bandwidth_matrix()
        # Branch and bound (not joint) needs only the model classes.
        self.tables, self.cls, class_info = set_tables(graph, free, model, use_model, joint_classes)
        self.class_info = class_info
        self.present_classes = self.tables.present_classes
        self.model_class_of = [signature[0] for signature in class_info]
        self.sym = shape.sym
        self.best_key: tuple[float, ...] | None = None
        self.best_gpus: tuple[int, ...] | None = None

    @property
    def allowed_model_classes(self) -> tuple[int, ...]:
        return tuple(sorted({self.model_class_of[c] for c in self.present_classes}))

    @property
    def root_bound(self) -> tuple[float, ...]:
        """An upper bound of every placement's key on this set: each edge on the widest link."""
        widest = max((self.tables.widest_to_free()[g] for g in self.free), default=0.0)
        agg = sum(weight * widest for (_, weight) in (e for v in self.shape.back for e in v))
        if self.use_model:
            eff = best_completion(self.model, self.allowed_model_classes, (0,) * len(self.model.class_names),
                                  self.shape.pending_edges[0])
            return (round(eff, _DIGITS), round(agg, _DIGITS))
        return (round(agg, _DIGITS),)

    def may_fit(self, budget) -> bool:
        """A necessary condition: no group of classes is asked for more edges than its components
        and degrees allow (:meth:`SetTables.group_limit`); no edge of a class the set lacks.

        The budgets sum to the pattern's edge count, so "the classes outside a group get at least
        q edges" is "the group gets at most edges - q"."""
        sums = group_sums(budget)
        tables = self.tables
        if sums[tables.absent_bits]:
            return False
        limits = tables._limits
        fit_key = self.shape.fit_key
        for group in tables.groups:
            inside = sums[group]
            if inside:  # 0 fits any limit
                limit = limits.get((fit_key, group))
                if limit is None:
                    limit = tables.group_limit(group, self.shape)
                if inside > limit:
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
        for (a, b), weight in self.shape.edges:
            counts[self.cls[gpus[a]][gpus[b]]] += 1
            agg += weight * self.bw[gpus[a]][gpus[b]]
        if self.use_model:
            return (round(self.model.predict(self.model_counts(counts)), _DIGITS), round(agg, _DIGITS))
        return (round(agg, _DIGITS),)

    def run(self, budget, keys: dict[tuple[int, ...], tuple[float, ...]] | None = None) -> tuple[int, ...] | None:
        """With ``keys`` (each budget's key, :func:`budget_keys`) and no budget: every placement is
        visited and ranked by the key of its counts (small sets, where that beats a walk per budget)."""
        shape, tables = self.shape, self.tables
        k = self.k
        free = self.free
        bw = self.bw
        cls = self.cls
        back = shape.back
        twin_prev = self.sym.twin_prev
        lower_twin = tables.lower_twin
        near = tables.near
        order_checks = shape.order_checks
        needs_leaf_check = shape.needs_leaf_check
        canonical = self.sym.canonical
        tick = self.meter.tick
        placed = [-1] * k
        used = [False] * (max(free) + 1)
        remaining = list(budget) if budget is not None else None
        self.best_key = None
        self.best_gpus = None
        n_classes = len(self.class_info)

        # With a budget: can each class still get the edges it is owed? An edge from a placed
        # vertex p lands on an unused GPU (distinct vertices, distinct GPUs), so p gives at most
        # min(its pending edges, the unused GPUs placed p reaches over class c) edges of class c;
        # an edge between two unplaced vertices joins two unused GPUs, each of which hosts one
        # vertex of at most D such edges.
        capacity_check = remaining is not None and not shape.parallel_edges
        frontier, inner_edges, inner_degree = shape.frontier, shape.inner_edges, shape.inner_degree

        def starved(m: int, unused: int) -> bool:
            cap_degree = inner_degree[m]
            inner = inner_edges[m]
            for c in range(n_classes):
                owed = remaining[c]  # type: ignore[index]
                if not owed:
                    continue
                cap = 0
                for p, count in frontier[m]:
                    have = (near[placed[p]][c] & unused).bit_count()
                    cap += count if count < have else have
                if inner and cap < owed:
                    ends = 0
                    for g in free:
                        if not used[g]:
                            have = (near[g][c] & unused).bit_count()
                            ends += cap_degree if cap_degree < have else have
                    cap += min(inner, ends // 2)
                if cap < owed:
                    return True
            return False

        bounded = remaining is None and keys is None
        widest_to_free = tables.widest_to_free() if bounded else None
        widest = max((widest_to_free[g] for g in free), default=0.0) if widest_to_free is not None else 0.0
        allowed_model_classes = self.allowed_model_classes if bounded else ()

        def bound_key(m: int, counts: list[int], agg: float) -> tuple[float, ...]:
            agg_bound = agg
            for v in range(m, k):
                for lo, weight in back[v]:
                    agg_bound += weight * (widest_to_free[placed[lo]] if lo < m else widest)  # type: ignore[index]
            if self.use_model:
                eff = best_completion(self.model, allowed_model_classes, self.model_counts(counts), shape.pending_edges[m])
                return (round(eff, _DIGITS), round(agg_bound, _DIGITS))
            return (round(agg_bound, _DIGITS),)

        def leaf_key(counts: list[int], agg: float) -> tuple[float, ...]:
            if self.use_model:
                return (round(self.model.predict(self.model_counts(counts)), _DIGITS), round(agg, _DIGITS))
            return (round(agg, _DIGITS),)

        def visit(m: int, counts: list[int], agg: float, unused: int) -> bool:
            """Returns True to stop the whole search (a budgeted search stops at its first hit)."""
            if m == k:
                if needs_leaf_check and canonical(tuple(placed)) != tuple(placed):
                    return False
                if remaining is not None:
                    self.best_gpus = tuple(placed)
                    return True
                key = keys[tuple(counts)] if keys is not None else leaf_key(counts, agg)
                if self.best_key is None or key > self.best_key:
                    self.best_key = key
                    self.best_gpus = tuple(placed)
                return False
            tick()
            if bounded and self.best_key is not None and bound_key(m, counts, agg) <= self.best_key:
                return False
            if capacity_check and starved(m, unused):
                return False
            floor = placed[twin_prev[m]] if twin_prev[m] >= 0 else -1
            edges_here = back[m]
            checks_here = order_checks[m]
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
                stop = False
                if ok:
                    placed[m] = gpu
                    in_order = True
                    for i, j in checks_here:
                        if placed[i] >= placed[j]:
                            in_order = False
                            break
                    if in_order:
                        used[gpu] = True
                        stop = visit(m + 1, counts, new_agg, unused & ~(1 << gpu))
                        used[gpu] = False
                    placed[m] = -1
                for t in taken:  # undone on every way out, a stop included
                    if t >= 0:
                        remaining[t] += 1  # type: ignore[index]
                    else:
                        counts[-1 - t] -= 1
                if stop:
                    return True
            return False

        visit(0, [0] * n_classes, 0.0, tables.mask)
        return self.best_gpus
