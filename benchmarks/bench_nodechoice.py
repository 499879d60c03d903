"""Choosing the node too (issue 15): first-fit, Slurm's cons_tres choice, and --prefer / --constraint on
MAPA's node features, on multi-node clusters. Numbers are model predictions (the paper's effective
bandwidth model; the execution-time model where asked), not measurements.

    .venv/bin/python benchmarks/bench_nodechoice.py study [--seeds 30] [--quick] [--jobs-per-node 60] [--json FILE] [--out FILE]
    .venv/bin/python benchmarks/bench_nodechoice.py insensitive [--seeds 10]   # what insensitive jobs should prefer
    .venv/bin/python benchmarks/bench_nodechoice.py threshold [--seeds 10]     # how much the feature threshold matters
    .venv/bin/python benchmarks/bench_nodechoice.py fleet [--seeds 10] [--choices A,B] [--rows R,S] [--json FILE]
        # issue 40: mixed fleets, backlogs and few nodes; the wait rules and node weights (VARIANTS)
    .venv/bin/python benchmarks/bench_nodechoice.py plot FILE.json --png FILE

Workloads (per seed, ``workload``):

* ``paper`` - the MAPA paper's section 4 jobs (1-5 GPUs uniform, AlexNet/Inception-v3/ResNet-50/
  VGG-16 sensitive, CaffeNet/GoogleNet not, rings, service 5-24);
* ``mix``   - the same jobs with GPU counts drawn like a real cluster's: 55% 1 GPU, 15% 2, 5% 3,
  12% 4, 13% 8 (drawn from a second generator seeded with the seed).

Arrivals: ``poisson`` - exponential gaps at a rate that gives about 85% of the cluster's GPUs
busy (base run times); ``packed`` - the paper generator's uniform arrivals at 150% of capacity, so
the queue is rarely empty; ``backlog`` - every job queued at time 0. Every run uses backfill and
Preserve inside the node (preserve-ahead in the cells that say so). ``ceiling`` is what no node choice can beat: each sensitive job gets the
best ring of its size on an idle node of the fleet.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace

from slurm_mapa.replay.directives import request_for
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.generate import generate
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate
from slurm_mapa.replay.timemodel import DEFAULT_CURVE, TimeModel

MEAN_SERVICE = 14.5
MIX = ((1, 0.55), (2, 0.15), (3, 0.05), (4, 0.12), (8, 0.13))
CHOICES = ("first-fit", "slurm", "prefer", "require")


def scaled_curve(fraction: float) -> TimeModel:
    """The paper's time curve with each slowdown's excess over 1 scaled by ``fraction``: a site whose
    jobs lose a quarter of what the paper's VGG-16 loses prices holding out with fraction 0.25."""
    return TimeModel(tuple((bw, 1 + fraction * (slow - 1)) for bw, slow in DEFAULT_CURVE))


# Issue 40's node choices: the name in the tables -> the replay's options for it
VARIANTS = {
    "first-fit": {"node_choice": "first-fit"},
    "slurm": {"node_choice": "slurm"},
    "prefer": {"node_choice": "prefer"},
    "require": {"node_choice": "require"},  # holds out require_wait (4 mean service times)
    "prefer+weights": {"node_choice": "prefer", "node_weights": True},
    # what insensitive jobs prefer, as mapa.toml's [features] insensitive_jobs: "none" / "noring"
    "prefer+none": {"node_choice": "prefer", "insensitive": "best-fit"},
    "prefer+noring": {"node_choice": "prefer", "insensitive": "complement"},
    "require-cost+none": {"node_choice": "require", "wait_rule": "cost", "insensitive": "best-fit"},
    "require-cost": {"node_choice": "require", "wait_rule": "cost"},
    "require-cost+weights": {"node_choice": "require", "wait_rule": "cost", "node_weights": True},
    "require-cost+weights+min": {"node_choice": "require", "wait_rule": "cost", "node_weights": True,
                                 "insensitive": "complement-min"},
    "require-cost+min": {"node_choice": "require", "wait_rule": "cost", "insensitive": "complement-min"},
    "require-cost/4": {"node_choice": "require", "wait_rule": "cost", "wait_pricing": scaled_curve(0.25)},
    "require-cost/4+weights": {"node_choice": "require", "wait_rule": "cost", "wait_pricing": scaled_curve(0.25),
                               "node_weights": True},
    # the price swept (a site's --time-curve with an eighth or half of the paper's slowdowns), with weights
    "require-cost/8+weights": {"node_choice": "require", "wait_rule": "cost", "wait_pricing": scaled_curve(0.125),
                               "node_weights": True},
    "require-cost/2+weights": {"node_choice": "require", "wait_rule": "cost", "wait_pricing": scaled_curve(0.5),
                               "node_weights": True},
    # The cost rule as `mapa release --wait-rule cost` runs it in Slurm: time limits of 1x or 3x the
    # run times (an assumption: how much users over-ask), ends at the limits, the worst ring free now.
    "require-cost-limits1": {"node_choice": "require", "wait_rule": "cost", "wait_limits": 1.0},
    "require-cost-limits3": {"node_choice": "require", "wait_rule": "cost", "wait_limits": 3.0},
    "require-never": {"node_choice": "require", "require_wait": float("inf")},
    "require-never+weights": {"node_choice": "require", "require_wait": float("inf"), "node_weights": True},
}
# Issue 40's rows: (cluster, workload, arrivals)
FLEET_ROWS = (("4xdgx1", "paper", "poisson"), ("16xdgx1", "mix", "poisson"), ("mixed", "paper", "poisson"),
              ("16xdgx1", "paper", "backlog"), ("16xdgx1", "mix", "backlog"))
CLUSTERS = {
    "16xdgx1": ["dgx1-v100"] * 16,
    "4xdgx1": ["dgx1-v100"] * 4,
    "4xtorus16": ["torus2d-16"] * 4,
    "4xcube16": ["cubemesh-16"] * 4,
    "mixed": ["pcie-8", "dgx1-v100"] * 4,  # alternating in node order
}
POISSON_LOAD = 0.85
PACKED_LOAD = 1.5


def mean_gpus(kind: str) -> float:
    return 3.0 if kind == "paper" else sum(g * w for g, w in MIX)


def workload(kind: str, arrivals: str, seed: int, jobs: int, total_gpus: int) -> list:
    """The jobs of one seed: ``kind`` paper|mix, ``arrivals`` poisson|packed|backlog (every job queued at 0)."""
    load = POISSON_LOAD if arrivals == "poisson" else PACKED_LOAD
    rate = load * total_gpus / (mean_gpus(kind) * MEAN_SERVICE)  # jobs per time unit
    out = list(generate("paper", jobs, seed=seed, load=rate * MEAN_SERVICE))
    if kind == "mix":
        rng = random.Random(20_000 + seed)
        sizes, weights = zip(*MIX)
        for job in out:
            job.gpus = rng.choices(sizes, weights)[0]
    if arrivals == "backlog":
        for job in out:
            job.submit = 0.0
    if arrivals == "poisson":
        rng = random.Random(10_000 + seed)
        t = 0.0
        for job in out:
            t += rng.expovariate(rate)
            job.submit = round(t, 3)
    return out


def ceiling(jobs: list, graphs: list, decider: Decider) -> list[float]:
    """What each sensitive job would get on an idle node of the fleet's best type for it, scored as the
    replay reports it (the link-bound model outside the model's fitted sizes, as for the runs)."""
    best: dict[int, float] = {}
    for job in jobs:
        if job.sensitive and job.gpus >= 2 and job.gpus not in best:
            rid = decider.request_id(request_for(job.shape, job.gpus, True))
            values = []
            for graph in dict.fromkeys(graphs):
                if graph.size >= job.gpus:
                    found = decider.decide("preserve", decider.graph_id(graph), (1 << graph.size) - 1, rid)
                    values.append(found[0].effective)
            best[job.gpus] = max(values)
    return [best[j.gpus] for j in jobs if j.sensitive and j.gpus >= 2]


def _q(values: list[float], q: float) -> float:
    data = sorted(values)
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def run_cell(cluster: str, kind: str, arrivals: str, timemodel: bool, seeds: int, jobs_per_node: int,
             policy: str = "preserve", choices=CHOICES, options: Options | None = None, deciders: dict | None = None) -> dict:
    """Per choice, per seed: p10/median/min of sensitive eff. BW, mean waits, throughput; plus the ceiling."""
    topos = CLUSTERS[cluster]
    nodes = [Node(f"n{i + 1}", preset(t)) for i, t in enumerate(topos)]
    graphs = [n.graph for n in nodes]
    total = sum(g.size for g in graphs)
    jobs = jobs_per_node * len(nodes)
    base = options or Options(backfill=True, require_wait=4 * MEAN_SERVICE)
    if timemodel:
        base = replace(base, time_model=TimeModel())
    deciders = deciders if deciders is not None else {}
    decider = deciders.setdefault(policy, Decider())
    rows: dict = {c: {k: [] for k in ("p10", "median", "min", "mean", "wait", "wait_sensitive", "throughput",
                                       "preference_met", "relaxed", "wait_8gpu")} for c in choices}
    rows["ceiling"] = {k: [] for k in ("p10", "median", "min", "mean")}
    for seed in range(1, seeds + 1):
        drawn = workload(kind, arrivals, seed, jobs, total)
        best = ceiling(drawn, graphs, deciders.setdefault("preserve", Decider()))
        for name, q in (("p10", 0.1), ("median", 0.5), ("min", 0.0)):
            rows["ceiling"][name].append(_q(best, q))
        rows["ceiling"]["mean"].append(statistics.fmean(best))
        for choice in choices:
            fresh = [replace(j) for j in drawn]
            result = simulate(fresh, nodes, policy, replace(base, **VARIANTS[choice]), decider=decider)
            dist = result.eff_sensitive
            row = rows[choice]
            row["p10"].append(dist.quantile(0.1))
            row["median"].append(dist.quantile(0.5))
            row["min"].append(dist.quantile(0.0))
            row["mean"].append(dist.mean)
            row["wait"].append(result.wait.mean)
            row["wait_sensitive"].append(result.wait_sensitive.mean)
            row["throughput"].append(result.throughput_per_hour / 3600.0)  # jobs per time unit
            row["preference_met"].append(result.preference_met / result.jobs if result.jobs else 0.0)
            row["relaxed"].append(result.relaxed)
            whole = result.by_gpus.get(8)
            if whole is not None and whole.jobs:
                row["wait_8gpu"].append(whole.wait.mean)
    return rows


def _m(values):
    return statistics.fmean(values) if values else float("nan")


def _se(values):
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def cell_lines(label: str, seeds: int, rows: dict) -> list[str]:
    lines = []
    ff = rows["first-fit"]
    for choice, row in rows.items():
        if choice == "ceiling":
            lines.append(f"| {label} | {seeds} | ceiling | {_m(row['p10']):.2f} | {_m(row['median']):.2f} | {_m(row['min']):.2f} | | | | | |")
            continue
        diffs = [a - b for a, b in zip(row["p10"], ff["p10"])]
        wait_ratio = _m(row["wait"]) / _m(ff["wait"]) if _m(ff["wait"]) > 0 else float("nan")
        lines.append(
            f"| {label} | {seeds} | {choice} | {_m(row['p10']):.2f} | {_m(row['median']):.2f} | {_m(row['min']):.2f} | "
            f"{_m(diffs):+.2f} +- {_se(diffs):.2f} | {_m(row['wait_sensitive']):.1f} | {_m(row['wait']):.1f} ({wait_ratio:.2f}x) | "
            f"{_m(row['throughput']):.3f} | {_m(row['preference_met']):.2f} |"
        )
    return lines


HEAD = ("| cell | seeds | node choice | p10 | median | min | p10 - first-fit (paired, +- s.e.) | wait sens. | wait all (x first-fit) "
        "| jobs/unit | pref. met |\n|---|---|---|---|---|---|---|---|---|---|---|")


def study(seeds: int, quick: bool, jobs_per_node: int, json_path: str | None, out: str | None) -> None:
    """Every cell of the issue's grid (``--quick``: 3 seeds per cell, to try it out)."""
    cells = []
    for cluster in CLUSTERS:
        for kind in ("paper", "mix"):
            for arrivals in ("poisson", "packed"):
                for timemodel in (False, True):
                    cells.append((cluster, kind, arrivals, timemodel, "preserve"))
    cells.append(("16xdgx1", "paper", "poisson", False, "preserve-ahead"))
    cells.append(("4xdgx1", "paper", "poisson", False, "preserve-ahead"))
    results = []
    lines = [HEAD]
    print(HEAD, flush=True)
    deciders: dict = {}
    started = time.time()
    for cluster, kind, arrivals, timemodel, policy in cells:
        n = seeds
        if quick:
            n = min(seeds, 3)
        t0 = time.time()
        rows = run_cell(cluster, kind, arrivals, timemodel, n, jobs_per_node, policy, deciders=deciders)
        label = f"{cluster} {kind} {arrivals}{' time' if timemodel else ''}{'' if policy == 'preserve' else ' ' + policy}"
        new = cell_lines(label, n, rows)
        lines += new
        print("\n".join(new), flush=True)
        print(f"  ({time.time() - t0:.0f} s, {time.time() - started:.0f} s in all)", file=sys.stderr, flush=True)
        results.append({"cluster": cluster, "topologies": CLUSTERS[cluster], "workload": kind, "arrivals": arrivals,
                        "timemodel": timemodel, "policy": policy, "seeds": n, "per_seed": rows})
        if json_path:
            with open(json_path, "w") as handle:
                json.dump({"jobs_per_node": jobs_per_node, "poisson_load": POISSON_LOAD, "packed_load": PACKED_LOAD,
                           "require_wait": 4 * MEAN_SERVICE, "cells": results}, handle)
    if out:
        with open(out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


def variants(seeds: int, jobs_per_node: int, what: str) -> None:
    """prefer with each insensitive choice (or feature threshold) against first-fit: 16 DGX-1 (paper and mix
    workloads) and 4 DGX-1 (paper), Poisson ~85%, backfill, Preserve, with and without the time model."""
    print(HEAD)
    for cluster, kind in (("16xdgx1", "paper"), ("16xdgx1", "mix"), ("4xdgx1", "paper")):
        for timemodel in (False, True):
            settings = ([("insensitive", v) for v in ("best-fit", "complement", "complement-min")] if what == "insensitive"
                        else [("feature_threshold", v) for v in (0.6, 0.8, 0.9, 1.0)])
            for key, value in settings:
                options = replace(Options(backfill=True, require_wait=4 * MEAN_SERVICE), **{key: value})
                rows = run_cell(cluster, kind, "poisson", timemodel, seeds, jobs_per_node, options=options,
                                choices=("first-fit", "prefer"))
                lines = cell_lines(f"{cluster} {kind} poisson{' time' if timemodel else ''} {key}={value}", seeds, rows)
                if rows["prefer"]["wait_8gpu"]:
                    lines[1] += f" 8-GPU jobs' mean wait {_m(rows['first-fit']['wait_8gpu']):.1f} -> {_m(rows['prefer']['wait_8gpu']):.1f}"
                print("\n".join(lines), flush=True)


def fleet(seeds: int, jobs_per_node: int, choices: list[str], rows: list[str] | None, json_path: str | None) -> None:
    """Issue 40's rows (mixed fleets, backlogs, few nodes), with and without the time model."""
    print(HEAD, flush=True)
    deciders: dict = {}
    results = []
    for cluster, kind, arrivals in FLEET_ROWS:
        if rows and f"{cluster}-{kind}-{arrivals}" not in rows:
            continue
        for timemodel in (False, True):
            t0 = time.time()
            cell = run_cell(cluster, kind, arrivals, timemodel, seeds, jobs_per_node, choices=choices, deciders=deciders)
            lines = cell_lines(f"{cluster} {kind} {arrivals}{' time' if timemodel else ''}", seeds, cell)
            for choice, line in zip(list(choices) + ["ceiling"], lines):
                relaxed = cell.get(choice, {}).get("relaxed")
                print(line + (f" relaxed {_m(relaxed):.1f}" if relaxed and choice != "ceiling" else ""), flush=True)
            print(f"  ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            results.append({"cluster": cluster, "topologies": CLUSTERS[cluster], "workload": kind, "arrivals": arrivals,
                            "timemodel": timemodel, "seeds": seeds, "per_seed": cell})
            if json_path:
                with open(json_path, "w") as handle:
                    json.dump({"jobs_per_node": jobs_per_node, "poisson_load": POISSON_LOAD,
                               "require_wait": 4 * MEAN_SERVICE, "variants": {c: VARIANTS[c] for c in choices},
                               "cells": results}, handle, default=str)


def plot(path: str, png: str) -> None:
    from needs import pyplot

    plt = pyplot("bench_nodechoice.py plot")
    with open(path) as handle:
        data = json.load(handle)
    cells = [c for c in data["cells"] if c["arrivals"] == "poisson" and not c["timemodel"] and c["policy"] == "preserve"]
    fig, axes = plt.subplots(2, len(cells), figsize=(2.3 * len(cells), 6.2), squeeze=False)
    colours = {"first-fit": "#bbbbbb", "slurm": "#7f9fbf", "prefer": "#4c72b0", "require": "#dd8452", "ceiling": "#55a868"}
    for c, cell in enumerate(cells):
        rows = cell["per_seed"]
        for r, stat in enumerate(("p10", "wait")):
            ax = axes[r][c]
            names = [n for n in ("first-fit", "slurm", "prefer", "require", "ceiling") if n in rows and stat in rows[n]]
            for x, name in enumerate(names):
                values = rows[name][stat]
                ax.bar(x, _m(values), yerr=_se(values), color=colours[name], capsize=2, label=name)
            ax.set_xticks([])
            if r == 0:
                ax.set_title(f"{cell['cluster']}\n{cell['workload']}", fontsize=9)
            if c == 0:
                ax.set_ylabel("p10 of sensitive jobs' predicted\neff. BW (GB/s)" if stat == "p10" else "mean wait, all jobs\n(time units)", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("node choice: Poisson arrivals at ~85% load, backfill, Preserve inside nodes; mean over seeds, bars 1 s.e. "
                 "(model predictions)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("study")
    s.add_argument("--seeds", type=int, default=30)
    s.add_argument("--quick", action="store_true")
    s.add_argument("--jobs-per-node", type=int, default=60)
    s.add_argument("--json")
    s.add_argument("--out")
    for name in ("insensitive", "threshold"):
        v = sub.add_parser(name)
        v.add_argument("--seeds", type=int, default=10)
        v.add_argument("--jobs-per-node", type=int, default=60)
    f = sub.add_parser("fleet")
    f.add_argument("--seeds", type=int, default=10)
    f.add_argument("--jobs-per-node", type=int, default=60)
    f.add_argument("--choices", default="first-fit,prefer,require,require-cost,require-cost+weights")
    f.add_argument("--rows", help="comma-separated CLUSTER-WORKLOAD-ARRIVALS, e.g. mixed-paper-poisson (default: all)")
    f.add_argument("--json")
    p = sub.add_parser("plot")
    p.add_argument("json")
    p.add_argument("--png", required=True)
    args = parser.parse_args()
    if args.cmd == "study":
        study(args.seeds, args.quick, args.jobs_per_node, args.json, args.out)
    elif args.cmd == "fleet":
        unknown = [c for c in args.choices.split(",") if c not in VARIANTS]
        if unknown:
            parser.error(f"unknown choice {', '.join(unknown)} (accepted: {', '.join(VARIANTS)})")
        fleet(args.seeds, args.jobs_per_node, args.choices.split(","), args.rows.split(",") if args.rows else None, args.json)
    elif args.cmd == "plot":
        plot(args.json, args.png)
    else:
        variants(args.seeds, args.jobs_per_node, args.cmd)


if __name__ == "__main__":
    main()
