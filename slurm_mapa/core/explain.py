"""Why a policy chose what it chose: the best alternative GPU sets and why each one lost.

Also the one rule every report of a choice follows (:func:`reported_placement`): for a
collective pattern (``Pattern.scored_by_set``) a GPU set is scored by its best order under the
model, whatever order the policy wrote, because NCCL and RCCL build their own rings over the GPUs
they get; for rank-order patterns the policy's order is the mapping and is scored as it is.

Owns the explanation of a choice; imports .allocation, .effbw, .hardware, .patterns and .search.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from math import comb

from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .allocation import Allocation, Request
from .placement import RING_OBJECTIVE
from .ring_choice import with_ring_rate
from .search import Placement, SearchLimit, best_placement, objective_key, score_placement

MAX_SETS_EXPLAINED = 20000


def reported_placement(
    graph: HardwareGraph, pattern: Pattern, placement: Placement, model: EffectiveBandwidthModel, limit: SearchLimit | None = None
) -> Placement:
    """The placement whose scores are reported for a choice: one number per GPU set for collectives.

    For a collective pattern the set is re-ordered to its best order under ``model`` (highest
    predicted effective bandwidth, then aggregated bandwidth, then the lexicographically smallest
    sequence), so every policy that picks the same set reports the same bandwidth. Rank-order
    patterns, 1-GPU jobs and patterns without edges are returned unchanged. The preserved
    bandwidth depends on the set only and is kept. With a ``limit`` that runs out (a big set), the
    better of the order found and the chosen one is reported; the choice's own ``gap`` is kept.
    """
    if not pattern.scored_by_set or pattern.size < 2 or not pattern.edges:
        return placement
    best = best_placement(graph, placement.gpus, pattern, "effective", model, limit)
    assert best is not None
    if best.gap is not None and placement.effective_bandwidth is not None and (
            best.effective_bandwidth is None or best.effective_bandwidth < placement.effective_bandwidth):
        return placement
    return replace(best, preserved_bandwidth=placement.preserved_bandwidth, gap=placement.gap, ring_rate=placement.ring_rate)


def reported_allocation(graph: HardwareGraph, request: Request, chosen: Allocation, model: EffectiveBandwidthModel,
                        limit: SearchLimit | None = None) -> Allocation:
    """``chosen`` with the placement :func:`reported_placement` reports (what ``eff=`` and ``mapa select`` show)."""
    placement = reported_placement(graph, request.pattern, chosen.placement, model, limit)
    if placement is chosen.placement:
        return chosen
    return Allocation(policy=chosen.policy, placement=placement, objective=chosen.objective)


@dataclass(frozen=True)
class Alternative:
    placement: Placement
    key: tuple[float, ...]
    reason: str


_TERMS = {
    "effective": ("predicted effective bandwidth", "aggregated bandwidth"),
    "aggregated": ("aggregated bandwidth",),
    "preserved": ("preserved bandwidth", "aggregated bandwidth"),
    RING_OBJECTIVE: ("predicted effective bandwidth", "ring rate of the set (the bus bandwidth rings can carry over its links)",
                     "aggregated bandwidth"),
}


def alternatives(
    graph: HardwareGraph,
    free: tuple[int, ...],
    request: Request,
    chosen: Allocation,
    model: EffectiveBandwidthModel,
    limit: int = 5,
) -> list[Alternative]:
    """The ``limit`` best other GPU sets under the chosen allocation's objective, each with the reason it lost.

    Sets are ranked by the policy's objective on their best placement; for a policy whose
    objective is not a score (baseline, topo-aware) the alternatives are ranked by the score it
    ordered GPUs with. Each alternative's placement is the one :func:`reported_placement` reports.
    """
    objective = chosen.objective if chosen.objective in _TERMS else ("effective" if request.sensitive and request.gpus > 1 else "preserved")
    if comb(len(free), request.gpus) > MAX_SETS_EXPLAINED:
        return []
    chosen_key = objective_key(objective, chosen.placement)
    chosen_set = sorted(chosen.gpus)
    scored: list[tuple[tuple[float, ...], tuple[int, ...], Placement]] = []
    for subset in combinations(free, request.gpus):
        if list(subset) == chosen_set:
            continue
        inner_objective = "aggregated" if objective == "preserved" else "effective" if objective == RING_OBJECTIVE else objective
        inside = best_placement(graph, subset, request.pattern, inner_objective, model)
        assert inside is not None
        placement = score_placement(graph, free, request.pattern, inside.gpus, model)
        if objective == RING_OBJECTIVE:
            placement = with_ring_rate(graph, placement)
        scored.append((objective_key(objective, placement), placement.gpus, reported_placement(graph, request.pattern, placement, model)))
    scored.sort(key=lambda item: (tuple(-v for v in item[0]), item[1]))
    return [Alternative(placement=p, key=key, reason=_why_lost(objective, key, chosen_key)) for key, _, p in scored[:limit]]


def _why_lost(objective: str, key: tuple[float, ...], chosen_key: tuple[float, ...]) -> str:
    for name, theirs, ours in zip(_TERMS[objective], key, chosen_key):
        if theirs < ours:
            return f"lower {name}: {theirs:.3f} < {ours:.3f}"
        if theirs > ours:
            return f"higher {name} ({theirs:.3f} > {ours:.3f}) but the policy does not rank by it"
    return "equal scores; loses the tie-break (the lexicographically smallest GPU sequence wins)"
