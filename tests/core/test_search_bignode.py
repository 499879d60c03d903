"""The search's symmetry and pruning for big nodes, and its work limit, against brute force.

Hardware twins (interchangeable GPUs), the branch and bound over sets that nodes of more than 20
GPUs use, the cut bound on link classes and the fast pattern symmetry are each checked on random
small instances with symmetric blocks, where every placement can be enumerated. A search cut
short by its limit must return a valid placement whose gap is a true bound on the optimum.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slurm_mapa.core.search as search
import slurm_mapa.core.symmetry as symmetry
from bruteforce import brute_force_all, pattern_automorphisms
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.server_models import bottleneck_model
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.patterns import SHAPES, make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.core.search import SearchLimit, best_placement, objective_key, preserved_bandwidth
from slurm_mapa.core.symmetry import MAX_AUTOMORPHISMS, is_twin_canonical, search_symmetry, twin_classes
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset

MODEL = paper_model()
LINK_TOKENS = ["NV1", "NV2", "NVS12", "PIX", "SYS"]
OBJECTIVES = ("effective", "aggregated", "preserved")


@st.composite
def block_graph(draw, max_size=7):
    """A node of blocks: one link class inside each block, one between each pair of blocks, so
    GPUs of a block are twins; a few pairs are then changed to break some of the symmetry."""
    size = draw(st.integers(min_value=2, max_value=max_size))
    block_of = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    inside = [draw(st.sampled_from(LINK_TOKENS)) for _ in range(3)]
    between = {(a, b): draw(st.sampled_from(LINK_TOKENS)) for a in range(3) for b in range(a, 3)}
    links = {}
    for a in range(size):
        for b in range(a + 1, size):
            x, y = sorted((block_of[a], block_of[b]))
            links[(a, b)] = inside[x] if x == y else between[(x, y)]
    for _ in range(draw(st.integers(0, 2))):
        a, b = sorted(draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True)))
        links[(a, b)] = draw(st.sampled_from(LINK_TOKENS))
    return build_graph("blocks", size, links)


@st.composite
def block_case(draw, max_size=7, max_k=5):
    graph = draw(block_graph(max_size))
    free = sorted(draw(st.lists(st.integers(0, graph.size - 1), min_size=1, max_size=graph.size, unique=True)))
    shape = draw(st.sampled_from([s for s in SHAPES if s != "custom"]))
    # Mostly jobs that fit (the interesting case); sometimes one GPU too many.
    k = draw(st.integers(min_value=1, max_value=min(max_k, len(free) + 1, graph.size)))
    if shape == "hypercube":
        k = draw(st.sampled_from([1, 2, 4]))
    pattern = make_pattern(shape, k)
    if pattern.edges and draw(st.booleans()):
        weights = tuple(draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=len(pattern.edges), max_size=len(pattern.edges))))
        pattern = make_pattern(shape, k, weights=weights)
    return graph, free, pattern


def _key(graph, free, pattern, objective, model=MODEL, limit=None):
    placement = best_placement(graph, free, pattern, objective, model, limit)
    return None if placement is None else (objective_key(objective, placement), placement.gpus)


# --- twins -------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(block_graph(max_size=9), st.data())
def test_twin_classes_are_exactly_the_interchangeable_gpus(graph, data):
    within = sorted(data.draw(st.lists(st.integers(0, graph.size - 1), min_size=1, max_size=graph.size, unique=True)))
    classes = twin_classes(graph, within)
    assert sorted(g for members in classes for g in members) == within
    class_of = {g: i for i, members in enumerate(classes) for g in members}
    for g, h in combinations(within, 2):
        same = all(graph.links[g][x] == graph.links[h][x] for x in within if x not in (g, h))
        assert same == (class_of[g] == class_of[h]), (g, h)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case())
def test_exact_with_twin_pruning_on_symmetric_blocks(case):
    graph, free, pattern = case
    expected = brute_force_all(graph, free, pattern, MODEL)
    for objective in OBJECTIVES:
        got = _key(graph, free, pattern, objective)
        assert got == (None if expected is None else expected[objective]), objective


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case(max_size=8, max_k=8))
def test_set_branch_and_bound_finds_every_tied_canonical_set(case):
    """The branch and bound that nodes of more than 20 GPUs use, against every k-subset."""
    graph, free, pattern = case
    k = pattern.size
    if k >= len(free) - 1:
        return
    everything = search._all_sets_keeping_most_bandwidth(graph, tuple(free), k)
    expected = [s for s in everything if is_twin_canonical(graph, free, s)]
    got = search._SetSearch(graph, tuple(free), k, search._Meter(None)).run()
    assert got == expected
    best = max(round(preserved_bandwidth(graph, set(free) - set(s)), 9) for s in combinations(free, k))
    assert {round(preserved_bandwidth(graph, set(free) - set(s)), 9) for s in got} == {best}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case(max_size=7, max_k=5))
def test_exact_when_big_node_set_search_is_forced(case):
    graph, free, pattern = case
    expected = brute_force_all(graph, free, pattern, MODEL)
    with every_node_big():
        got = _key(graph, free, pattern, "preserved")
    assert got == (None if expected is None else expected["preserved"])


@contextmanager
def every_node_big():
    """Every node counts as big: the set branch and bound instead of the subset tables."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(search, "_MAX_TABLE_GPUS", 0)
        yield


# --- pattern symmetry --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "custom"])
@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 8, 9])
def test_search_symmetry_is_the_pattern_symmetry_on_small_patterns(shape, size):
    if shape == "hypercube" and size & (size - 1):
        return
    pattern = make_pattern(shape, size)
    fast, reference = search_symmetry(pattern), pattern.symmetry
    assert fast.twin_prev == reference.twin_prev
    assert fast.twin_classes == reference.twin_classes
    assert set(fast.automorphisms) == set(reference.automorphisms)


@pytest.mark.parametrize("shape,size", [("ring", 64), ("tree", 64), ("torus2d", 64), ("hypercube", 64), ("all", 64), ("star", 40)])
def test_search_symmetry_of_big_patterns_keeps_only_true_automorphisms(shape, size):
    pattern = make_pattern(shape, size)
    edges = sorted((min(a, b), max(a, b)) for a, b in pattern.edges)
    sym = search_symmetry(pattern)
    assert len(sym.automorphisms) <= MAX_AUTOMORPHISMS
    assert (len(sym.automorphisms) == 0) == (shape in ("all", "star"))  # their groups are twin swaps only
    for perm in sym.automorphisms:
        assert sorted((min(perm[a], perm[b]), max(perm[a], perm[b])) for a, b in pattern.edges) == edges


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.data())
def test_pattern_connectivity_matches_brute_force(size, data):
    pairs = [(a, b) for a in range(size) for b in range(a + 1, size)]
    edges = tuple(data.draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=8)))
    pattern = make_pattern("custom", size, edges=edges)

    def connected(edge_list):
        reach, stack = {0}, [0]
        while stack:
            v = stack.pop()
            for a, b in edge_list:
                for x, y in ((a, b), (b, a)):
                    if x == v and y not in reach:
                        reach.add(y)
                        stack.append(y)
        return len(reach) == size

    is_connected = connected(edges)
    bridgeless = is_connected and all(connected(edges[:i] + edges[i + 1 :]) for i in range(len(edges)))
    assert search._connectivity(pattern) == (is_connected, bridgeless)


def test_fast_symmetry_group_times_twins_is_the_whole_group_on_small_patterns():
    for shape, size in [("ring", 5), ("ring", 4), ("star", 5), ("all", 4), ("torus2d", 9), ("hypercube", 8), ("mesh2d", 6)]:
        pattern = make_pattern(shape, size)
        sym = search_symmetry(pattern)
        twin_orders = 1
        for members in sym.twin_classes:
            for n in range(2, len(members) + 1):
                twin_orders *= n
        assert twin_orders * (len(sym.automorphisms) + 1) == len(pattern_automorphisms(pattern)), (shape, size)


# --- the work limit and its gap ----------------------------------------------------------------


def _check_within_gap(graph, free, pattern, objective, model, limit, expected):
    placement = best_placement(graph, free, pattern, objective, model, limit)
    if expected is None:
        assert placement is None
        return None
    assert len(set(placement.gpus)) == pattern.size and set(placement.gpus) <= set(free)
    # The reported scores are the placement's own.
    rescored = search.score_placement(graph, free, pattern, placement.gpus, model)
    assert objective_key(objective, rescored) == objective_key(objective, placement)
    key = objective_key(objective, placement)
    best_key, best_gpus = expected[objective]
    if placement.gap is None:
        assert (key, placement.gpus) == (best_key, best_gpus)
    else:
        assert placement.gap >= 0
        assert key[0] <= best_key[0] + 1e-9
        assert best_key[0] <= key[0] + placement.gap + 1e-6, (key, best_key, placement.gap)
        if placement.gap == 0:
            assert key[0] == best_key[0]
    return placement.gap


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case(max_size=7, max_k=7), st.integers(1, 40))
def test_a_reported_gap_bounds_the_true_optimum(case, work):
    graph, free, pattern = case
    expected = brute_force_all(graph, free, pattern, MODEL)
    for objective in OBJECTIVES:
        _check_within_gap(graph, free, pattern, objective, MODEL, SearchLimit(work=work), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case(max_size=7, max_k=6), st.integers(1, 60))
def test_a_reported_gap_bounds_the_optimum_with_the_big_node_set_search(case, work):
    graph, free, pattern = case
    expected = brute_force_all(graph, free, pattern, MODEL)
    with every_node_big():
        _check_within_gap(graph, free, pattern, "preserved", MODEL, SearchLimit(work=work), expected)


def test_gaps_are_reported_and_bounded_on_a_node_too_big_for_a_tiny_limit():
    """A 7-GPU node with a 7-GPU ring and a work limit of 3 cannot be proven: a gap must come."""
    graph = preset("torus2d-16")
    free = (0, 1, 2, 3, 4, 5, 6)
    pattern = make_pattern("ring", 7)
    expected = brute_force_all(graph, free, pattern, bottleneck_model(graph))
    gaps = [_check_within_gap(graph, free, pattern, objective, bottleneck_model(graph), SearchLimit(work=3), expected)
            for objective in ("effective", "aggregated")]
    assert any(gap is not None for gap in gaps)


def test_the_limit_is_deterministic_and_a_large_one_changes_nothing():
    graph = preset("cubemesh-16")
    pattern = make_pattern("ring", 9)
    first = best_placement(graph, range(16), pattern, "preserved", MODEL, SearchLimit(work=500))
    again = best_placement(graph, range(16), pattern, "preserved", MODEL, SearchLimit(work=500))
    assert first == again
    small = make_pattern("ring", 5)
    assert best_placement(graph, range(16), small, "effective", MODEL, SearchLimit(work=10**7)) == best_placement(
        graph, range(16), small, "effective", MODEL)


def test_a_clock_limit_stops_the_search():
    """A clock that jumps past the deadline at once: the search must stop at its next look."""
    ticks = iter(range(0, 10**9, 1000))
    limit = SearchLimit(seconds=0.5, clock=lambda: float(next(ticks)))
    placement = best_placement(preset("cubemesh-16"), range(16), make_pattern("ring", 13), "preserved", MODEL, limit)
    assert placement is not None and len(placement.gpus) == 13 and placement.gap is not None


@pytest.mark.parametrize("kwargs,message", [
    ({"work": 0}, "work limit"),
    ({"work": 2.5}, "work limit"),
    ({"seconds": 0.2}, "needs a clock"),
    ({"seconds": -1.0, "clock": lambda: 0.0}, "positive number"),
])
def test_a_bad_limit_is_a_clear_error(kwargs, message):
    with pytest.raises(InputError, match=message):
        SearchLimit(**kwargs)


def test_dgx1_choices_are_proven_and_unchanged_under_a_generous_limit():
    """The paper's machine: every free set and size, the limit never bites and nothing changes."""
    graph = preset("dgx1-v100")
    for free_size in range(1, 9):
        for free in combinations(range(8), free_size):
            for k in range(1, free_size + 1):
                pattern = make_pattern("ring", k)
                for objective in ("effective", "preserved"):
                    plain = best_placement(graph, free, pattern, objective, MODEL)
                    limited = best_placement(graph, free, pattern, objective, MODEL, SearchLimit(work=100_000))
                    assert limited == plain and limited.gap is None


def test_policies_answer_on_big_symmetric_nodes():
    """A 32-GPU node of four 8-GPU NVSwitch islands: a whole island for an 8-GPU job on an idle node."""
    links = {(a, b): "NVS18" for i in range(4) for a in range(i * 8, i * 8 + 8) for b in range(a + 1, i * 8 + 8)}
    graph = build_graph("islands", 32, links)
    for sensitive in (True, False):
        chosen = select("preserve", graph, range(32), Request(make_pattern("ring", 8), sensitive))
        assert sorted(chosen.gpus) == list(range(8)) and chosen.placement.gap is None


@pytest.mark.parametrize("name,free,k", [("torus2d-16", (0, 1, 2, 3, 4, 5, 6, 7), 3), ("cubemesh-16", (0, 1, 2, 4, 5, 8, 12), 4)])
def test_set_search_gaps_bound_the_optimum_at_every_small_limit(name, free, k):
    """The preserved bandwidth's gap when the set branch and bound is cut short, limit by limit."""
    graph = preset(name)
    pattern = make_pattern("ring", k)
    expected = brute_force_all(graph, free, pattern, MODEL)
    gaps = []
    with every_node_big():
        for work in [*range(1, 40), 400, 10**6]:
            gaps.append(_check_within_gap(graph, free, pattern, "preserved", MODEL, SearchLimit(work=work), expected))
    assert any(gap for gap in gaps)  # some limit left a positive gap to check
    assert gaps[-1] is None  # and the largest proves the optimum


def test_select_passes_the_limit_to_every_policy_and_only_orders_are_bounded_for_the_peers():
    graph = preset("cubemesh-16")
    request = Request(make_pattern("ring", 13), False)
    limited = select("preserve", graph, range(16), request, MODEL, limit=SearchLimit(work=50))
    assert limited.placement.gap is not None and len(limited.gpus) == 13
    greedy = select("greedy", graph, range(16), Request(make_pattern("ring", 13), True), MODEL, limit=SearchLimit(work=50))
    assert greedy.placement.gap is not None
    # baseline does not search for its set, only for the set's ring order: the limit bounds that
    # (its gap says so) and never changes the set; a limit the order fits in changes nothing.
    small = Request(make_pattern("ring", 4), True)
    plain = select("baseline", graph, range(16), small, MODEL)
    tight = select("baseline", graph, range(16), small, MODEL, limit=SearchLimit(work=1))
    assert sorted(tight.gpus) == sorted(plain.gpus) and tight.placement.gap is not None
    assert select("baseline", graph, range(16), small, MODEL, limit=SearchLimit(work=10**6)) == plain


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_case(max_size=7, max_k=6), st.integers(0, 3))
def test_exact_with_only_a_few_pattern_automorphisms(case, kept):
    """Any subset of the pattern's automorphisms keeps the search exact (what the cap relies on)."""
    graph, free, pattern = case
    expected = brute_force_all(graph, free, pattern, MODEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symmetry, "MAX_AUTOMORPHISMS", kept)
        search_symmetry.cache_clear()
        try:
            assert len(search_symmetry(pattern).automorphisms) <= kept
            for objective in OBJECTIVES:
                assert _key(graph, free, pattern, objective) == (None if expected is None else expected[objective]), objective
        finally:
            search_symmetry.cache_clear()


def _cycle_node(size: int, chords: tuple[tuple[int, int], ...] = ()):
    """GPUs on a ring of double NVLink (plus chords), SYS elsewhere: no twins, many automorphisms."""
    links = {(min(g, (g + 1) % size), max(g, (g + 1) % size)): "NV2" for g in range(size)}
    links.update({pair: "NV1" for pair in chords})
    return build_graph(f"cycle-{size}", size, links)


@pytest.mark.parametrize("size,chords", [(6, ()), (7, ()), (8, ()), (8, ((0, 4), (2, 6))), (9, ((0, 3), (3, 6), (0, 6)))])
def test_set_search_with_graph_automorphisms_finds_every_tied_set(size, chords):
    """Symmetric nodes without twins: the orbit pruning and the orbits added back give every set that ties."""
    graph = _cycle_node(size, chords)
    assert symmetry.graph_automorphisms(graph, range(size))  # the pruning is in use
    for free in [tuple(range(size)), tuple(g for g in range(size) if g != 3)]:
        for k in range(1, len(free) - 1):
            expected = search._all_sets_keeping_most_bandwidth(graph, free, k)
            assert search._SetSearch(graph, free, k, search._Meter(None)).run() == expected, (free, k)


@pytest.mark.parametrize("size", [6, 7])
def test_preserve_on_symmetric_nodes_without_twins_matches_brute_force(size):
    graph = _cycle_node(size)
    with every_node_big():
        for free in [tuple(range(size)), (0, 1, 2, 4, 5)]:
            for k in range(1, min(len(free), 5) + 1):
                for shape in ("ring", "chain", "star"):
                    pattern = make_pattern(shape, k)
                    expected = brute_force_all(graph, free, pattern, MODEL)
                    assert _key(graph, free, pattern, "preserved") == expected["preserved"], (free, k, shape)


@settings(max_examples=100, deadline=None)
@given(block_graph(max_size=9), st.data())
def test_graph_automorphisms_keep_every_link(graph, data):
    within = sorted(data.draw(st.lists(st.integers(0, graph.size - 1), min_size=1, max_size=graph.size, unique=True)))
    for sigma in symmetry.graph_automorphisms(graph, within):
        assert sorted(sigma) == within and sorted(sigma.values()) == within
        assert any(sigma[g] != g for g in within)
        for a, b in combinations(within, 2):
            assert graph.links[a][b] == graph.links[sigma[a]][sigma[b]]


def test_searches_under_one_limit_share_its_end():
    """SearchLimit.until: a search that starts after the decision's end has passed stops at its
    first look at the clock, with the best it found and a gap, however much of ``seconds`` it
    would have had alone. The clock is a counter: each look at it is one unit of time."""
    import itertools

    from slurm_mapa.core.model_files import paper_model
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import SearchLimit, best_placement
    from slurm_mapa.hardware.presets import preset

    graph, pattern = preset("torus2d-16"), make_pattern("ring", 13)
    free = (0, 1, 2, 3, 4, 5, 7, 8, 10, 12, 13, 14, 15)  # the slow case: seconds before the new search

    def looks(until):
        ticks = itertools.count()
        found = best_placement(graph, free, pattern, "preserved", paper_model(),
                               SearchLimit(seconds=1000.0, clock=lambda: next(ticks), until=until))
        return found, next(ticks)

    ended, ended_looks = looks(until=-1.0)
    alone, alone_looks = looks(until=None)
    assert ended is not None and len(ended.gpus) == 13 and ended.gap is not None
    assert ended_looks < alone_looks
    proven = best_placement(graph, free, pattern, "preserved", paper_model())
    assert ended.preserved_bandwidth <= proven.preserved_bandwidth <= ended.preserved_bandwidth + ended.gap


@pytest.mark.parametrize("size", [6, 7])
def test_a_limit_spent_while_the_tied_sets_orbits_are_added_still_gives_a_bounded_choice(size):
    """On a node with automorphisms and no twins the set search adds back the orbits of the sets
    that tie; a limit spent there (work, or a clock under load) must leave the sets found so far
    and a proven gap, never an internal error. Every work limit up to the whole search's."""
    graph = _cycle_node(size)
    pattern = make_pattern("ring", 2)
    free = tuple(range(size))
    expected = brute_force_all(graph, free, pattern, MODEL)
    with every_node_big():
        for work in range(1, 200):
            _check_within_gap(graph, free, pattern, "preserved", MODEL, SearchLimit(work=work), expected)
