"""Ring rates by look-up (issue 49): the ring rate of every GPU set of a topology computed once, not
in a decision.

A sensitive ring job's tie-break (:mod:`.ring_choice`) reads the ring rate of each candidate set,
a linear programme (:func:`.ring_packing.solve_ring_rate`) that needs numpy. For the bundled
presets of up to 8 GPUs every set's rate ships as a table in ``data/ring_rates/<preset>.json``
(written by ``scripts/ring-rate-tables``, checked against the programme by
tests/core/test_ring_rate_tables.py), read with json alone, once per process. A table is keyed by
the graph's :func:`fingerprint`, a digest of what the programme reads (every pair's link family
and bandwidths, the PCIe port), so it applies to any graph with those links, whatever its name
(a topology file of a DGX-1), and never to another topology.

Graphs with no table get their rates solved per set, once per orbit: an automorphism of the graph
keeps every link class, so a set and its images have one rate, and :func:`canonical_set` names
one set per orbit under the automorphisms :func:`.symmetry.graph_automorphisms` finds.

Owns fingerprint, shipped_table, table_rows and canonical_set; imports :mod:`.links` and
:mod:`.symmetry`; its only read is the package's own data directory.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import Any, Callable

from .hardware import HardwareGraph
from .links import path_bandwidth

TABLES_DIR = Path(__file__).resolve().parent.parent / "data" / "ring_rates"
TABLE_FORMAT = "ring-rates-2"  # 2: SYS hops share the SMP interconnect (issue 49)
MIN_SET, MAX_TABLE_SET = 3, 8  # a table holds every set of 3 to min(8, n) GPUs
MAX_GROUP = 256  # automorphisms kept per graph for canonical_set (any subset of the group is sound)


@lru_cache(maxsize=64)
def fingerprint(graph: HardwareGraph) -> str:
    """A digest of everything the ring-rate programme reads of ``graph``: per GPU pair its link
    family, bandwidth and path bandwidth, and the PCIe port (the widest PCIe level). The name,
    domains and CPU affinity do not change a rate, so they are left out."""
    bandwidths = graph.bandwidths
    pairs = []
    for a, b in graph.pairs():
        link = graph.link(a, b)
        pairs.append([a, b, link.kind, bandwidths.of(link), path_bandwidth(graph, link)])
    content = {"format": TABLE_FORMAT, "gpus": graph.size, "pcie_port": max(bandwidths.pcie.values()), "pairs": pairs}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def set_key(gpus: tuple[int, ...]) -> str:
    """A set as a table writes it: its GPUs ascending, comma-separated."""
    return ",".join(map(str, sorted(gpus)))


@lru_cache(maxsize=1)
def _shipped() -> dict[str, dict[str, float]]:
    """Every shipped table's rows by fingerprint, read once per process (json alone: no numpy)."""
    tables: dict[str, dict[str, float]] = {}
    if not TABLES_DIR.is_dir():
        return tables
    for path in sorted(TABLES_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") == TABLE_FORMAT:
            tables[data["fingerprint"]] = data["rates"]
    return tables


@lru_cache(maxsize=64)
def _table_by_mask(graph: HardwareGraph) -> dict[int, float] | None:
    rows = _shipped().get(fingerprint(graph))
    if rows is None:
        return None
    # Bit masks, so a look-up needs no string (only the table a graph matches is converted).
    return {sum(1 << int(g) for g in key.split(",")): float(rate) for key, rate in rows.items()}


def shipped_table(graph: HardwareGraph) -> dict[int, float] | None:
    """The shipped rates of ``graph`` ({set as a bit mask: rate}), or None when no table has its fingerprint."""
    return _table_by_mask(graph)


def table_rows(graph: HardwareGraph, rate: Callable[[Any, tuple[int, ...]], float | None]) -> dict[str, float]:
    """Every set of MIN_SET..min(MAX_TABLE_SET, n) GPUs of ``graph`` with ``rate`` of it, as a table holds them."""
    rows: dict[str, float] = {}
    for k in range(MIN_SET, min(MAX_TABLE_SET, graph.size) + 1):
        for gpus in combinations(graph.gpus, k):
            value = rate(graph, gpus)
            assert value is not None
            rows[set_key(gpus)] = value
    return rows


def table_document(graph: HardwareGraph, rate: Callable[[Any, tuple[int, ...]], float | None], topology: str) -> dict:
    """The JSON document of ``graph``'s table (``topology``: the preset it was made from, for people)."""
    return {"format": TABLE_FORMAT, "topology": topology, "gpus": graph.size, "fingerprint": fingerprint(graph),
            "rates": table_rows(graph, rate)}


@lru_cache(maxsize=16)
def _group(graph: HardwareGraph) -> tuple[tuple[int, ...], ...]:
    """Automorphisms of the whole graph, closed under composition up to MAX_GROUP, each as GPU -> bit of its image."""
    from .symmetry import graph_automorphisms  # here: only graphs without a table need it

    n = graph.size
    generators = [tuple(found[g] for g in range(n)) for found in graph_automorphisms(graph, graph.gpus)]
    identity = tuple(range(n))
    group = {identity}
    frontier = [identity]
    while frontier and len(group) < MAX_GROUP:
        reached = []
        for perm in frontier:
            for step in generators:
                image = tuple(step[perm[g]] for g in range(n))
                if image not in group and len(group) < MAX_GROUP:
                    group.add(image)
                    reached.append(image)
        frontier = reached
    return tuple(tuple(1 << perm[g] for g in range(n)) for perm in sorted(group))


def canonical_set(graph: HardwareGraph, gpus: tuple[int, ...]) -> tuple[int, ...]:
    """One set of the orbit of ``gpus`` under the graph's automorphisms (the smallest bit mask
    among the images found): sets of one orbit have one ring rate."""
    group = _group(graph)
    if len(group) == 1:
        return tuple(sorted(gpus))
    mask = min(sum(bits[g] for g in gpus) for bits in group)
    return tuple(g for g in range(graph.size) if mask >> g & 1)


__all__ = ["MAX_TABLE_SET", "MIN_SET", "TABLES_DIR", "TABLE_FORMAT", "canonical_set", "fingerprint", "set_key",
           "shipped_table", "table_document", "table_rows"]
