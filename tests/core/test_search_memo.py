"""The search's shortcuts give the same placements as the plain walk per budget.

Two shortcuts run only without a limit: results kept per k-set (core/subset_results.py: a free
set's optimum is the best of its k-subsets') and, on sets with few placements, one walk over all
of them ranked by the key of their counts. Both must choose the very GPUs, in the very order, that
the walk per budget chooses, tie-break included.
"""

from __future__ import annotations

import random
from dataclasses import replace as dataclass_replace

import pytest

import slurm_mapa.core.search as search
import slurm_mapa.core.subset_results as subset_results
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.hardware.presets import preset

MODEL = paper_model()


def _cases(name: str, count: int, seed: int):
    rng = random.Random(seed)
    graph = preset(name)
    for _ in range(count):
        free = tuple(sorted(rng.sample(range(graph.size), rng.randint(1, graph.size))))
        k = rng.randint(1, min(len(free), 6))
        shape = rng.choice(["ring", "ring", "chain", "tree", "star", "all"])
        yield graph, free, make_pattern(shape, k), rng.choice(["effective", "aggregated", "preserved"])


@pytest.mark.parametrize("name", ["torus2d-16", "cubemesh-16", "dgx1-v100", "dgx-a100"])
def test_kept_k_set_results_and_one_walk_choose_what_the_walk_per_budget_chooses(name):
    cases = list(_cases(name, 300, seed=len(name)))
    subset_results.clear_caches()
    # Twice: the second pass finds the k-sets the first one kept and looks most of them up.
    shortcut = [[search.best_placement(g, free, p, obj, MODEL) for g, free, p, obj in cases] for _ in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subset_results, "MAX_LOOKUPS", 0)
        patch.setattr(search, "_ENUMERATE_UP_TO", 0)
        plain = [search.best_placement(g, free, p, obj, MODEL) for g, free, p, obj in cases]
    assert shortcut[0] == plain
    assert shortcut[1] == plain
    assert sum(len(memo.results) for memo in subset_results._memos.values()) > 0  # the shortcut was taken


def _ring_choice_by_a_search_per_set(graph, free, pattern, model):
    """The ring-rate tie-break as it was first written (issue 38): the search on every k-set of
    ``free``, then the largest (effective bandwidth, ring rate, aggregated bandwidth) and the
    smallest GPU sequence; scored on ``free``."""
    from itertools import combinations

    from slurm_mapa.core.placement import DIGITS, score_placement
    from slurm_mapa.core.ring_packing import max_ring_rate

    best = None
    for subset in combinations(free, pattern.size):
        inside = search.best_placement(graph, subset, pattern, "effective", model)
        rate = max_ring_rate(graph, subset)
        key = (round(inside.effective_bandwidth, DIGITS), round(rate, DIGITS), round(inside.aggregated_bandwidth, DIGITS))
        if best is None or key > best[0] or (key == best[0] and inside.gpus < best[1]):
            best = (key, inside.gpus, rate)
    placement = score_placement(graph, free, pattern, best[1], model)
    return dataclass_replace(placement, ring_rate=best[2])


@pytest.mark.parametrize("name", ["torus2d-16", "cubemesh-16", "dgx1-v100"])
def test_ring_rate_choice_from_kept_results_is_the_one_a_search_per_set_gives(name):
    """Preserve's ring-rate tie-break (core/ring_choice.py) chooses the same placement, scores
    included, cold (the search, then the tie-break over the sets of the top rates), warm (every
    k-set's result kept: one pass, no search: best_by_rings_known) and as a search per k-set does."""
    import slurm_mapa.core.ring_choice as ring_choice
    from slurm_mapa.core.policies import Request, select

    model = dataclass_replace(MODEL, ties="rings")
    graph = preset(name)
    rng = random.Random(len(name))
    cases = []
    while len(cases) < 30:
        k = rng.randint(3, 8)
        free = tuple(sorted(rng.sample(range(graph.size), rng.randint(k, min(graph.size, k + 5)))))
        if ring_choice.ranks_by_rings(make_pattern("ring", k), free, model):
            cases.append((free, make_pattern(rng.choice(["ring", "ring+tree"]), k)))
    cold = []
    for free, pattern in cases:  # nothing kept: the search, then the tie-break over the top rates' sets
        subset_results.clear_caches()
        ring_choice.clear_caches()
        assert ring_choice.best_by_rings_known(graph, free, pattern, model) is None
        cold.append(select("preserve", graph, free, Request(pattern, True), model))
    expected = [_ring_choice_by_a_search_per_set(graph, free, pattern, model) for free, pattern in cases]  # every k-set searched: kept
    known = [ring_choice.best_by_rings_known(graph, free, pattern, model) for free, pattern in cases]
    warm = [select("preserve", graph, free, Request(pattern, True), model) for free, pattern in cases]
    for (free, pattern), a, b, c, want in zip(cases, cold, known, warm, expected):
        assert a.objective == c.objective == "effective-rings"
        assert a.placement == want, (free, pattern.shape, pattern.size)
        assert b == want, (free, pattern.shape, pattern.size)
        assert c.placement == want, (free, pattern.shape, pattern.size)
