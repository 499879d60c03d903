"""The order in which a job's GPUs are handed to its steps and tasks.

Slurm numbers a job's GPUs on a node and hands a step or a task the GPUs it picks, lowest indices
first. The Prolog pairs Slurm's indices, in ascending order, with MAPA's GPUs in the order below
(the job file of slurm/node_state keeps the pairing), so that what Slurm hands out first is what MAPA links best:
the first two GPUs are a best-linked pair, each next GPU is the one that best closes the ring of
those before it, and so consecutive GPUs (local ranks r and r+1 of `--gpus-per-task=1`) are link
neighbours wherever the set allows. Greedy, O(k^2): the Prolog runs it for every job.

Owns prefix_order; imports only :mod:`.hardware`.
"""

from __future__ import annotations

from typing import Sequence

from .hardware import HardwareGraph


def prefix_order(graph: HardwareGraph, gpus: Sequence[int]) -> tuple[int, ...]:
    """``gpus`` ordered so that every prefix is a well-linked ring (see the module docstring).
    Ties go to the lower GPU index, so the order is a function of the set alone."""
    left = sorted(set(gpus))
    if len(left) <= 2:
        return tuple(left)
    bw = graph.bandwidth_matrix()
    first, second = max(((a, b) for i, a in enumerate(left) for b in left[i + 1:]), key=lambda pair: (bw[pair[0]][pair[1]], -pair[0], -pair[1]))
    order = [first, second]
    left = [g for g in left if g not in order]
    while left:
        last = order[-1]
        # The ring of the prefix gains bw(last, g) + bw(g, first) - bw(last, first): the first two
        # terms decide; then the link to the last GPU (ring neighbours), then the lower index.
        chosen = max(left, key=lambda g: (bw[last][g] + bw[g][first], bw[last][g], -g))
        order.append(chosen)
        left.remove(chosen)
    return tuple(order)
