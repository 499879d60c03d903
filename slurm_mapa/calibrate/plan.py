"""What to measure: one ring allocation per distinct combination of link-class counts.

The paper fitted its model on NCCL all-reduce over 31 allocations of a DGX-1: for every GPU
count, every combination of (double NVLink, single NVLink, PCIe) ring edges measured. NCCL
builds its own ring over the GPUs it is given, so what can be measured is one count vector per
GPU *set*: that of the ring NCCL takes (approximated as the order whose slowest link is fastest,
then the highest total bandwidth). ``make_plan`` walks every set of 2..N GPUs (a k-GPU ring
counts k edges; a 2-GPU ring counts its link twice) and keeps the first set (lowest GPU indices)
for each distinct count vector.

AMD nodes (xGMI): the same runs with rccl-tests (its ``all_reduce_perf`` prints what nccl-tests
prints), the GPUs given with ``HIP_VISIBLE_DEVICES``, and :func:`default_model` counting xGMI
bonds by their link count (``NV<n>`` selectors match a direct bond of n links of either fabric)
and relayed pairs (``XGMI0``) by their own bandwidth.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
from dataclasses import dataclass
from typing import Any

from ..core.effbw import EffectiveBandwidthModel
from ..core.server_models import bottleneck_model
from ..core.hardware import HardwareGraph
from ..core.links import DEFAULT_PCIE_PATH_FACTORS, PCIE_LEVELS, Link
from ..errors import InputError
from ..textfile import read_text

MAX_RINGS = 2_000_000  # ring orders walked before giving up (a 9-GPU server is ~100k)
NCCL_ARGS = "-b 8 -e 1G -f 2"


@dataclass(frozen=True)
class PlannedRun:
    id: str
    ring: tuple[int, ...]  # GPUs in ring order
    counts: tuple[int, ...]  # edges per model class

    @property
    def gpus(self) -> int:
        return len(self.ring)

    @property
    def file(self) -> str:
        return f"{self.id}.txt"


def has_xgmi(graph: HardwareGraph) -> bool:
    return any(graph.link(a, b).is_xgmi for a, b in graph.pairs())


def default_model(graph: HardwareGraph) -> EffectiveBandwidthModel:
    """The default (bottleneck) model of ``graph``: :func:`~slurm_mapa.core.server_models.bottleneck_model`,
    or on an xGMI node the same idea with selectors the model grammar reads: ``NV<n>`` for a
    direct bond of n links (of either fabric), ``SYS`` for a relayed pair (``XGMI0``, whose
    PCIe level is SYS) at its own bandwidth, PCIe levels as bottleneck_model scales them."""
    if not has_xgmi(graph):
        return bottleneck_model(graph)
    links = {graph.links[a][b] for a, b in graph.pairs()}
    same_pcie = len({graph.bandwidths.pcie[level] for level in PCIE_LEVELS}) == 1

    def bandwidth(link: Link) -> float:
        value = graph.bandwidths.of(link)
        if link.kind == "pcie" and not link.is_xgmi and same_pcie:
            value *= DEFAULT_PCIE_PATH_FACTORS.get(link.level, 1.0)
        return round(value, 6)

    by_selector: dict[str, float] = {}
    for link in links:
        if link.kind == "nvswitch":
            selector = f"NVS>={link.links}"
        elif link.kind == "nvlink":
            selector = f"NV{link.links}"
        else:
            selector = link.level
        # XGMI0 and a real SYS path share the SYS selector: the slower of the two counts.
        by_selector[selector] = min(by_selector.get(selector, float("inf")), bandwidth(link))
    ordered = sorted(by_selector.items(), key=lambda item: (-item[1], item[0]))
    return EffectiveBandwidthModel(
        name=f"bottleneck-{graph.name}",
        class_names=tuple(f"x{i + 1}" for i in range(len(ordered))),
        selectors=tuple((selector,) for selector, _ in ordered),
        terms=(),
        description=f"default bottleneck model of {graph.name} (xGMI: NV<n> counts bonds of n links, SYS relayed "
                    f"pairs): predicted bus bandwidth = the slowest link class the pattern uses",
        kind="bottleneck",
        class_bandwidths=tuple(value for _, value in ordered),
    )


@dataclass(frozen=True)
class Plan:
    topology: str
    class_names: tuple[str, ...]
    selectors: tuple[tuple[str, ...], ...]
    runs: tuple[PlannedRun, ...]
    vendor: str = "nvidia"  # "amd": rccl-tests, HIP_VISIBLE_DEVICES

    def as_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "vendor": self.vendor,
            "classes": {name: list(sel) for name, sel in zip(self.class_names, self.selectors)},
            "nccl_args": NCCL_ARGS,
            "allocations": [
                {"id": run.id, "gpus": run.gpus, "ring": list(run.ring), "counts": list(run.counts), "file": run.file}
                for run in self.runs
            ],
        }


def ring_counts(graph: HardwareGraph, model: EffectiveBandwidthModel, ring: tuple[int, ...]) -> tuple[int, ...]:
    counts = [0] * len(model.class_names)
    k = len(ring)
    for i in range(k):
        counts[model.classify(graph.link(ring[i], ring[(i + 1) % k]))] += 1
    return tuple(counts)


def _nccl_ring(subset: tuple[int, ...], speed: list[list[float]]) -> tuple[int, ...]:
    """The ring NCCL builds over ``subset``: the order whose slowest edge is fastest (its search
    maximises the per-channel bandwidth), then the highest total bandwidth, then the first found."""
    first, rest = subset[0], subset[1:]
    best: tuple[float, float] | None = None
    best_ring = subset
    for order in itertools.permutations(rest):
        if len(subset) > 2 and order[0] > order[-1]:
            continue  # the same ring walked backwards
        ring = (first, *order)
        edges = [speed[ring[i]][ring[(i + 1) % len(ring)]] for i in range(len(ring))]
        key = (min(edges), sum(edges))
        if best is None or key > best:
            best, best_ring = key, ring
    return best_ring


def _all_rings(subset: tuple[int, ...]):
    first, rest = subset[0], subset[1:]
    for order in itertools.permutations(rest):
        if len(subset) > 2 and order[0] > order[-1]:
            continue
        yield (first, *order)


def make_plan(
    graph: HardwareGraph,
    model: EffectiveBandwidthModel,
    *,
    max_gpus: int | None = None,
    min_gpus: int = 2,
    orders: str = "nccl",
) -> Plan:
    """``orders="nccl"``: one ring per GPU set, the one NCCL builds; ``"all"``: every ring order
    (count vectors NCCL will not reproduce unless its ring is forced, e.g. with NCCL_GRAPH_FILE)."""
    if orders not in ("nccl", "all"):
        raise InputError(f"ring orders {orders!r}: accepted nccl, all")
    top = graph.size if max_gpus is None else max_gpus
    if not 2 <= min_gpus <= top <= graph.size:
        raise InputError(f"GPU counts {min_gpus}..{top}: need 2 <= min <= max <= {graph.size} (the GPUs of {graph.name})")
    work = sum(math.comb(graph.size, k) * max(1, math.factorial(k - 1) // 2) for k in range(min_gpus, top + 1))
    if work > MAX_RINGS:
        raise InputError(
            f"{graph.name}: {work} ring orders for {min_gpus}..{top} GPUs is more than the {MAX_RINGS} this planner walks; "
            f"lower --max-gpus"
        )
    class_of = [[-1 if a == b else model.classify(graph.link(a, b)) for b in graph.gpus] for a in graph.gpus]
    default = default_model(graph)
    speed = [[0.0 if a == b else default.class_bandwidths[default.classify(graph.link(a, b))] for b in graph.gpus] for a in graph.gpus]
    runs: list[PlannedRun] = []
    for k in range(min_gpus, top + 1):
        seen: dict[tuple[int, ...], tuple[int, ...]] = {}
        for subset in itertools.combinations(graph.gpus, k):
            rings = [_nccl_ring(subset, speed)] if orders == "nccl" else _all_rings(subset)
            for ring in rings:
                counts = [0] * len(model.class_names)
                for i in range(k):
                    counts[class_of[ring[i]][ring[(i + 1) % k]]] += 1
                seen.setdefault(tuple(counts), ring)
        for index, (counts, ring) in enumerate(sorted(seen.items(), key=lambda item: (item[1], item[0]))):
            runs.append(PlannedRun(id=f"ring{k}-{index + 1:02d}", ring=ring, counts=counts))
    return Plan(topology=graph.name, class_names=model.class_names, selectors=model.selectors, runs=tuple(runs),
                vendor="amd" if has_xgmi(graph) else "nvidia")


def plan_from_dict(data: Any, *, source: str) -> Plan:
    try:
        classes = data["classes"]
        runs = tuple(
            PlannedRun(id=str(run["id"]), ring=tuple(int(g) for g in run["ring"]), counts=tuple(int(c) for c in run["counts"]))
            for run in data["allocations"]
        )
        plan = Plan(
            topology=str(data.get("topology", "")),
            class_names=tuple(classes),
            selectors=tuple(tuple(str(s) for s in sel) for sel in classes.values()),
            runs=runs,
            vendor=str(data.get("vendor", "nvidia")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise InputError(f"{source}: not a calibration plan (from `mapa calibrate plan --json`): {error}") from None
    if plan.vendor not in ("nvidia", "amd"):
        raise InputError(f"{source}: vendor {plan.vendor!r}; expected nvidia or amd")
    for run in plan.runs:
        if len(run.counts) != len(plan.class_names):
            raise InputError(f"{source}: allocation {run.id} has {len(run.counts)} counts for {len(plan.class_names)} classes")
    return plan


def load_plan(path: str) -> Plan:
    accepted = "the plan.json that `mapa calibrate plan --output-dir DIR` (or `--json`) wrote"
    text = read_text(path, what="plan", accepted=accepted)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not JSON: {error}; accepted: {accepted}") from None
    return plan_from_dict(data, source=path)


def format_plan(plan: Plan) -> str:
    lines = [f"calibration plan for {plan.topology}: {len(plan.runs)} allocations"]
    lines.append("classes: " + "; ".join(f"{n} = {'|'.join(s)}" for n, s in zip(plan.class_names, plan.selectors)))
    lines.append(f"{'id':<10} {'GPUs':>4}  {'ring':<24} counts ({', '.join(plan.class_names)})")
    for run in plan.runs:
        lines.append(f"{run.id:<10} {run.gpus:>4}  {','.join(map(str, run.ring)):<24} {','.join(map(str, run.counts))}")
    return "\n".join(lines)


def measurement_script(plan: Plan) -> str:
    """A bash script that runs all_reduce_perf on every planned allocation, one output file each
    (nccl-tests with CUDA_VISIBLE_DEVICES, or on AMD nodes rccl-tests with HIP_VISIBLE_DEVICES)."""
    amd = plan.vendor == "amd"
    library, tests, visible = ("RCCL", "rccl-tests", "HIP_VISIBLE_DEVICES") if amd else ("NCCL", "nccl-tests", "CUDA_VISIBLE_DEVICES")
    lines = [
        "#!/bin/bash",
        f"# Generated by `mapa calibrate plan` for {plan.topology}: {len(plan.runs)} {library} all-reduce runs.",
        "# Run it on an idle node (e.g. inside `salloc --exclusive --gres=gpu:N`), then:",
        "#   mapa calibrate fit --plan plan.json results/*.txt --output model.toml",
        f"# ALL_REDUCE_PERF: the {tests} binary; RESULTS: the output folder.",
        "set -euo pipefail",
        'ALL_REDUCE_PERF="${ALL_REDUCE_PERF:-all_reduce_perf}"',
        'RESULTS="${RESULTS:-results}"',
        'mkdir -p "$RESULTS"',
    ]
    for run in plan.runs:
        devices = ",".join(map(str, run.ring))
        out = f'"$RESULTS"/{shlex.quote(run.file)}'
        marker = f"# mapa-calibrate id={run.id} ring={devices} counts={','.join(map(str, run.counts))}"
        lines.append(f"echo {shlex.quote(marker)} > {out}")
        lines.append(f'NCCL_ALGO=Ring {visible}={devices} "$ALL_REDUCE_PERF" {NCCL_ARGS} -g {run.gpus} >> {out}')
    return "\n".join(lines) + "\n"
