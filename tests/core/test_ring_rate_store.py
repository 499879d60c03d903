"""Issue 49: ring-rate tables of graphs with no shipped one, computed once and kept in a table
store (core.ring_rate_tables.stored_table): written on first use, read back instead of solving,
the same rates as the programme on every set, and nothing half trusted."""

from __future__ import annotations

import json
from itertools import combinations

import pytest

from slurm_mapa.core import ring_packing
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.ring_packing import max_ring_rate, solve_ring_rate
from slurm_mapa.core.ring_rate_tables import (fingerprint, set_key, stored_table, table_bytes, table_from_bytes,
                                              table_size, use_store)
from slurm_mapa.hardware.presets import preset


def changed_dgx1():
    """A DGX-1 V100 with GPUs 0 and 1 joined by two NVLinks instead of one: no preset's links."""
    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"
    return build_graph("my-dgx1", 8, links)


class MemoryStore:
    def __init__(self, files=None):
        self.files = dict(files or {})
        self.saved = []

    def load(self, key):
        return self.files.get(key)

    def save(self, key, data):
        self.saved.append(key)
        self.files[key] = data


def test_the_first_use_stores_the_table_and_a_later_process_reads_it_without_solving(fresh, monkeypatch):
    graph = changed_dgx1()
    store = MemoryStore()
    use_store(store)
    rate = solve_ring_rate(graph, (0, 1, 2, 3))
    assert max_ring_rate(graph, (0, 1, 2, 3)) == rate == 125.0  # the double link 0-1 carries more than the DGX-1's 100
    assert store.saved == [fingerprint(graph)]
    max_ring_rate(graph, (4, 5, 6))
    assert store.saved == [fingerprint(graph)]  # computed once per process

    max_ring_rate.cache_clear()
    ring_packing._solved_once.cache_clear()
    later = MemoryStore(store.files)
    use_store(later)
    monkeypatch.setattr(ring_packing, "solve_ring_rate", lambda *_: pytest.fail("solved although the table is stored"))
    assert max_ring_rate(graph, (0, 1, 2, 3)) == rate and later.saved == []


def test_the_stored_table_holds_the_programmes_rate_of_every_set(fresh):
    graph = changed_dgx1()
    use_store(MemoryStore())
    table = stored_table(graph, ring_packing.solved_per_orbit)
    sets = [gpus for k in range(3, 9) for gpus in combinations(range(8), k)]
    assert len(table) == len(sets) == table_size(8) == 219
    for gpus in sets:
        assert table[sum(1 << g for g in gpus)] == solve_ring_rate(graph, gpus), gpus


def test_shipped_and_large_graphs_never_touch_the_store(fresh):
    store = MemoryStore()
    use_store(store)
    max_ring_rate(preset("dgx1-v100"), (0, 1, 2))
    max_ring_rate(preset("torus2d-16"), (0, 1, 2, 3))
    assert store.saved == [] and stored_table(preset("torus2d-16"), ring_packing.solved_per_orbit) is None


def test_without_a_store_nothing_is_kept_and_the_rate_is_the_programmes(fresh):
    graph = changed_dgx1()
    assert stored_table(graph, ring_packing.solved_per_orbit) is None
    assert max_ring_rate(graph, (0, 1, 2)) == solve_ring_rate(graph, (0, 1, 2))


def _document(graph):
    return json.loads(table_bytes(graph, ring_packing.solved_per_orbit))


def _spoiled(change):
    graph = changed_dgx1()
    document = _document(graph)
    change(document)
    return json.dumps(document).encode()


@pytest.mark.parametrize("change", [
    lambda d: d.update(format="ring-rates-0"),
    lambda d: d.update(fingerprint=fingerprint(preset("dgx1-v100"))),
    lambda d: d["rates"].pop("0,1,2"),
    lambda d: d["rates"].update({"0,1": 50.0}),
    lambda d: d["rates"].update({"0,1,8": 50.0}),
    lambda d: d["rates"].update({"2,1,0": d["rates"].pop("0,1,2")}),
    lambda d: d["rates"].update({"00,1,2": d["rates"].pop("0,1,2")}),
    lambda d: d["rates"].update({"0,1,2": -1.0}),
    lambda d: d["rates"].update({"0,1,2": "50"}),
    lambda d: d["rates"].update({"0,1,2": True}),
    lambda d: d.update(rates=[]),
], ids=["format", "fingerprint", "missing-row", "pair-row", "gpu-out-of-range", "keys-unsorted", "zero-padded", "negative",
        "string-rate", "bool-rate", "rates-not-a-table"])
def test_a_table_that_is_not_exactly_the_graphs_is_ignored(fresh, change):
    graph = changed_dgx1()
    assert table_from_bytes(table_bytes(graph, ring_packing.solved_per_orbit), graph) is not None
    assert table_from_bytes(_spoiled(change), graph) is None


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null", b'{"format": "ring-rates-1"}'])
def test_a_corrupt_table_is_ignored_and_rewritten(fresh, data):
    graph = changed_dgx1()
    assert table_from_bytes(data, graph) is None
    store = MemoryStore({fingerprint(graph): data})
    use_store(store)
    assert max_ring_rate(graph, (0, 1, 2)) == solve_ring_rate(graph, (0, 1, 2))
    assert store.saved == [fingerprint(graph)] and table_from_bytes(store.files[fingerprint(graph)], graph) is not None


def test_a_table_of_nan_is_ignored(fresh):
    graph = changed_dgx1()
    text = table_bytes(graph, ring_packing.solved_per_orbit).decode().replace(f'"{set_key((0, 1, 2))}": ', '"0,1,2": NaN, "x": ', 1)
    assert table_from_bytes(text.encode(), graph) is None
