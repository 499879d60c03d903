"""Application patterns: which GPUs of a job talk to which.

A pattern is a small multigraph over pattern vertices 0..k-1. An edge may appear twice: a
2-GPU ring sends both ways over its one link, and the MAPA model was fitted counting that
link twice (k edges for a k-GPU ring). Edge weights are relative communication volumes
(Amaral et al., Faraji et al.); they scale the aggregated bandwidth, the effective-bandwidth
model counts edges.

Shapes: ring, chain, tree (binary, heap order), ring+tree (the paper's figure 8: both NCCL
patterns at once), all (every pair), star (vertex 0 is the hub), mesh2d and torus2d of R x C,
hypercube, and custom edge lists.

Set or order: a collective library (NCCL, RCCL) builds its own rings and trees over whatever
GPUs a job is given, so for the collective shapes (ring, tree, ring+tree, all) the bandwidth a
job gets depends on its GPU *set*, and every report scores a set by its best order
(:data:`SET_SCORED_SHAPES`). For the other shapes a pattern vertex is the job's rank (a pipeline
stage, a stencil neighbour, a hub, a custom edge list), so the order the GPUs are handed out in
is the mapping and the score follows it.

Owns Pattern, make_pattern and the shapes; imports no other core module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..errors import InputError

SHAPES = ("ring", "chain", "tree", "ring+tree", "all", "star", "mesh2d", "torus2d", "hypercube", "custom")
MAX_PATTERN_GPUS = 64
SET_SCORED_SHAPES = ("ring", "tree", "ring+tree", "all")  # collectives: the score depends on the GPU set only


@dataclass(frozen=True)
class Pattern:
    """A communication pattern over ``size`` GPUs; build one with :func:`make_pattern`."""

    shape: str
    size: int
    edges: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]
    grid: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        if self.grid:
            return f"{self.shape}:{self.grid[0]}x{self.grid[1]}"
        return self.shape

    @property
    def scored_by_set(self) -> bool:
        """Whether the bandwidth this pattern gets depends on its GPU set only (a collective) or on the order too."""
        return self.shape in SET_SCORED_SHAPES

    @property
    def total_weight(self) -> float:
        return sum(self.weights)

    @cached_property
    def symmetry(self) -> "PatternSymmetry":
        return _symmetry(self)


def make_pattern(
    shape: str,
    size: int,
    *,
    grid: tuple[int, int] | None = None,
    edges: tuple[tuple[int, int], ...] | None = None,
    weights: tuple[float, ...] | None = None,
) -> Pattern:
    """Build a validated pattern of ``shape`` over ``size`` GPUs."""
    if shape not in SHAPES:
        raise InputError(f"unknown topology {shape!r} (accepted: {', '.join(SHAPES)})")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_PATTERN_GPUS:
        raise InputError(f"a pattern needs 1 to {MAX_PATTERN_GPUS} GPUs, got {size!r}")
    if shape != "custom" and edges is not None:
        raise InputError(f"edges= is only accepted with topology=custom, not {shape}")
    if grid is not None and shape not in ("mesh2d", "torus2d"):
        raise InputError(f"a grid shape is only accepted for mesh2d and torus2d, not {shape}")
    built: list[tuple[int, int]]
    if shape == "ring":
        built = _ring(size)
    elif shape == "chain":
        built = [(i, i + 1) for i in range(size - 1)]
    elif shape == "tree":
        built = _tree(size)
    elif shape == "ring+tree":
        built = _ring(size) + _tree(size)
    elif shape == "all":
        built = [(a, b) for a in range(size) for b in range(a + 1, size)]
    elif shape == "star":
        built = [(0, b) for b in range(1, size)]
    elif shape in ("mesh2d", "torus2d"):
        rows, cols = grid if grid is not None else squarest_grid(size)
        if rows < 1 or cols < 1 or rows * cols != size:
            raise InputError(f"{shape} grid {rows}x{cols} does not have {size} GPUs")
        grid = (rows, cols)
        built = _grid(rows, cols, wrap=shape == "torus2d")
    elif shape == "hypercube":
        if size & (size - 1):
            raise InputError(f"a hypercube needs a power-of-two GPU count (1, 2, 4, 8, 16, ...), got {size}")
        dims = size.bit_length() - 1
        built = [(a, a ^ (1 << d)) for a in range(size) for d in range(dims) if a < a ^ (1 << d)]
    else:
        if not edges:
            raise InputError("topology=custom needs an edge list, e.g. edges=0-1,1-2,2-3")
        built = list(edges)
        for a, b in built:
            if not (0 <= a < size and 0 <= b < size):
                raise InputError(f"custom edge {a}-{b} names a GPU outside 0..{size - 1}")
            if a == b:
                raise InputError(f"custom edge {a}-{b} links a GPU to itself")
    if weights is None:
        weight_tuple = tuple(1.0 for _ in built)
    else:
        if len(weights) != len(built):
            raise InputError(f"{len(weights)} weights given for the {len(built)} edges of {shape} over {size} GPUs")
        for value in weights:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InputError(f"edge weights must be positive finite numbers, got {value!r}")
        weight_tuple = tuple(float(w) for w in weights)
    return Pattern(shape=shape, size=size, edges=tuple(built), weights=weight_tuple, grid=grid)


def _ring(size: int) -> list[tuple[int, int]]:
    if size == 1:
        return []
    if size == 2:
        return [(0, 1), (1, 0)]  # both directions over the one link, as the model was fitted
    return [(i, (i + 1) % size) for i in range(size)]


def _tree(size: int) -> list[tuple[int, int]]:
    return [((i - 1) // 2, i) for i in range(1, size)]


def _grid(rows: int, cols: int, *, wrap: bool) -> list[tuple[int, int]]:
    def index(r: int, c: int) -> int:
        return r * cols + c

    edges: list[tuple[int, int]] = []
    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols:
                edges.append((index(r, c), index(r, c + 1)))
            elif wrap and cols > 1:
                edges.append((index(r, c), index(r, 0)))
            if r + 1 < rows:
                edges.append((index(r, c), index(r + 1, c)))
            elif wrap and rows > 1:
                edges.append((index(r, c), index(0, c)))
    return edges


def squarest_grid(size: int) -> tuple[int, int]:
    """R x C with R <= C and R as large as possible: 8 -> 2x4, 9 -> 3x3, 7 -> 1x7."""
    rows = max(r for r in range(1, math.isqrt(size) + 1) if size % r == 0)
    return rows, size // rows


# --- symmetry -------------------------------------------------------------------------------
#
# Two placements that differ by an automorphism of the pattern score the same, so the search
# visits only one of them: the lexicographically smallest image (the "lex leader"). The group is
# split in two: swaps of twin vertices (vertices with identical neighbourhoods, e.g. the leaves
# of a star or all vertices of `all`), handled by asking their GPUs to ascend, and the few
# automorphisms that keep every twin class in ascending order, checked explicitly.


@dataclass(frozen=True)
class PatternSymmetry:
    twin_prev: tuple[int, ...]  # for each vertex, the previous vertex of its twin class, or -1
    automorphisms: tuple[tuple[int, ...], ...]  # monotone on twin classes, identity excluded
    twin_classes: tuple[tuple[int, ...], ...]

    def canonical(self, placement: tuple[int, ...]) -> tuple[int, ...]:
        """The lex-smallest placement equivalent to ``placement`` under the pattern's automorphisms."""
        best = self._twin_sorted(placement)
        for perm in self.automorphisms:
            image = self._twin_sorted(tuple(placement[perm[i]] for i in range(len(placement))))
            if image < best:
                best = image
        return best

    def _twin_sorted(self, placement: tuple[int, ...]) -> tuple[int, ...]:
        result = list(placement)
        for members in self.twin_classes:
            if len(members) > 1:
                for position, value in zip(members, sorted(placement[m] for m in members)):
                    result[position] = value
        return tuple(result)


def _adjacency(pattern: Pattern) -> list[list[tuple[float, ...]]]:
    """Per vertex pair the sorted weights of the edges between them (a multigraph signature)."""
    size = pattern.size
    lists: list[list[list[float]]] = [[[] for _ in range(size)] for _ in range(size)]
    for (a, b), weight in zip(pattern.edges, pattern.weights):
        lists[a][b].append(weight)
        lists[b][a].append(weight)
    return [[tuple(sorted(cell)) for cell in row] for row in lists]


def twin_links(class_of: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """From each vertex's twin class (its lowest twin): each vertex's next lower twin (-1: none)
    and the classes' members in order."""
    classes: dict[int, list[int]] = {}
    for v, representative in enumerate(class_of):
        classes.setdefault(representative, []).append(v)
    twin_prev = [-1] * len(class_of)
    for members in classes.values():
        for earlier, later in zip(members, members[1:]):
            twin_prev[later] = earlier
    return twin_prev, classes


def _symmetry(pattern: Pattern) -> PatternSymmetry:
    size = pattern.size
    adj = _adjacency(pattern)

    def are_twins(u: int, v: int) -> bool:
        return adj[u][v] == adj[v][u] and all(adj[u][w] == adj[v][w] for w in range(size) if w not in (u, v))

    class_of = list(range(size))
    for v in range(size):
        for u in range(v):
            if class_of[u] == u and are_twins(u, v):
                class_of[v] = u
                break
    twin_prev, classes = twin_links(class_of)
    return PatternSymmetry(
        twin_prev=tuple(twin_prev),
        automorphisms=tuple(_monotone_automorphisms(adj, class_of, size)),
        twin_classes=tuple(tuple(m) for m in classes.values()),
    )


def _monotone_automorphisms(adj: list[list[tuple[float, ...]]], class_of: list[int], size: int) -> list[tuple[int, ...]]:
    """Automorphisms that map each twin class onto a twin class in ascending order."""
    degree = [(sum(len(c) for c in row), tuple(sorted(row))) for row in adj]
    found: list[tuple[int, ...]] = []
    image = [-1] * size
    taken = [False] * size

    def extend(v: int) -> None:
        if v == size:
            perm = tuple(image)
            if perm != tuple(range(size)):
                found.append(perm)
            return
        for w in range(size):
            if taken[w] or degree[w] != degree[v]:
                continue
            # ascending inside twin classes: the earlier twin of v must map below w
            prev = _previous_twin(class_of, v)
            if prev >= 0 and not (image[prev] < w and class_of[image[prev]] == class_of[w]):
                continue
            if any(adj[v][u] != adj[w][image[u]] for u in range(v)):
                continue
            image[v] = w
            taken[w] = True
            extend(v + 1)
            taken[w] = False
            image[v] = -1

    extend(0)
    return found


def _previous_twin(class_of: list[int], v: int) -> int:
    for u in range(v - 1, -1, -1):
        if class_of[u] == class_of[v]:
            return u
    return -1
