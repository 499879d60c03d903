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

Graphs of up to 8 GPUs with no shipped table (a topology file whose links match no preset) get
the same table computed once per topology and kept on disk, where a process has a
:class:`TableStore` (:func:`use_store`; the hooks' and the agent's is in the node's state
directory, the commands' in the user's cache: slurm_mapa/slurm/ring_rate_cache.py): the first
process to need it solves every set (:func:`stored_table`, once per orbit, about 40 ms and numpy)
and stores it; every later one reads it back with json alone, no numpy. A stored table is used
only when :func:`table_from_bytes` finds it this graph's, in this format, with a row for exactly
every set; anything else is ignored and rewritten.

Larger graphs (16-64 GPUs) have no table: every set of 3 to 8 of 64 GPUs is 4.4 billion rows,
and even one row per orbit needs every set looked at to find the orbits. Their rates are solved
per set, once per orbit: an automorphism of the graph keeps every link class, so a set and its
images have one rate, and :func:`canonical_set` names one set per orbit under the automorphisms
:func:`.symmetry.graph_automorphisms` finds; the rates are kept for the process.

Owns fingerprint, shipped_table, stored_table, table_from_bytes, table_rows and canonical_set;
imports :mod:`.links` and :mod:`.symmetry`; its only read is the package's own data directory
(stored tables come through the store a process installs).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
import math
from itertools import combinations
from math import comb
from pathlib import Path
from typing import Any, Callable, Protocol

from .hardware import HardwareGraph
from .links import path_bandwidth

TABLES_DIR = Path(__file__).resolve().parent.parent / "data" / "ring_rates"
INDEX_FILE = "index.json"  # fingerprint -> the shipped file holding it, so a process reads one table only
# Bump when the programme's meaning changes: old tables (shipped or stored) stop matching.
# 2: SYS hops share the SMP interconnect (issue 49).
TABLE_FORMAT = "ring-rates-2"
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
def _shipped_index() -> dict[str, str]:
    """{fingerprint: file name} of the shipped tables (json alone: no numpy)."""
    path = TABLES_DIR / INDEX_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@lru_cache(maxsize=64)
def _table_by_mask(graph: HardwareGraph) -> dict[int, float] | None:
    name = _shipped_index().get(fingerprint(graph))
    if name is None:
        return None
    data = json.loads((TABLES_DIR / name).read_text(encoding="utf-8"))
    if data.get("format") != TABLE_FORMAT or data.get("fingerprint") != fingerprint(graph):
        return None
    return _rows_by_mask(data["rates"])


def shipped_table(graph: HardwareGraph) -> dict[int, float] | None:
    """The shipped rates of ``graph`` ({set as a bit mask: rate}), or None when no table has its fingerprint."""
    return _table_by_mask(graph)


class TableStore(Protocol):
    """Where tables of graphs with no shipped one are kept between processes, by fingerprint. Neither
    method raises: a store that cannot read says None, one that cannot write says so in its log."""

    def load(self, fingerprint: str) -> bytes | None: ...

    def save(self, fingerprint: str, data: bytes) -> None: ...


_store: TableStore | None = None
_stored: dict[str, dict[int, float]] = {}  # tables read back or computed in this process, by fingerprint


def use_store(store: TableStore | None) -> None:
    """Keep and find the tables of graphs with no shipped one in ``store`` (None: solve per orbit, keep nothing)."""
    global _store
    _store = store
    _stored.clear()


def current_store() -> TableStore | None:
    return _store


def stored_table(graph: HardwareGraph, rate: Callable[[Any, tuple[int, ...]], float | None]) -> dict[int, float] | None:
    """The rates of ``graph`` ({set as a bit mask: rate}) from the process's store, computed with
    ``rate`` and stored first when the store has no valid table of it; None without a store, or
    for a graph of more than MAX_TABLE_SET GPUs (no table: see the module's docstring)."""
    if _store is None or graph.size > MAX_TABLE_SET:
        return None
    key = fingerprint(graph)
    table = _stored.get(key)
    if table is None:
        data = _store.load(key)
        table = table_from_bytes(data, graph) if data is not None else None
        if table is None:
            data = table_bytes(graph, rate)
            _store.save(key, data)
            table = _rows_by_mask(json.loads(data)["rates"])
        _stored[key] = table
    return table


def _rows_by_mask(rows: dict[str, float]) -> dict[int, float]:
    """A table's rows by bit mask, so a look-up needs no string."""
    return {sum(1 << int(g) for g in key.split(",")): float(rate) for key, rate in rows.items()}


def table_size(gpus: int) -> int:
    """How many rows a table of a ``gpus``-GPU graph has: every set of MIN_SET..min(MAX_TABLE_SET, gpus) GPUs."""
    return sum(comb(gpus, k) for k in range(MIN_SET, min(MAX_TABLE_SET, gpus) + 1))


def table_from_bytes(data: bytes, graph: HardwareGraph) -> dict[int, float] | None:
    """A stored table's rates by bit mask, or None unless ``data`` is a table document of this
    format and of ``graph``'s fingerprint with one row, a finite rate >= 0, for each set of
    MIN_SET..min(MAX_TABLE_SET, n) GPUs (keys ascending, as set_key writes them) and no other:
    a file others could have damaged or that an older version wrote is never half trusted."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if (not isinstance(document, dict) or document.get("format") != TABLE_FORMAT
            or document.get("fingerprint") != fingerprint(graph) or not isinstance(document.get("rates"), dict)):
        return None
    rows = document["rates"]
    largest = min(MAX_TABLE_SET, graph.size)
    table: dict[int, float] = {}
    for key, rate in rows.items():
        try:
            gpus = [int(g) for g in key.split(",")]
        except ValueError:
            return None
        if (key != set_key(tuple(gpus)) or len(set(gpus)) != len(gpus) or not MIN_SET <= len(gpus) <= largest
                or gpus[0] < 0 or gpus[-1] >= graph.size or isinstance(rate, bool) or not isinstance(rate, (int, float))
                or not math.isfinite(rate) or rate < 0):
            return None
        table[sum(1 << g for g in gpus)] = float(rate)
    return table if len(table) == table_size(graph.size) else None


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


def table_bytes(graph: HardwareGraph, rate: Callable[[Any, tuple[int, ...]], float | None]) -> bytes:
    """``graph``'s table document as a file holds it (the shipped tables' layout)."""
    return (json.dumps(table_document(graph, rate, graph.name), indent=0, sort_keys=True) + "\n").encode()


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


__all__ = ["INDEX_FILE", "MAX_TABLE_SET", "MIN_SET", "TABLES_DIR", "TABLE_FORMAT", "TableStore", "canonical_set",
           "current_store", "fingerprint", "set_key", "shipped_table", "stored_table", "table_document", "table_bytes",
           "table_from_bytes", "table_rows", "table_size", "use_store"]
