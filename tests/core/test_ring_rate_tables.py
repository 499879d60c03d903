"""Issue 49: ring rates by look-up. The shipped tables (data/ring_rates) against the linear
programme on every set, their fingerprint key, rates solved once per orbit on graphs without a
table, the tie-break's choice against looking at every set, and decisions that never import numpy."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import pytest

from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.placement import DIGITS, score_placement
from slurm_mapa.core.policies import Request, select
from slurm_mapa.core.ring_packing import max_ring_rate, solve_ring_rate
from slurm_mapa.core.ring_rate_tables import (TABLES_DIR, canonical_set, fingerprint, set_key, shipped_table,
                                              table_document)
from slurm_mapa.core.search import best_placement
from slurm_mapa.core.server_models import default_model
from slurm_mapa.hardware.presets import PRESETS, preset

ROOT = Path(__file__).resolve().parents[2]
TABLED = [name for name in PRESETS if preset(name).size <= 8]


@pytest.mark.parametrize("name", TABLED)
def test_the_shipped_table_equals_the_programme_on_every_set(name):
    graph = preset(name)
    shipped = json.loads((TABLES_DIR / f"{name}.json").read_text())
    assert shipped == table_document(graph, solve_ring_rate, name)  # what the generator writes today
    table = shipped_table(graph)
    sets = [gpus for k in range(3, graph.size + 1) for gpus in combinations(graph.gpus, k)]
    assert len(table) == len(sets)
    for gpus in sets:
        assert table[sum(1 << g for g in gpus)] == solve_ring_rate(graph, gpus), gpus
        assert max_ring_rate(graph, gpus) == solve_ring_rate(graph, gpus), gpus


def test_the_generator_finds_the_shipped_tables_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "ring-rate-tables"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_table_applies_to_the_same_links_under_another_name_and_never_to_other_links():
    dgx = preset("dgx1-v100")
    assert shipped_table(replace(dgx, name="my-dgx1", description="from a topology file")) is not None
    slower = replace(dgx, bandwidths=replace(dgx.bandwidths, nvlink_generation=1))  # 20 GB/s per NVLink, not 25
    assert fingerprint(slower) != fingerprint(dgx) and shipped_table(slower) is None
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"  # one pair's link changed
    other = build_graph("dgx1-v100", 8, links)
    assert shipped_table(other) is None
    assert max_ring_rate(slower, (0, 1, 2, 3)) == solve_ring_rate(slower, (0, 1, 2, 3)) == 80.0
    assert shipped_table(preset("torus2d-16")) is None


@pytest.mark.parametrize("name", ["torus2d-16", "cubemesh-16"])
def test_without_a_table_the_rate_is_solved_once_per_orbit_and_is_the_programmes(name):
    graph = preset(name)
    rng = random.Random(49)
    for _ in range(60):
        k = rng.randint(3, 7)
        gpus = tuple(sorted(rng.sample(range(graph.size), k)))
        canonical = canonical_set(graph, gpus)
        assert len(canonical) == k and canonical_set(graph, canonical) == canonical
        assert max_ring_rate(graph, gpus) == solve_ring_rate(graph, gpus) == solve_ring_rate(graph, canonical), gpus


def test_an_orbit_has_one_representative_on_a_symmetric_node():
    graph = preset("cubemesh-16")
    representatives = {canonical_set(graph, gpus) for gpus in combinations(graph.gpus, 4)}
    assert len(representatives) < 1820 / 8  # 1,820 sets of 4 GPUs fall into far fewer orbits


def _every_set_choice(graph, free, pattern, model, best):
    """The tie-break as it was: every set searched, the best (rate, aggregated) key, then the smallest sequence."""
    target = round(best.effective_bandwidth, DIGITS)
    chosen = None
    for subset in combinations(sorted(free), pattern.size):
        inside = best_placement(graph, subset, pattern, "effective", model)
        if inside is None or round(inside.effective_bandwidth, DIGITS) != target:
            continue
        rate = solve_ring_rate(graph, subset)
        key = (round(rate, DIGITS), round(inside.aggregated_bandwidth, DIGITS))
        if chosen is None or key > chosen[0] or (key == chosen[0] and inside.gpus < chosen[1]):
            chosen = (key, inside.gpus, rate)
    return score_placement(graph, free, pattern, chosen[1], model).gpus, chosen[2]


@pytest.mark.parametrize("name", ["torus2d-16", "cubemesh-16", "dgx1-p100", "summit"])
def test_the_tie_break_by_rate_order_chooses_what_looking_at_every_set_chose(name):
    graph = preset(name)
    model = default_model(graph)
    rng = random.Random(name)
    checked = 0
    for _ in range(12):
        free = tuple(sorted(rng.sample(range(graph.size), rng.randint(4, min(9, graph.size)))))
        k = rng.randint(3, min(6, len(free)))
        for shape in ("ring", "ring+tree"):
            request = Request(make_pattern(shape, k), True)
            chosen = select("preserve", graph, free, request, model)
            if chosen.objective != "effective-rings":
                continue
            best = best_placement(graph, free, request.pattern, "effective", model)
            assert (chosen.gpus, chosen.placement.ring_rate) == _every_set_choice(graph, free, request.pattern, model, best), (free, shape, k)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("gpus", [4, 8])
def test_a_sensitive_ring_decision_in_a_fresh_process_imports_no_numpy(gpus):
    """The in-process Prolog (node agent down) decides in a fresh interpreter: its ring rates come from
    the shipped table, so neither the programme nor numpy is loaded."""
    code = ("import sys\n"
            "from slurm_mapa.core.patterns import make_pattern\n"
            "from slurm_mapa.core.policies import Request, select\n"
            "from slurm_mapa.hardware.presets import preset\n"
            f"chosen = select('preserve', preset('dgx1-v100'), tuple(range(8)), Request(make_pattern('ring', {gpus}), True))\n"
            "print(chosen.objective, chosen.placement.ring_rate, 'numpy' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    rate = {4: 100.0, 8: 150.0}[gpus]
    assert done.stdout.split() == ["effective-rings", str(rate), "False"], done.stdout + done.stderr


def test_set_keys_are_ascending_gpu_lists():
    assert set_key((3, 0, 2)) == "0,2,3"
