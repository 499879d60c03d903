"""One name per quantity on every screen (issue 52): what ``mapa select``, ``mapa explain`` and
``mapa-replay`` call the bandwidths of one GPU set, said once where each screen first shows them.

One set on a DGX-1 (GPUs 0-3 as a ring) reads: predicted 38.056, ring rate 100, judged 80. They
are three quantities, not three guesses at one:

* **predicted** (effective bandwidth): the ranking model's estimate, what MAPA ranks sets by;
  ``mapa select`` and ``mapa explain`` show it, ``mapa-replay`` in its ``ranked`` column.
* **ring rate**: the bus bandwidth rings can carry over the set's links (rings packed over them);
  MAPA breaks the ranking model's ties by it.
* **judged**: what a replay scores every policy's sets by (``--judge``); by default link-bound,
  0.8 x the ring rate. ``mapa-replay``'s effective-bandwidth columns and headline are judged.

``x1``, ``x2``, ``x3``: how many of the pattern's edges run over each link class of the ranking
model (the model names each class by its links, e.g. ``NV2`` a double NVLink, ``SYS`` a socket
crossing); the model's prediction is a function of these counts.
"""

from __future__ import annotations

from typing import Sequence

PREDICTED = ("predicted: the ranking model's effective bandwidth of the set (what MAPA ranks sets by; "
             "mapa-replay's 'ranked' column)")
RING_RATE = ("ring rate: the bus bandwidth rings can carry over the set's links (MAPA breaks the model's ties by it)")
JUDGED = ("judged: what mapa-replay scores every policy's set by (its effective-bandwidth columns; link-bound, the "
          "default judge: 0.8 x the ring rate)")
LINK_COUNTS = "x1, x2, ...: the pattern's edges over each link class of the ranking model"
# Where the replay shows preserved bandwidth (issue 52: MAPA's is often the lowest of the topology-aware policies).
PRESERVED_WHY = ("why MAPA's preserved can be the lowest: it spends the best links on the bandwidth-sensitive jobs "
                 "instead of keeping them free, and where its jobs run faster (--time-model) the same work packs into "
                 "less time, so fewer GPUs stand free to count; preserved is a means, the sensitive jobs' bandwidth the end")


def link_classes(class_names: Sequence[str], selectors: Sequence[Sequence[str]], counts: Sequence[int]) -> str:
    """``x1=3 (NV2), x2=1 (NV1), x3=0 (SYS)``: each count with the links its class counts."""
    return ", ".join(f"{name}={count} ({'/'.join(links)})" for name, links, count in zip(class_names, selectors, counts))
