"""Replay at scale (issue 28): the indexes, streams and packed accumulators decide and report exactly
what the plain algorithms they replace do (each checked against a brute-force reference here)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay import report
from slurm_mapa.replay import generate as generate_module
from slurm_mapa.replay import simulate as simulate_module
from slurm_mapa.replay.audit import _audit, _sorted_events, audit
from slurm_mapa.replay.cluster_spec import _log_peak_sorted, log_peak
from slurm_mapa.replay.generate import NETWORKS, SENSITIVE, generate
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.node_pick import _pick_sorted, _pick_vector, slurm_pick
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate
from slurm_mapa.replay.stats import Dist

DGX = preset("dgx1-v100")


# ------------------------------------------------------------------ node choice over runs of nodes

def _runs_reference(eligible: list[int], counts: list[int], n: int, needed: int) -> list[int] | None:
    """cons_tres' choice written out plainly: every maximal run of eligible consecutive nodes."""
    if len(eligible) < needed:
        return None
    runs, run = [], []
    for i in range(n):
        if i in eligible:
            run.append(i)
        else:
            if run:
                runs.append(run)
            run = []
    if run:
        runs.append(run)
    sufficient = [r for r in runs if len(r) >= needed]
    if not sufficient:
        return sorted(eligible)[:needed]
    best = min(sufficient, key=lambda r: (sum(counts[i] for i in r), r[0]))  # first on ties
    if needed > 1:
        return best[:needed]
    return [min(best, key=lambda i: (counts[i], i))]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.booleans()), min_size=1, max_size=30), st.integers(1, 8),
       st.sampled_from([1, 1, 2, 3]))
def test_every_way_of_picking_among_runs_is_cons_tres_choice(nodes, gpus, needed):
    counts = [c for c, _ in nodes]
    eligible = [i for i, (c, ok) in enumerate(nodes) if ok and c >= gpus]
    expected = _runs_reference(eligible, counts, len(nodes), needed)
    assert slurm_pick(eligible, counts, len(nodes), needed) == expected
    assert _pick_sorted(eligible, counts, needed) == expected
    mask = np.zeros(len(nodes), dtype=bool)
    mask[eligible] = True
    assert _pick_vector(mask, np.array(counts, dtype=np.int64), needed) == expected


# ------------------------------------------------------------------ the simulator's node index

def _mixed(n: int, seed: int, names: list[str]):
    rng = random.Random(seed)
    t = 0.0
    for i in range(n):
        t += rng.expovariate(0.3 * len(names))
        multi = rng.random() < 0.05
        yield Job(str(i), round(t, 1), float(rng.randint(5, 40)), rng.randint(1, 4 if multi else 8),
                  rng.choice(["ring", "ring", "tree"]), rng.random() < 0.6, nodes=2 if multi else 1,
                  node=rng.choice(names) if rng.random() < 0.2 else None)


def _replay(jobs, nodes, policy, options):
    rows = []
    result = simulate(jobs, nodes, policy, options, on_record=lambda rec: rows.append(report.csv_row(rec)))
    return report.summary(result), rows


def test_array_node_choice_equals_the_per_node_one(monkeypatch):
    """Large clusters index the nodes and pick among them with arrays; forced on a small one, every
    report is the same as scanning the nodes."""
    nodes = [Node(f"a{i}", DGX) for i in range(6)] + [Node("t0", preset("torus2d-16"))] + [Node(f"b{i}", DGX) for i in range(5)]
    names = [n.name for n in nodes]
    for choice in ("slurm", "prefer", "require"):
        for policy in ("preserve", "preserve-ahead"):
            options = Options(node_choice=choice, backfill=choice == "prefer", require_wait=20.0)
            monkeypatch.setattr(simulate_module, "INDEX_NODES", 10**9)
            monkeypatch.setattr(simulate_module, "VECTOR_NODES", 10**9)
            plain = _replay(_mixed(600, 3, names), nodes, policy, options)
            monkeypatch.setattr(simulate_module, "INDEX_NODES", 1)
            indexed = _replay(_mixed(600, 3, names), nodes, policy, options)
            monkeypatch.setattr(simulate_module, "VECTOR_NODES", 1)
            arrays = _replay(_mixed(600, 3, names), nodes, policy, options)
            assert indexed == plain and arrays == plain, (choice, policy)
            assert choice == "slurm" or plain[0]["node_preference"]["met"] > 0  # features were looked at


def _first_fit_reference(jobs: list[Job], sizes: list[int]) -> dict[str, tuple[int, float]]:
    """First-fit FIFO with head-of-line blocking, scanning every node at every step, with baseline
    (the lowest free GPUs): job id -> (node, start)."""
    free = [set(range(s)) for s in sizes]
    running: list[tuple[float, int, int, set]] = []  # (end, order, node, gpus)
    queue: list[Job] = []
    out: dict[str, tuple[int, float]] = {}
    pending = sorted(jobs, key=lambda j: j.submit)
    order = 0
    while pending or queue or running:
        t = min([j.submit for j in pending[:1]] + [r[0] for r in running])
        for end, o, node, gpus in sorted(r for r in running if r[0] <= t):
            free[node] |= gpus
        running = [r for r in running if r[0] > t]
        while pending and pending[0].submit <= t:
            queue.append(pending.pop(0))
        while queue:
            job = queue[0]
            node = next((i for i in range(len(sizes)) if len(free[i]) >= job.gpus), None)
            if node is None:
                break
            gpus = set(sorted(free[node])[:job.gpus])
            free[node] -= gpus
            running.append((t + job.runtime, order, node, gpus))
            order += 1
            out[job.id] = (node, t)
            queue.pop(0)
    return out


def test_first_fit_index_finds_the_first_node_with_room(monkeypatch):
    monkeypatch.setattr(simulate_module, "INDEX_NODES", 1)  # the index, not the scan of a small cluster
    presets = ["dgx1-v100", "summit", "dgx1-v100", "torus2d-16", "summit", "dgx1-v100", "pcie-8", "dgx1-v100"]
    nodes = [Node(f"n{i}", preset(name)) for i, name in enumerate(presets)]
    rng = random.Random(7)
    jobs, t = [], 0
    for i in range(3000):
        t += rng.choice([0, 0, 1, 1, 2])
        jobs.append(Job(str(i), float(t), float(rng.randint(1, 30)), rng.choice([1, 1, 2, 2, 3, 4, 6, 8])))
    expected = _first_fit_reference(jobs, [n.graph.size for n in nodes])
    starts: dict[str, tuple[int, float]] = {}
    simulate(iter(jobs), nodes, "baseline", Options(),
             on_record=lambda rec: starts.__setitem__(rec.id, (int(rec.node[1:]), rec.start)))
    assert starts == expected
    assert len({node for node, _ in starts.values()}) == len(nodes)
    monkeypatch.setattr(simulate_module, "INDEX_NODES", 10**9)
    scanned: dict[str, tuple[int, float]] = {}
    simulate(iter(jobs), nodes, "baseline", Options(),
             on_record=lambda rec: scanned.__setitem__(rec.id, (int(rec.node[1:]), rec.start)))
    assert scanned == expected


# ------------------------------------------------------------------ the streamed paper workload

def _paper_at_once(jobs, seed=1, min_gpus=1, max_gpus=5, patterns=("ring",), min_service=5, max_service=24, load=1.0):
    """The reference generator: draw every job, sort the arrivals, pair them up."""
    rng = random.Random(seed)
    span = (min_service + max_service) / 2 * jobs / load
    drawn = []
    for _ in range(jobs):
        net = rng.choice(NETWORKS)
        drawn.append((rng.uniform(0, span), rng.randint(min_gpus, max_gpus), rng.choice(list(patterns)),
                      rng.randint(min_service, max_service), net))
    arrivals = sorted(d[0] for d in drawn)
    return [(str(i), float(round(a)), float(service), gpus, shape, SENSITIVE[net])
            for i, (a, (_, gpus, shape, service, net)) in enumerate(zip(arrivals, drawn))]


def test_streamed_paper_workload_is_the_one_drawn_at_once(monkeypatch):
    def streamed(*args, **kwargs):
        return [(j.id, j.submit, j.runtime, j.gpus, j.shape, j.sensitive) for j in generate("paper", *args, **kwargs)]

    assert streamed(0) == [] and streamed(1) == _paper_at_once(1)
    assert streamed(2000, seed=3, load=40) == _paper_at_once(2000, seed=3, load=40)
    assert streamed(1500, seed=5, patterns=("ring", "tree")) == _paper_at_once(1500, seed=5, patterns=("ring", "tree"))
    monkeypatch.setattr(generate_module, "ARRIVAL_WINDOW", 997)  # counted over many windows
    assert streamed(3000, seed=2, load=0.3) == _paper_at_once(3000, seed=2, load=0.3)


# ------------------------------------------------------------------ streamed log reads

def _log(seed: int, ordered: bool) -> list[Job]:
    rng = random.Random(seed)
    jobs, t = [], 0
    for i in range(rng.randint(1, 80)):
        t += rng.choice([0, 0, 1, 2, 5])
        submit = t if ordered or rng.random() > 0.15 else t - rng.randint(1, 30)
        start = submit + rng.choice([0, 0, 1, 3, 10])
        gpus = rng.choice([1, 2, 2, 4])
        node = rng.choice(["n1", "n2"])
        recorded = tuple(sorted(rng.sample(range(8), gpus))) if rng.random() < 0.8 else None
        jobs.append(Job(str(i), float(submit), float(rng.choice([0, 1, 4, 9, 20])), gpus, node=node, sensitive=rng.random() < 0.5,
                        recorded=recorded, start=float(start) if rng.random() > 0.05 else None,
                        nodes=rng.choice([1, 1, 2])))
    return jobs


def test_streamed_log_peak_and_audit_equal_sorting_the_whole_log():
    nodes = [Node("n1", DGX), Node("n2", DGX)]
    decider = Decider()
    for seed in range(60):
        for ordered in (True, False):
            jobs = _log(seed, ordered)
            expected = _log_peak_sorted(jobs)
            assert log_peak(jobs) == expected
            assert log_peak(iter(jobs), lambda: iter(jobs)) == expected
            whole = _audit(_sorted_events(jobs), nodes, ["preserve", "baseline"], decider)
            assert audit(iter(jobs), nodes, ["preserve", "baseline"], decider, again=lambda: iter(jobs)) == whole
            assert audit(jobs, nodes, ["preserve", "baseline"], decider) == whole


# ------------------------------------------------------------------ packed distributions

def test_packed_distribution_has_the_quantiles_of_a_list():
    rng = random.Random(3)
    values = [rng.uniform(0, 100) for _ in range(5000)]
    packed = Dist()
    for v in values:
        packed.add(v)
    data = sorted(values)
    for q in (0.1, 0.25, 0.5, 0.9):
        pos = q * (len(data) - 1)
        lo = int(pos)
        assert packed.quantile(q) == data[lo] + (data[lo + 1] - data[lo]) * (pos - lo)
    ints = Dist()
    for v in (3, 1, 2):
        ints.add(v)
    assert list(ints.values) == [3, 1, 2] and all(type(v) is int for v in ints.values)
