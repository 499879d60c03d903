"""A brute-force reference for the exact search: every injective placement, scored and compared.

Deliberately naive (itertools.permutations, automorphisms by trying every vertex permutation)
so that it shares no search logic with the code it checks. Scores use the same public
definitions (link classes, the model, Eq. 1-3), written out again here.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

DIGITS = 9


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
        yield gpus, {
            "effective": (round(eff, DIGITS), agg_r),
            "aggregated": (agg_r,),
            "preserved": (round(preserved, DIGITS), agg_r),
        }


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
