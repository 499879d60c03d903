"""Whether a GPU set holds a ring over fast links only: a yardstick read from the links, no model.

A ring all-reduce moves every byte over every hop of its ring, and NCCL/RCCL build their rings
over the GPUs a job is given; a set in which no ring avoids PCIe runs its rings at PCIe speed,
whatever a model predicts. The replay reports, per job size, the share of sensitive jobs whose
GPUs hold such a ring (issue 38): a judgement by the links a choice uses.
"""

from __future__ import annotations

from typing import Any, Sequence

# Sets above this size are not checked (the search is exponential in the set's size).
MAX_CHECKED_GPUS = 10  # 2^10 x 10^2 steps: milliseconds per distinct set, which a replay meets once


def has_fast_ring(graph: Any, gpus: Sequence[int]) -> bool | None:
    """True if some cyclic order of ``gpus`` uses no PCIe hop (two GPUs: their link is not PCIe);
    None for one GPU or a set above MAX_CHECKED_GPUS."""
    k = len(gpus)
    if k < 2 or k > MAX_CHECKED_GPUS:
        return None
    fast = [[a != b and graph.link(gpus[a], gpus[b]).kind != "pcie" for b in range(k)] for a in range(k)]
    if k == 2:
        return fast[0][1]
    if any(sum(row) < 2 for row in fast):
        return False  # a GPU with fewer than two fast neighbours cannot sit in a fast ring
    # Hamiltonian cycle through GPU 0: reach[mask] = the GPUs a fast path from 0 covering mask can end at.
    full = (1 << k) - 1
    reach = [0] * (1 << k)
    reach[1] = 1
    for mask in range(1, full + 1, 2):  # every path starts at GPU 0, so mask always holds bit 0
        ends = reach[mask]
        if not ends:
            continue
        for last in range(k):
            if not ends >> last & 1:
                continue
            for nxt in range(1, k):
                if not mask >> nxt & 1 and fast[last][nxt]:
                    reach[mask | 1 << nxt] |= 1 << nxt
    return any(reach[full] >> last & 1 and fast[last][0] for last in range(1, k))
