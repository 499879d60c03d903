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

Owns the effective-bandwidth models; imports only :mod:`.links`.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError
from .links import PCIE_LEVELS, Link

_PRODUCT = r"x[0-9]+(?:\*x[0-9]+)*"
_TERM = re.compile(rf"^(?:(?P<product>{_PRODUCT})|1/\((?P<inverse>{_PRODUCT})\+1\))$")
MODEL_KINDS = ("regression", "bottleneck")
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


def model_from_dict(data: Mapping[str, Any], *, source: str = "model") -> EffectiveBandwidthModel:
    """Build a model from the parsed TOML of a model file, with errors that name ``source``."""
    classes = data.get("classes")
    terms = data.get("terms")
    kind = data.get("kind", "regression")
    if kind not in MODEL_KINDS:
        raise InputError(f"{source}: unknown model kind {kind!r} (accepted: {', '.join(MODEL_KINDS)})")
    if not isinstance(classes, Mapping) or not classes:
        raise InputError(f"{source}: needs a [classes] table, e.g. x1 = [\"NV>=2\", \"NVS\"]")
    fitted = _fitted_range(data.get("fitted_gpus"), source, "fitted_gpus", "GPU counts")
    metadata = {
        "fitted_gpus": fitted,
        "fitted_edges": _fitted_range(data.get("fitted_edges"), source, "fitted_edges", "edge counts"),
        "fitted_links": _fitted_links(data.get("fitted_links"), source),
        "basis": _basis(data.get("basis"), source),
    }
    if kind == "bottleneck":
        model = _bottleneck_from_dict(data, classes, source=source)
        if model.class_curves and metadata["fitted_edges"] is None:
            # A curve's points are the edge counts it was built on: beyond them it is flat, an extrapolation.
            points = [edges for curve in model.class_curves for edges, _ in curve]
            metadata["fitted_edges"] = (min(points), max(points))
        return replace(model, **metadata)
    if not isinstance(terms, Mapping) or not terms:
        raise InputError(f"{source}: needs a [terms] table of term = coefficient, e.g. \"x1*x2\" = -7.97")
    names, selectors = _parse_classes(classes, source=source)
    parsed: list[Term] = []
    for text, coefficient in terms.items():
        match = _TERM.match(text.replace(" ", ""))
        if not match:
            raise InputError(f"{source}: unknown term {text!r} (accepted: products like x1*x2 or inverses like 1/(x1*x2+1))")
        product = match.group("product") or match.group("inverse")
        variables = tuple(int(v[1:]) - 1 for v in product.split("*"))
        for index in variables:
            if not 0 <= index < len(names):
                raise InputError(f"{source}: term {text!r} uses x{index + 1}, but only {', '.join(names)} are defined")
        if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)):
            raise InputError(f"{source}: term {text!r} needs a number, got {coefficient!r}")
        parsed.append(Term(variables=variables, inverse=match.group("inverse") is not None, coefficient=float(coefficient)))
    return EffectiveBandwidthModel(
        name=str(data.get("name", source)),
        class_names=names,
        selectors=selectors,
        terms=tuple(parsed),
        description=str(data.get("description", "")),
        **metadata,
    )


MODEL_BASES = ("fitted", "published", "derived")
_LINK_TOKEN = re.compile(r"^(?:NVS?[1-9][0-9]?|XGMI(?:0|[1-9][0-9]?)|PCIE|PIX|PXB|PHB|NODE|SYS)$")


def _fitted_range(value: Any, source: str, key: str, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
        or value[0] > value[1]
    ):
        raise InputError(f"{source}: {key} must be [LOW, HIGH], two {what} with LOW <= HIGH (e.g. [2, 5]), got {value!r}")
    return (value[0], value[1])


def _fitted_links(value: Any, source: str) -> tuple[tuple[str, float], ...]:
    """``[fitted_links]``: link token = the GB/s that link had where the model's numbers were taken."""
    if value is None:
        return ()
    accepted = "a table of link token = GB/s, e.g. NV2 = 50.0, NVS12 = 300.0, XGMI4 = 200.0, PCIE = 12.0 (any PCIe level)"
    if not isinstance(value, Mapping) or not value:
        raise InputError(f"{source}: fitted_links must be {accepted}; got {value!r}")
    links = []
    for token, bandwidth in value.items():
        if not _LINK_TOKEN.match(token):
            raise InputError(f"{source}: fitted_links: unknown link token {token!r} ({accepted})")
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise InputError(f"{source}: fitted_links: {token} needs a positive number of GB/s, got {bandwidth!r}")
        links.append((token, float(bandwidth)))
    return tuple(links)


def _basis(value: Any, source: str) -> str:
    if value is None:
        return ""
    if value not in MODEL_BASES:
        raise InputError(f"{source}: basis must be one of {', '.join(MODEL_BASES)} (how its numbers were obtained), got {value!r}")
    return str(value)


def _parse_classes(classes: Mapping[str, Any], *, source: str) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    names = tuple(classes)
    expected = tuple(f"x{i + 1}" for i in range(len(names)))
    if names != expected:
        raise InputError(f"{source}: classes must be named {', '.join(expected)} in that order, got {', '.join(names)}")
    selectors: list[tuple[str, ...]] = []
    for name, values in classes.items():
        if not isinstance(values, list) or not values:
            raise InputError(f"{source}: class {name} must be a non-empty list of link selectors")
        for value in values:
            if not isinstance(value, str) or not _SELECTOR.match(value):
                raise InputError(
                    f"{source}: class {name}: unknown link selector {value!r} "
                    f"(accepted: NV<n>, NV>=<n>, NVS, NVS>=<n>, PCIE, {', '.join(PCIE_LEVELS)})"
                )
        selectors.append(tuple(values))
    return names, tuple(selectors)


def _bottleneck_from_dict(data: Mapping[str, Any], classes: Mapping[str, Any], *, source: str) -> EffectiveBandwidthModel:
    names, selectors = _parse_classes(classes, source=source)
    bandwidths = data.get("bandwidths")
    if not isinstance(bandwidths, Mapping) or set(bandwidths) != set(names):
        raise InputError(f"{source}: a bottleneck model needs a [bandwidths] table with one GB/s value per class ({', '.join(names)})")
    if data.get("terms"):
        raise InputError(f"{source}: a bottleneck model has no [terms] (it predicts the slowest used class's bandwidth)")
    values: list[float] = []
    curves: list[tuple[tuple[int, float], ...]] = []
    for name in names:
        value = bandwidths[name]
        if isinstance(value, Mapping):
            curve = _curve(value, f"{source}: bandwidth of {name}")
            curves.append(curve)
            values.append(max(v for _, v in curve))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"{source}: bandwidth of {name} must be a positive number of GB/s or a table of edges = GB/s "
                             f"(e.g. {{ 2 = 208.0, 8 = 232.5 }}), got {value!r}")
        values.append(float(value))
        curves.append(())
    return EffectiveBandwidthModel(
        name=str(data.get("name", source)),
        class_names=names,
        selectors=selectors,
        terms=(),
        description=str(data.get("description", "")),
        kind="bottleneck",
        class_bandwidths=tuple(values),
        class_curves=tuple(curves) if any(curves) else (),
    )


def _curve(table: Mapping[str, Any], where: str) -> tuple[tuple[int, float], ...]:
    accepted = "a table of edge count = GB/s, e.g. { 2 = 208.0, 8 = 232.5 } (a k-GPU ring has k edges)"
    points = []
    for key, value in table.items():
        if not str(key).isdigit() or not 1 <= int(key) <= 4096:
            raise InputError(f"{where}: {key!r} is not an edge count ({accepted})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"{where}: {key} edges needs a positive number of GB/s, got {value!r} ({accepted})")
        points.append((int(key), float(value)))
    if not points:
        raise InputError(f"{where}: an empty table ({accepted})")
    return tuple(sorted(points))


# How much of a PCIe link's nominal bandwidth a GPU-to-GPU transfer gets, by path. Applied by
# bottleneck_model() only when the graph gives every PCIe level the same bandwidth (the default):
# a site that configured per-level bandwidths has already said what each path delivers.
#   PIX/PXB: peer-to-peer through PCIe switches only, full link rate.
#   PHB: through the CPU's root complex; P2P still works but the root port is shared (~0.8).
#   NODE: between host bridges of one socket; P2P often crosses the CPU's internal fabric (~0.6).
#   SYS: across the socket interconnect (QPI/UPI/xGMI); NCCL disables P2P there by default and
#        stages through host memory, roughly halving the rate again (~0.35).
DEFAULT_PCIE_PATH_FACTORS: dict[str, float] = {"PIX": 1.0, "PXB": 0.9, "PHB": 0.8, "NODE": 0.6, "SYS": 0.35}


def _path_bandwidth(graph: Any, link: Link, pcie_factors: Mapping[str, float] | None = None) -> float:
    """The graph's bandwidth of ``link``, a PCIe level's times its path factor when the graph gives every level the same."""
    factors = DEFAULT_PCIE_PATH_FACTORS if pcie_factors is None else pcie_factors
    value = graph.bandwidths.of(link)
    if link.kind == "pcie" and len({graph.bandwidths.pcie[level] for level in PCIE_LEVELS}) == 1:
        value *= factors.get(link.level, 1.0)
    return value


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
        return round(_path_bandwidth(graph, link, pcie_factors), 6)

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


def model_to_toml(model: EffectiveBandwidthModel, *, comments: tuple[str, ...] = ()) -> str:
    """The model file text for ``model`` (loads back to an equal model)."""
    lines = [f"# {line}" if line else "#" for line in comments]
    lines.append(f"name = {_toml_string(model.name)}")
    if model.description:
        lines.append(f"description = {_toml_string(model.description)}")
    if model.kind != "regression":
        lines.append(f"kind = {_toml_string(model.kind)}")
    if model.basis:
        lines.append(f"basis = {_toml_string(model.basis)}")
    if model.fitted_gpus is not None:
        lines.append(f"fitted_gpus = [{model.fitted_gpus[0]}, {model.fitted_gpus[1]}]")
    if model.fitted_edges is not None:
        lines.append(f"fitted_edges = [{model.fitted_edges[0]}, {model.fitted_edges[1]}]")
    if model.fitted_links:
        lines += ["", "[fitted_links]"]
        lines += [f"{token} = {value!r}" for token, value in model.fitted_links]
    lines += ["", "[classes]"]
    for name, selectors in zip(model.class_names, model.selectors):
        lines.append(f"{name} = [{', '.join(_toml_string(s) for s in selectors)}]")
    if model.kind == "bottleneck":
        lines += ["", "[bandwidths]"]
        curves = model.class_curves or ((),) * len(model.class_names)
        for name, value, curve in zip(model.class_names, model.class_bandwidths, curves):
            if curve:
                lines.append(f"{name} = {{ {', '.join(f'{edges} = {gbps!r}' for edges, gbps in curve)} }}")
            else:
                lines.append(f"{name} = {value!r}")
    else:
        lines += ["", "[terms]"]
        for term in model.terms:
            lines.append(f"{_toml_string(term_text(term))} = {term.coefficient!r}")
    return "\n".join(lines) + "\n"


def term_text(term: Term) -> str:
    product = "*".join(f"x{index + 1}" for index in term.variables)
    return f"1/({product}+1)" if term.inverse else product


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_model_text(text: str, *, source: str) -> EffectiveBandwidthModel:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{source}: not valid TOML: {error}") from None
    return model_from_dict(data, source=source)


def load_model_file(path: str) -> EffectiveBandwidthModel:
    """A model file named by an admin (``--model``, the hooks' ``model`` key)."""
    from ..textfile import read_text  # strict UTF-8, one-line errors (never a decode traceback)

    accepted = "a UTF-8 TOML model file with [classes] and [terms] or [bandwidths] (docs/calibration.md)"
    return load_model_text(read_text(path, what="model file", accepted=accepted), source=path)


_MODELS_DIR = Path(__file__).resolve().parent.parent / "data" / "models"
GROUNDED_MODEL_FILE = "link-bound.toml"


@lru_cache(maxsize=None)
def paper_model() -> EffectiveBandwidthModel:
    """The MAPA paper's DGX-1 V100 model, shipped as package data."""
    # A path next to the package, not importlib.resources: the Prolog pays for every import.
    text = (_MODELS_DIR / "mapa-dgx1-v100.toml").read_text()
    return load_model_text(text, source="mapa-dgx1-v100.toml")


def bundled_model_names() -> list[str]:
    """Names of the model files shipped with the package (``--model NAME``)."""
    return sorted(p.stem for p in _MODELS_DIR.glob("*.toml") if p.name != GROUNDED_MODEL_FILE)


def load_model(name_or_path: str) -> EffectiveBandwidthModel:
    """A model file by path, or a bundled model by name (``mapa-dgx1-v100``, ``bottleneck-generic``)."""
    if os.path.isfile(name_or_path):
        return load_model_file(name_or_path)
    stem = name_or_path[:-5] if name_or_path.endswith(".toml") else name_or_path
    if stem == GROUNDED_MODEL_FILE[:-5]:
        raise InputError(
            f"model {name_or_path!r} is the link-bound reporting model: it scores a chosen GPU set but cannot rank "
            f"placements (accepted: a model file or one of {', '.join(bundled_model_names())})"
        )
    if stem in bundled_model_names():
        return bundled_model(stem)
    raise InputError(f"no model file or bundled model {name_or_path!r} (accepted: a model file path or one of {', '.join(bundled_model_names())})")


@lru_cache(maxsize=None)
def bundled_model(name: str) -> EffectiveBandwidthModel:
    """A model shipped in ``data/models`` by its name (the file's stem), read once."""
    if name == "mapa-dgx1-v100":
        return paper_model()
    return load_model_text((_MODELS_DIR / f"{name}.toml").read_text(), source=f"{name}.toml")


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


def matching_model(graph: Any) -> EffectiveBandwidthModel:
    """The bundled model fitted on exactly this server's link classes (at its bandwidths), else the one fitted
    on the fewest others besides them, else a model derived for it (:func:`derived_model`). Between models
    that cover it equally, a fitted one beats a published one, which beats a derived one."""
    rank = {"fitted": 0, "published": 1, "": 2, "derived": 3}
    best: tuple[int, int, str] | None = None
    for name in bundled_model_names():
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


def derived_model(graph: Any, *, name: str | None = None) -> EffectiveBandwidthModel:
    """A model for ``graph`` from its links' bandwidths and the fitted DGX-1 efficiency curve (``basis = "derived"``).

    One class per link class of the graph, widest first (as :func:`bottleneck_model`, but PCIe
    levels at the graph's own bandwidths, unscaled); each class's GB/s at k = 2..5 edges is its bandwidth x :func:`dgx1_efficiency`
    of its reference class; a pattern gets its slowest used class's value at its edge count.
    """
    # No PCIe path factors: the DGX-1's PCIe curve was measured on its own paths (all SYS) counted at
    # 12 GB/s, so every level takes the graph's own PCIe bandwidth, as the paper's Table 1 does.
    base = bottleneck_model(graph, pcie_factors={})
    links = {graph.link(a, b) for a, b in graph.pairs()}
    curves = []
    for selectors, bandwidth in zip(base.selectors, base.class_bandwidths):
        link = next(link for link in sorted(links) if _selector(link) == selectors[0] and
                    round(_path_bandwidth(graph, link, {}), 6) == bandwidth)
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


@dataclass(frozen=True)
class LinkBoundModel:
    """A physically grounded estimate of the bus bandwidth a job gets, from its links alone.

    Collectives (``Pattern.scored_by_set``): NCCL and RCCL run several rings at once over every
    link among the job's GPUs, and in a ring all-reduce each GPU sends at the bus bandwidth, so
    the bus bandwidth is at most the slowest GPU's outgoing bandwidth to the rest of the set: the
    sum of its point-to-point NVLink bandwidths (or its NVSwitch port bandwidth). When the set's
    fast links do not connect all of it, every ring crosses PCIe, and the slowest PCIe path among
    the GPUs that must cross it bounds it instead. Rank-order patterns are bounded by the slowest
    link one of their edges uses. ``efficiency`` is the share of that bound a tuned library
    reaches; it is an assumption, set in the model file (see docs/replay.md).
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
        value = graph.bandwidths.of(link)
        if link.kind == "pcie":
            pcie_values = {graph.bandwidths.pcie[level] for level in PCIE_LEVELS}
            if len(pcie_values) == 1:
                value *= DEFAULT_PCIE_PATH_FACTORS.get(link.level, 1.0)
            return self.pcie_efficiency * value
        return self.efficiency * value

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
def grounded_model() -> LinkBoundModel:
    """The link-bound model shipped as ``data/models/link-bound.toml``."""
    path = _MODELS_DIR / GROUNDED_MODEL_FILE
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{path}: not valid TOML: {error}") from None
    values = []
    for key in ("efficiency", "pcie_efficiency"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise InputError(f"{path}: {key} must be a fraction in (0, 1], got {value!r}")
        values.append(float(value))
    return LinkBoundModel(name=str(data.get("name", "link-bound")), efficiency=values[0], pcie_efficiency=values[1],
                          description=str(data.get("description", "")))


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
