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
* A set with few placements (at most ``_ENUMERATE_UP_TO`` ordered k-subsets) is walked once,
  every placement ranked by the key of its counts, instead of once per budget.
* Without a limit, the result of each k-set is kept (:mod:`.subset_results`): the best placement
  on a free set is the best of those on its k-subsets, so once a node's k-sets are known (a
  replay, a warm daemon) a search becomes a look-up per k-subset.
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

Modules: :mod:`.placement` (Placement, the scores and objectives), :mod:`.search_limit` (the
limit), :mod:`.preserving_sets` (the sets that keep the most bandwidth), :mod:`.placement_dfs` (the
walk over placements and the budgets), :mod:`.best_found` (the best found when the limit runs
out), :mod:`.subset_results` (the results kept per k-set). This module holds the entry point and
re-exports the names callers use.

Owns best_placement; imports .best_found, .effbw, .hardware, .patterns, .placement,
.placement_dfs, .preserving_sets, .search_limit, .subset_results and .symmetry.
"""

from __future__ import annotations

from math import comb, perm
from typing import Iterable

from ..errors import InputError
from .best_found import improved_placement
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .placement import OBJECTIVES, Placement, objective_key, preserved_bandwidth, score_placement, with_gap
from .placement import DIGITS as _DIGITS
from .placement_dfs import PlacementDfs, budget_keys, class_matrix, connectivity, ranked_budgets
from .preserving_sets import SetSearch, all_sets_keeping_most_bandwidth
from .search_limit import EXACT_SHARE, Meter, OutOfWork, SearchLimit
from .subset_results import subset_results
from .symmetry import is_twin_canonical

__all__ = [
    "EXACT_SHARE", "OBJECTIVES", "Placement", "SearchLimit", "best_placement", "objective_key", "preserved_bandwidth",
    "score_placement",
]

# The names the tests reach in (tests/core/test_search_bignode.py).
_SetSearch = SetSearch
_all_sets_keeping_most_bandwidth = all_sets_keeping_most_bandwidth
_Meter = Meter
_connectivity = connectivity

_ENUMERATE_UP_TO = 720  # placements (ordered k-subsets) of one set visited all at once rather than per budget
_MAX_TABLE_GPUS = 20  # nodes up to this size rank every subset (a table of 2^n floats); patched by tests


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
    meter = Meter(limit)
    if objective == "preserved":
        return _best_preserving(graph, free_sorted, pattern, model, meter)
    try:
        found = _branch_and_bound(graph, free_sorted, pattern, objective, model, meter)
    except OutOfWork as stop:
        assert stop.upper is not None
        gpus = improved_placement(graph, free_sorted, pattern, objective, model, meter, stop.found)
        placement = score_placement(graph, free_sorted, pattern, gpus, model)
        return with_gap(placement, stop.upper, objective_key(objective, placement)[0])
    return score_placement(graph, free_sorted, pattern, found, model) if found is not None else None


def _best_preserving(
    graph: HardwareGraph, free: tuple[int, ...], pattern: Pattern, model: EffectiveBandwidthModel, meter: Meter
) -> Placement | None:
    k = pattern.size
    try:
        tied = _sets_keeping_most_bandwidth(graph, free, k, meter)
    except OutOfWork as stop:
        # No proof of the best set: the best set found, in a good order, and the set's gap. A limit
        # spent before the first set was found (a clock that ran out at once, under load) leaves the
        # lowest free GPUs, bounded by what keeping every free GPU would preserve.
        found = stop.found if stop.found is not None else free[:k]
        upper = stop.upper if stop.upper is not None else preserved_bandwidth(graph, free)
        gpus = improved_placement(graph, found, pattern, "aggregated", model, meter, None)
        placement = score_placement(graph, free, pattern, gpus, model)
        return with_gap(placement, upper, round(placement.preserved_bandwidth, _DIGITS))
    try:
        if tied is None:
            # Every set ties (e.g. at most one GPU stays free): one search over all of them.
            gpus = _branch_and_bound(graph, free, pattern, "aggregated", model, meter)
        else:
            gpus = _best_on_any_set(graph, tied, pattern, "aggregated", model, meter)
    except OutOfWork as stop:
        # The preserved bandwidth is proven; the order inside the best sets is not.
        pool = free if tied is None else tuple(sorted(stop.found)) if stop.found is not None else tied[0]
        gpus = improved_placement(graph, pool, pattern, "aggregated", model, meter, stop.found)
        placement = score_placement(graph, free, pattern, gpus, model)
        return with_gap(placement, placement.preserved_bandwidth, placement.preserved_bandwidth)
    assert gpus is not None
    return score_placement(graph, free, pattern, gpus, model)



def _sets_keeping_most_bandwidth(
    graph: HardwareGraph, free: tuple[int, ...], k: int, meter: Meter
) -> list[tuple[int, ...]] | None:
    """The k-subsets of ``free`` whose removal leaves the most link bandwidth among the rest, in lex
    order, each taking the lowest members of every twin class (see :mod:`.symmetry`); None when
    every k-subset ties."""
    if k >= len(free) - 1:
        return None  # at most one GPU stays free: no link is left whatever is taken
    if graph.size <= _MAX_TABLE_GPUS:
        tied = all_sets_keeping_most_bandwidth(graph, free, k)
        if len(tied) == comb(len(free), k):
            return None
        return [subset for subset in tied if is_twin_canonical(graph, free, subset)]
    return SetSearch(graph, free, k, meter).run()


def _branch_and_bound(
    graph: HardwareGraph,
    free: tuple[int, ...],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: Meter,
) -> tuple[int, ...] | None:
    """Lex-first optimum of ``objective`` ("effective" or "aggregated") over placements on ``free``."""
    return _best_on_any_set(graph, [free], pattern, objective, model, meter)


def _best_on_any_set(
    graph: HardwareGraph,
    gpu_sets: list[tuple[int, ...]],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: Meter,
) -> tuple[int, ...] | None:
    """The lex-first optimum over placements that lie inside any one of ``gpu_sets``.

    Out of work it raises OutOfWork with an upper bound of the objective's first term and the
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
            dfs = PlacementDfs(graph, gpus, pattern, model, use_model=use_model, meter=meter)
            try:
                meter.tick(len(gpus))
                hit = dfs.run(budget=None)
            except OutOfWork:
                if dfs.best_gpus is not None:
                    found.append((dfs.best_key, tuple(-g for g in dfs.best_gpus), dfs.best_gpus))
                # This set and those not searched yet are bounded as their widest links allow.
                later = gpu_sets[gpu_sets.index(gpus) + 1 :]
                bounds = [PlacementDfs(graph, other, pattern, model, use_model=use_model, meter=meter).root_bound[0] for other in [gpus, *later]]
                upper = max([key[0] for key, _, _ in found] + bounds)
                raise OutOfWork(upper=upper, found=max(found)[2] if found else None) from None
            if hit is not None:
                found.append((dfs.leaf_key_of(hit), tuple(-g for g in hit), hit))
        return max(found)[2] if found else None
    # Without a limit (the result is exact either way) the k-sets' results may answer it.
    memo = subset_results(graph, model, pattern, objective) if meter.unlimited and graph.size <= _MAX_TABLE_GPUS else None
    if memo is not None and memo.worth_looking_up(sum(comb(len(s), pattern.size) for s in gpu_sets)):
        return memo.best(gpu_sets, lambda chosen: _by_class_budgets(graph, [chosen], pattern, objective, model, meter))  # type: ignore[arg-type,return-value]  # a k-set always has a placement
    key, found = _by_class_budgets(graph, gpu_sets, pattern, objective, model, meter)
    if memo is not None and key is not None and found is not None:
        memo.record((key, found))
    return found


def _by_class_budgets(
    graph: HardwareGraph,
    gpu_sets: list[tuple[int, ...]],
    pattern: Pattern,
    objective: str,
    model: EffectiveBandwidthModel,
    meter: Meter,
) -> tuple[tuple[float, ...] | None, tuple[int, ...] | None]:
    """(key, placement): with unit weights both objectives are functions of how many pattern edges
    use each link class.

    So enumerate the class-count vectors in descending objective, and for each group of equal
    value ask the search for the lex-first placement with exactly those counts. The first group
    that has one holds the optimum. This prunes far harder than a bound on a non-monotone model.
    Every group before the one being searched is refuted, so its value bounds the optimum.
    """
    use_model = objective == "effective"
    _, class_info = class_matrix(graph, model, use_model)
    searches = [PlacementDfs(graph, gpus, pattern, model, use_model=use_model, joint_classes=True, meter=meter) for gpus in gpu_sets]
    present = tuple(sorted(set().union(*(dfs.present_classes for dfs in searches))))
    ranked = ranked_budgets(class_info, present, len(pattern.edges), objective, model)
    if meter.unlimited and len(searches) == 1 and perm(len(gpu_sets[0]), pattern.size) <= _ENUMERATE_UP_TO:
        # Few placements: visiting them all once beats a walk per budget; the lex-first of the best
        # key is the same placement (the walk visits placements in lex order).
        found = searches[0].run(budget=None, keys=budget_keys(ranked))
        return searches[0].best_key, found
    setting_up = sum(len(gpus) for gpus in gpu_sets)  # charged once a bound is known
    for key, budgets in ranked:
        found: list[tuple[int, ...]] = []
        try:
            meter.tick(setting_up)
            setting_up = 0
            for dfs in searches:
                for budget in budgets:
                    if dfs.may_fit(budget) and (hit := dfs.run(budget=budget)) is not None:
                        found.append(hit)
        except OutOfWork:
            raise OutOfWork(upper=key[0], found=min(found) if found else None) from None
        if found:
            return key, min(found)
    return None, None

