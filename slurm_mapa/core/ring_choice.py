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
from itertools import combinations, groupby
from math import comb, inf
from typing import Callable

from .effbw import RING_PACKED_SHAPES, EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .placement import DIGITS, RING_OBJECTIVE, Placement, score_placement
from .ring_packing import MAX_PACKED_GPUS, max_ring_rate
from .search import best_placement
from .search_limit import SearchLimit

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
    never a choice that depends on how far the refinement got."""
    deadline = _deadline(limit)
    target = round(best.effective_bandwidth or 0.0, DIGITS)
    # Every set's ring rate (looked up), then the sets by rate, highest first: no set reaches more
    # than ``target``, so the first rate with a set that reaches it is the best key's rate, and only
    # the sets of that rate and above need a search (usually one or two, not every set).
    rated = []
    for subset in combinations(sorted(free), pattern.size):
        if deadline is not None and deadline[0]() > deadline[1]:
            return replace(with_ring_rate(graph, best), gap=0.0)
        rate = max_ring_rate(graph, subset) or 0.0
        rated.append((-round(rate, DIGITS), subset, rate))
    rated.sort(key=lambda item: item[0])  # stable: ascending sets within one rate
    chosen: tuple | None = None
    for _, same_rate in groupby(rated, key=lambda item: item[0]):
        for _, subset, rate in same_rate:
            if deadline is not None and deadline[0]() > deadline[1]:
                # gap 0.0: the model's value is proven optimal, the ring-rate tie-break is not.
                return replace(with_ring_rate(graph, best), gap=0.0)
            inside = best_placement(graph, subset, pattern, "effective", model)
            if inside is None or round(inside.effective_bandwidth or 0.0, DIGITS) != target:
                continue
            key = round(inside.aggregated_bandwidth, DIGITS)
            if chosen is None or key > chosen[0] or (key == chosen[0] and inside.gpus < chosen[1]):
                chosen = (key, inside.gpus, rate)
        if chosen is not None:
            break
    if chosen is None:  # cannot happen: best's own set reaches the target
        return with_ring_rate(graph, best)
    placement = score_placement(graph, free, pattern, chosen[1], model)
    return replace(placement, ring_rate=chosen[2])


def _deadline(limit: SearchLimit | None) -> tuple[Callable[[], float], float] | None:
    """(clock, the reading past which the refinement gives up), from a limit in seconds; None: no time limit."""
    if limit is None or limit.clock is None or (limit.seconds is None and limit.until is None):
        return None
    end = limit.until if limit.until is not None else inf
    if limit.seconds is not None:
        end = min(end, limit.clock() + limit.seconds)
    return limit.clock, end


__all__ = ["MAX_TIE_SETS", "RING_OBJECTIVE", "best_by_rings", "ranks_by_rings", "with_ring_rate"]
