"""Node features from MAPA (issue 15): names, the brute-force check of the score, and their invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bruteforce import brute_force_all
from slurm_mapa.core import features
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.features import (
    best_free,
    complement_name,
    feature_name,
    feature_names,
    fleet_best,
    has_good,
    node_features,
    node_weight,
    weight_of_preserved,
)
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset

MODEL = paper_model()
DGX = preset("dgx1-v100")
PCIE = preset("pcie-8")
SIZES = (2, 3, 4, 5)


def test_names_and_the_list_for_slurm_conf():
    assert feature_name(4) == "mapa_ring4" and complement_name(4) == "mapa_noring4"
    assert feature_name(2, "ring+tree") == "mapa_ring_tree2" and complement_name(3, "tree") == "mapa_notree3"
    assert feature_names((4, 2, 2)) == ("mapa_ring2", "mapa_noring2", "mapa_ring4", "mapa_noring4")
    with pytest.raises(InputError, match="unknown pattern"):
        feature_name(2, "donut")


@pytest.mark.parametrize("graph", [DGX, PCIE], ids=lambda g: g.name)
@pytest.mark.parametrize("free", [(0, 1, 2, 3, 4, 5, 6, 7), (0, 5, 6), (1, 2, 4, 7), (0, 3, 4, 6, 7), (2, 6)])
def test_best_free_is_the_brute_force_best_ring(graph, free):
    for k in SIZES:
        brute = brute_force_all(graph, free, make_pattern("ring", k), MODEL)
        expected = None if brute is None else brute["effective"][0][0]
        got = best_free(graph, free, k, MODEL)
        assert (got is None and expected is None) or got == pytest.approx(expected, abs=1e-9), (free, k)


def test_fleet_best_is_the_best_idle_node_type_and_skips_sizes_no_node_holds():
    mixed = fleet_best([PCIE, DGX, PCIE], (2, 4, 9), MODEL)
    assert set(mixed) == {2, 4}  # no node holds 9 GPUs
    assert mixed == fleet_best([DGX], (2, 4), MODEL)  # DGX-1's NVLink beats PCIe at every size
    assert mixed[2] == pytest.approx(58.925036, abs=1e-5)  # f(2,0,0): two double-NVLink edges


def test_an_idle_best_node_has_every_ring_and_a_pcie_node_none():
    best = fleet_best([PCIE, DGX], SIZES, MODEL)
    assert node_features(DGX, range(8), best, MODEL, threshold=1.0) == tuple(f"mapa_ring{k}" for k in SIZES)
    assert node_features(PCIE, range(8), best, MODEL) == tuple(f"mapa_noring{k}" for k in SIZES)
    assert node_features(DGX, (), best, MODEL) == tuple(f"mapa_noring{k}" for k in SIZES)


def test_mask_and_set_agree_and_bad_input_is_refused():
    best = fleet_best([DGX], SIZES, MODEL)
    assert node_features(DGX, 0b01100001, best, MODEL) == node_features(DGX, (0, 5, 6), best, MODEL)
    with pytest.raises(InputError, match="not on"):
        node_features(DGX, (8,), best, MODEL)
    with pytest.raises(InputError, match="not on"):
        node_features(DGX, 1 << 8, best, MODEL)
    with pytest.raises(InputError, match="threshold"):
        node_features(DGX, (0, 1), best, MODEL, threshold=0)


def test_the_cache_is_keyed_by_free_set_and_clearable():
    features.clear_cache()
    best_free(DGX, (0, 1, 2), 2, MODEL)
    assert len(features._cache) == 1
    best_free(DGX, 0b111, 2, MODEL)  # the same free set as a mask: no new entry
    assert len(features._cache) == 1
    features.clear_cache()
    assert not features._cache


free_sets = st.sets(st.integers(0, 7)).map(lambda s: tuple(sorted(s)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(free=free_sets, extra=free_sets, threshold=st.sampled_from([0.6, 0.8, 0.9, 1.0]), graph=st.sampled_from([DGX, PCIE]))
def test_invariants(free, extra, threshold, graph):
    best = fleet_best([DGX, PCIE], SIZES, MODEL)
    published = node_features(graph, free, best, MODEL, threshold)
    # exactly one of each pair per size, in size order
    assert len(published) == len(best)
    for k, name in zip(sorted(best), published):
        assert name in (feature_name(k), complement_name(k))
        assert (name == feature_name(k)) == has_good(graph, free, k, best[k], MODEL, threshold)
        if len(free) < k:
            assert name == complement_name(k)
    # freeing more GPUs never takes a ring feature away
    more = tuple(sorted(set(free) | set(extra)))
    rings = {n for n in published if "noring" not in n}
    assert rings <= {n for n in node_features(graph, more, best, MODEL, threshold) if "noring" not in n}
    # a lower threshold never takes a ring feature away
    assert rings <= {n for n in node_features(graph, free, best, MODEL, threshold * 0.9) if "noring" not in n}


def _brute_good_at(graph, free, ends, k, fleet_k, threshold):
    """The reference for good_free_at: the earliest of 0 and the jobs' end times at which the GPUs
    free then (the free ones and those of every job ended by that time) hold a ring the brute-force
    search rates at least threshold x fleet_k."""
    def good(gpus):
        brute = brute_force_all(graph, tuple(sorted(gpus)), make_pattern("ring", k), MODEL) if len(gpus) >= k else None
        return brute is not None and brute["effective"][0][0] >= threshold * fleet_k - 1e-9

    for t in sorted({0.0, *(end for end, _ in ends)}):
        if good(set(free) | {g for end, gpus in ends if end <= t for g in gpus}):
            return t
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_good_free_at_is_the_first_end_that_frees_a_good_ring_as_brute_force_finds(data):
    graph = data.draw(st.sampled_from([DGX, PCIE]))
    owner = data.draw(st.lists(st.integers(-1, 3), min_size=8, max_size=8))  # -1: free; else the job holding the GPU
    free = [gpu for gpu, job in enumerate(owner) if job < 0]
    end_of = data.draw(st.lists(st.sampled_from([100.0, 200.0, 300.0]), min_size=4, max_size=4))
    ends = [(end_of[job], [gpu for gpu, j in enumerate(owner) if j == job]) for job in range(4) if job in owner]
    known = data.draw(st.lists(st.booleans(), min_size=len(ends), max_size=len(ends)))
    ends = [pair for pair, kept in zip(ends, known) if kept]  # jobs whose end is unknown are left out
    k = data.draw(st.sampled_from([2, 3, 4]))
    threshold = data.draw(st.sampled_from([0.5, 0.9, 1.0]))
    fleet_k = fleet_best([DGX], (k,), MODEL)[k]
    expected = _brute_good_at(graph, free, ends, k, fleet_k, threshold)
    assert features.good_free_at(graph, free, ends, k, fleet_k, MODEL, threshold) == expected


def test_good_free_at_on_a_dgx1_whose_good_rings_are_held():
    best4 = fleet_best([DGX], (4,), MODEL)[4]
    assert features.good_free_at(DGX, range(8), [], 4, best4, MODEL) == 0.0
    # 0-3 free later (job A at 500), 4-7 by job B ending at 200: B's end frees a double-NVLink quad first.
    assert features.good_free_at(DGX, (), [(500.0, (0, 1, 2, 3)), (200.0, (4, 5, 6, 7))], 4, best4, MODEL) == 200.0
    # B's end unknown (left out): only A's end frees one.
    assert features.good_free_at(DGX, (), [(500.0, (0, 1, 2, 3))], 4, best4, MODEL) == 500.0
    assert features.good_free_at(DGX, (), [], 4, best4, MODEL) is None
    assert features.good_free_at(PCIE, range(8), [], 4, best4, MODEL) is None  # never as good as a DGX-1's


@pytest.mark.parametrize("name", ["dgx1-v100", "pcie-8", "torus2d-16"])
def test_node_weight_is_the_replays_weight_for_every_free_set(name):
    """The weight mapa-agent publishes (summed over the free GPUs' links) equals the replay's, read
    from its preserved-bandwidth table built by another recurrence, for every free set; it grows
    with every GPU freed and a base shifts it whole."""
    from slurm_mapa.replay.decider import Decider

    graph = preset(name)
    decider = Decider()
    table = decider.preserved_table(decider.graph_id(graph))
    for mask in range(1 << graph.size) if graph.size <= 8 else range(0, 1 << graph.size, 97):
        weight = node_weight(graph, mask)
        assert weight == weight_of_preserved(table[mask])
        assert node_weight(graph, mask, base=1000) == weight + 1000
        for gpu in range(graph.size):
            if not mask >> gpu & 1:
                assert node_weight(graph, mask | 1 << gpu) >= weight
    assert node_weight(graph, 0) == 1
    with pytest.raises(InputError):
        node_weight(graph, 0, base=-1)
