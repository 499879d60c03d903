"""Issue 38's invariant, by brute force: a bandwidth-sensitive ring job gets a ring whose slowest
hop is the best the free GPUs allow, on every preset and every topology file the repository
ships, at every size, on every free set (all of them on nodes of up to 8 GPUs, random ones on
bigger nodes), and the GPUs come back in that ring's order; likewise a chain's slowest hop and an
all-to-all's slowest pair on nodes of up to 8 GPUs.

The yardstick is the links themselves, not any model: a hop's quality is its link's bandwidth
(graph.bandwidths, the paper's Table 1 by default), and among PCIe paths of one bandwidth the
order NCCL and `nvidia-smi topo -m` give them (PIX > PXB > PHB > NODE > SYS). The policy ranks with
the server's default model; this test never reads that model."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache
from pathlib import Path

import pytest
from repo_paths import REPO, TEST_DATA

from slurm_mapa.core.links import PCIE_LEVELS
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.hardware.load import load_topology, model_for_topology
from slurm_mapa.hardware.presets import PRESETS, preset

ROOT = REPO
DATA = TEST_DATA
# Every topology the repository ships or tests with: the presets' files, real `nvidia-smi topo -m`
# and `rocm-smi --showtopo` texts (the servers' own link classes, PCIe levels included), the
# 64-GPU test node.
TOPOLOGY_FILES = sorted([*(ROOT / "slurm_mapa" / "data" / "gres_conf").glob("*.toml"), DATA / "boards-64.toml",
                         *(DATA / "nvidia-smi").glob("*.txt"), *(DATA / "rocm-smi").glob("*.txt")])
MAX_RING = 8  # the sizes checked: 2..8 (and the node's size, if smaller)


def hop_quality(graph, a: int, b: int) -> tuple[float, int]:
    """Higher is better: the link's bandwidth, then (PCIe) its path level's rank."""
    link = graph.link(a, b)
    level = PCIE_LEVELS.index(link.level) if link.kind == "pcie" and link.level in PCIE_LEVELS else 0
    return (graph.bandwidths.of(link), -level)


def ring_bottleneck(graph, order: tuple[int, ...]) -> tuple[float, int]:
    hops = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))] if len(order) > 2 else [order]
    return min(hop_quality(graph, a, b) for a, b in hops)


def best_ring_of(graph, gpus: tuple[int, ...]) -> tuple[float, int]:
    """The best slowest hop of any ring through exactly ``gpus`` (every cyclic order)."""
    first, rest = gpus[0], gpus[1:]
    return max(ring_bottleneck(graph, (first, *perm)) for perm in itertools.permutations(rest))


def best_ring_bounds(graph) -> dict[frozenset[int], tuple[float, int]]:
    """Best ring bottleneck of every GPU set of 2..MAX_RING GPUs (nodes of up to 8 GPUs)."""
    return {frozenset(gpus): best_ring_of(graph, gpus)
            for k in range(2, min(graph.size, MAX_RING) + 1) for gpus in itertools.combinations(range(graph.size), k)}


def check(graph, model, free: tuple[int, ...], k: int, bound: tuple[float, int]) -> None:
    chosen = select("preserve", graph, free, Request(pattern=make_pattern("ring", k), sensitive=True), model)
    order = tuple(chosen.placement.gpus)
    assert len(order) == k and set(order) <= set(free), (graph.name, free, k, order)
    got = ring_bottleneck(graph, order)
    assert got == bound, (f"{graph.name}: free {free}, {k}-GPU ring: chose {order} (slowest hop {got}), "
                          f"but a ring with slowest hop {bound} is free")


@lru_cache(maxsize=None)
def _graph(source: str):
    return preset(source) if source in PRESETS else load_topology(source)


def _loadable(path: Path) -> bool:
    try:
        return _graph(str(path)).size >= 2
    except Exception:  # noqa: BLE001 - a fixture of a malformed text (tests/test_bad_input.py's) is no server
        return False


SOURCES = sorted(PRESETS) + [str(path) for path in TOPOLOGY_FILES if _loadable(path)]


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: Path(s).name)
def test_a_sensitive_ring_gets_the_best_slowest_hop_the_free_gpus_allow(source):
    graph = _graph(source)
    model = model_for_topology(graph)
    if graph.size <= 8:
        bounds = best_ring_bounds(graph)
        for size in range(2, graph.size + 1):
            for free in itertools.combinations(range(graph.size), size):
                for k in range(2, min(size, MAX_RING) + 1):
                    bound = max(bounds[frozenset(s)] for s in itertools.combinations(free, k))
                    check(graph, model, free, k, bound)
        return
    rng = random.Random(38)
    for _ in range(40):
        free = tuple(sorted(rng.sample(range(graph.size), rng.randint(2, 10))))
        for k in range(2, min(len(free), 5) + 1):
            bound = max(best_ring_of(graph, s) for s in itertools.combinations(free, k))
            check(graph, model, free, k, bound)


def chain_bottleneck(graph, order: tuple[int, ...]) -> tuple[float, int]:
    return min(hop_quality(graph, order[i], order[i + 1]) for i in range(len(order) - 1))


def pair_bottleneck(graph, gpus: tuple[int, ...]) -> tuple[float, int]:
    return min(hop_quality(graph, a, b) for a, b in itertools.combinations(gpus, 2))


MAX_CHAIN = 5  # chains are checked over every order of every subset: 2..5 GPUs keeps that small


@pytest.mark.parametrize("source", [s for s in SOURCES if _graph(s).size <= 8], ids=lambda s: Path(s).name)
def test_a_sensitive_chain_and_all_to_all_get_the_best_slowest_link_the_free_gpus_allow(source):
    """The other patterns with a link-true bound: a chain's slowest hop (over every order of every
    subset), an all-to-all's slowest pair (every pair talks)."""
    graph = _graph(source)
    model = model_for_topology(graph)
    for size in range(2, graph.size + 1):
        for free in itertools.combinations(range(graph.size), size):
            for k in range(2, min(size, MAX_CHAIN) + 1):
                subsets = list(itertools.combinations(free, k))
                chain = select("preserve", graph, free, Request(pattern=make_pattern("chain", k), sensitive=True), model)
                got, bound = chain_bottleneck(graph, tuple(chain.placement.gpus)), max(
                    chain_bottleneck(graph, order) for s in subsets for order in itertools.permutations(s))
                assert got == bound, (graph.name, free, k, "chain", chain.placement.gpus, got, bound)
                every = select("preserve", graph, free, Request(pattern=make_pattern("all", k), sensitive=True), model)
                got, bound = pair_bottleneck(graph, tuple(every.placement.gpus)), max(pair_bottleneck(graph, s) for s in subsets)
                assert got == bound, (graph.name, free, k, "all", every.placement.gpus, got, bound)
