"""Soak test of issue 13's invariant: 10,000+ jobs through the real hooks under every fault.

Usage (as root, like the hooks and mapa-agent):

    .venv/bin/python benchmarks/bench_soak.py [--jobs 10000] [--seed 1] [--gpus 8|64] [--mode agent|inprocess|mixed]
                                              [--segment 500] [--out results/soak.json] [--package-root DIR]

It runs segments of --segment jobs, each a fresh node driven by tests/faultsim.py (the real
wrappers, mapa-agent and TaskProlog; fake scontrol/squeue; kill -9 of hooks and agent, non-UTF-8
scripts and names, slow / failing / hanging / garbage Slurm commands, bursts of 32+ Prologs,
CPU-only jobs, stale marks with live pids, corrupted ledgers), cycling through every combination
of --gpus and --mode not fixed on the command line, with seeds seed, seed+1, ... (the same seed
gives the same fault schedule). Each segment ends with one more Prolog+Epilog round and a
convergence check. It prints one line per segment, then a Markdown table for docs/benchmarks.md,
and writes every count, overlap and anomaly to --out. Exit status 1 if any double use,
wrapper failure or unconverged segment was seen.

Not collected by pytest (only tests/ is): it takes tens of minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultsim import REPO, Scenario, default_python, run_scenario  # noqa: E402
from revisions import stop_on_signals  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10000, help="jobs in all (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpus", type=int, choices=(8, 64), help="one node size (default: both)")
    parser.add_argument("--mode", choices=("agent", "inprocess", "mixed"), help="one hook path (default: all three)")
    parser.add_argument("--segment", type=int, default=500, help="jobs per fresh node (default %(default)s)")
    parser.add_argument("--out", help="write the full results as JSON here")
    parser.add_argument("--package-root", default=str(REPO), help="the directory holding the slurm_mapa under test")
    parser.add_argument("--python", default=default_python())
    parser.add_argument("--budget", type=float, default=4.0, help="prolog_budget in the config, if it accepts the key")
    parser.add_argument("--command-timeout", type=float, default=1.0)
    parser.add_argument("--segment-deadline", type=float, default=3600.0, help="wall seconds per segment")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_soak: run as root (mapa-agent refuses otherwise)", file=sys.stderr)
        return 2
    # SIGTERM and SIGHUP end the run through the simulation's cleanup (its mapa-agent, floods and
    # decoy run in sessions of their own and would otherwise outlive it), as Ctrl-C does.
    stop_on_signals()
    combos = [(g, m) for g in ((args.gpus,) if args.gpus else (8, 64)) for m in ((args.mode,) if args.mode else ("agent", "inprocess", "mixed"))]
    reports = []
    done = 0
    index = 0
    started = time.monotonic()
    while done < args.jobs:
        gpus, mode = combos[index % len(combos)]
        jobs = min(args.segment, args.jobs - done)
        # Every third agent segment also floods the isolate socket and the metrics port (issue 36).
        flooded = mode != "inprocess" and index % 3 == 2
        scenario = Scenario(seed=args.seed + index, jobs=jobs, gpus=gpus, mode=mode, package_root=args.package_root,
                            python=args.python, prolog_budget=args.budget, command_timeout=args.command_timeout,
                            deadline=args.segment_deadline, flood=flooded, metrics_flood=flooded)
        report = run_scenario(scenario)
        reports.append(report)
        done += report.jobs_run
        index += 1
        print(report.text(details=5), flush=True)
        if report.jobs_run == 0:
            print("bench_soak: a segment ran no job; stopping", file=sys.stderr)
            break
    wall = time.monotonic() - started
    table = markdown(reports, wall)
    print()
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "machine": machine(), "command": " ".join(sys.argv), "wall_s": round(wall, 1), "table": table,
            "segments": [r.to_dict() for r in reports],
        }, indent=1, default=str))
        print(f"\nwrote {out}")
    bad = any(r.double_uses or r.wrapper_failures or not r.converged for r in reports)
    return 1 if bad else 0


def machine() -> str:
    return f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def _row(name: str, reports: list) -> str:
    walls = [w for r in reports for w in r.prolog_walls]
    faults: Counter = Counter()
    for r in reports:
        faults.update(r.faults())
    prolog_kills, epilog_kills = faults["kill -9 of a Prolog's Python"], faults["kill -9 of an Epilog's Python"]
    return (f"| {name} | {sum(r.jobs_run for r in reports):,} | {prolog_kills:,} "
            f"| {faults['GPU jobs whose every Prolog attempt was killed']:,} | {epilog_kills:,} "
            f"| {faults['kill -9 of the agent']:,} | {faults['ledger corruptions']:,} | {faults['stale marks with a live pid']:,} "
            f"| {faults['Slurm calls slow'] + faults['Slurm calls failing'] + faults['Slurm calls hanging'] + faults['Slurm calls printing garbage']:,} "
            f"| {faults['bursts of 32+ jobs']:,} | {faults['CPU-only jobs']:,} "
            f"| **{sum(r.double_uses for r in reports)}** | {sum(r.shared_after_killed_prolog for r in reports)} "
            f"| {sum(r.wrapper_failures for r in reports)} "
            f"| {statistics.median(walls) if walls else 0:.3f} | {max(walls, default=0):.2f} "
            f"| {sum(r.prologs_over_budget for r in reports)} "
            f"| {sum(1 for r in reports if r.converged)}/{len(reports)} |")


def markdown(reports: list, wall: float) -> str:
    head = ("| node, hook path | jobs | kill -9 Prolog | all attempts killed | kill -9 Epilog | kill -9 agent | ledger corruptions "
            "| stale marks | faulty Slurm calls | bursts 32+ | CPU-only jobs | double uses | shared after killed Prolog "
            "| wrapper failures | Prolog median s | Prolog max s | Prologs over budget+1 s | converged |\n"
            "|" + "---|" * 18)
    groups: dict[str, list] = {}
    for r in reports:
        groups.setdefault(f"{r.scenario.gpus} GPUs, {r.scenario.mode}", []).append(r)
    rows = [_row(name, rs) for name, rs in groups.items()]
    rows.append(_row("**all**", reports))
    corruptions: Counter = Counter()
    for r in reports:
        corruptions.update({k.split(": ", 1)[1]: v for k, v in r.counts.items() if k.startswith("ledger corruption: ")})
    note = (f"\n{sum(r.jobs_run for r in reports):,} jobs in {wall / 60:.1f} min on {machine()}; "
            f"prolog_budget {reports[0].scenario.prolog_budget:g} s (in the config: {reports[0].budget_supported}), "
            f"command_timeout {reports[0].scenario.command_timeout:g} s.\n"
            f"Ledger corruptions by kind: {', '.join(f'{k} {v}' for k, v in sorted(corruptions.items()))}.")
    return head + "\n" + "\n".join(rows) + note


if __name__ == "__main__":
    sys.exit(main())
