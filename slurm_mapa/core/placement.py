"""A placement of a pattern on GPUs and its scores: what the search returns and ranks by.

Objectives (each a tuple compared lexicographically, floats rounded to :data:`DIGITS` decimals):

* ``effective``  - (predicted effective bandwidth, aggregated bandwidth)
* ``aggregated`` - (aggregated bandwidth,)
* ``preserved``  - (preserved bandwidth of the GPUs left free, aggregated bandwidth)
* ``effective-rings`` - (predicted effective bandwidth, ring rate of the set, aggregated
  bandwidth): a sensitive ring job's choice among sets its model ranks equal (:mod:`.ring_choice`)

Owns Placement, score_placement, preserved_bandwidth, objective_key and OBJECTIVES; imports
.effbw, .hardware and .patterns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..errors import InputError
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern

OBJECTIVES = ("effective", "aggregated", "preserved")  # what the search ranks by
RING_OBJECTIVE = "effective-rings"  # ranked by .ring_choice on top of the search's "effective"
DIGITS = 9


@dataclass(frozen=True)
class Placement:
    """A pattern placed on GPUs: ``gpus[i]`` runs pattern vertex i."""

    gpus: tuple[int, ...]
    aggregated_bandwidth: float
    link_counts: tuple[int, ...]
    effective_bandwidth: float | None
    preserved_bandwidth: float
    # None: proven optimal (tie-break included). Otherwise the search ran out of its limit, and the
    # optimum of the objective's first term (effective, preserved or aggregated bandwidth, GB/s)
    # is proven to lie in [value, value + gap]. 0.0: that term is proven optimal, but a later term
    # or the tie-break among equals is not.
    gap: float | None = None
    # The most bus bandwidth rings can carry over the set's links (.ring_packing), where the policy
    # ranked by it (objective effective-rings); None otherwise.
    ring_rate: float | None = None


def with_gap(placement: Placement, upper: float, value: float) -> Placement:
    """``placement`` marked as not proven: the optimum's first term is at most ``upper``."""
    return replace(placement, gap=max(0.0, round(upper - value, DIGITS)))


def score_placement(
    graph: HardwareGraph, free: Iterable[int], pattern: Pattern, gpus: Sequence[int], model: EffectiveBandwidthModel
) -> Placement:
    """All scores of one placement (the reference the search and the tests agree on)."""
    gpus = tuple(gpus)
    bw = graph.bandwidth_matrix()
    classes = _class_rows(graph, model)
    counts = [0] * len(model.class_names)
    aggregated = 0.0
    for (a, b), weight in zip(pattern.edges, pattern.weights):
        x, y = gpus[a], gpus[b]
        c = classes[x][y]
        if c is None:
            c = classes[x][y] = model.classify(graph.link(x, y))
        aggregated += weight * bw[x][y]
        counts[c] += 1
    left = sorted(set(free) - set(gpus))
    return Placement(
        gpus=gpus,
        aggregated_bandwidth=aggregated,
        link_counts=tuple(counts),
        effective_bandwidth=model.predict(tuple(counts)) if pattern.edges else None,
        preserved_bandwidth=preserved_bandwidth(graph, left),
    )


_MAX_CLASS_ROWS = 16
_class_rows_of: dict[tuple[HardwareGraph, EffectiveBandwidthModel], list[list[int | None]]] = {}


def _class_rows(graph: HardwareGraph, model: EffectiveBandwidthModel) -> list[list[int | None]]:
    """Per GPU pair the model's class of its link, filled in as pairs are met (a model may lack a
    class for a link no placement uses: classify raises only for a link it is asked about)."""
    found = _class_rows_of.get((graph, model))
    if found is None:
        if len(_class_rows_of) >= _MAX_CLASS_ROWS:
            _class_rows_of.clear()
        found = _class_rows_of[(graph, model)] = [[None] * graph.size for _ in graph.gpus]
    return found


def preserved_bandwidth(graph: HardwareGraph, free: Iterable[int]) -> float:
    """The paper's Eq. 3: the summed bandwidth of every link among the GPUs that stay free."""
    left = sorted(free)
    if len(set(left)) != len(left):  # a GPU twice: graph.bandwidth refuses a link to itself
        return sum(graph.bandwidth(a, b) for i, a in enumerate(left) for b in left[i + 1 :])
    bw = graph.bandwidth_matrix()
    return sum(bw[a][b] for i, a in enumerate(left) for b in left[i + 1 :])


def objective_key(objective: str, placement: Placement) -> tuple[float, ...]:
    agg = round(placement.aggregated_bandwidth, DIGITS)
    if objective == "effective":
        eff = placement.effective_bandwidth
        return (round(eff, DIGITS) if eff is not None else 0.0, agg)
    if objective == "aggregated":
        return (agg,)
    if objective == "preserved":
        return (round(placement.preserved_bandwidth, DIGITS), agg)
    if objective == RING_OBJECTIVE:
        eff = placement.effective_bandwidth
        rate = placement.ring_rate
        return (round(eff, DIGITS) if eff is not None else 0.0, round(rate, DIGITS) if rate is not None else 0.0, agg)
    raise InputError(f"unknown objective {objective!r} (accepted: {', '.join((*OBJECTIVES, RING_OBJECTIVE))})")
