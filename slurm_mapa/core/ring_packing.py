"""The most bus bandwidth rings can carry over a GPU set's links: the link-bound model's bound for
collectives (issue 38).

NCCL and RCCL run an all-reduce over several rings at once (channels), each a cyclic order of the
job's GPUs, each moving its share of the data over every hop. A ring's rate is capped by every link
it crosses, and rings share links, so the bus bandwidth of a set is at most the largest total rate
a family of rings (each used in both directions, since links are full duplex) can carry without
over-filling a link:

    maximise  sum of x_C  over the set's Hamiltonian cycles C (undirected)
    subject to, per pair of GPUs with a direct link (NVLink, xGMI): the rings crossing it <= its
               bandwidth (one direction); per GPU, its rings' hops over the NVSwitch <= its port
               and its hops over PCIe <= its PCIe link (every PCIe peer shares the one link);
               per PCIe pair, the rings crossing it <= that path's bandwidth; per two CPU
               domains, all SYS hops between them <= a SYS path's bandwidth (their one link)

and the bound is twice the optimum (each cycle runs both ways); two GPUs: one link, both ways, so
the bound is the pair's bandwidth. Rings are packed over fast links only (NVLink, xGMI, NVSwitch)
when the set has a ring over them, as NCCL searches for its rings at the fastest path type first;
otherwise over every path, PCIe included, and the SYS hops of every ring between the same two CPU
domains share the one interconnect between them (its capacity: a SYS path's bandwidth). It is a linear programme
of (k-1)!/2 columns (2,520 for eight GPUs), solved exactly here by the simplex method (Bland's
rule: it never cycles), once per topology: decisions look the rate up (:mod:`.ring_rate_tables`).

A plain per-GPU bound (the sum of a GPU's link bandwidths to the rest of the set) says the same
for richly linked sets but over-rates sparse ones: three GPUs joined by one double and two single
NVLinks cannot use the double link's second lane, since every ring crosses each of the three pairs.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Any

from .links import path_bandwidth
from .ring_rate_tables import canonical_set, shipped_table, stored_table

# Sets above this size get the per-GPU bound instead (the programme grows as (k-1)!).
MAX_PACKED_GPUS = 8
_EPS = 1e-9


@lru_cache(maxsize=None)
def _cycles(k: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The undirected Hamiltonian cycles of k positions (k >= 3), each as its k edges (low, high)."""
    found = []
    for rest in itertools.permutations(range(1, k)):
        if rest[0] > rest[-1]:
            continue  # the same cycle the other way round
        order = (0, *rest)
        found.append(tuple(tuple(sorted((order[i], order[(i + 1) % k]))) for i in range(k)))
    return tuple(found)


@lru_cache(maxsize=65536)
def max_ring_rate(graph: Any, gpus: tuple[int, ...]) -> float | None:
    """Twice the largest total rate of rings through exactly ``gpus`` (GB/s, one direction per
    link; PCIe paths by :func:`.links.path_bandwidth`, each GPU's PCIe link at the graph's widest
    PCIe level); None for fewer than 3 GPUs or more than MAX_PACKED_GPUS. The value depends on the
    set only (the order of ``gpus`` does not change it).

    Looked up, never solved inside a decision where a table ships (:mod:`.ring_rate_tables`: the
    presets of up to 8 GPUs and any graph with their links) or is stored (other graphs of up to 8
    GPUs, where the process has a table store: the first use computes and stores the table);
    elsewhere solved once per orbit of the set under the graph's automorphisms and kept for the
    process."""
    gpus = tuple(sorted(gpus))
    k = len(gpus)
    if k < 3 or k > MAX_PACKED_GPUS:
        return None
    table = shipped_table(graph)
    if table is None:
        table = stored_table(graph, solved_per_orbit)
    if table is not None:
        return table[sum(1 << g for g in gpus)]
    return solved_per_orbit(graph, gpus)


def solved_per_orbit(graph: Any, gpus: tuple[int, ...]) -> float | None:
    """:func:`solve_ring_rate` of ``gpus``, solved once per orbit of the set and kept for the process."""
    return _solved_once(graph, canonical_set(graph, gpus))


@lru_cache(maxsize=65536)
def _solved_once(graph: Any, gpus: tuple[int, ...]) -> float | None:
    return solve_ring_rate(graph, gpus)


def solve_ring_rate(graph: Any, gpus: tuple[int, ...]) -> float | None:
    """:func:`max_ring_rate` solved: the linear programme over the set's Hamiltonian cycles (what
    the shipped tables hold, and what graphs without one compute)."""
    gpus = tuple(sorted(gpus))
    k = len(gpus)
    if k < 3 or k > MAX_PACKED_GPUS:
        return None
    import numpy as np  # here, not at import: the Prolog imports the policies for every job
    bandwidths = graph.bandwidths
    port = max(bandwidths.pcie.values())
    cycles = _cycles(k)
    rows: list = []
    caps: list[float] = []
    pcie_use = np.zeros((k, len(cycles)))
    switch_use = np.zeros((k, len(cycles)))
    switch_port = [0.0] * k
    edge_index = {edge: i for i, edge in enumerate(itertools.combinations(range(k), 2))}
    on_edge = np.zeros((len(edge_index), len(cycles)))
    for c, cycle in enumerate(cycles):
        for edge in cycle:
            on_edge[edge_index[edge], c] = 1.0
    # Every SYS path crosses the SMP interconnect between two CPU domains (nvidia-smi's definition
    # of SYS), so the rings' SYS hops between the same two domains share one link: at most one SYS
    # path's bandwidth per direction in all. Counting each SYS pair alone priced a DGX-1's GPUs 0-4
    # (one NVLink-less hop to GPU 4) at 3x what NCCL measures there. Two NUMA nodes of one socket
    # are taken as having a link of their own to the other socket's (an over-rating there).
    domains = graph.domains or (0,) * graph.size
    crossings: dict[tuple[int, int], tuple[Any, list[float]]] = {}
    for (a, b), i in edge_index.items():
        link = graph.link(gpus[a], gpus[b])
        value = bandwidths.of(link)
        if link.kind == "nvswitch":
            switch_use[a] += on_edge[i]
            switch_use[b] += on_edge[i]
            switch_port[a] = max(switch_port[a], value)
            switch_port[b] = max(switch_port[b], value)
            continue
        if link.kind == "pcie":
            pcie_use[a] += on_edge[i]
            pcie_use[b] += on_edge[i]
            value = path_bandwidth(graph, link)
            if link.level == "SYS":
                pair = tuple(sorted((domains[gpus[a]], domains[gpus[b]])))
                use, pair_caps = crossings.setdefault(pair, (np.zeros(len(cycles)), []))
                use += on_edge[i]
                pair_caps.append(value)
        rows.append(on_edge[i])
        caps.append(value)
    for use, pair_caps in crossings.values():
        rows.append(use)
        caps.append(min(pair_caps))
    for v in range(k):
        if switch_use[v].any():
            rows.append(switch_use[v])
            caps.append(switch_port[v])
        if pcie_use[v].any():
            rows.append(pcie_use[v])
            caps.append(port)
    a, b = np.array(rows), np.array(caps)
    over_pcie = pcie_use.sum(axis=0) > 0
    if not over_pcie.all():
        # NCCL builds its rings over the fastest path type that connects the set: with a ring over
        # fast links only, no ring takes PCIe as well.
        a = a[:, ~over_pcie]
    return round(2.0 * _simplex_max_sum(a, b), 6)


def _simplex_max_sum(a: Any, b: Any) -> float:
    """max sum(x) subject to a @ x <= b, x >= 0, for b >= 0 (the slack basis is feasible), by the
    tableau simplex method with Bland's rule."""
    import numpy as np

    m, n = a.shape
    tableau = np.zeros((m + 1, n + m + 1))
    tableau[:m, :n] = a
    tableau[:m, n:n + m] = np.eye(m)
    tableau[:m, -1] = b
    tableau[m, :n] = -1.0
    basis = list(range(n, n + m))
    while True:
        negative = np.flatnonzero(tableau[m, :-1] < -_EPS)
        if not negative.size:
            return float(tableau[m, -1])
        entering = int(negative[0])
        column = tableau[:m, entering]
        ratios = [(tableau[i, -1] / column[i], basis[i], i) for i in range(m) if column[i] > _EPS]
        if not ratios:  # unbounded: cannot happen, every cycle crosses a capped pair or port
            raise ValueError("ring packing is unbounded")
        _, _, row = min(ratios)
        tableau[row] /= tableau[row, entering]
        factors = tableau[:, entering].copy()
        factors[row] = 0.0
        tableau -= np.outer(factors, tableau[row])
        basis[row] = entering
