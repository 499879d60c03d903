"""A sensitive ring job's set among those its model ranks equal: the one whose links carry the
most rings (issue 38).

An effective-bandwidth model prices a ring job by one ring over the set, at its slowest hop
(derived models) or by its link-class counts (fitted ones), so sets whose best ring has the same
slowest hop tie, however richly the rest of the set is linked. NCCL and RCCL do not run one ring:
they run several at once over every link among the job's GPUs, so of two such sets the one whose
links carry more rings (:func:`.ring_packing.max_ring_rate`) is faster. On a DGX-1 V100, GPUs
0,1,2,3 (every pair linked) carry twice the rings of 0,3,4,7 (one 4-cycle), and both best rings
cross a single NVLink.

So MAPA ranks a sensitive ring job's candidate sets by (predicted effective bandwidth, ring rate
of the set, aggregated bandwidth), then the lexicographically smallest GPU sequence: the
model's value first (the search's ``effective`` objective, unchanged), the links' ring rate only
among the sets it ranks equal. Applied to ring and ring+tree jobs of 3 to
ring_packing.MAX_PACKED_GPUS GPUs when the free GPUs hold at most MAX_TIE_SETS sets of the job's
size (every set is looked at); elsewhere the search's choice stands, as it does when a decision's
time limit runs out before every set was looked at.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations
from math import comb, inf
from typing import Callable

from .effbw import RING_PACKED_SHAPES, EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .placement import DIGITS, RING_OBJECTIVE, Placement, preserved_bandwidth, score_placement
from .ring_packing import MAX_PACKED_GPUS, max_ring_rate
from .search import best_placement
from .search_limit import SearchLimit
from .subset_results import kept_results

# The most k-sets looked at for one choice (C(8, 4) = 70 on an 8-GPU node; C(12, 4) = 495 is not).
MAX_TIE_SETS = 256


def ranks_by_rings(pattern: Pattern, free: tuple[int, ...], model: EffectiveBandwidthModel | None = None) -> bool:
    """Whether a sensitive job of ``pattern`` on ``free`` is ranked by ring rate among its ties: not
    under a model whose ``ties`` are "first" (the paper's by name keeps the paper's own choice)."""
    k = pattern.size
    return (getattr(model, "ties", "rings") == "rings" and pattern.shape in RING_PACKED_SHAPES and 3 <= k <= MAX_PACKED_GPUS
            and k <= len(free) and comb(len(free), k) <= MAX_TIE_SETS)


def with_ring_rate(graph: HardwareGraph, placement: Placement) -> Placement:
    """``placement`` with its set's ring rate filled in."""
    return replace(placement, ring_rate=max_ring_rate(graph, tuple(placement.gpus)))


def best_by_rings(graph: HardwareGraph, free: tuple[int, ...], pattern: Pattern, model: EffectiveBandwidthModel,
                  best: Placement, limit: SearchLimit | None = None) -> Placement:
    """The placement objective effective-rings picks on ``free``, given ``best``, the search's
    exact ``effective`` optimum there (its value is the first term every candidate must reach).
    A ``limit`` in seconds (the Prolog's) whose time runs out before every set was looked at
    leaves ``best``, the search's own choice, with gap 0.0 (its value proven, the tie-break not):
    never a choice that depends on how far the refinement got.

    The choice is the k-set of ``free`` with the largest (ring rate, aggregated bandwidth), then
    the smallest GPU sequence, among those whose best placement reaches ``target``, the optimum
    (none exceeds it). ``best``'s own set reaches it, its best placement being ``best``: so no set
    of a lower ring rate than the best one met so far is ever searched, and a set's search (its
    best placement, kept for the process: :func:`_set_results`) waits until the sets whose results
    are known have been compared, then runs by rate, highest first, only while a rate can still win."""
    deadline = _deadline(limit)
    target = round(best.effective_bandwidth or 0.0, DIGITS)
    table, _, rated, search = _set_results(graph, pattern, model)
    own = 0
    for g in best.gpus:
        own |= 1 << g
    record = table.get(own) or rated(own)
    if record[2] is _UNKNOWN:  # what a search of best's own set finds: best (see above)
        search(own, best)
        record = table[own]
    # The chosen set so far: (-its rate rounded, its rounded aggregated bandwidth, GPUs, its rate).
    top, top_agg, top_gpus, top_rate = record[0], record[2][1], best.gpus, record[1]

    def beats(negative: float, found) -> bool:
        """Whether a set of rate ``-negative`` whose best placement is ``found`` replaces the chosen one."""
        return found is not None and found[0] == target and (
            negative < top or found[1] > top_agg or (found[1] == top_agg and found[2] < top_gpus))

    unknown = []
    for combo in combinations([1 << g for g in sorted(free)], pattern.size):
        if deadline is not None and deadline[0]() > deadline[1]:
            return replace(with_ring_rate(graph, best), gap=0.0)
        mask = sum(combo)
        record = table.get(mask)
        if record is None:
            record = rated(mask)
        if record[0] > top:
            continue  # a lower ring rate than a set that reaches the target
        found = record[2]
        if found is _UNKNOWN:
            unknown.append((record[0], mask))
        elif beats(record[0], found):
            top, top_agg, top_gpus, top_rate = record[0], found[1], found[2], record[1]
    unknown.sort()  # highest rate first
    for negative, mask in unknown:
        if negative > top:
            break  # this rate and every later one are lower than a set that reaches the target
        if deadline is not None and deadline[0]() > deadline[1]:
            # gap 0.0: the model's value is proven optimal, the ring-rate tie-break is not.
            return replace(with_ring_rate(graph, best), gap=0.0)
        found = search(mask)
        if beats(negative, found):
            top, top_agg, top_gpus, top_rate = negative, found[1], found[2], table[mask][1]
    if top_gpus == best.gpus:
        # The search's own choice: its scores on ``free`` are those score_placement gives.
        return replace(best, ring_rate=top_rate)
    placement = score_placement(graph, free, pattern, top_gpus, model)
    return replace(placement, ring_rate=top_rate)


def best_by_rings_known(graph: HardwareGraph, free: tuple[int, ...], pattern: Pattern, model: EffectiveBandwidthModel
                        ) -> Placement | None:
    """What ``best_by_rings`` chooses on ``free`` after the search, in one pass over its k-sets and
    without the search, where every k-set's best placement is known already (a warm replay or
    daemon: kept here, or kept by the search, :mod:`.subset_results`); None where one is not (then
    the search and ``best_by_rings`` run). The search's optimum on ``free`` is the best of its
    k-sets' (:mod:`.subset_results`), so the set ``best_by_rings`` picks is the k-set with the
    largest (effective bandwidth, ring rate, aggregated bandwidth), then the smallest GPU
    sequence: the same choice, with the same scores. No limit: its choice is exact."""
    gpus = sorted(set(free))
    k = pattern.size
    if not gpus or gpus[0] < 0 or gpus[-1] >= graph.size or len(gpus) < k:
        return None  # the search says what is wrong
    table, order, rated, search = _set_results(graph, pattern, model)
    bits = [1 << g for g in gpus]
    try:
        top = min([order[sum(combo)] for combo in combinations(bits, k)])
    except KeyError:
        kept_by_search = kept_results(graph, model, pattern, "effective")
        for combo in combinations(bits, k):
            mask = sum(combo)
            if mask not in order:
                if mask not in kept_by_search:
                    return None
                if mask not in table:
                    rated(mask)
                search(mask)  # the search's kept placement, scored (once per k-set)
        top = min([order[sum(combo)] for combo in combinations(bits, k)])
    if top[0] == inf:
        return None
    inside: Placement = top[5]  # scored on its own set: what score_placement gives on ``free`` but what stays free
    return Placement(gpus=inside.gpus, aggregated_bandwidth=inside.aggregated_bandwidth, link_counts=inside.link_counts,
                     effective_bandwidth=inside.effective_bandwidth,
                     preserved_bandwidth=preserved_bandwidth(graph, sorted(set(gpus) - set(inside.gpus))), ring_rate=top[4])


# What the tie-break looks up decision after decision (a replay, a warm daemon), kept for the
# process, per (graph, pattern, model) and k-set (a bit mask): the set's ring rate, and its best
# placement's scores (a search each; the torus's top rate ties about 20 sets per decision). Both
# depend on the set alone, never on the free GPUs around it.
_MAX_KINDS = 64  # (graph, pattern, model) kept
_MAX_SETS = 400_000  # k-sets kept, every kind together (~200 B each)
_UNKNOWN = object()  # a set not searched yet
# Per kind, two tables. k-set -> (-its ring rate rounded, its ring rate, its best placement's
# (rounded effective bandwidth, rounded aggregated bandwidth, GPUs), None where the pattern does
# not fit, or _UNKNOWN); and for each k-set whose placement is known, its place in the order
# effective-rings ranks by: (-effective, -ring rate, -aggregated bandwidth (all rounded), GPUs,
# ring rate, the placement), smallest first ((inf,) where the pattern does not fit).
Record = tuple[float, float, object]
_kinds: dict[tuple, tuple[dict[int, Record], dict[int, tuple]]] = {}
_kept = 0


def _set_results(graph: HardwareGraph, pattern: Pattern, model: EffectiveBandwidthModel
                 ) -> tuple[dict[int, Record], dict[int, tuple], Callable[[int], Record], Callable[..., object]]:
    """(table, order, rated, search): the records of the k-sets met so far and the order of those
    known; ``rated(mask)``, which adds a k-set's record with its ring rate
    (:func:`.ring_packing.max_ring_rate`) and its placement unknown; ``search(mask)``, which fills
    in a rated k-set's best placement (best_placement's choice on it, looked up where the search
    kept it: :mod:`.subset_results`), or ``search(mask, placement)`` with that placement known
    (its GPUs and scores; what stays free plays no part)."""
    global _kept
    kind = (graph, pattern, model)
    tables = _kinds.get(kind)
    if tables is None:
        if len(_kinds) >= _MAX_KINDS:
            clear_caches()
        tables = _kinds[kind] = ({}, {})
    if _kept >= _MAX_SETS:
        for kept in _kinds.values():
            kept[0].clear()
            kept[1].clear()
        _kept = 0
    table, order = tables
    kept_by_search = kept_results(graph, model, pattern, "effective")

    def rated(mask: int) -> Record:
        global _kept
        rate = max_ring_rate(graph, tuple(g for g in range(graph.size) if mask >> g & 1)) or 0.0
        record = table[mask] = (-round(rate, DIGITS), rate, _UNKNOWN)
        _kept += 1
        return record

    def search(mask: int, inside: Placement | None = None) -> object:
        negative, rate, _ = table[mask]
        if inside is None:
            kept = kept_by_search.get(mask)
            if kept is not None:
                # best_placement on this k-set returns the placement the search kept for it.
                inside = score_placement(graph, kept[1], pattern, kept[1], model)
            else:
                inside = best_placement(graph, [g for g in range(graph.size) if mask >> g & 1], pattern, "effective", model)
        found = None if inside is None else (round(inside.effective_bandwidth or 0.0, DIGITS),
                                             round(inside.aggregated_bandwidth, DIGITS), inside.gpus)
        table[mask] = (negative, rate, found)
        order[mask] = (inf,) if found is None else (-found[0], negative, -found[1], found[2], rate, inside)
        return found

    return table, order, rated, search


def clear_caches() -> None:
    """Forget every k-set's ring rate and best placement kept here."""
    global _kept
    _kinds.clear()
    _kept = 0


def _deadline(limit: SearchLimit | None) -> tuple[Callable[[], float], float] | None:
    """(clock, the reading past which the refinement gives up), from a limit in seconds; None: no time limit."""
    if limit is None or limit.clock is None or (limit.seconds is None and limit.until is None):
        return None
    end = limit.until if limit.until is not None else inf
    if limit.seconds is not None:
        end = min(end, limit.clock() + limit.seconds)
    return limit.clock, end


__all__ = ["MAX_TIE_SETS", "RING_OBJECTIVE", "best_by_rings", "best_by_rings_known", "clear_caches", "ranks_by_rings", "with_ring_rate"]
