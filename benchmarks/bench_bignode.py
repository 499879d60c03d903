"""Decision time of Preserve on big nodes: the search before and after issue #28, side by side.

    .venv/bin/python benchmarks/bench_bignode.py [--budget-ms 200] [--before-cap 5] [--before REV] [--quick] [--json FILE]

Each decision is what ``preserve`` asks of the search: a ring of k GPUs, sensitive (highest
predicted effective bandwidth) or insensitive (highest preserved bandwidth), on a free set of a
node. Nodes: the presets torus2d-16 and cubemesh-16 (every size 2..15, on the idle node, on the
free set of issue #28 and on two random free sets per size), and three nodes built here with the
core's graph constructor: four 8-GPU NVSwitch islands joined by SYS (32 GPUs), a 4x8 2-D torus of
double NVLink with SYS elsewhere (32 GPUs), and a 64-GPU NVSwitch node (all-to-all).

"after" is this tree's search with ``SearchLimit(seconds=budget, clock=time.perf_counter)``, as a
Prolog with a 200 ms budget would call it; it reports how many decisions came back with a gap
(None: proven optimal) and the largest one. "before" is the search of revision REV (default
2a547b1, the last commit before issue 28): REV's whole tree, extracted with ``git archive`` into a
temporary directory and run in a worker process whose PYTHONPATH is that tree alone (no module of
this checkout is loaded there; benchmarks/revisions.py), killed and started again when a decision
takes more than ``--before-cap`` seconds (then counted as "> cap"). Decisions that both finish
with a proof are compared: they must agree. Last, every decision on the DGX-1 V100 (every free
set, ring size and sensitivity, without a limit) is compared with before. The worker dies with the
benchmark (Ctrl-C, SIGTERM, SIGHUP; on Linux also SIGKILL, through the parent-death signal).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from revisions import TREE_ENV, Workers, assert_one_tree, checkout, stop_on_signals  # noqa: E402

if TREE_ENV not in os.environ:  # the driver (and bench_policies_bignode): this checkout's package
    sys.path.insert(0, str(ROOT))

# The slurm_mapa names are imported inside the functions: the worker of the "before" side runs
# this file with an old revision's package, which has only what graphs() and the search need.

ISSUE_FREE_SET = (0, 1, 2, 3, 4, 5, 7, 8, 10, 12, 13, 14, 15)  # torus2d-16, 13 GPUs: 3.7-5.3 s before


def nvswitch_islands(islands: int = 4, per_island: int = 8):
    from slurm_mapa.core.hardware import build_graph
    from slurm_mapa.core.links import Bandwidths

    links = {}
    for island in range(islands):
        members = range(island * per_island, (island + 1) * per_island)
        links.update({(a, b): "NVS18" for a in members for b in members if a < b})
    return build_graph(f"nvs-islands-{islands}x{per_island}", islands * per_island, links, default_link="SYS",
                       bandwidths=Bandwidths(nvlink_generation=4), domains=[g // per_island for g in range(islands * per_island)])


def torus_2d(rows: int = 4, cols: int = 8):
    from slurm_mapa.core.hardware import build_graph

    links = {}
    for r in range(rows):
        for c in range(cols):
            a = r * cols + c
            for b in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                links[(min(a, b), max(a, b))] = "NV2"
    return build_graph(f"torus2d-{rows}x{cols}", rows * cols, links, default_link="SYS")


def nvswitch_node(size: int = 64):
    from slurm_mapa.core.hardware import build_graph
    from slurm_mapa.core.links import Bandwidths

    links = {(a, b): "NVS18" for a in range(size) for b in range(a + 1, size)}
    return build_graph(f"nvs-{size}", size, links, bandwidths=Bandwidths(nvlink_generation=4))


def graphs():
    from slurm_mapa.hardware.presets import preset

    return {
        "torus2d-16": preset("torus2d-16"),
        "cubemesh-16": preset("cubemesh-16"),
        "nvs-islands-4x8": nvswitch_islands(),
        "torus2d-4x8": torus_2d(),
        "nvs-64": nvswitch_node(),
    }


def decisions(quick: bool) -> list[tuple[str, tuple[int, ...], int, bool]]:
    """(graph, free set, ring size, sensitive), reproducibly (seed 28)."""
    rng = random.Random(28)
    cases = []
    for name, size in graphs().items():
        n = size.size
        if n == 16:
            sizes = range(2, 16)
        elif n == 32:
            sizes = [2, 4, 8, 12, 16, 20, 24, 28, 31]
        else:
            sizes = [2, 8, 16, 24, 32, 48, 63]
        if quick:
            sizes = [k for k in sizes if k in (4, 12, 13, 31, 32)]
        for k in sizes:
            free_sets = [tuple(range(n))]
            if name == "torus2d-16" and k <= len(ISSUE_FREE_SET):
                free_sets.append(ISSUE_FREE_SET)
            for _ in range(2 if n == 16 else 1):
                m = rng.randint(k, n - 1) if k < n else n
                free_sets.append(tuple(sorted(rng.sample(range(n), m))))
            for free in free_sets:
                for sensitive in (True, False):
                    cases.append((name, free, k, sensitive))
    return cases


def objective(k: int, sensitive: bool) -> str:
    return "effective" if sensitive and k > 1 else "preserved"


# --- the search before, in a worker process of the old revision's tree -------------------------

def paper_model():
    try:
        from slurm_mapa.core.model_files import paper_model as load
    except ImportError:  # revisions before core/model_files.py
        from slurm_mapa.core.effbw import paper_model as load
    return load()


def _worker_decision(name: str, free, k: int, sensitive: bool):
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import best_placement, objective_key

    graph = graphs()[name]
    obj = objective(k, sensitive)
    start = time.perf_counter()
    placement = best_placement(graph, tuple(free), make_pattern("ring", k), obj, paper_model())
    ms = (time.perf_counter() - start) * 1000
    return ms, objective_key(obj, placement), placement.gpus


def _worker_dgx1():
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import best_placement
    from slurm_mapa.hardware.presets import preset

    graph, model = preset("dgx1-v100"), paper_model()
    return [best_placement(graph, free, make_pattern("ring", k), objective(k, s), model).gpus
            for _, free, k, s in dgx1_cases()]


def worker() -> None:
    """The "before" side: answers one JSON line per request line on stdin (``["decide", node, free,
    k, sensitive]`` or ``["dgx1"]``), after a first line ``"ready"`` once its imports are done."""
    import slurm_mapa.core.search  # noqa: F401 - imported before "ready": not timed against the cap

    paper_model()
    assert_one_tree()
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        answer = _worker_decision(*request[1:]) if request[0] == "decide" else _worker_dgx1()
        assert_one_tree()
        print(json.dumps(answer), flush=True)


class Before:
    """A worker process running the search of the old tree; restarted after a decision past the cap."""

    def __init__(self, workers: Workers, tree: str) -> None:
        self.workers, self.tree, self.process = workers, tree, None

    def _start(self) -> None:
        self.process = self.workers.start([sys.executable, os.path.abspath(__file__), "worker"], self.tree,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._answer(120.0) != "ready":
            raise SystemExit(f"the worker of {self.tree} did not start")

    def _answer(self, timeout: float | None):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return TimeoutError
        line = self.process.stdout.readline()
        if not line:
            self.workers.kill(self.process)
            raise SystemExit(f"the worker of {self.tree} ended (exit status {self.process.returncode}); its error is above")
        return json.loads(line)

    def ask(self, request: list, timeout: float | None = None):
        """The worker's answer, or None when it took longer than ``timeout`` (the worker is then killed)."""
        if self.process is None:
            self._start()
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._answer(timeout)
        if answer is TimeoutError:
            self.workers.kill(self.process)
            self.process = None
            return None
        return answer


def dgx1_cases() -> list[tuple[str, tuple[int, ...], int, bool]]:
    """Every free set, ring size and sensitivity of the paper's DGX-1 V100 (its choices must not change)."""
    return [("dgx1-v100", free, k, sensitive) for m in range(1, 9) for free in combinations(range(8), m)
            for k in range(1, m + 1) for sensitive in (True, False)]


def dgx1_unchanged(before: Before) -> tuple[int, int]:
    """(decisions, how many chose the same GPUs in the same order as before)."""
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import best_placement
    from slurm_mapa.hardware.presets import preset

    cases = dgx1_cases()
    old = [tuple(gpus) for gpus in before.ask(["dgx1"])]
    graph, model = preset("dgx1-v100"), paper_model()
    after = [best_placement(graph, free, make_pattern("ring", k), objective(k, s), model).gpus for _, free, k, s in cases]
    return len(cases), sum(1 for a, b in zip(after, old) if a == b)


def run_before(cases, before: Before, cap: float):
    results = []
    for name, free, k, sensitive in cases:
        answer = before.ask(["decide", name, list(free), k, sensitive], timeout=cap)
        results.append(None if answer is None else (answer[0], tuple(answer[1]), tuple(answer[2])))
    return results


# --- the search after, in this process --------------------------------------------------------


def run_after(cases, budget_s: float):
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import SearchLimit, best_placement, objective_key

    cache = graphs()
    results = []
    for name, free, k, sensitive in cases:
        graph = cache[name]
        obj = objective(k, sensitive)
        pattern = make_pattern("ring", k)
        limit = SearchLimit(seconds=budget_s, clock=time.perf_counter)
        start = time.perf_counter()
        placement = best_placement(graph, free, pattern, obj, paper_model(), limit)
        ms = (time.perf_counter() - start) * 1000
        value = objective_key(obj, placement)
        results.append((ms, value, placement.gpus, placement.gap))
    return results


def summarise(cases, before, after):
    rows = {}
    mismatches = []
    for case, old, new in zip(cases, before, after):
        row = rows.setdefault(case[0], {"decisions": 0, "before_ms": [], "before_over": 0, "after_ms": [], "speedups": [],
                                        "gaps": {True: 0, False: 0}, "zero_gaps": 0, "largest": {True: 0.0, False: 0.0},
                                        "largest_share": 0.0})
        row["decisions"] += 1
        ms, value, gpus, gap = new
        row["after_ms"].append(ms)
        if old is None:
            row["before_over"] += 1
        else:
            row["before_ms"].append(old[0])
            row["speedups"].append(old[0] / ms)
        sensitive = case[3] and case[2] > 1
        if gap is not None:
            if gap > 0:
                row["gaps"][sensitive] += 1
                row["largest"][sensitive] = max(row["largest"][sensitive], gap)
                if not sensitive:
                    row["largest_share"] = max(row["largest_share"], gap / (value[0] + gap))
            else:
                row["zero_gaps"] += 1
        if old is not None and gap is None and (old[1], old[2]) != (value, gpus):
            mismatches.append((case, old[1:], (value, gpus)))
    return rows, mismatches


def table(rows, cap) -> list[str]:
    lines = [
        "| node | decisions | before: median / max ms (finished) | before: over the cap | after: median / max ms | "
        "speed-up, median (finished) | insensitive with gap > 0: count, largest (share of bound) | "
        "sensitive with gap > 0: count, largest | gap = 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        b, a = row["before_ms"], row["after_ms"]
        before_text = f"{statistics.median(b):.1f} / {max(b):.0f}" if b else "-"
        speedup = f"{statistics.median(row['speedups']):.1f}x" if row["speedups"] else "-"
        share = f"{100 * row['largest_share']:.0f} %"
        insensitive = f"{row['gaps'][False]}, {row['largest'][False]:.0f} GB/s ({share})" if row["gaps"][False] else "0"
        sensitive = f"{row['gaps'][True]}, {row['largest'][True]:.0f} GB/s" if row["gaps"][True] else "0"
        lines.append(f"| {name} | {row['decisions']} | {before_text} | {row['before_over']} (> {cap:.0f} s) | "
                     f"{statistics.median(a):.1f} / {max(a):.0f} | {speedup} | {insensitive} | {sensitive} | {row['zero_gaps']} |")
    return lines


def main() -> None:
    if sys.argv[1:] == ["worker"]:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-ms", type=float, default=200.0)
    parser.add_argument("--before-cap", type=float, default=5.0, help="seconds before a 'before' decision is given up")
    parser.add_argument("--before", default="2a547b1", help="git revision of the search to compare with (default: the last before issue 28)")
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--json", help="write the per-decision results here")
    args = parser.parse_args()
    stop_on_signals()
    with tempfile.TemporaryDirectory() as tmp, Workers() as workers:
        measure(args, Before(workers, checkout(args.before, tmp)))


def measure(args, before_side: Before) -> None:
    from slurm_mapa.core.placement_dfs import clear_caches as clear_set_tables
    from slurm_mapa.core.ring_choice import clear_caches as clear_ring_choices
    from slurm_mapa.core.symmetry import _graph_automorphisms, _twin_classes

    cases = decisions(args.quick)
    # Warm-up: imports, the model file, the 16-GPU subset tables, pattern symmetries (what a
    # long-lived mapa-agent has); what depends on the free set is computed afresh (the searches
    # here have a limit, so no k-set results are looked up: core/subset_results.py).
    run_after(cases, args.budget_ms / 1000)
    _twin_classes.cache_clear()
    _graph_automorphisms.cache_clear()
    clear_set_tables()
    clear_ring_choices()  # the k-sets' results the ring-rate tie-break keeps (a warm replay's)
    after = run_after(cases, args.budget_ms / 1000)
    before = run_before(cases, before_side, args.before_cap)
    rows, mismatches = summarise(cases, before, after)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}; "
          f"{len(cases)} decisions; budget {args.budget_ms:.0f} ms; before = {args.before}, cap {args.before_cap:.0f} s")
    print("\n".join(table(rows, args.before_cap)))
    print(f"proven decisions that differ from before: {len(mismatches)}")
    total, same = dgx1_unchanged(before_side)
    print(f"dgx1-v100, every free set, ring size and sensitivity: {same} of {total} decisions identical to before")
    for case, old, new in mismatches[:10]:
        print("  MISMATCH", case, old, new)
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"node": c[0], "free": c[1], "k": c[2], "sensitive": c[3], "before_ms": o[0] if o else None,
             "after_ms": round(n[0], 3), "value": n[1], "gap": n[3]} for c, o, n in zip(cases, before, after)], indent=1) + "\n")


if __name__ == "__main__":
    main()
