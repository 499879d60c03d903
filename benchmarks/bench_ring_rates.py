"""What the ring-rate tie-break costs a decision (issue 49): the working tree against a baseline
revision, side by side in one run.

    .venv/bin/python benchmarks/bench_ring_rates.py [--baseline-rev 9a4ec15] [--fresh 9] [--jobs 5000] [--replays 3]

* ``fresh``: a sensitive ring job of 4 and of 8 GPUs on an idle DGX-1 V100, decided by
  ``select("preserve", ...)`` in a fresh interpreter (the in-process Prolog's path when the node
  agent is down): CPU ms of the decision alone (``time.process_time`` around the call; the imports
  before it are timed apart), the median of ``--fresh`` processes, and whether numpy got imported.
* ``fresh-file``: the same decisions on a topology FILE whose links match no preset (the DGX-1
  V100 with GPUs 0 and 1 joined by two NVLinks, not one), so no table ships: the new tree with its
  table stored on disk (slurm/ring_rate_cache.py; written by a first process, as ``mapa hooks`` or
  the agent's start would), the new tree without a store (rates solved in the process, once per
  orbit: numpy), and the old tree.
* ``replay`` (skipped with ``--replays 0``): decisions per CPU second of Preserve on 4 nodes of each 16-GPU preset, "warm" as
  bench_replay_scale.py ``rate`` measures it (a first ``--jobs`` workload fills the decision memo,
  a second one is timed), the median of ``--replays`` workers per side, new and old alternating; a
  CPU ratio above 1 is what the new tree costs more (issue 49's bound: 1.1 against the revision
  before the ring-rate tie-break, ``--baseline-rev 276d70f^``).

Each side runs in its own worker processes with PYTHONPATH set to its tree alone
(benchmarks/revisions.py); both trees are byte-compiled first, so no side pays for compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from revisions import Workers, assert_one_tree, checkout, stop_on_signals  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_REV = "9a4ec15"  # the last commit before ring rates were looked up


def work_fresh(gpus: int) -> dict:
    c0 = time.process_time()
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.policies import Request, select
    from slurm_mapa.hardware.presets import preset

    graph, request = preset("dgx1-v100"), Request(make_pattern("ring", gpus), True)
    c1 = time.process_time()
    chosen = select("preserve", graph, tuple(range(8)), request)
    c2 = time.process_time()
    return {"import_ms": (c1 - c0) * 1e3, "decision_ms": (c2 - c1) * 1e3, "numpy": "numpy" in sys.modules,
            "gpus": list(chosen.gpus)}


CHANGED_LINK = ((0, 1), "NV2")  # the DGX-1 V100's 0-1 is one NVLink: no preset has these links


def work_write_topology(path: str) -> dict:
    from slurm_mapa.core.hardware import build_graph
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.hardware.topofile import graph_to_toml

    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[CHANGED_LINK[0]] = CHANGED_LINK[1]
    with open(path, "w", encoding="utf-8") as out:
        out.write(graph_to_toml(build_graph("dgx1-v100-changed", 8, links)))
    return {}


def work_fresh_file(gpus: int, topology: str, cache: str) -> dict:
    """As work_fresh, on a topology file; ``cache``: the directory of stored tables, "none": no store."""
    c0 = time.process_time()
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.policies import Request, select
    from slurm_mapa.hardware.load import load_topology

    if cache != "none":
        from slurm_mapa.slurm.ring_rate_cache import use_directory

        use_directory(cache)
    graph, request = load_topology(topology), Request(make_pattern("ring", gpus), True)
    c1 = time.process_time()
    chosen = select("preserve", graph, tuple(range(8)), request)
    c2 = time.process_time()
    return {"import_ms": (c1 - c0) * 1e3, "decision_ms": (c2 - c1) * 1e3, "numpy": "numpy" in sys.modules,
            "gpus": list(chosen.gpus)}


def work_replay(topology: str, jobs: int) -> dict:
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.replay.generate import generate
    from slurm_mapa.replay.simulate import Decider, Node, simulate

    cluster = [Node(f"n{i}", preset(topology)) for i in range(4)]
    decider = Decider()
    simulate(generate("paper", jobs, seed=1, load=16), cluster, "preserve", decider=decider)
    workload = list(generate("paper", jobs, seed=2, load=16))
    c0 = time.process_time()
    result = simulate(workload, cluster, "preserve", decider=decider)
    return {"decisions": result.decisions, "cpu_s": time.process_time() - c0}


WORKERS = {"fresh": work_fresh, "fresh-file": work_fresh_file, "write-topology": work_write_topology, "replay": work_replay}
WORKERS_RUNNING = Workers()


def run_worker(tree: str, name: str, *args) -> dict:
    done = WORKERS_RUNNING.run([sys.executable, os.path.abspath(__file__), "worker", name, *map(str, args)], tree)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} {args} on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def show(*cells) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |")
    sys.stdout.flush()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        values = [int(v) if v.isdigit() else v for v in sys.argv[3:]]
        result = WORKERS[sys.argv[2]](*values)
        assert_one_tree()
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument("--fresh", type=int, default=9, help="fresh processes per side and size (median)")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--topologies", default="torus2d-16,cubemesh-16")
    parser.add_argument("--replays", type=int, default=3, help="replay workers per side and topology, new and old alternating (median)")
    args = parser.parse_args()
    stop_on_signals()
    with tempfile.TemporaryDirectory() as tmp, WORKERS_RUNNING:
        old = checkout(args.baseline_rev, tmp)
        for tree in (ROOT, old):
            subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "slurm_mapa")], check=True)
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; new: the working tree; old: {args.baseline_rev}\n")
        show("sensitive ring, dgx1-v100, all free", "new decision CPU ms", "old decision CPU ms", "old/new",
             "new numpy imported", "old numpy imported", "new imports CPU ms", "old imports CPU ms")
        print("|---|---|---|---|---|---|---|---|")
        for gpus in (4, 8):
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            for _ in range(args.fresh):  # alternating, so both sides meet the same load
                for side, tree in (("new", ROOT), ("old", old)):
                    runs[side].append(run_worker(tree, "fresh", gpus))
            med = {side: {key: statistics.median(r[key] for r in rs) for key in ("decision_ms", "import_ms")} for side, rs in runs.items()}
            assert runs["new"][0]["gpus"] == runs["old"][0]["gpus"], runs  # the same choice
            show(f"{gpus} GPUs", f"{med['new']['decision_ms']:.1f}", f"{med['old']['decision_ms']:.1f}",
                 f"{med['old']['decision_ms'] / med['new']['decision_ms']:.1f}x",
                 runs["new"][0]["numpy"], runs["old"][0]["numpy"], f"{med['new']['import_ms']:.0f}", f"{med['old']['import_ms']:.0f}")
        print()
        topology, cache = os.path.join(tmp, "dgx1-v100-changed.toml"), os.path.join(tmp, "ring-rates")
        run_worker(ROOT, "write-topology", topology)
        run_worker(ROOT, "fresh-file", 4, topology, cache)  # stores the table, as `mapa hooks` would
        sides = (("new, table stored", ROOT, cache), ("new, no store", ROOT, "none"), ("old", old, "none"))
        show("sensitive ring, dgx1-v100 file with one link changed, all free", *(f"{side} decision CPU ms" for side, _, _ in sides),
             *(f"{side} numpy imported" for side, _, _ in sides), *(f"{side} imports CPU ms" for side, _, _ in sides))
        print("|---|---|---|---|---|---|---|---|---|---|")
        for gpus in (4, 8):
            runs: list[list[dict]] = [[] for _ in sides]
            for _ in range(args.fresh):  # alternating, as above
                for found, (_, tree, where) in zip(runs, sides):
                    found.append(run_worker(tree, "fresh-file", gpus, topology, where))
            assert len({tuple(r[0]["gpus"]) for r in runs}) == 1, runs  # the same choice
            show(f"{gpus} GPUs", *(f"{statistics.median(r['decision_ms'] for r in rs):.1f}" for rs in runs),
                 *(rs[0]["numpy"] for rs in runs), *(f"{statistics.median(r['import_ms'] for r in rs):.0f}" for rs in runs))
        if not args.replays:
            return
        print()
        show("topology (4 nodes)", "jobs", "new decisions/CPU s", "old decisions/CPU s", "new/old", "new CPU / old CPU",
             "each run's new CPU / old CPU")
        print("|---|---|---|---|---|---|---|")
        for topology in args.topologies.split(","):
            rates: dict[str, list[float]] = {"new": [], "old": []}
            for _ in range(args.replays):  # alternating, so both sides meet the same load
                for side, tree in (("new", ROOT), ("old", old)):
                    done = run_worker(tree, "replay", topology, args.jobs)
                    rates[side].append(done["decisions"] / done["cpu_s"])
            new, was = statistics.median(rates["new"]), statistics.median(rates["old"])
            show(topology, f"{args.jobs:,}", f"{new:,.0f}", f"{was:,.0f}", f"{new / was:.2f}x", f"{was / new:.2f}",
                 " ".join(f"{o / n:.2f}" for n, o in zip(rates["new"], rates["old"])))


if __name__ == "__main__":
    main()
