"""``preserve-ahead``: MAPA Preserve with a look-ahead at the jobs likely to come next.

The paper's Preserve gives an insensitive job the GPUs that leave the largest *sum* of link
bandwidth free (Eq. 3). What the next sensitive job needs is one good ring of its own size, so
this policy scores a free set by what the likely next sensitive jobs could get on it:

    future(F) = sum over sizes k (2..) of  w_k * best_k(F)

where ``best_k(F)`` is the best predicted effective bandwidth (the paper's model, Eq. 2) of a
k-GPU ring on the GPUs of F (0 when k > |F|) and ``w_k`` the probability of size k. By default the
sizes are the paper's uniform 1..5, so w_2..w_5 = 1/5 (a 1-GPU job has no ring: it adds nothing).

On a busy node the next job rarely fits in what is left now: it starts when a running job ends,
on what is left plus that job's GPUs. So a remainder R is judged by its *outlook*

    outlook(R) = future(R) + mean over the jobs j running on the node of future(R + G_j)

(G_j: job j's GPUs here; just future(R) on an idle node). Every running job counts alike: the
Prolog knows which GPUs each job holds, not when it will end.

* Insensitive jobs and every 1-GPU job: the k-subset S of the free GPUs that maximises
  ``outlook(free - S)``; ties go to the higher preserved bandwidth (Eq. 3) of ``free - S``, then
  to the lexicographically smallest S.
* Sensitive jobs of 2+ GPUs: the sets whose best placement of the job's pattern is within
  ``tolerance`` (a fraction, 0 by default: only the sets that tie) of the best predicted effective
  bandwidth; among them the highest ``outlook(free - S)``, then the higher (effective, aggregated)
  key of the job, then the lexicographically smallest S.

The chosen set is ordered with :func:`~.allocation.order_within`, as the engine does for every set.

Everything is exact: ``best_k`` comes from :func:`~.search.best_placement` on each k-set, and
``best_k(F) = max(best_k(F - {g}) for g in F)`` for |F| > k. The values are memoised per
(graph, model, size distribution) across decisions: a node has at most 2^n free sets, so a
long-running process (the replay, a warm daemon) pays each set once.

Owns preserve-ahead (AHEAD_POLICIES, make_preserve_ahead, its settings); imports .allocation,
.effbw, .hardware, .patterns and .search, never :mod:`.policies`, which imports this module for
its registry.
"""

from __future__ import annotations

from itertools import combinations
from typing import Iterable, Mapping

from ..errors import InputError, toml_text
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern, make_pattern
from .allocation import Allocation, NoFit, Policy, Request, order_within
from .search import best_placement, preserved_bandwidth
from .search_limit import OutOfWork, SearchLimit

_DIGITS = 9
PAPER_SIZES: dict[int, float] = {1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2, 5: 0.2}
_MAX_CACHED_GRAPHS = 16
# The look-ahead's tables hold a value per free set: 65,536 on a 16-GPU node, 4e9 on 32. On bigger
# nodes the policy does not run: select() gives the job Preserve's choice (docs/policies.md).
MAX_LOOK_AHEAD_GPUS = 16
_MAX_ENTRIES = 4_000_000  # per (graph, model, sizes): 2^16 masks x 4 sizes fit many times over


def _normalised(sizes: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    """The size distribution as sorted (size, probability) pairs for the sizes 2+ (a key for caches)."""
    sizes = dict(PAPER_SIZES if sizes is None else sizes)
    if not sizes:
        raise InputError("the size distribution of preserve-ahead is empty")
    total = 0.0
    for size, weight in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise InputError(f"preserve-ahead: job size {size!r} must be a whole number of GPUs, 1 or more")
        if weight < 0:
            raise InputError(f"preserve-ahead: the weight of size {size} is negative ({weight})")
        total += weight
    if total <= 0:
        raise InputError("preserve-ahead: the size distribution has no weight")
    return tuple((k, w / total) for k, w in sorted(sizes.items()) if k >= 2 and w > 0)


_PAPER_NORMALISED = _normalised(None)


class _Unknown(dict):
    """A memo read as ``memo[key]``: None where nothing is kept yet."""

    def __missing__(self, key: int) -> None:
        return None


def _future_table(size: int) -> "list[float | None] | _Unknown":
    """The outlook's memo per free set: a list indexed by the mask on nodes of up to 16 GPUs (the
    policy's hot path reads it dozens of times per decision), else a dict."""
    return [None] * (1 << size) if size <= 16 else _Unknown()


class _Tables:
    """Memoised values for one (graph, model, size distribution)."""

    def __init__(self, graph: HardwareGraph, model: EffectiveBandwidthModel, sizes: tuple[tuple[int, float], ...]) -> None:
        self.graph = graph
        self.model = model
        self.sizes = sizes
        self.rings = {k: make_pattern("ring", k) for k, _ in sizes}
        self.best: dict[int, dict[int, float]] = {k: {} for k, _ in sizes}  # k -> mask -> best_k
        self.future_memo = _future_table(graph.size)
        self.job_memo: dict[Pattern, dict[int, tuple[float, float]]] = {}  # pattern -> mask -> (eff, agg)
        self.preserved_memo: dict[int, float] = {}
        # (policy name, free mask, chosen mask, sensitive) -> the Allocation order_within makes of it, per
        # pattern: the same set from the same free set comes back under many running jobs' GPUs
        self.ordered_memo: dict[Pattern, dict[tuple, Allocation]] = {}
        # pattern -> (free mask, tolerance) -> the (mask, job key) of each set within tolerance of the best
        self.contenders: dict[Pattern, dict[tuple[int, float], tuple]] = {}
        self.entries = 0

    def _count(self) -> None:
        self.entries += 1
        if self.entries > _MAX_ENTRIES:
            for k in self.best:
                self.best[k].clear()
            self.future_memo = _future_table(self.graph.size)
            self.job_memo.clear()
            self.preserved_memo.clear()
            self.ordered_memo.clear()
            self.contenders.clear()
            self.entries = 0

    def best_ring(self, k: int, mask: int) -> float:
        """Best predicted effective bandwidth of a k-ring on the GPUs of ``mask`` (0 if it does not fit)."""
        memo = self.best[k]
        found = memo.get(mask)
        if found is not None:
            return found
        n = mask.bit_count()
        if n < k:
            value = 0.0
        elif n == k:
            gpus = [g for g in range(self.graph.size) if mask >> g & 1]
            placed = best_placement(self.graph, gpus, self.rings[k], "effective", self.model)
            assert placed is not None and placed.effective_bandwidth is not None
            value = round(placed.effective_bandwidth, _DIGITS)
        else:
            value = 0.0
            rest = mask
            while rest:
                bit = rest & -rest
                rest ^= bit
                sub = self.best_ring(k, mask ^ bit)
                if sub > value:
                    value = sub
        memo[mask] = value
        self._count()
        return value

    def future(self, mask: int) -> float:
        """The look-ahead score of a free set: the size-weighted best ring bandwidth on it."""
        found = self.future_memo[mask]
        if found is not None:
            return found
        value = round(sum(w * self.best_ring(k, mask) for k, w in self.sizes), _DIGITS)
        self.future_memo[mask] = value
        self._count()
        return value

    def preserved(self, mask: int) -> float:
        found = self.preserved_memo.get(mask)
        if found is None:
            found = round(preserved_bandwidth(self.graph, [g for g in range(self.graph.size) if mask >> g & 1]), _DIGITS)
            self.preserved_memo[mask] = found
            self._count()
        return found

    def job_keys(self, pattern: Pattern) -> dict[int, tuple[float, float]]:
        """The memo of :meth:`job_key` for one pattern (hashing the pattern once per decision)."""
        found = self.job_memo.get(pattern)
        if found is None:
            found = self.job_memo[pattern] = {}
        return found

    def job_key(self, pattern: Pattern, mask: int) -> tuple[float, float]:
        """(effective, aggregated) of the best placement of ``pattern`` on exactly the GPUs of ``mask``."""
        memo = self.job_keys(pattern)
        found = memo.get(mask)
        if found is None:
            gpus = [g for g in range(self.graph.size) if mask >> g & 1]
            placed = best_placement(self.graph, gpus, pattern, "effective", self.model)
            assert placed is not None
            eff = placed.effective_bandwidth if placed.effective_bandwidth is not None else 0.0
            found = (round(eff, _DIGITS), round(placed.aggregated_bandwidth, _DIGITS))
            memo[mask] = found
            self._count()
        return found


_TABLES: dict[tuple, _Tables] = {}


def tables_for(graph: HardwareGraph, model: EffectiveBandwidthModel, sizes: tuple[tuple[int, float], ...]) -> _Tables:
    key = (graph, model, sizes)
    found = _TABLES.get(key)
    if found is None:
        if len(_TABLES) >= _MAX_CACHED_GRAPHS:
            _TABLES.clear()
        found = _TABLES[key] = _Tables(graph, model, sizes)
    return found


def clear_cache() -> None:
    """Forget every memoised score (for cold-start timings and tests)."""
    _TABLES.clear()


def _mask_of(gpus: Iterable[int]) -> int:
    mask = 0
    for g in gpus:
        mask |= 1 << g
    return mask


def choose_set(
    graph: HardwareGraph,
    free: tuple[int, ...],
    request: Request,
    model: EffectiveBandwidthModel,
    sizes: Mapping[int, float] | None = None,
    tolerance: float = 0.0,
    running: Iterable[Iterable[int]] = (),
) -> tuple[int, ...] | None:
    """The GPU set preserve-ahead gives ``request`` on ``free`` (sorted), or None if it does not fit.

    ``running``: the GPUs of each job running on the node (disjoint from ``free``), for the outlook.
    """
    free = tuple(sorted(set(free)))
    k = request.gpus
    if k > len(free):
        return None
    if tolerance < 0:
        raise InputError(f"preserve-ahead: tolerance must be 0 or more, got {tolerance}")
    tables = tables_for(graph, model, _PAPER_NORMALISED if sizes is None else _normalised(sizes))
    free_mask = _mask_of(free)
    groups = sorted({_mask_of(group) for group in running})  # sorted: the same sum in every process
    share = len(groups)

    known = tables.future_memo  # the hot path: an index, the method only on a miss

    bits = [1 << g for g in free]
    best_mask = 0
    # Subsets as masks in the lexicographic order of combinations(free, k); the set is read back
    # from the winning mask.
    if request.sensitive and k > 1:
        # The sets within tolerance of the best depend on the free set alone, not on the running
        # jobs: kept per (pattern, free set, tolerance), so a decision the replay meets again under
        # other running jobs only weighs their outlooks.
        contenders_of = tables.contenders.get(request.pattern)
        if contenders_of is None:
            contenders_of = tables.contenders[request.pattern] = {}
        contenders = contenders_of.get((free_mask, tolerance))
        if contenders is None:
            scored = []
            top = None
            job_memo = tables.job_keys(request.pattern)
            for subset_bits in combinations(bits, k):
                mask = sum(subset_bits)
                job = job_memo.get(mask) or tables.job_key(request.pattern, mask)
                scored.append((mask, job))
                if top is None or job[0] > top:
                    top = job[0]
            assert top is not None
            floor = round(top - tolerance * abs(top), _DIGITS)
            contenders = contenders_of[(free_mask, tolerance)] = tuple((mask, job) for mask, job in scored if job[0] >= floor)
            tables._count()
        if len(contenders) == 1:  # no choice left for the outlook to make
            best_mask = contenders[0][0]
        else:
            # The key is (outlook of what is left, the job's key); lex order: a later set must be
            # strictly better. outlook() is inlined: this loop is the policy's hot path.
            best_outlook: float | None = None
            best_job = None
            for mask, job in contenders:
                rest = free_mask ^ mask
                value = known[rest]
                if value is None:
                    value = tables.future(rest)
                if groups:
                    later = 0.0
                    for group in groups:
                        after = known[rest | group]
                        later += after if after is not None else tables.future(rest | group)
                    value = round(value + later / share, _DIGITS)
                if best_outlook is None or value > best_outlook or (value == best_outlook and job > best_job):
                    best_outlook, best_job, best_mask = value, job, mask
        return tuple(g for g in free if best_mask >> g & 1)
    # The key is (outlook, preserved bandwidth) of what is left; the preserved bandwidth is read only
    # where the outlooks tie (lex order: a later set must be strictly better).
    preserved = tables.preserved_memo.get
    best_outlook = None
    best_kept = None
    for subset_bits in combinations(bits, k):
        rest = free_mask ^ sum(subset_bits)
        value = known[rest]  # outlook(rest), inlined as above
        if value is None:
            value = tables.future(rest)
        if groups:
            later = 0.0
            for group in groups:
                after = known[rest | group]
                later += after if after is not None else tables.future(rest | group)
            value = round(value + later / share, _DIGITS)
        if best_outlook is None or value > best_outlook:
            best_outlook, best_kept, best_mask = value, None, free_mask ^ rest
        elif value == best_outlook:
            if best_kept is None:
                best_rest = free_mask ^ best_mask
                best_kept = preserved(best_rest)
                if best_kept is None:
                    best_kept = tables.preserved(best_rest)
            kept = preserved(rest)
            if kept is None:
                kept = tables.preserved(rest)
            if kept > best_kept:
                best_kept, best_mask = kept, free_mask ^ rest
    return tuple(g for g in free if best_mask >> g & 1)


def parse_sizes(spec: str | Mapping) -> dict[int, float]:
    """A size distribution from ``"1:0.2,2:0.2,4:1"`` (GPUs:weight) or a TOML table ``{"1" = 0.2, ...}``.

    Weights need not sum to 1 (they are normalised). Raises InputError naming what is wrong.
    """
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in str(spec).split(","):
            if part.strip():
                size, colon, weight = part.partition(":")
                if not colon:
                    raise InputError(f"preserve-ahead sizes: {part.strip()!r} is not GPUS:WEIGHT (e.g. 1:0.2,2:0.2,4:0.6)")
                items.append((size.strip(), weight.strip()))
    sizes: dict[int, float] = {}
    for size, weight in items:
        if not (size.isascii() and size.isdigit()) or int(size) < 1 or int(size) > 64:
            raise InputError(f"preserve-ahead sizes: job size {size!r} must be a whole number of GPUs from 1 to 64")
        try:
            value = float(weight) if not isinstance(weight, bool) else float("nan")
        except (TypeError, ValueError):
            value = float("nan")
        if not value >= 0 or value == float("inf"):
            raise InputError(f"preserve-ahead sizes: the weight of size {size} must be a number, 0 or more, got {toml_text(weight)}")
        sizes[int(size)] = value
    _normalised(sizes)  # an empty or weightless distribution is refused here
    return sizes


def settings_from_table(table: object, source: str) -> tuple[dict[int, float] | None, float]:
    """(sizes or None, tolerance) from a config's ``[preserve_ahead]`` table (Prolog and replay configs)."""
    if table is None:
        table = {}
    if not isinstance(table, Mapping) or set(table) - {"sizes", "tolerance"}:
        raise InputError(f"{source}: [preserve_ahead] takes sizes = {{ 1 = 0.2, 2 = 0.2, ... }} and tolerance = 0.0")
    sizes = None
    if "sizes" in table:
        if not isinstance(table["sizes"], Mapping):
            raise InputError(f"{source}: [preserve_ahead] sizes must be a table of GPUs to weight, e.g. {{ 1 = 0.5, 4 = 0.5 }}")
        try:
            sizes = parse_sizes(table["sizes"])
        except InputError as error:
            raise InputError(f"{source}: {error}") from None
    tolerance = table.get("tolerance", 0.0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance <= 1:
        raise InputError(f"{source}: [preserve_ahead] tolerance must be a fraction from 0 to 1, got {toml_text(tolerance)}")
    return sizes, float(tolerance)


def sizes_from_jobs(gpus_per_job: Iterable[int]) -> dict[int, float]:
    """The size distribution of a job history (GPUs per node of each job), e.g. from a sacct log."""
    counts: dict[int, float] = {}
    for gpus in gpus_per_job:
        counts[gpus] = counts.get(gpus, 0.0) + 1.0
    if not counts:
        raise InputError("preserve-ahead sizes: the history has no GPU jobs to learn sizes from")
    total = sum(counts.values())
    return {k: round(v / total, 6) for k, v in sorted(counts.items())}


def make_preserve_ahead(sizes: Mapping[int, float] | None = None, tolerance: float = 0.0, name: str = "preserve-ahead") -> Policy:
    """A preserve-ahead policy for a size distribution ({gpus: weight}, default uniform 1..5) and tolerance."""
    normalised = _normalised(sizes)  # validate now, not at the first decision
    if tolerance < 0:
        raise InputError(f"preserve-ahead: tolerance must be 0 or more, got {tolerance}")

    def policy(
        graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel,
        running: tuple[tuple[int, ...], ...] = (), limit: SearchLimit | None = None,
    ) -> Allocation | NoFit:
        if graph.size > MAX_LOOK_AHEAD_GPUS:
            raise OutOfWork()  # select() gives the job Preserve's choice, and says so
        chosen = choose_set(graph, free, request, model, sizes, tolerance, running)
        if chosen is None:
            return NoFit(name, request, free)
        tables = tables_for(graph, model, normalised)
        memo = tables.ordered_memo.get(request.pattern)
        if memo is None:
            memo = tables.ordered_memo[request.pattern] = {}
        key = (name, _mask_of(free), _mask_of(chosen), request.sensitive)
        found = memo.get(key)
        if found is None:
            found = order_within(name, graph, free, chosen, request, model, limit)
            if found.placement.gap is None:  # only proven orders are kept for later decisions
                memo[key] = found
                tables._count()
        return found

    policy.__name__ = name.replace("-", "_")
    policy.sees_running = True  # select() hands it the GPUs of the jobs running on the node
    policy.takes_limit = True  # for the order of the set it picks
    return policy


preserve_ahead = make_preserve_ahead()

AHEAD_POLICIES: dict[str, Policy] = {"preserve-ahead": preserve_ahead}
