"""Which model prices a server: the default bottleneck model of a hardware graph, the model
derived from a server's links and the paper's DGX-1 efficiency curve, the bundled model that
matches a topology, and whether a prediction lies outside the range a model was fitted on.

Imports :mod:`.effbw` (the model types), :mod:`.model_files` (the bundled models) and :mod:`.links`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Mapping

from .effbw import EffectiveBandwidthModel
from .links import DEFAULT_PCIE_PATH_FACTORS, Link, path_bandwidth
from .model_files import REPRODUCTION_ONLY, bundled_model, bundled_model_basis, bundled_model_names, paper_model


def _selector(link: Link) -> str:
    """The class selector that stands for exactly ``link`` when classes are tried widest first (an xGMI bond
    counts by its link count, as NV<n>; a relayed xGMI pair by its PCIe level)."""
    if link.kind == "nvswitch":
        return f"NVS>={link.links}"
    if link.kind == "nvlink":
        return f"NV{link.links}"
    return link.level


def bottleneck_model(graph: Any, *, pcie_factors: Mapping[str, float] | None = None, name: str | None = None) -> EffectiveBandwidthModel:
    """The default model for ``graph``: one class per link class present, with its bandwidth.

    NVLink and NVSwitch classes take the graph's bandwidth (``graph.bandwidths``); PCIe levels
    take it times :data:`DEFAULT_PCIE_PATH_FACTORS` when the graph does not tell the levels apart.
    """
    links = {graph.links[a][b] for a, b in graph.pairs()}

    def bandwidth(link: Link) -> float:
        return round(path_bandwidth(graph, link, pcie_factors), 6)

    # Widest first: with first-match classification NVS>=n then stands for exactly NVS<n>.
    ordered = sorted(links, key=lambda link: (-bandwidth(link), link.kind, -link.links, link.level))
    selectors = [(_selector(link),) for link in ordered]
    return EffectiveBandwidthModel(
        name=name or f"bottleneck-{graph.name}",
        class_names=tuple(f"x{i + 1}" for i in range(len(ordered))),
        selectors=tuple(selectors),
        terms=(),
        description=f"default bottleneck model of {graph.name}: predicted bus bandwidth = the slowest link class the pattern uses",
        kind="bottleneck",
        class_bandwidths=tuple(bandwidth(link) for link in ordered),
    )


# --- the fitted range, and which model prices a server ---------------------------------------


def _fitted_link_entry(model: EffectiveBandwidthModel, link: Link, bandwidth: float) -> bool:
    """Whether ``link`` at ``bandwidth`` GB/s is one of the link classes the model's numbers were taken on."""
    for token, fitted in model.fitted_links:
        if token == link.token or (token == "PCIE" and link.kind == "pcie" and not link.is_xgmi):
            if abs(fitted - bandwidth) <= 1e-6 * max(1.0, fitted):
                return True
    return False


def out_of_range(model: EffectiveBandwidthModel, graph: Any, gpus: tuple[int, ...], pattern: Any) -> tuple[str, ...]:
    """Why a prediction of ``model`` for ``pattern`` on ``gpus`` (in pattern order) is an extrapolation; () when
    it lies inside the model's fitted range: its pattern sizes (``fitted_gpus``), edge counts
    (``fitted_edges``) and link classes (``fitted_links``). A range the model does not state is not checked."""
    if len(gpus) < 2 or not pattern.edges:
        return ()
    reasons = []
    if model.fitted_gpus is not None and not model.fitted_for(len(gpus)):
        low, high = model.fitted_gpus
        reasons.append(f"{len(gpus)} GPUs (fitted on {low}-{high})")
    edges = len(pattern.edges)
    said = bool(reasons) and edges == len(gpus)  # a ring's edges are its GPUs: said once
    if model.fitted_edges is not None and not model.fitted_edges[0] <= edges <= model.fitted_edges[1] and not said:
        low, high = model.fitted_edges
        reasons.append(f"{edges} pattern edges (fitted on {low}-{high})")
    if model.fitted_links:
        outside = []
        for a, b in pattern.edges:
            link = graph.link(gpus[a], gpus[b])
            text = f"{link.token} at {graph.bandwidths.of(link):g} GB/s"
            if text not in outside and not _fitted_link_entry(model, link, graph.bandwidths.of(link)):
                outside.append(text)
        if outside:
            fitted = ", ".join(f"{token} {value:g}" for token, value in model.fitted_links)
            reasons.append(f"link {', '.join(sorted(outside))} (fitted on {fitted})")
    return tuple(reasons)


def covers(model: EffectiveBandwidthModel, graph: Any) -> int | None:
    """How many of the model's fitted link classes ``graph`` does not use, when the model was fitted on every
    link class of ``graph`` (at the graph's bandwidths); None when it was not (or states no links)."""
    if not model.fitted_links:
        return None
    used: set[str] = set()
    for a, b in graph.pairs():
        link = graph.link(a, b)
        bandwidth = graph.bandwidths.of(link)
        match = next((token for token, fitted in model.fitted_links
                      if (token == link.token or (token == "PCIE" and link.kind == "pcie" and not link.is_xgmi))
                      and abs(fitted - bandwidth) <= 1e-6 * max(1.0, fitted)), None)
        if match is None:
            return None
        used.add(match)
    return len(model.fitted_links) - len(used)


@lru_cache(maxsize=256)
def default_model(graph: Any) -> EffectiveBandwidthModel:
    """The model a policy ranks ``graph``'s GPU sets by when it is given none: :func:`matching_model`
    (a preset's own numbers; hardware.load.model_for_topology also gives a preset its file's name)."""
    return matching_model(graph)


def matching_model(graph: Any) -> EffectiveBandwidthModel:
    """The bundled model fitted or published on exactly this server's link classes (at its bandwidths),
    else the one fitted on the fewest others besides them, else a model derived for it
    (:func:`derived_model`). Between models that cover it equally, a fitted one beats a published
    one. The paper's regression (REPRODUCTION_ONLY) and the presets' derived files are never matched."""
    rank = {"fitted": 0, "published": 1, "": 2}
    best: tuple[int, int, str] | None = None
    for name in bundled_model_names():
        # The paper's regression reproduces the paper; it ranks no server by default (it is not
        # monotone in link quality: docs/engine.md). A bundled derived model is its preset's: any
        # other server gets one derived for it (same numbers for the same links, its own name).
        # Both are passed over before their whole files are parsed (only the basis is read).
        if name in REPRODUCTION_ONLY or bundled_model_basis(name) not in rank:
            continue
        model = bundled_model(name)
        extra = covers(model, graph)
        if extra is not None and (best is None or (extra, rank[model.basis], name) < best):
            best = (extra, rank[model.basis], name)
    return bundled_model(best[2]) if best else derived_model(graph)


# The fitted DGX-1 efficiency curve: the paper's model for a k-GPU ring on one link class of the
# DGX-1 V100, divided by that class's bandwidth there (Table 1: double NVLink 2 50 GB/s, single
# 25, PCIe 12), for k = 2..5, the ring sizes it was fitted on. A derived model multiplies a
# server's link bandwidths by it, so its numbers are on the paper's scale (its 2-GPU ring on a
# 50 GB/s double NVLink is 58.9); beyond 5 edges the 5-edge value is kept (the regression itself
# grows past the links' physical bound there) and marked as an extrapolation.
_CURVE_EDGES = (2, 3, 4, 5)


def dgx1_efficiency(reference_class: int, edges: int) -> float:
    """The paper model's prediction for ``edges`` edges all of class ``reference_class`` (0: double NVLink, 1: single
    NVLink, 2: PCIe), per GB/s of that class's DGX-1 V100 link."""
    paper = paper_model()
    counts = tuple(edges if index == reference_class else 0 for index in range(len(paper.class_names)))
    return paper.predict(counts) / dict(paper.fitted_links)[("NV2", "NV1", "PCIE")[reference_class]]


def _reference_class(link: Link) -> int:
    """Which DGX-1 link class a link takes its efficiency curve from: bonds of 2+ links and switches the double
    NVLink's, a single link the single NVLink's, a pair without a direct link (PCIe, relayed xGMI) PCIe's."""
    if link.kind == "pcie":
        return 2
    return 0 if link.links >= 2 else 1


def relative_path_factors(graph: Any) -> dict[str, float]:
    """DEFAULT_PCIE_PATH_FACTORS divided by that of the best PCIe level among ``graph``'s pairs (so
    that level keeps the graph's bandwidth and each slower level is scaled below it)."""
    levels = {graph.link(a, b).level for a, b in graph.pairs() if graph.link(a, b).kind == "pcie"}
    known = [DEFAULT_PCIE_PATH_FACTORS[level] for level in levels if level in DEFAULT_PCIE_PATH_FACTORS]
    if not known:
        return {}
    best = max(known)
    return {level: factor / best for level, factor in DEFAULT_PCIE_PATH_FACTORS.items()}


def derived_model(graph: Any, *, name: str | None = None) -> EffectiveBandwidthModel:
    """A model for ``graph`` from its links' bandwidths and the fitted DGX-1 efficiency curve (``basis = "derived"``).

    One class per link class of the graph, widest first (as :func:`bottleneck_model`, but PCIe
    levels at the graph's own bandwidths, unscaled); each class's GB/s at k = 2..5 edges is its bandwidth x :func:`dgx1_efficiency`
    of its reference class; a pattern gets its slowest used class's value at its edge count.
    """
    # PCIe paths in order (PIX > PXB > PHB > NODE > SYS, as NCCL and nvidia-smi order them): when
    # the graph gives every level the same bandwidth, the best level present keeps it and each
    # slower one is scaled down by DEFAULT_PCIE_PATH_FACTORS relative to it. A server with one
    # level only keeps the graph's bandwidth: the DGX-1's PCIe curve was measured on its own paths
    # (all SYS) counted at 12 GB/s, as the paper's Table 1 does.
    factors = relative_path_factors(graph)
    base = bottleneck_model(graph, pcie_factors=factors)
    links = {graph.link(a, b) for a, b in graph.pairs()}
    curves = []
    for selectors, bandwidth in zip(base.selectors, base.class_bandwidths):
        link = next(link for link in sorted(links) if _selector(link) == selectors[0] and
                    round(path_bandwidth(graph, link, factors), 6) == bandwidth)
        reference = _reference_class(link)
        curves.append(tuple((k, round(bandwidth * dgx1_efficiency(reference, k), 3)) for k in _CURVE_EDGES))
    fitted_links = tuple(sorted({(link.token, graph.bandwidths.of(link)) for link in links}))
    return replace(
        base,
        name=name or f"derived-{graph.name}",
        description=f"derived for {graph.name}: link bandwidths x the DGX-1 efficiency curve of the MAPA paper's model",
        class_bandwidths=tuple(max(v for _, v in curve) for curve in curves),
        class_curves=tuple(curves),
        fitted_gpus=(_CURVE_EDGES[0], _CURVE_EDGES[-1]),
        fitted_edges=(_CURVE_EDGES[0], _CURVE_EDGES[-1]),
        fitted_links=fitted_links,
        basis="derived",
    )
