"""Where a job's nodes go when the cluster has NVLink domains (issue 51): MAPA's domain-level
Preserve and the peers it is compared with.

Plain data, no I/O: a cluster is a sequence of domains, each the free GPUs of its nodes in node
order; a node is ``(domain, position)``. A job asks for ``nodes`` nodes with ``gpus`` free GPUs
each, and has a domain need (:data:`NEEDS`): ``required`` (all its nodes in one domain, else it
waits), ``preferred`` (one domain when one has room now, else anywhere) or ``any``.

* ``mapa`` - Preserve one level up. Among the placements that meet the need, the one that leaves
  the most useful free space (:func:`state_score`): the most whole domains free, then the largest
  numbers of whole free nodes per domain, then the longest runs of consecutive whole free nodes (the
  node runs a ``--segment`` or a block-aligned job needs). Nodes that are already in use but still
  have the GPUs the job needs cost nothing and are taken first, the fullest first, so small and
  insensitive jobs pack into trays and domains that are already broken.
* ``block`` - Slurm's ``topology/block`` as documented (https://slurm.schedmd.com/topology.html,
  "Block Topology"; https://slurm.schedmd.com/topology.conf.html): the base blocks (here the
  domains) and the higher block levels of ``BlockSizes`` (each the next power of two of
  consecutive base blocks); a job goes to the smallest block level that can hold it, the
  lowest-numbered block of that level with room; a ``required`` job (``--segment`` of its size)
  only into a base block. Inside the block: a one-node job the node with the fewest free GPUs
  that fits (cons_tres' best fit), a multi-node job the block's first usable nodes.
* ``first-fit`` - the lowest usable nodes in node order; it does not see domains.
* ``random`` - usable nodes drawn at random (seeded by the caller's ``rng``); it does not see
  domains.

A ``required`` job that fits no domain now waits under ``mapa`` and ``block``; the two
domain-blind peers place it wherever there is room (as Slurm would without topology/block).
"""

from __future__ import annotations

import random
from itertools import accumulate
from typing import Sequence

from ..errors import InputError

NEEDS = ("required", "preferred", "any")
DOMAIN_POLICIES = ("mapa", "block", "first-fit", "random")

Free = Sequence[Sequence[int]]
Placement = tuple[tuple[int, int], ...]


def parse_need(text: str) -> str:
    """A ``domain=`` value, or InputError naming what is accepted."""
    value = (text or "").strip().lower()
    if value not in NEEDS:
        raise InputError(f"domain={text!r} (accepted: {', '.join(NEEDS)})")
    return value


def default_need(sensitive: bool, nodes: int, domain_nodes: int) -> str:
    """The need of a job that states none: ``required`` for a sensitive multi-node job that fits
    one domain (as ``--segment`` of the job's size asks), else ``any``."""
    return "required" if sensitive and 1 < nodes <= domain_nodes else "any"


def effective_need(need: str | None, sensitive: bool, nodes: int, domain_nodes: int) -> str:
    """The need the placement honours: the stated one, else :func:`default_need`; a ``required``
    job larger than every domain could never start, so it is placed as ``preferred``."""
    chosen = need or default_need(sensitive, nodes, domain_nodes)
    if chosen == "required" and nodes > domain_nodes:
        return "preferred"
    return chosen


def runs(flags: Sequence[bool]) -> list[int]:
    """The lengths of the maximal runs of true values."""
    out: list[int] = []
    length = 0
    for flag in flags:
        if flag:
            length += 1
        elif length:
            out.append(length)
            length = 0
    if length:
        out.append(length)
    return out


def state_score(free: Free, capacity: int) -> tuple:
    """How useful the free space is (larger is better, compared as a tuple): whole domains free;
    then the numbers of whole free nodes per domain, largest first; then the runs of consecutive
    whole free nodes, longest first."""
    whole = [[f >= capacity for f in domain] for domain in free]
    counts = [sum(w) for w in whole]
    whole_domains = sum(1 for w, c in zip(whole, counts) if w and c == len(w))
    return (whole_domains, tuple(sorted(counts, reverse=True)),
            tuple(sorted((r for w in whole for r in runs(w)), reverse=True)))


def after(free: Free, placement: Placement, gpus: int) -> list[list[int]]:
    """The free GPUs once ``placement`` took ``gpus`` on each of its nodes."""
    out = [list(domain) for domain in free]
    for d, j in placement:
        out[d][j] -= gpus
    return out


def usable(free: Free, gpus: int) -> list[tuple[int, int]]:
    """The nodes with at least ``gpus`` free, in node order."""
    return [(d, j) for d, domain in enumerate(free) for j, f in enumerate(domain) if f >= gpus]


def _whole_order(domain: Sequence[int], capacity: int) -> list[int]:
    """The whole free nodes of a domain in the order MAPA takes them: the shortest runs first
    (a run taken from its low end), so that the longest runs stay whole."""
    spans: list[tuple[int, int]] = []  # (length, start)
    start = None
    for j, f in enumerate([*domain, -1]):
        if f >= capacity and start is None:
            start = j
        elif f < capacity and start is not None:
            spans.append((j - start, start))
            start = None
    return [j for length, s in sorted(spans) for j in range(s, s + length)]


def _partials(free: Free, capacity: int, gpus: int, domains: Sequence[int]) -> list[tuple[int, int]]:
    """Nodes already in use that still have ``gpus`` free, the fullest first, then node order."""
    found = [(free[d][j], d, j) for d in domains for j, f in enumerate(free[d]) if gpus <= f < capacity]
    return [(d, j) for _, d, j in sorted(found)]


def _in_domain(free: Free, d: int, capacity: int, nodes: int, gpus: int) -> Placement | None:
    picks = _partials(free, capacity, gpus, [d])[:nodes]
    if len(picks) < nodes and gpus <= capacity:
        picks += [(d, j) for j in _whole_order(free[d], capacity)][:nodes - len(picks)]
    return tuple(sorted(picks)) if len(picks) == nodes else None


def _spread(free: Free, capacity: int, nodes: int, gpus: int) -> Placement | None:
    """Anywhere: nodes in use first (the fullest first), then whole free nodes drained domain by
    domain, a whole free domain last, otherwise the domain with the fewest whole free nodes (on a
    tie, the one whose runs are shortest) first."""
    picks = _partials(free, capacity, gpus, range(len(free)))[:nodes]
    if len(picks) < nodes and gpus <= capacity:
        def order(d: int) -> tuple:
            w = [f >= capacity for f in free[d]]
            c = sum(w)
            return (bool(w) and c == len(w), c, sorted(runs(w), reverse=True), d)

        for d in sorted(range(len(free)), key=order):
            picks += [(d, j) for j in _whole_order(free[d], capacity)][:nodes - len(picks)]
            if len(picks) == nodes:
                break
    return tuple(sorted(picks)) if len(picks) == nodes else None


def mapa_place(free: Free, capacity: int, nodes: int, gpus: int, need: str = "any") -> Placement | None:
    """MAPA's domain-level Preserve (see the module docstring); None: no placement meets the need now."""
    if nodes < 1 or gpus > capacity:
        return None
    if need in ("required", "preferred"):
        best: tuple | None = None
        for d in range(len(free)):
            placement = _in_domain(free, d, capacity, nodes, gpus)
            if placement is None:
                continue
            key = state_score(after(free, placement, gpus), capacity)
            if best is None or key > best[0]:  # the lowest-numbered domain on ties
                best = (key, placement)
        if best is not None:
            return best[1]
        if need == "required":
            return None
    return _spread(free, capacity, nodes, gpus)


def block_levels(domain_sizes: Sequence[int], block_sizes: Sequence[int] = ()) -> list[int]:
    """How many consecutive base blocks each block level joins: 1, 2, 4, ... up to all of them
    (``block_sizes`` in nodes, as topology.conf's ``BlockSizes``: the first is the base block size,
    each next one a power of two times it; by default every power of two up to the cluster)."""
    count = len(domain_sizes)
    if block_sizes:
        base = block_sizes[0]
        return [max(1, size // base) for size in block_sizes if size // base <= max(count, 1)] or [1]
    levels = [1]
    while levels[-1] < count:
        levels.append(levels[-1] * 2)
    return levels


def block_place(free: Free, capacity: int, nodes: int, gpus: int, need: str = "any",
                block_sizes: Sequence[int] = ()) -> Placement | None:
    """Slurm's topology/block as documented (see the module docstring); None: it waits."""
    if nodes < 1 or gpus > capacity:
        return None
    sizes = [len(domain) for domain in free]
    levels = block_levels(sizes, block_sizes)
    if need == "required":
        levels = levels[:1]
    starts = [0, *accumulate(sizes)]
    for width in levels:
        for first in range(0, len(free), width):
            members = range(first, min(first + width, len(free)))
            if sum(sizes[d] for d in members) < nodes:
                continue
            room = [(d, j) for d in members for j, f in enumerate(free[d]) if f >= gpus]
            if len(room) < nodes:
                continue
            if nodes == 1:
                return (min(room, key=lambda node: (free[node[0]][node[1]], starts[node[0]] + node[1])),)
            return tuple(room[:nodes])
    if need == "required":
        return None
    room = usable(free, gpus)
    return tuple(room[:nodes]) if len(room) >= nodes else None


def first_fit_place(free: Free, capacity: int, nodes: int, gpus: int, need: str = "any") -> Placement | None:
    """The lowest usable nodes in node order (domain-blind)."""
    room = usable(free, gpus) if gpus <= capacity else []
    return tuple(room[:nodes]) if nodes >= 1 and len(room) >= nodes else None


def random_place(free: Free, capacity: int, nodes: int, gpus: int, need: str = "any",
                 rng: random.Random | None = None) -> Placement | None:
    """Usable nodes drawn at random (domain-blind)."""
    room = usable(free, gpus) if gpus <= capacity else []
    if nodes < 1 or len(room) < nodes:
        return None
    return tuple(sorted((rng or random.Random(0)).sample(room, nodes)))


def place(policy: str, free: Free, capacity: int, nodes: int, gpus: int, need: str = "any", *,
          rng: random.Random | None = None, block_sizes: Sequence[int] = ()) -> Placement | None:
    """The placement ``policy`` (one of :data:`DOMAIN_POLICIES`) gives the job; None: it waits."""
    if policy == "mapa":
        return mapa_place(free, capacity, nodes, gpus, need)
    if policy == "block":
        return block_place(free, capacity, nodes, gpus, need, block_sizes)
    if policy == "first-fit":
        return first_fit_place(free, capacity, nodes, gpus, need)
    if policy == "random":
        return random_place(free, capacity, nodes, gpus, need, rng)
    raise InputError(f"unknown domain policy {policy!r} (accepted: {', '.join(DOMAIN_POLICIES)})")


def one_domain(placement: Placement) -> bool:
    """Whether every node of the placement is in one domain."""
    return len({d for d, _ in placement}) == 1
