"""A brute-force reference for the exact search: every injective placement, scored and compared.

Deliberately naive (itertools.permutations, automorphisms by trying every vertex permutation)
so that it shares no search logic with the code it checks. Scores use the same public
definitions (link classes, the model, Eq. 1-3), written out again here.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations
from math import comb

DIGITS = 9
RING_RATE_DIGITS = 6
RING_SHAPES = ("ring", "ring+tree")
PCIE_FACTORS = {"PIX": 1.0, "PXB": 0.9, "PHB": 0.8, "NODE": 0.6, "SYS": 0.35}


@lru_cache(maxsize=None)
def _automorphisms(edges, weights, size):
    edge_multiset = sorted((min(a, b), max(a, b), w) for (a, b), w in zip(edges, weights))
    found = []
    for perm in permutations(range(size)):
        image = sorted((min(perm[a], perm[b]), max(perm[a], perm[b]), w) for (a, b), w in zip(edges, weights))
        if image == edge_multiset:
            found.append(perm)
    return tuple(found)


def pattern_automorphisms(pattern):
    return _automorphisms(pattern.edges, pattern.weights, pattern.size)


def canonical(placement, automorphisms):
    # Pattern vertex i runs on placement[i]; automorphism p gives the equivalent i -> placement[p[i]].
    return min(tuple(placement[p[i]] for i in range(len(placement))) for p in automorphisms)


def ring_rate(graph, gpus):
    """The most bus bandwidth rings can carry over the links among ``gpus`` (3+ GPUs), solved here
    as a directed programme by scipy's HiGHS: one variable per directed Hamiltonian cycle (over fast
    links only when some cycle is); per
    ordered pair with a direct link its bandwidth, per GPU and direction its NVSwitch port and its
    one PCIe link, per ordered PCIe pair its path's bandwidth (scaled by level when the graph
    gives every PCIe level one value), and per direction the SYS hops together one SYS path's."""
    return _ring_rate(graph, tuple(sorted(gpus)))


@lru_cache(maxsize=None)
def _ring_rate(graph, gpus):
    import numpy as np
    from scipy.optimize import linprog

    k = len(gpus)
    cycles = [(gpus[0], *rest) for rest in permutations(gpus[1:])]
    fast = [c for c in cycles if all(graph.links[c[i]][c[(i + 1) % k]].kind != "pcie" for i in range(k))]
    cycles = fast or cycles  # rings over fast links only when the set has one
    one_level = len(set(graph.bandwidths.pcie.values())) == 1
    rows, caps = [], []
    for a in gpus:
        for b in gpus:
            if a == b:
                continue
            link = graph.links[a][b]
            if link.kind == "nvswitch":
                continue
            value = value_of(graph, link, one_level)
            rows.append([1.0 if any(c[i] == a and c[(i + 1) % k] == b for i in range(k)) else 0.0 for c in cycles])
            caps.append(value)
    for a in gpus:
        for kind, cap in (("pcie", max(graph.bandwidths.pcie.values())),
                          ("nvswitch", max((graph.bandwidths.of(graph.links[a][b]) for b in gpus
                                            if b != a and graph.links[a][b].kind == "nvswitch"), default=0.0))):
            sending = [sum(1.0 for i in range(k) if c[i] == a and graph.links[a][c[(i + 1) % k]].kind == kind) for c in cycles]
            receiving = [sum(1.0 for i in range(k) if c[(i + 1) % k] == a and graph.links[c[i]][a].kind == kind) for c in cycles]
            for row in (sending, receiving):  # full duplex: each direction carries its bandwidth
                if any(row):
                    rows.append(row)
                    caps.append(cap)
    # The SMP interconnect: the SYS hops from one CPU domain to another share that link, per
    # direction (within one domain, by GPU index), at one SYS path's bandwidth.
    domain = {g: (graph.domains[g] if graph.domains else 0) for g in gpus}
    directed = {}
    for a in gpus:
        for b in gpus:
            if a != b and graph.links[a][b].kind == "pcie" and graph.links[a][b].level == "SYS":
                way = (domain[a], domain[b]) if domain[a] != domain[b] else (domain[a], domain[a], a < b)
                directed.setdefault(way, set()).add((a, b))
    for hops in directed.values():
        rows.append([sum(1.0 for i in range(k) if (c[i], c[(i + 1) % k]) in hops) for c in cycles])
        caps.append(min(value_of(graph, graph.links[a][b], one_level) for a, b in hops))
    result = linprog(-np.ones(len(cycles)), A_ub=np.array(rows), b_ub=np.array(caps), bounds=(0, None), method="highs")
    assert result.status == 0, result.message
    return -result.fun


def value_of(graph, link, one_level):
    value = graph.bandwidths.of(link)
    if link.kind == "pcie" and one_level:
        value *= PCIE_FACTORS.get(link.level, 1.0)
    return value


def ranks_by_rings(pattern, free, model=None):
    """MAPA's rule for ranking a sensitive job's ties by ring rate (core.ring_choice), restated:
    never under a model whose ties are "first" (the paper's, by name)."""
    from slurm_mapa.core.ring_choice import MAX_TIE_SETS

    return (getattr(model, "ties", "rings") != "first" and pattern.shape in RING_SHAPES and 3 <= pattern.size <= 8 and pattern.size <= len(free)
            and comb(len(free), pattern.size) <= MAX_TIE_SETS)


def preserve_objective(pattern, free, sensitive, model=None):
    """The objective MAPA's preserve ranks a job by."""
    if not sensitive or pattern.size < 2:
        return "preserved"
    return "effective-rings" if ranks_by_rings(pattern, free, model) else "effective"


def all_keys(graph, free, pattern, model):
    """Yield (placement, {objective: key}) for every injective placement of pattern on free."""
    free = sorted(free)
    bw = [[0.0 if a == b else graph.bandwidths.of(graph.links[a][b]) for b in range(graph.size)] for a in range(graph.size)]
    cls = [[-1 if a == b else model.classify(graph.links[a][b]) for b in range(graph.size)] for a in range(graph.size)]
    n_classes = len(model.class_names)
    for gpus in permutations(free, pattern.size):
        counts = [0] * n_classes
        agg = 0.0
        for (a, b), w in zip(pattern.edges, pattern.weights):
            agg += w * bw[gpus[a]][gpus[b]]
            counts[cls[gpus[a]][gpus[b]]] += 1
        left = [g for g in free if g not in gpus]
        preserved = sum(bw[a][b] for i, a in enumerate(left) for b in left[i + 1 :])
        eff = model.predict(tuple(counts)) if pattern.edges else 0.0
        agg_r = round(agg, DIGITS)
        keys = {
            "effective": (round(eff, DIGITS), agg_r),
            "aggregated": (agg_r,),
            "preserved": (round(preserved, DIGITS), agg_r),
        }
        if pattern.shape in RING_SHAPES and 3 <= pattern.size <= 8:
            # Ring rates are kept to 6 digits (the programme's and the shipped tables' precision).
            keys["effective-rings"] = (round(eff, DIGITS), round(round(ring_rate(graph, gpus), RING_RATE_DIGITS), DIGITS), agg_r)
        yield gpus, keys


def brute_force_all(graph, free, pattern, model):
    """{objective: (best key, lex-smallest canonical placement among the best)}, or None if it cannot fit."""
    if pattern.size > len(free):
        return None
    autos = pattern_automorphisms(pattern)
    best = {}
    for gpus, keys in all_keys(graph, free, pattern, model):
        for objective, key in keys.items():
            current = best.get(objective)
            if current is None or key > current[0]:
                best[objective] = (key, canonical(gpus, autos))
            elif key == current[0]:
                canon = canonical(gpus, autos)
                if canon < current[1]:
                    best[objective] = (key, canon)
    return best
