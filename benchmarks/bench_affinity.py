"""What CPU affinity in the decision costs (issue 14 item 4): strict and prefer against ignore, in the replay.

Numbers are model predictions (the paper's effective-bandwidth model; the link-bound model for
sizes outside its fitted range, as the replay reports them), not measurements.

    .venv/bin/python benchmarks/bench_affinity.py [--seeds 5] [--jobs 2000] [--nodes 4] [--util 0.85,1.5] [--json FILE]

Per topology and seed, the same generated workload (the MAPA paper's section 4 jobs: 1-5 GPUs,
rings, two thirds sensitive; arrivals uniform, at ``--util`` times the cluster's GPU capacity for
the mean job of 3 GPUs and 14.5 time units) is replayed with Preserve and backfill on ``--nodes`` nodes, once
per affinity setting: ``ignore`` (the plain policy; it only counts how many jobs got GPUs local
to their CPUs), ``prefer`` with max_loss 0.25 and 0.1, and ``strict``. Each job's CPUs are
modelled as the replay models them (:func:`slurm_mapa.core.affinity.modelled_job_cpus`: those of
the lowest-numbered free GPUs, as if cons_tres gave cores on their socket(s)).

The replay's CPU model follows the lowest free GPUs, which Preserve's choices often use too, so a
second table looks at single decisions with the job's CPUs independent of the GPUs: every free set
of the node, every job size 2-5, the job's CPUs on socket 0 or on socket 1, sensitive ring jobs,
counting only the cases where the job's socket has enough free GPUs (elsewhere strict cannot start
and prefer is ignore). For each setting: how often the job gets a GPU that is not local, and the
effective bandwidth it gets relative to ignore.

A third part times the decision itself, as the Prolog makes it: ``select`` against
``select_with_affinity`` in prefer mode (max_loss 0.1, the default) on the same 400 random
cases per topology (free set, job size 1-5, sensitive or not, the job's CPUs those of the k
lowest free GPUs, as Slurm's pick), the two interleaved case by case, 5 passes; the medians of
the per-case times are compared. This one is a measurement of this machine's CPU time.

Topologies: ``dgx1-v100`` (its CPU affinity: GPUs 0-3 on socket 0, 4-7 on socket 1) and
``pcie-8``, which carries no affinity in its preset: here it gets two sockets by its domains
(GPUs 0-3 CPUs 0-15,32-47; GPUs 4-7 CPUs 16-31,48-63), an assumption of this study.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace

from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.generate import generate
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate

MEAN_GPUS = 3.0
MEAN_SERVICE = 14.5
SETTINGS = (("ignore", 0.25), ("prefer", 0.25), ("prefer", 0.1), ("strict", 0.25))


def graphs() -> dict:
    pcie = replace(preset("pcie-8"), cpu_affinity=("0-15,32-47",) * 4 + ("16-31,48-63",) * 4)
    return {"dgx1-v100": preset("dgx1-v100"), "pcie-8": pcie}


def label(mode: str, max_loss: float) -> str:
    return f"prefer {max_loss:g}" if mode == "prefer" else mode


def one_run(graph, seed: int, jobs: int, nodes: int, util: float, mode: str, max_loss: float, decider: Decider) -> dict:
    # the paper generator spreads arrivals over (mean service x jobs / load): load = util x GPUs / mean job size
    workload = list(generate("paper", jobs, seed=seed, load=util * nodes * graph.size / MEAN_GPUS))
    cluster = [Node(f"n{i + 1}", graph) for i in range(nodes)]
    options = Options(backfill=True, affinity=mode, affinity_max_loss=max_loss)
    result = simulate(workload, cluster, "preserve", options, decider=decider)
    eff = result.eff_sensitive
    counted = result.affinity_local + result.affinity_remote
    return {
        "jobs": result.jobs,
        "eff_sensitive_mean": eff.mean,
        "eff_sensitive_p10": eff.quantile(0.1),
        "eff_sensitive_median": eff.quantile(0.5),
        "preserved_time_mean": result.mean_preserved,
        "wait_mean": result.wait.mean,
        "local_share": result.affinity_local / counted if counted else None,
    }


def study(args) -> dict:
    out: dict = {"command": " ".join(["benchmarks/bench_affinity.py"] + sys.argv[1:]), "cells": {}}
    for name, graph in graphs().items():
        decider = Decider()
        for util in args.util:
            per_setting: dict = {}
            for mode, max_loss in SETTINGS:
                runs = [one_run(graph, seed, args.jobs, args.nodes, util, mode, max_loss, decider) for seed in range(1, args.seeds + 1)]
                per_setting[label(mode, max_loss)] = runs
            out["cells"][f"{name}, util {util:g}"] = per_setting
    return out


def decisions() -> dict:
    """Single decisions over every free set (module docstring): per topology and setting."""
    from itertools import combinations

    from slurm_mapa.core.affinity import gpu_cpus, select_with_affinity
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.policies import Allocation, Request, select

    out: dict = {}
    for name, graph in graphs().items():
        sockets = sorted(set(gpu_cpus(graph)), key=min)
        rows: dict = {label(m, x): {"all": 0, "cases": 0, "not_local": 0, "ratios": []} for m, x in SETTINGS}
        for size in range(2, graph.size + 1):
            for free in combinations(range(graph.size), size):
                for k in range(2, min(5, size) + 1):
                    request = Request(make_pattern("ring", k), True)
                    plain = select("preserve", graph, free, request)
                    for cpus in sockets:
                        for mode, max_loss in SETTINGS:
                            row = rows[label(mode, max_loss)]
                            row["all"] += 1
                            if sum(1 for g in free if gpu_cpus(graph)[g] & cpus) < k:
                                continue
                            result, why = select_with_affinity("preserve", graph, free, request, cpus, mode, max_loss=max_loss)
                            assert isinstance(result, Allocation)
                            row["cases"] += 1
                            row["not_local"] += not why.local
                            row["ratios"].append(result.placement.effective_bandwidth / plain.placement.effective_bandwidth)
        out[name] = {
            setting: {"all": r["all"], "cases": r["cases"], "not_local": r["not_local"],
                      "eff_vs_ignore_mean": statistics.fmean(r["ratios"]), "eff_vs_ignore_min": min(r["ratios"]),
                      "eff_below_ignore": sum(1 for x in r["ratios"] if x < 1 - 1e-9)}
            for setting, r in rows.items()
        }
    return out


def decision_time(cases: int = 400, passes: int = 5, seed: int = 7) -> dict:
    """Median microseconds per Prolog decision without and with the affinity rule (module docstring)."""
    import random

    from slurm_mapa.core.affinity import cpus_of_slurms_gpus, select_with_affinity
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.policies import Request, select

    rng = random.Random(seed)
    out: dict = {}
    for name in ("dgx1-v100", "mi250x"):
        graph = preset(name)
        sample = []
        while len(sample) < cases:
            free = tuple(sorted(rng.sample(range(graph.size), rng.randint(1, graph.size))))
            k = rng.randint(1, min(5, len(free)))
            sample.append((free, Request(make_pattern("ring", k), rng.random() < 2 / 3), cpus_of_slurms_gpus(graph, free[:k])))
        plain_us: list[float] = []
        rule_us: list[float] = []
        for _ in range(passes):
            for free, request, cpus in sample:
                started = time.perf_counter()
                select("preserve", graph, free, request)
                plain_us.append((time.perf_counter() - started) * 1e6)
                started = time.perf_counter()
                select_with_affinity("preserve", graph, free, request, cpus, "prefer", max_loss=0.1)
                rule_us.append((time.perf_counter() - started) * 1e6)
        out[name] = {"ignore_median_us": round(statistics.median(plain_us), 1),
                     "prefer_median_us": round(statistics.median(rule_us), 1),
                     "ignore_p90_us": round(statistics.quantiles(plain_us, n=10)[-1], 1),
                     "prefer_p90_us": round(statistics.quantiles(rule_us, n=10)[-1], 1), "decisions": len(plain_us)}
    return out


def decision_time_table(found: dict) -> str:
    lines = ["| topology | decisions each | ignore: median / p90 us | prefer 0.1: median / p90 us | ratio of medians |",
             "|---|---|---|---|---|"]
    for name, row in found.items():
        lines.append(f"| {name} | {row['decisions']} | {row['ignore_median_us']} / {row['ignore_p90_us']} | "
                     f"{row['prefer_median_us']} / {row['prefer_p90_us']} | {row['prefer_median_us'] / row['ignore_median_us']:.2f} |")
    return "\n".join(lines)


def decision_table(found: dict) -> str:
    lines = [
        "| topology | affinity | decisions with room on the job's socket | not local | eff. BW vs ignore: mean | worst | decisions below ignore |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, per_setting in found.items():
        for setting, r in per_setting.items():
            lines.append(
                f"| {name} | {setting} | {r['cases']} of {r['all']} | {r['not_local'] / r['cases']:.1%} "
                f"| {r['eff_vs_ignore_mean']:.3f} | {r['eff_vs_ignore_min']:.3f} | {r['eff_below_ignore'] / r['cases']:.1%} |"
            )
    return "\n".join(lines)


def _mean(values) -> float:
    return statistics.fmean(values)


def table(out: dict) -> str:
    lines = [
        "| topology, load | affinity | sensitive eff. BW mean (GB/s) | vs ignore | p10 | median | preserved BW mean | wait mean | jobs on local GPUs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, per_setting in out["cells"].items():
        base = per_setting["ignore"]
        for setting, runs in per_setting.items():
            diffs = [r["eff_sensitive_mean"] - b["eff_sensitive_mean"] for r, b in zip(runs, base)]
            spread = f"{_mean(diffs):+.2f} (seeds {min(diffs):+.2f} .. {max(diffs):+.2f})" if setting != "ignore" else "-"
            lines.append(
                f"| {name} | {setting} | {_mean(r['eff_sensitive_mean'] for r in runs):.2f} | {spread} "
                f"| {_mean(r['eff_sensitive_p10'] for r in runs):.2f} | {_mean(r['eff_sensitive_median'] for r in runs):.2f} "
                f"| {_mean(r['preserved_time_mean'] for r in runs):.1f} | {_mean(r['wait_mean'] for r in runs):.2f} "
                f"| {_mean(r['local_share'] for r in runs):.1%} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--util", default="0.85,1.5", help="offered load as a fraction of the GPUs, comma-separated (default 0.85,1.5)")
    parser.add_argument("--json", help="also write the per-seed numbers to this file")
    args = parser.parse_args(argv)
    args.util = [float(part) for part in args.util.split(",")]
    started = time.perf_counter()
    out = study(args)
    out["decisions"] = decisions()
    out["decision_time"] = decision_time()
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["machine"] = {"uname": " ".join(platform.uname()), "python": platform.python_version()}
    print(table(out))
    print()
    print(decision_table(out["decisions"]))
    print()
    print(decision_time_table(out["decision_time"]))
    print(f"\n{args.seeds} seeds x {args.jobs} jobs on {args.nodes} nodes per topology and load; "
          f"{out['seconds']} s. The first two tables are model predictions; the last is a measurement.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
