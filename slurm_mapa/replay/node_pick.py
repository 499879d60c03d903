"""Slurm's node choice for the replay's slurm, prefer and require node choices (issue 15).

select/cons_tres with equal node weights: among the maximal runs of consecutive nodes (node order)
that can hold the job, the run with the fewest free GPUs, and in it the node with the fewest (the
tightest fit). :func:`slurm_pick` is the reference; the simulator calls :func:`_pick_sorted` on a
small cluster and :func:`_pick_vector`, the same choice with array operations, on a large one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def slurm_pick(eligible: Sequence[int], free_counts: Sequence[int], n_nodes: int, needed: int = 1) -> list[int] | None:
    """select/cons_tres' node choice for equal weights (``_eval_nodes_consec``), free GPUs as the resource.

    ``eligible``: the nodes (indices into ``free_counts``, the cluster's node order) that can hold
    the job. They form maximal runs of consecutive indices; a run is sufficient when it has
    ``needed`` nodes. The sufficient run with the fewest free GPUs wins (the first on ties), and
    in it a one-node job gets the node with the fewest free GPUs (the first on ties), a multi-node
    job the run's first ``needed`` nodes. With no sufficient run, the first ``needed`` eligible
    nodes (Slurm would gather the largest runs first; a modelling shortcut for multi-node jobs).
    """
    if len(eligible) < needed:
        return None
    return _pick_sorted(sorted({i for i in eligible if 0 <= i < n_nodes}), free_counts, needed)


def _pick_sorted(eligible: list[int], free_counts: Sequence[int], needed: int = 1) -> list[int] | None:
    """:func:`slurm_pick` on eligible nodes already in node order: one pass over them, none over the others."""
    if len(eligible) < needed:
        return None
    best_start = best_end = -1
    best_total = 0
    start = 0
    total = 0
    last = len(eligible) - 1
    for pos, i in enumerate(eligible):
        if pos > start and i != eligible[pos - 1] + 1:  # a gap: the run before it ended
            start, total = pos, 0
        total += free_counts[i]
        if pos == last or eligible[pos + 1] != i + 1:  # the run ends here
            if pos - start + 1 >= needed and (best_start < 0 or total < best_total):
                best_start, best_end, best_total = start, pos, total
    if best_start < 0:
        return eligible[:needed]
    if needed == 1:
        node = eligible[best_start]
        for i in eligible[best_start + 1:best_end + 1]:
            if free_counts[i] < free_counts[node]:
                node = i
        return [node]
    return eligible[best_start:best_start + needed]


def weighted_pick(eligible: list[int], weights: Sequence[int], free_counts: Sequence[int], needed: int = 1) -> list[int] | None:
    """Slurm's choice when nodes have weights: the lowest weight first. The nodes of the lowest weight
    are tried alone (:func:`_pick_sorted`); when they cannot hold the job, the next weight's nodes join
    them, and so on (slurm.conf(5), ``Weight``: jobs get the nodes with the lowest weight that
    satisfy their requirements).
    ``eligible`` is in node order; ``weights`` is indexed by node."""
    if len(eligible) < needed:
        return None
    level = sorted(weights[i] for i in eligible)[max(needed, 1) - 1]  # the lowest weight whose nodes (and lighter ones) suffice
    return _pick_sorted([i for i in eligible if weights[i] <= level], free_counts, needed)


def _pick_vector(eligible: np.ndarray, free_counts: np.ndarray, needed: int = 1) -> list[int] | None:
    """:func:`slurm_pick` with ``eligible`` a boolean array over the cluster's nodes (ndarray methods
    only: the module-level numpy functions cost more than the work on a few thousand nodes)."""
    index = eligible.nonzero()[0]
    k = index.size
    if k < needed:
        return None
    counts = free_counts[index]
    first = np.empty(k, dtype=bool)  # where a run of consecutive nodes begins
    first[0] = True
    np.not_equal(index[1:] - index[:-1], 1, out=first[1:])
    starts = first.nonzero()[0]
    if starts.size == 1:  # one run: every eligible node
        if needed > 1:
            return index[:needed].tolist()
        return [int(index[counts.argmin()])]
    totals = np.add.reduceat(counts, starts)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = k
    if needed > 1:
        sufficient = (ends - starts >= needed).nonzero()[0]
        if not sufficient.size:
            return index[:needed].tolist()
        run = sufficient[totals[sufficient].argmin()]  # argmin: the first on ties
        return index[starts[run]:starts[run] + needed].tolist()
    run = totals.argmin()
    low = starts[run]
    return [int(index[low + counts[low:ends[run]].argmin()])]
