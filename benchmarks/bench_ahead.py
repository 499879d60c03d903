"""preserve-ahead against preserve, greedy and baseline: the lower tail of sensitive jobs, and decision time.

    .venv/bin/python benchmarks/bench_ahead.py tail [--seeds 30] [--seeds16 30] [--timemodel] [--topologies a,b] [--out FILE] [--json FILE]
    .venv/bin/python benchmarks/bench_ahead.py plot TAIL.json [TAIL-TIMEMODEL.json] --png FILE
    .venv/bin/python benchmarks/bench_ahead.py ceiling [--seeds 30]
    .venv/bin/python benchmarks/bench_ahead.py timing [--decisions 300]

``tail`` replays the paper workload (300 jobs, 1-5 GPUs uniform, 4 of 6 networks sensitive, rings)
on one node of each topology, per seed and arrival mode:

* ``packed``  - the paper generator's uniform arrivals packed 4x (``--load 4``, as the replay
  figures): the queue is rarely empty, as in the paper's runs;
* ``poisson`` - the same jobs with Poisson arrivals at the same mean rate (exponential gaps of
  mean 14.5 / 4, drawn from a second generator seeded with the seed).

Per run it takes min, p10, p25 and median of the sensitive jobs' predicted effective bandwidth,
and prints the mean over seeds as a markdown table. With ``--timemodel`` the runtimes follow the
replay's execution-time model (slower rings run longer) and the mean makespan is added.

``plot`` draws, from the per-seed values ``tail --json`` saved, p10 and median of each policy per
topology and arrival mode (mean over seeds, bars of one standard error), one row per JSON file.

``ceiling`` bounds what any policy can reach: each sensitive job gets the best placement of its
ring on an *empty* node (no policy can do better for it), and the same statistics are taken over
those values, per seed, as ``tail`` does for the real schedules.

``timing`` times single decisions (through ``select``, as the Prolog calls it) on random free
sets and paper requests, the busy GPUs split into running jobs of 1-5 GPUs (preserve-ahead's
outlook reads them), preserve and preserve-ahead side by side: preserve-ahead warm (its memo
filled by a first pass over the same decisions) and cold (memo cleared before each decision).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from slurm_mapa.core.ahead import clear_cache
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.directives import request_for
from slurm_mapa.replay.generate import generate
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate

TOPOLOGIES = ("dgx1-v100", "torus2d-16", "cubemesh-16")
POLICIES = ("baseline", "greedy", "preserve", "preserve-ahead")
STATS = (("min", 0.0), ("p10", 0.10), ("p25", 0.25), ("median", 0.5))
LOAD = 4.0
MEAN_SERVICE = 14.5


def workload(seed: int, mode: str) -> list:
    jobs = list(generate("paper", 300, seed=seed, load=LOAD))
    if mode == "poisson":
        rng = random.Random(10_000 + seed)
        t = 0.0
        for job in jobs:
            t += rng.expovariate(LOAD / MEAN_SERVICE)
            job.submit = round(t, 3)
    return jobs


def tail(seeds: int, seeds16: int, timemodel: bool, topologies=TOPOLOGIES, per_seed: dict | None = None) -> str:
    """The markdown table; ``per_seed`` (if given) receives {topology: {arrivals: {policy: {stat: [per seed]}}}}."""
    options = Options()
    if timemodel:
        from slurm_mapa.replay.timemodel import TimeModel

        options = Options(time_model=TimeModel())
    lines = []
    head = ("| topology | arrivals | seeds | policy | min | p10 | p25 | median | mean | p10 - preserve (paired, +- s.e.) |"
            + (" makespan |" if timemodel else ""))
    lines.append(head)
    lines.append("|" + "---|" * (head.count("|") - 1))
    for topo in topologies:
        graph = preset(topo)
        n_seeds = seeds if graph.size <= 8 else seeds16
        decider = Decider()
        for mode in ("packed", "poisson"):
            rows = {p: {name: [] for name, _ in STATS} | {"mean": [], "makespan": []} for p in POLICIES}
            for seed in range(1, n_seeds + 1):
                for policy in POLICIES:
                    result = simulate(workload(seed, mode), [Node("n0", graph)], policy, options, decider=decider)
                    dist = result.eff_sensitive
                    for name, q in STATS:
                        rows[policy][name].append(dist.quantile(q))
                    rows[policy]["mean"].append(dist.mean)
                    rows[policy]["makespan"].append(result.makespan)
            if per_seed is not None:
                per_seed.setdefault(topo, {})[mode] = rows
            for policy in POLICIES:
                cells = [f"{statistics.fmean(rows[policy][name]):.2f}" for name, _ in STATS]
                cells.append(f"{statistics.fmean(rows[policy]['mean']):.2f}")
                diffs = [a - b for a, b in zip(rows[policy]["p10"], rows["preserve"]["p10"])]
                se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
                cells.append(f"{statistics.fmean(diffs):+.2f} +- {se:.2f}")
                if timemodel:
                    cells.append(f"{statistics.fmean(rows[policy]['makespan']):.0f}")
                lines.append(f"| {topo} | {mode} | {n_seeds} | {policy} | " + " | ".join(cells) + " |")
            print("\n".join(lines[-len(POLICIES):]), flush=True)
    return "\n".join(lines)


def ceiling(seeds: int, topologies=TOPOLOGIES) -> str:
    """Per topology and arrival mode: the mean over seeds of each statistic if every sensitive job got its empty-node best."""
    from slurm_mapa.core.policies import select
    from slurm_mapa.replay.stats import Dist

    model = paper_model()
    lines = ["| topology | arrivals | seeds | min | p10 | p25 | median | best ring on an empty node, by size |", "|---|---|---|---|---|---|---|---|"]
    for topo in topologies:
        graph = preset(topo)
        best: dict[tuple[str, int], float] = {}
        for mode in ("packed", "poisson"):
            rows: dict[str, list[float]] = {name: [] for name, _ in STATS}
            for seed in range(1, seeds + 1):
                dist = Dist()
                for job in workload(seed, mode):
                    if not job.sensitive or job.gpus < 2:
                        continue  # a 1-GPU job has no effective bandwidth, as in the replay
                    key = (job.shape, job.gpus)
                    if key not in best:
                        placed = select("preserve", graph, range(graph.size), request_for(job.shape, job.gpus, True), model)
                        best[key] = placed.placement.effective_bandwidth
                    dist.add(best[key])
                for name, q in STATS:
                    rows[name].append(dist.quantile(q))
            sizes = ", ".join(f"{k}: {v:.2f}" for (_, k), v in sorted(best.items(), key=lambda item: item[0][1]))
            lines.append(f"| {topo} | {mode} | {seeds} | " + " | ".join(f"{statistics.fmean(rows[name]):.2f}" for name, _ in STATS) + f" | {sizes} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def timing(decisions: int) -> str:
    from slurm_mapa.core.policies import select

    model = paper_model()
    lines = ["| topology | decisions | preserve us/decision | preserve-ahead warm us | ratio warm | preserve-ahead cold ms (mean / max) |",
             "|---|---|---|---|---|---|"]
    for topo in TOPOLOGIES:
        graph = preset(topo)
        rng = random.Random(7)
        cases = []
        while len(cases) < decisions:
            free = tuple(g for g in range(graph.size) if rng.random() < 0.6)
            gpus = rng.randint(1, 5)
            if gpus > len(free):
                continue
            busy = [g for g in range(graph.size) if g not in free]
            rng.shuffle(busy)
            running = []
            while busy:
                size = rng.randint(1, 5)
                running.append(busy[:size])
                busy = busy[size:]
            cases.append((free, request_for("ring", gpus, rng.random() < 4 / 6), running))
        clear_cache()
        cold = []
        for free, request, running in cases[:5]:
            clear_cache()
            t0 = time.perf_counter()
            select("preserve-ahead", graph, free, request, model, running=running)
            cold.append(time.perf_counter() - t0)
        for free, request, running in cases:  # warm the memo
            select("preserve-ahead", graph, free, request, model, running=running)
        timed = {}
        for name in ("preserve", "preserve-ahead", "preserve", "preserve-ahead"):  # interleaved, best of two
            t0 = time.perf_counter()
            for free, request, running in cases:
                select(name, graph, free, request, model, running=running)
            elapsed = (time.perf_counter() - t0) / len(cases)
            timed[name] = min(timed.get(name, elapsed), elapsed)
        p, a = timed["preserve"] * 1e6, timed["preserve-ahead"] * 1e6
        lines.append(f"| {topo} | {decisions} | {p:.0f} | {a:.0f} | {a / p:.2f} | {statistics.fmean(cold) * 1e3:.0f} / {max(cold) * 1e3:.0f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def plot(paths: list[str], png: str) -> None:
    import json

    from needs import pyplot

    plt = pyplot("bench_ahead.py plot")

    runs = []
    for path in paths:
        with open(path) as handle:
            runs.append(json.load(handle))
    cells = [(topo, mode) for topo in runs[0]["per_seed"] for mode in runs[0]["per_seed"][topo]]
    fig, axes = plt.subplots(len(runs), len(cells), figsize=(2.6 * len(cells), 3.3 * len(runs)), squeeze=False)
    colours = {"baseline": "#bbbbbb", "greedy": "#7f9fbf", "preserve": "#4c72b0", "preserve-ahead": "#dd8452"}
    for r, run in enumerate(runs):
        for c, (topo, mode) in enumerate(cells):
            ax = axes[r][c]
            rows = run["per_seed"][topo][mode]
            policies = list(rows)
            for s, stat in enumerate(("p10", "median")):
                for p, policy in enumerate(policies):
                    values = rows[policy][stat]
                    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
                    x = s * (len(policies) + 1) + p
                    ax.bar(x, statistics.fmean(values), yerr=se, color=colours.get(policy, "#999999"),
                           label=policy if s == 0 else None, capsize=2)
            ax.set_xticks([(len(policies) - 1) / 2, len(policies) + 1 + (len(policies) - 1) / 2], ["p10", "median"])
            ax.set_title(f"{topo}\n{mode}{', time model' if run['timemodel'] else ''}", fontsize=9)
            if c == 0:
                ax.set_ylabel("sensitive jobs' predicted eff. BW (GB/s)", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"mean over seeds ({runs[0]['seeds']} on 8 GPUs, {runs[0]['seeds16']} on 16), bars: 1 s.e.", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tail")
    t.add_argument("--seeds", type=int, default=30)
    t.add_argument("--seeds16", type=int, default=30)
    t.add_argument("--timemodel", action="store_true")
    t.add_argument("--topologies", default=",".join(TOPOLOGIES))
    t.add_argument("--out")
    t.add_argument("--json", help="also save the per-seed values (for plot)")
    pl = sub.add_parser("plot")
    pl.add_argument("json", nargs="+")
    pl.add_argument("--png", required=True)
    c = sub.add_parser("ceiling")
    c.add_argument("--seeds", type=int, default=30)
    c.add_argument("--topologies", default=",".join(TOPOLOGIES))
    c.add_argument("--out")
    m = sub.add_parser("timing")
    m.add_argument("--decisions", type=int, default=300)
    m.add_argument("--out")
    args = parser.parse_args()
    if args.cmd == "plot":
        plot(args.json, args.png)
        return
    if args.cmd == "tail":
        per_seed: dict = {}
        text = tail(args.seeds, args.seeds16, args.timemodel, args.topologies.split(","), per_seed)
        if args.json:
            import json

            with open(args.json, "w") as handle:
                json.dump({"timemodel": args.timemodel, "seeds": args.seeds, "seeds16": args.seeds16, "per_seed": per_seed}, handle)
    elif args.cmd == "ceiling":
        text = ceiling(args.seeds, args.topologies.split(","))
    else:
        text = timing(args.decisions)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
