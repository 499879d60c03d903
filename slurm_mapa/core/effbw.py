"""Predicted effective bandwidth: a regression over the link classes a pattern's edges use.

The model is data, not code (a TOML file): the link classes it counts (``x1``, ``x2``, ...,
each a list of selectors such as ``NV1``, ``NV>=2``, ``NVS``, ``PCIE`` or a PCIe level) and one
coefficient per term. Terms are products of counts (``x1``, ``x1*x2``) or their inverses
(``1/(x1*x2+1)``), which covers the paper's 14-term model (Eq. 2, Table 2) and the
generalisations a site may fit for its own servers.

A second kind, ``kind = "bottleneck"``, is the default for servers nobody has measured: each
class carries a bandwidth (``[bandwidths]``) and the prediction is the bandwidth of the slowest
class the pattern's edges use. A ring all-reduce moves every byte over every ring edge, so its
bus bandwidth is bounded by its slowest link; NCCL's tree pipelines the data through every tree
edge, up and down, so the same bound holds, and so for any pattern whose edges all carry a share
of the traffic at the same time (mesh, torus, hypercube, all-to-all). It is still a function of
the per-class edge counts only, which the exact search needs. :func:`bottleneck_model` derives
one from a hardware graph (see docs/calibration.md for the numbers and why).

A bottleneck class's bandwidth may be a curve over the pattern's edge count instead of a number
(``x1 = { 2 = 370.0, 8 = 480.0 }``): published nccl-tests figures per job size, or a model
:func:`derived_model` builds from a server's links and the paper model's efficiency per GB/s of
the DGX-1's links (``basis = "derived"``). Every server the package knows has its own model
(docs/engine.md); :func:`matching_model` picks one for any other topology by its link classes.

A model may name the range it was fitted on: pattern sizes (``fitted_gpus = [2, 5]``: the paper's
regression saw rings of 2 to 5 GPUs), edge counts (``fitted_edges``) and link classes with their
bandwidths (``[fitted_links]``). Outside it its numbers are extrapolations, and
:func:`out_of_range` says why; everything that shows a prediction marks them. The replay, by
default, reports the :class:`LinkBoundModel` instead for sizes outside the range: a physically
grounded estimate from the links themselves (``data/models/link-bound.toml``; see
docs/replay.md for how it compares with public nccl-tests figures).

Owns the effective-bandwidth model types and their predictions; :mod:`.model_files` reads and
writes model files and holds the bundled models, :mod:`.server_models` picks or derives the
model of a server. Imports only :mod:`.links`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from ..errors import InputError
from .links import PCIE_LEVELS, Link, path_bandwidth
from .ring_packing import max_ring_rate

_PRODUCT = r"x[0-9]+(?:\*x[0-9]+)*"
_TERM = re.compile(rf"^(?:(?P<product>{_PRODUCT})|1/\((?P<inverse>{_PRODUCT})\+1\))$")
MODEL_KINDS = ("regression", "bottleneck")
MODEL_TIES = ("rings", "first")
_SELECTOR = re.compile(r"^(?:NV(?P<ge>>=)?(?P<n>[1-9][0-9]?)|NVS(?:>=(?P<sn>[1-9][0-9]?))?|PCIE|PIX|PXB|PHB|NODE|SYS)$")


@dataclass(frozen=True)
class Term:
    variables: tuple[int, ...]  # indices into the class counts
    inverse: bool
    coefficient: float

    def value(self, counts: tuple[float, ...]) -> float:
        product = 1.0
        for index in self.variables:
            product *= counts[index]
        return self.coefficient / (product + 1.0) if self.inverse else self.coefficient * product


@dataclass(frozen=True)
class EffectiveBandwidthModel:
    name: str
    class_names: tuple[str, ...]
    selectors: tuple[tuple[str, ...], ...]
    terms: tuple[Term, ...]
    description: str = ""
    kind: str = "regression"  # or "bottleneck"
    class_bandwidths: tuple[float, ...] = ()  # GB/s per class, bottleneck models only (a curve's largest value)
    fitted_gpus: tuple[int, int] | None = None  # pattern sizes the model was fitted on; None: no stated limit
    # Bottleneck models only: per class, GB/s at given edge counts ((edges, GB/s), ...), or () for
    # the constant class_bandwidths value. Read by linear interpolation, flat beyond the ends.
    class_curves: tuple[tuple[tuple[int, float], ...], ...] = ()
    fitted_edges: tuple[int, int] | None = None  # edge counts (sum of the class counts) it was fitted on
    fitted_links: tuple[tuple[str, float], ...] = ()  # link classes and GB/s it was fitted on ("PCIE": any level)
    basis: str = ""  # where its numbers come from: "fitted", "published" or "derived" ("": not stated)
    # How Preserve chooses among a sensitive ring job's sets the model prices equal: "rings" (the
    # set whose links carry the most rings, .ring_choice) or "first" (the first maximum in
    # candidate order, as the paper's reference implementation chooses: its model by name).
    ties: str = "rings"

    @property
    def derived(self) -> bool:
        """Whether the numbers are derived (link bandwidths x the DGX-1 efficiency curve), not measured."""
        return self.basis == "derived"

    def fitted_for(self, gpus: int) -> bool:
        """Whether a pattern over ``gpus`` GPUs lies inside the sizes the model was fitted on."""
        return self.fitted_gpus is None or self.fitted_gpus[0] <= gpus <= self.fitted_gpus[1]

    def classify(self, link: Link) -> int:
        """The index of the class that counts ``link``; the first class that matches wins."""
        for index, selectors in enumerate(self.selectors):
            if any(_matches(selector, link) for selector in selectors):
                return index
        raise InputError(
            f"effective-bandwidth model {self.name!r} counts no class for link {link.token} "
            f"(its classes: {', '.join(f'{n}={list(s)}' for n, s in zip(self.class_names, self.selectors))})"
        )

    def predict(self, counts: tuple[float, ...]) -> float:
        if self.kind == "bottleneck":
            if self.class_curves:
                edges = sum(counts)
                used = [_on_curve(curve, edges) if curve else bw
                        for bw, curve, count in zip(self.class_bandwidths, self.class_curves, counts) if count > 0]
            else:
                used = [bw for bw, count in zip(self.class_bandwidths, counts) if count > 0]
            return min(used) if used else 0.0
        return sum(term.value(counts) for term in self.terms)

    @cached_property
    def _hash(self) -> int:
        return hash((self.name, self.class_names, self.selectors, self.terms, self.kind, self.class_bandwidths, self.fitted_gpus,
                     self.class_curves))

    def __hash__(self) -> int:
        # Models key the search's caches: hash the terms once, not on every lookup.
        return self._hash


def _on_curve(curve: tuple[tuple[int, float], ...], edges: float) -> float:
    """The curve's GB/s at ``edges``: linear between its points, its end value beyond them."""
    if edges <= curve[0][0]:
        return curve[0][1]
    for (low, low_value), (high, high_value) in zip(curve, curve[1:]):
        if edges <= high:
            return low_value + (high_value - low_value) * (edges - low) / (high - low)
    return curve[-1][1]


def _matches(selector: str, link: Link) -> bool:
    if selector == "PCIE":
        return link.kind == "pcie"
    if selector in PCIE_LEVELS:
        return link.kind == "pcie" and link.level == selector
    if selector.startswith("NVS"):
        if link.kind != "nvswitch":
            return False
        return selector == "NVS" or link.links >= int(selector[5:])
    if link.kind != "nvlink":
        return False
    if selector.startswith("NV>="):
        return link.links >= int(selector[4:])
    return link.links == int(selector[2:])


# Collectives whose rings bound them: the link-bound model prices them by ring packing (.ring_packing).
RING_PACKED_SHAPES = ("ring", "ring+tree")


@dataclass(frozen=True)
class LinkBoundModel:
    """A physically grounded estimate of the bus bandwidth a job gets, from its links alone.

    Ring collectives (ring, ring+tree) of 3 to ring_packing.MAX_PACKED_GPUS GPUs: NCCL and RCCL
    run several rings at once, each crossing every GPU of the set, so the bus bandwidth is at
    most the largest total rate rings can carry over the set's links (:mod:`.ring_packing`: a
    link, an NVSwitch port and a GPU's one PCIe link each carry at most their bandwidth per
    direction). Other collectives, and bigger sets: each GPU sends at the bus bandwidth, so it
    is at most the slowest GPU's outgoing bandwidth to the rest of the set: the sum of its
    point-to-point NVLink bandwidths (or its NVSwitch port bandwidth); when the set's fast links
    do not connect all of it, every ring crosses PCIe, and the slowest PCIe path among the GPUs
    that must cross it bounds it instead. Two GPUs: their link. Rank-order patterns are bounded
    by the slowest link one of their edges uses. ``efficiency`` is the share of that bound a
    tuned library reaches; it is an assumption, set in the model file (see docs/replay.md).
    """

    name: str
    efficiency: float
    pcie_efficiency: float
    description: str = ""

    def predict(self, graph: Any, gpus: tuple[int, ...], pattern: Any) -> float | None:
        if len(gpus) < 2 or not pattern.edges:
            return None
        if not pattern.scored_by_set:
            slowest = min(self._pair(graph, gpus[a], gpus[b]) for a, b in pattern.edges)
            return round(slowest, 6)
        if pattern.shape in RING_PACKED_SHAPES and len(gpus) >= 3:
            rate = max_ring_rate(graph, tuple(gpus))
            if rate is not None:
                return round(self.efficiency * rate, 6)
        components = self._fast_components(graph, gpus)
        if len(components) > 1:
            # Every ring leaves each fast island at least once: the island whose best way out is
            # slowest bounds the rings.
            best_exit = [
                max(self._pair(graph, a, b) for a in group for b in gpus if b not in group) for group in components
            ]
            return round(min(best_exit), 6)
        outgoing = []
        for a in gpus:
            point_to_point = 0.0
            switch = 0.0
            for b in gpus:
                if a == b:
                    continue
                link = graph.link(a, b)
                if link.kind == "nvswitch":
                    switch = max(switch, graph.bandwidths.of(link))
                elif link.kind != "pcie":
                    point_to_point += graph.bandwidths.of(link)
            outgoing.append(point_to_point + switch)
        return round(self.efficiency * min(outgoing), 6)

    def _pair(self, graph: Any, a: int, b: int) -> float:
        link = graph.link(a, b)
        if link.kind == "pcie":
            return self.pcie_efficiency * path_bandwidth(graph, link)
        return self.efficiency * graph.bandwidths.of(link)

    @staticmethod
    def _fast_components(graph: Any, gpus: tuple[int, ...]) -> list[list[int]]:
        left = list(gpus)
        groups = []
        while left:
            group = [left.pop(0)]
            grew = True
            while grew:
                grew = False
                for b in list(left):
                    if any(graph.link(a, b).kind != "pcie" for a in group):
                        group.append(b)
                        left.remove(b)
                        grew = True
            groups.append(group)
        return groups


@lru_cache(maxsize=None)
def best_completion(model: EffectiveBandwidthModel, allowed: tuple[int, ...], counts: tuple[int, ...], remaining: int) -> float:
    """The highest prediction reachable from ``counts`` by adding ``remaining`` edges of the ``allowed`` classes.

    The exact search uses it as an upper bound: the model is not monotone (e.g. on the paper's
    coefficients f(0,3,2) > f(4,0,1)), so no simpler bound is safe.
    """
    if remaining == 0:
        return model.predict(counts)
    best = float("-inf")
    for index in allowed:
        bumped = counts[:index] + (counts[index] + 1,) + counts[index + 1 :]
        best = max(best, best_completion(model, allowed, bumped, remaining - 1))
    return best
