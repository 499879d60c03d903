"""Bandwidth models held against public measurements (issue 49).

``data/measured/collectives.toml`` holds published nccl-tests / rccl-tests results on chosen GPU
sets of real servers (docs/measured.md). A point names the topology it can be judged on
(``judged_on``: a preset, or ``box:NAME`` for a topology file kept beside the points, with the
assumptions it rests on in the box's ``why``) and whether the models are held to it (``held``;
otherwise ``not_held`` says why: P2P turned off, links not shown, a source's own doubts). No
parameter of any model was fitted to these points: every held point is held out.

Pure: the text is parsed and judged here; reading the bundled file is :func:`bundled_reference`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..core.allocation import Request
from ..core.effbw import EffectiveBandwidthModel
from ..core.hardware import HardwareGraph
from ..core.patterns import make_pattern
from ..core.policies import order_within
from ..errors import InputError
from ..hardware.presets import PRESETS, preset
from ..hardware.topofile import graph_from_toml_text

MEASURED_FILE = Path(__file__).resolve().parent.parent / "data" / "measured" / "collectives.toml"
# A model agrees with a held point when its value is within this factor of the measured busbw,
# either way (issue 49's bound).
HELD_FACTOR = 1.4


@dataclass(frozen=True)
class JudgedPoint:
    """One measured point and a model's value for the same GPU set."""

    server: str
    judged_on: str  # a preset name or "box:NAME"
    gpus: tuple[int, ...]  # in judged_on's numbering
    measured: float  # busbw, GB/s
    predicted: float | None
    held: bool
    not_held: str
    order_group: str
    source: str

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.measured

    @property
    def agrees(self) -> bool:
        return self.ratio is not None and 1 / HELD_FACTOR <= self.ratio <= HELD_FACTOR


@dataclass(frozen=True)
class Reference:
    points: tuple[dict, ...]
    boxes: dict[str, HardwareGraph]
    why: dict[str, str]  # per box: what its topology assumes


def parse_reference(text: str) -> Reference:
    data = tomllib.loads(text)
    boxes, why = {}, {}
    for name, box in data.get("box", {}).items():
        boxes[name] = graph_from_toml_text(box["topology"], source=f"box {name}")
        why[name] = box.get("why", "")
    points = tuple(data.get("point", ()))
    for point in points:
        target = point.get("judged_on", "")
        if target and graph_for(target, boxes) is None:
            raise InputError(f"measured point {point['source']}: judged_on {target!r} names no preset or box "
                             f"(presets: {', '.join(PRESETS)}; boxes: {', '.join(boxes)})")
        if point.get("held") and not target:
            raise InputError(f"measured point {point['source']}: held but not judged_on a topology")
        if not point.get("held") and not point.get("not_held"):
            raise InputError(f"measured point {point['source']}: not held, and not_held does not say why")
    return Reference(points, boxes, why)


@lru_cache(maxsize=1)
def bundled_reference() -> Reference:
    return parse_reference(MEASURED_FILE.read_text(encoding="utf-8"))


def graph_for(target: str, boxes: dict[str, HardwareGraph]) -> HardwareGraph | None:
    if target.startswith("box:"):
        return boxes.get(target[4:])
    return preset(target) if target in PRESETS else None


def model_value(graph: HardwareGraph, gpus: tuple[int, ...], model: Any) -> float | None:
    """``model``'s all-reduce bandwidth for exactly ``gpus``: a judge (``predict(graph, gpus,
    pattern)``) directly, a ranking model by the best ring order on the set, as Preserve scores it."""
    pattern = make_pattern("ring", len(gpus))
    if isinstance(model, EffectiveBandwidthModel):
        request = Request(pattern, True)
        return order_within("measured", graph, gpus, gpus, request, model).placement.effective_bandwidth
    return model.predict(graph, gpus, pattern)


def judge_points(reference: Reference, model: Any, *, models_by_graph: Any = None) -> list[JudgedPoint]:
    """Every point judged on a topology, valued by ``model`` (or, with ``models_by_graph``, by the
    model that function gives each graph: e.g. each server's default ranking model)."""
    judged = []
    for point in reference.points:
        target = point.get("judged_on", "")
        if not target:
            continue
        graph = graph_for(target, reference.boxes)
        gpus = tuple(point["judged_gpus"])
        chosen = models_by_graph(graph) if models_by_graph is not None else model
        try:
            value = model_value(graph, gpus, chosen)
        except InputError:  # a model file for other servers: it has no class for this box's links
            value = None
        judged.append(JudgedPoint(point["server"], target, gpus, float(point["busbw_gbs"]), value,
                                  bool(point.get("held")), point.get("not_held", ""), point.get("order_group", ""),
                                  point["source"]))
    return judged


def held_ratios(judged: list[JudgedPoint]) -> tuple[float, float, int] | None:
    """(lowest, highest ratio, how many) over the held points with a value; None if none."""
    ratios = [p.ratio for p in judged if p.held and p.ratio is not None]
    return (min(ratios), max(ratios), len(ratios)) if ratios else None


def order_disagreements(judged: list[JudgedPoint]) -> list[tuple[JudgedPoint, JudgedPoint]]:
    """Pairs of points of one order group (one server, one setting) and one size that the model
    orders against the measurements (a tie measured or modelled is no disagreement)."""
    found = []
    for i, a in enumerate(judged):
        for b in judged[i + 1:]:
            if not a.order_group or a.order_group != b.order_group or len(a.gpus) != len(b.gpus):
                continue
            if a.predicted is None or b.predicted is None:
                continue
            measured, modelled = a.measured - b.measured, a.predicted - b.predicted
            if measured * modelled < 0:
                found.append((a, b))
    return found


def table_rows(judged: list[JudgedPoint]) -> list[tuple[str, ...]]:
    """Markdown-ready rows: server, judged on, GPUs, measured, model, ratio, held (or why not)."""
    rows = []
    for p in judged:
        ratio = "" if p.ratio is None else f"{p.ratio:.2f}"
        predicted = "" if p.predicted is None else f"{p.predicted:.1f}"
        rows.append((p.server, p.judged_on, ",".join(map(str, p.gpus)), f"{p.measured:g}", predicted, ratio,
                     "held" if p.held else f"shown only: {p.not_held}"))
    return rows


@lru_cache(maxsize=8)
def error_against_measured(model: Any) -> dict | None:
    """``model`` against the bundled held points: {"low", "high", "points", "outside"} (its lowest and
    highest ratio to the measured busbw, how many points, how many outside HELD_FACTOR); None if none."""
    judged = judge_points(bundled_reference(), model)
    summary = held_ratios(judged)
    if summary is None:
        return None
    low, high, count = summary
    return {"low": round(low, 3), "high": round(high, 3), "points": count,
            "outside": sum(1 for p in judged if p.held and not p.agrees)}


def markdown_rows(judged: list[JudgedPoint]) -> list[str]:
    """The table docs/replay.md shows (one row per point judged), server linked to its source."""
    return [f"| {server} ([source]({p.source})) | {judged_on} | {gpus} | {measured} | {predicted} | {ratio} | {held} |"
            for p, (server, judged_on, gpus, measured, predicted, ratio, held) in zip(judged, table_rows(judged))]

