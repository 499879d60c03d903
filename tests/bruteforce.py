"""A brute-force reference for the exact search: every injective placement, scored and compared.

Deliberately naive (itertools.permutations, automorphisms by trying every vertex permutation)
so that it shares no logic with the search it checks.
"""

from __future__ import annotations

from itertools import permutations

from slurm_mapa.core.search import objective_key, score_placement


def pattern_automorphisms(pattern):
    size = pattern.size
    edge_multiset = sorted((min(a, b), max(a, b), w) for (a, b), w in zip(pattern.edges, pattern.weights))
    found = []
    for perm in permutations(range(size)):
        image = sorted((min(perm[a], perm[b]), max(perm[a], perm[b]), w) for (a, b), w in zip(pattern.edges, pattern.weights))
        if image == edge_multiset:
            found.append(perm)
    return found


def canonical(placement, automorphisms):
    # The placement maps pattern vertex i to placement[i]; an automorphism p gives the
    # equivalent placement i -> placement[p[i]].
    return min(tuple(placement[p[i]] for i in range(len(placement))) for p in automorphisms)


def brute_force(graph, free, pattern, objective, model):
    free = sorted(free)
    if pattern.size > len(free):
        return None
    autos = pattern_automorphisms(pattern)
    best = None
    for gpus in permutations(free, pattern.size):
        placement = score_placement(graph, free, pattern, gpus, model)
        key = objective_key(objective, placement)
        canon = canonical(gpus, autos)
        if best is None or key > best[0] or (key == best[0] and canon < best[1]):
            best = (key, canon)
    return best
