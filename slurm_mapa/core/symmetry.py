"""Interchangeable GPUs: twin classes of a hardware graph, relative to a set of GPUs.

Two GPUs g < h of a set are *twins* when each has the same link class to every other GPU of the
set (an NVSwitch island, the GPUs of an all-to-all node). Swapping twins is an automorphism of
the graph restricted to the set, so it changes no score: not the effective or the aggregated
bandwidth of a placement inside the set, not the preserved bandwidth of what is left of it.

Twins are an equivalence relation: if g~h and h~i, then for any other x the links g-x, h-x, i-x
agree, and g-h = g-i (h~i seen from g) = h-i (g~h seen from i), so g-h = h-i = i-g as well.

The search uses them through one fact. Among placements of equal score the lexicographically
smallest GPU sequence wins; so the winner uses, of every twin class, its lowest members (else
swapping in a lower unused twin makes the sequence smaller) and in ascending order along the
pattern (else swapping two of them does). The search may therefore skip a GPU whose lower twin
is still unused, and pick sets as "how many of each class", taking the lowest members.

Also the pattern's symmetry as the search uses it (:func:`search_symmetry`), and automorphisms
of the hardware graph for nodes without twins, such as a torus (:func:`graph_automorphisms`).

Owns twin_classes, lower_twins, is_twin_canonical, search_symmetry and graph_automorphisms;
imports :mod:`.hardware` and :mod:`.patterns`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from .hardware import HardwareGraph
from .patterns import Pattern, PatternSymmetry, twin_links


@lru_cache(maxsize=16)
def _link_ids(graph: HardwareGraph) -> tuple[tuple[int, ...], ...]:
    """Per GPU pair a small int naming its link class (-1 on the diagonal), so rows compare in C."""
    ids: dict[object, int] = {}
    return tuple(
        tuple(-1 if a == b else ids.setdefault(graph.links[a][b], len(ids)) for b in graph.gpus) for a in graph.gpus
    )


@lru_cache(maxsize=4096)  # a replay meets many free sets of a 16-GPU node
def _twin_classes(graph: HardwareGraph, within: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    ids = _link_ids(graph)
    rows = {g: tuple(ids[g][x] for x in within) for g in within}
    position = {g: i for i, g in enumerate(within)}
    classes: list[list[int]] = []
    for g in within:
        row_g, i = rows[g], position[g]
        for members in classes:
            h = members[0]
            row_h, j = rows[h], position[h]
            # Same link to every GPU other than g and h (positions j < i are masked).
            if row_g[:j] == row_h[:j] and row_g[j + 1 : i] == row_h[j + 1 : i] and row_g[i + 1 :] == row_h[i + 1 :]:
                members.append(g)
                break
        else:
            classes.append([g])
    return tuple(tuple(members) for members in classes)


def twin_classes(graph: HardwareGraph, within: Iterable[int]) -> tuple[tuple[int, ...], ...]:
    """The twin classes of the GPUs ``within`` (twins relative to the links among them), each
    ascending, ordered by their lowest member."""
    return _twin_classes(graph, tuple(sorted(set(within))))


def lower_twins(graph: HardwareGraph, within: Iterable[int]) -> dict[int, int]:
    """For each GPU of ``within`` its next lower twin in ``within``, or -1."""
    lower: dict[int, int] = {}
    for members in twin_classes(graph, within):
        previous = -1
        for gpu in members:
            lower[gpu] = previous
            previous = gpu
    return lower


def is_twin_canonical(graph: HardwareGraph, within: Iterable[int], chosen: Iterable[int]) -> bool:
    """Whether ``chosen`` takes the lowest members of every twin class of ``within``."""
    taken = set(chosen)
    for members in twin_classes(graph, within):
        inside = [g in taken for g in members]
        if any(later and not earlier for earlier, later in zip(inside, inside[1:])):
            return False
    return True


# --- pattern symmetry for the search ----------------------------------------------------------
#
# The search visits only lex-leader placements (see :class:`~.patterns.PatternSymmetry`). Any
# subset of the pattern's automorphisms is enough for that to stay exact: the lex-first optimal
# placement is the lex leader under the whole group, so under any subset too, and is visited;
# every other optimal placement visited is at least its own lex leader, so not smaller. A bigger
# subset only prunes more. Pattern.symmetry enumerates the group by trying every vertex at every
# step, which takes seconds for rings, trees and cliques of 32 to 64 GPUs; this one follows pattern
# edges (a vertex with an earlier neighbour can only go to a neighbour of that neighbour's image),
# compares neighbour lists instead of whole rows, and stops at a cap.

MAX_AUTOMORPHISMS = 256  # kept per pattern: each is checked on every prefix the search extends
_MAX_AUTOMORPHISM_STEPS = 20_000


@lru_cache(maxsize=64)
def search_symmetry(pattern: Pattern) -> PatternSymmetry:
    """The pattern's twin classes and (up to a cap) its automorphisms monotone on them."""
    size = pattern.size
    cells: list[dict[int, list[float]]] = [{} for _ in range(size)]
    for (a, b), weight in zip(pattern.edges, pattern.weights):
        cells[a].setdefault(b, []).append(weight)
        cells[b].setdefault(a, []).append(weight)
    adjacent = [{u: tuple(sorted(ws)) for u, ws in cell.items()} for cell in cells]
    ids: dict[tuple[float, ...], int] = {(): 0}
    rows = [tuple(ids.setdefault(adjacent[v].get(u, ()), len(ids)) for u in range(size)) for v in range(size)]
    class_of = list(range(size))
    for v in range(size):
        for u in range(v):
            # Twins: the same edges to every other vertex (and, trivially, between themselves).
            same = rows[u][:u] == rows[v][:u] and rows[u][u + 1 : v] == rows[v][u + 1 : v] and rows[u][v + 1 :] == rows[v][v + 1 :]
            if class_of[u] == u and same:
                class_of[v] = u
                break
    twin_prev, classes = twin_links(class_of)
    return PatternSymmetry(
        twin_prev=tuple(twin_prev),
        automorphisms=tuple(_monotone_automorphisms(adjacent, class_of, twin_prev, size)),
        twin_classes=tuple(tuple(m) for m in classes.values()),
    )


def _monotone_automorphisms(
    adjacent: list[dict[int, tuple[float, ...]]], class_of: list[int], twin_prev: list[int], size: int
) -> list[tuple[int, ...]]:
    """Automorphisms mapping each twin class onto a twin class in ascending order, identity
    excluded; at most MAX_AUTOMORPHISMS of them, found within _MAX_AUTOMORPHISM_STEPS steps."""
    signature = [tuple(sorted(adj.values())) for adj in adjacent]
    earlier_neighbour = [min((u for u in adjacent[v] if u < v), default=-1) for v in range(size)]
    earlier_count = [sum(1 for u in adjacent[v] if u < v) for v in range(size)]
    # A monotone map sends the i-th member of a twin class to the i-th member of one of equal size.
    rank = [0] * size
    class_size = [0] * size
    for v in range(size):
        if twin_prev[v] >= 0:
            rank[v] = rank[twin_prev[v]] + 1
    for v in range(size):
        class_size[v] = sum(1 for u in range(size) if class_of[u] == class_of[v])
    found: list[tuple[int, ...]] = []
    image = [-1] * size
    preimage = [-1] * size
    steps = [0]
    everyone = range(size)

    def fits(v: int, w: int) -> bool:
        if preimage[w] >= 0 or rank[w] != rank[v] or class_size[w] != class_size[v] or signature[w] != signature[v]:
            return False
        prev = twin_prev[v]
        if prev >= 0 and not (image[prev] < w and class_of[image[prev]] == class_of[w]):
            return False
        # Every earlier neighbour of v must map to a neighbour of w over the same edges, and w may
        # have no other neighbour among the images placed so far.
        for u, cell in adjacent[v].items():
            if u < v and adjacent[w].get(image[u]) != cell:
                return False
        return sum(1 for x in adjacent[w] if 0 <= preimage[x] < v) == earlier_count[v]

    def extend(v: int) -> bool:
        steps[0] += 1
        if steps[0] > _MAX_AUTOMORPHISM_STEPS:
            return True
        if v == size:
            perm = tuple(image)
            if any(perm[i] != i for i in range(size)) and len(found) < MAX_AUTOMORPHISMS:
                found.append(perm)
            return len(found) >= MAX_AUTOMORPHISMS
        anchor = earlier_neighbour[v]
        candidates = sorted(adjacent[image[anchor]]) if anchor >= 0 else everyone
        for w in candidates:
            if fits(v, w):
                image[v], preimage[w] = w, v
                stop = extend(v + 1)
                image[v], preimage[w] = -1, -1
                if stop:
                    return True
        return False

    extend(0)
    return found


# --- automorphisms of the hardware graph --------------------------------------------------------
#
# A 2-D torus has no twins, but its translations and reflections map it onto itself. The set
# search uses such automorphisms (restricted to the free GPUs) to visit only one set of each
# orbit; see search._SetSearch. Like the pattern's, any subset of them is enough to stay exact.

MAX_GRAPH_AUTOMORPHISMS = 256
_MAX_GRAPH_STEPS = 1_500  # about 10 ms on a 64-GPU torus; more finds more automorphisms, not a better answer


@lru_cache(maxsize=256)
def _graph_automorphisms(graph: HardwareGraph, within: tuple[int, ...]) -> tuple[dict[int, int], ...]:
    ids = _link_ids(graph)
    n = len(within)
    if n < 3:
        return ()  # two GPUs: only their swap, which is a twin swap, not needed here
    # Per GPU its links to the others as a multiset: an automorphism keeps it.
    signature = {g: tuple(sorted(ids[g][x] for x in within if x != g)) for g in within}
    frequency: dict[int, int] = {}
    for g in within:
        for x in within:
            if x != g:
                frequency[ids[g][x]] = frequency.get(ids[g][x], 0) + 1
    # Map GPUs in an order where each (after the first) has a mapped GPU over a rare link class:
    # its image must then sit on that class next to the mapped one's image.
    # Next, the GPU with the most rare links to GPUs already placed (a square closes early, so a
    # wrong image fails early); its anchor is a placed GPU it reaches over its rarest link.
    commonest = max(frequency, key=lambda c: (frequency[c], c))
    order = [within[0]]
    anchor: dict[int, int] = {}
    rarest = {g: (frequency[ids[within[0]][g]], within[0]) for g in within[1:]}
    rare_links = {g: int(ids[within[0]][g] != commonest) for g in within[1:]}
    while rarest:
        g = min(rarest, key=lambda x: (-rare_links[x], rarest[x][0], x))
        order.append(g)
        anchor[g] = rarest.pop(g)[1]
        del rare_links[g]
        for x in rarest:
            link = ids[g][x]
            if link != commonest:
                rare_links[x] += 1
            if frequency[link] < rarest[x][0]:
                rarest[x] = (frequency[link], g)
    # Not the whole group: per level of the stabiliser chain (the first GPUs of `order` fixed),
    # one automorphism for each GPU the next one can be sent to. They generate the group, and any
    # set of automorphisms keeps the set search exact. The first level with none ends the search.
    found: list[dict[int, int]] = []
    image: dict[int, int] = {}
    taken: set[int] = set()
    steps = [0]

    def extend(position: int) -> bool:
        """Completes ``image`` from ``position`` on; True when it found an automorphism."""
        steps[0] += 1
        if position == n:
            return True
        if steps[0] > _MAX_GRAPH_STEPS:
            return False
        g = order[position]
        u = anchor[g]
        wanted = ids[u][g]
        for w in within:
            if w in taken or ids[image[u]][w] != wanted or signature[w] != signature[g]:
                continue
            if any(ids[g][x] != ids[w][image[x]] for x in order[:position]):
                continue
            image[g] = w
            taken.add(w)
            if extend(position + 1):
                return True
            taken.discard(w)
            del image[g]
        return False

    for level in range(n):
        image.clear()
        taken.clear()
        for x in order[:level]:
            image[x] = x
            taken.add(x)
        g = order[level]
        new = 0
        for w in within:
            if w == g or w in taken or signature[w] != signature[g]:
                continue
            if any(ids[g][x] != ids[w][x] for x in order[:level]):
                continue
            image[g] = w
            taken.add(w)
            if extend(level + 1):
                found.append(dict(image))
                new += 1
                for x in order[level + 1 :]:
                    taken.discard(image.pop(x))
            taken.discard(w)
            del image[g]
            if len(found) >= MAX_GRAPH_AUTOMORPHISMS or steps[0] > _MAX_GRAPH_STEPS:
                return tuple(found)
        if not new:
            break
    return tuple(found)


def graph_automorphisms(graph: HardwareGraph, within: Iterable[int]) -> tuple[dict[int, int], ...]:
    """Automorphisms of the graph restricted to the GPUs ``within`` (each keeps every link class
    among them): coset representatives along a stabiliser chain, which generate the group (up to
    MAX_GRAPH_AUTOMORPHISMS of them, found within a step cap; any subset is sound to use)."""
    return _graph_automorphisms(graph, tuple(sorted(set(within))))
