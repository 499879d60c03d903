"""Exact search results kept per k-set of GPUs, shared by every free set that contains the k-set.

The best placement on a free set F (or on any of a few sets) is the best of the best placements
on each k-subset of it: the lex-first optimum on F uses some k-set S, is optimal on S, and is not
larger than the lex-first optimum of S, which is itself a placement on F with the best key; so
the two are the same. A replay or a daemon meets many free sets of a node, and they share their
k-subsets (a 16-GPU node has 4,368 sets of 5 GPUs), so a search on F becomes a look-up per
k-subset once the k-sets are known.

Looking up pays only when few k-sets are unknown: each unknown one costs a search of its own. So
:meth:`SubsetResults.worth_looking_up` invests in k-sets in step with how often the same (node,
pattern, objective) is searched: a single decision in a cold process searches its free set as
before, a long replay soon looks every decision up.

Owns SubsetResults, subset_results and kept_results; imports .effbw, .hardware and .patterns (types only).
"""

from __future__ import annotations

from itertools import combinations
from math import comb
from typing import Callable

from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern

MAX_LOOKUPS = 1_000  # k-subsets of one search; beyond, one search over the set is cheaper
_SEARCHES_PER_UNKNOWN = 4  # searches of the same kind that pay for one k-set searched ahead
_MAX_RESULTS = 400_000  # k-sets kept, all nodes, patterns and objectives together (~100 B each)
_MAX_KINDS = 1_000  # (node, model, pattern, objective) kept

Found = tuple[tuple[float, ...], tuple[int, ...]]  # (objective key, lex-first optimal placement)


class SubsetResults:
    """The exact (key, placement) of each k-set met, for one (node, model, pattern, objective)."""

    def __init__(self, size: int, k: int) -> None:
        self.k = k
        self.results: dict[int, Found] = {}  # k-set as a bit mask -> its result
        self.all_sets = comb(size, k)
        self.searches = 0  # searches of this kind asked for

    def worth_looking_up(self, lookups: int) -> bool:
        """Whether ``lookups`` k-subsets are cheaper to look up (searching the unknown ones) than one search."""
        self.searches += 1
        if lookups > MAX_LOOKUPS:
            return False
        unknown = lookups * (1.0 - len(self.results) / self.all_sets)
        return unknown <= max(1.0, self.searches / _SEARCHES_PER_UNKNOWN)

    def best(self, gpu_sets: list[tuple[int, ...]], search: Callable[[tuple[int, ...]], Found]) -> tuple[int, ...]:
        """The lex-first optimal placement on any of ``gpu_sets``; ``search(S)``: the result of a k-set."""
        results = self.results
        best_key: tuple[float, ...] | None = None
        best: tuple[int, ...] = ()
        for gpus in gpu_sets:
            for subset in combinations([1 << g for g in gpus], self.k):
                mask = sum(subset)
                found = results.get(mask)
                if found is None:
                    found = search(tuple(g for g in gpus if mask >> g & 1))
                    self.record(found, mask)
                key, placement = found
                if best_key is None or key > best_key or (key == best_key and placement < best):
                    best_key, best = key, placement
        return best

    def record(self, found: Found, mask: int | None = None) -> None:
        """Keep a result: the optimum of a search over a bigger set is also that of its own k-set."""
        if mask is None:
            mask = 0
            for g in found[1]:
                mask |= 1 << g
        if mask not in self.results:
            global _count
            if _count >= _MAX_RESULTS:
                clear_caches()
            self.results[mask] = found
            _count += 1


_memos: dict[tuple, SubsetResults] = {}
_count = 0


def subset_results(graph: HardwareGraph, model: EffectiveBandwidthModel, pattern: Pattern, objective: str) -> SubsetResults:
    key = (graph, model, pattern, objective)
    found = _memos.get(key)
    if found is None:
        if len(_memos) >= _MAX_KINDS:
            clear_caches()
        found = _memos[key] = SubsetResults(graph.size, pattern.size)
    return found


def kept_results(graph: HardwareGraph, model: EffectiveBandwidthModel, pattern: Pattern, objective: str) -> dict[int, Found]:
    """The k-sets' results kept for this kind so far (bit mask -> (key, placement)), without starting a kind."""
    found = _memos.get((graph, model, pattern, objective))
    return found.results if found is not None else {}


def clear_caches() -> None:
    """Forget every k-set's result."""
    global _count
    for memo in _memos.values():
        memo.results.clear()
    _memos.clear()
    _count = 0
