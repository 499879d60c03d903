"""The search's shortcuts give the same placements as the plain walk per budget.

Two shortcuts run only without a limit: results kept per k-set (core/subset_results.py: a free
set's optimum is the best of its k-subsets') and, on sets with few placements, one walk over all
of them ranked by the key of their counts. Both must choose the very GPUs, in the very order, that
the walk per budget chooses, tie-break included.
"""

from __future__ import annotations

import random

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
