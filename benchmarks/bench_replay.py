"""Replay speed and memory: jobs per second per policy on 8- and 16-GPU nodes, and peak memory of a
streamed one-million-job sacct log.

    .venv/bin/python benchmarks/bench_replay.py speed [--jobs 20000]
    .venv/bin/python benchmarks/bench_replay.py memory [--jobs 1000000] [--policy preserve]

``speed`` replays the paper workload (arrivals packed 4x per node, so nodes are busy and free sets
vary) on a cluster of 4 nodes of one topology: once cold (memo empty, seed 1), then timed warm on a
second workload (seed 2, generated before the clock starts). Jobs/s = decisions/s: every job is
one decision.
``memory`` writes nothing to disk: it makes sacct --parsable2 text line by line, reads it with the
sacct reader and replays it, and prints the peak resident memory of the process (ru_maxrss).
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from datetime import datetime, timezone

from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.generate import NETWORKS, SENSITIVE, generate
from slurm_mapa.replay.sacct import read_sacct_text
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate

POLICIES = ("baseline", "topo-aware", "greedy", "preserve", "slurm-native", "slurm-native-gpus",
            "nvidia-besteffort", "first-fit", "round-robin", "hami-topology")


def speed(jobs: int, topologies: list[str], nodes: int, policies: tuple[str, ...] = POLICIES) -> None:
    print("| topology | policy | jobs | cold s | warm s | warm jobs/s | searches |")
    print("|---|---|---|---|---|---|---|")
    for topo in topologies:
        cluster = [Node(f"n{i}", preset(topo)) for i in range(nodes)]
        for policy in policies:
            decider = Decider()
            t0 = time.perf_counter()
            simulate(generate("paper", jobs, seed=1, load=4 * nodes), cluster, policy, decider=decider)
            cold = time.perf_counter() - t0
            workload = list(generate("paper", jobs, seed=2, load=4 * nodes))
            t0 = time.perf_counter()
            result = simulate(workload, cluster, policy, decider=decider)
            warm = time.perf_counter() - t0
            print(f"| {topo} | {policy} | {result.jobs} | {cold:.2f} | {warm:.2f} | {result.jobs / warm:,.0f} | {decider.searches} |")
            sys.stdout.flush()


def sacct_lines(jobs: int, nodes: int, recorded: int = 0):
    """A synthetic sacct --parsable2 log of the paper workload, line by line (``recorded`` > 0: the
    AdminComment of every ``recorded``-th job also carries a decision record, its lowest GPUs, for
    the decision audit)."""
    yield "JobID|JobName|User|Account|Partition|Submit|Start|End|State|NodeList|AllocTRES|AdminComment\n"
    base = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()

    def ts(s: float) -> str:
        return datetime.fromtimestamp(base + s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")

    # streamed: the paper's job mix with exponential arrival gaps (the paper generator sorts all
    # arrivals first, which would hold the whole workload in memory)
    rng = random.Random(1)
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(1.5 * nodes / 14.5)  # about 55% of the GPUs asked for: the queue stays short
        gpus, runtime = rng.randint(1, 5), rng.randint(5, 24)
        net = rng.choice(NETWORKS)
        sens = "yes" if SENSITIVE[net] else "no"
        record = f" # n{i % nodes}={','.join(map(str, range(gpus)))} policy=preserve" if recorded and i % recorded == 0 else ""
        yield (f"{1000 + i}|{net}|u|acct|gpu|{ts(t)}|{ts(t)}|{ts(t + runtime)}|"
               f"COMPLETED|n{i % nodes}|billing=1,cpu=1,gres/gpu={gpus},node=1|mapa:topology=ring sensitive={sens}{record}\n")


def memory(jobs: int, policy: str, topo: str, nodes: int) -> None:
    cluster = [Node(f"n{i}", preset(topo)) for i in range(nodes)]
    t0 = time.perf_counter()
    result = simulate(read_sacct_text(sacct_lines(jobs, nodes)), cluster, policy, decider=Decider(),
                      options=Options(pin_nodes=False))
    elapsed = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{result.jobs:,} jobs ({policy}, {nodes} x {topo}) in {elapsed:.1f} s "
          f"({result.jobs / elapsed:,.0f} jobs/s incl. parsing); peak RSS {peak_mib:.0f} MiB")


def figures(seeds: int, out_dir: str) -> None:
    """The docs' figures: sensitive jobs' effective bandwidth, 300-job paper workloads, ``seeds`` seeds pooled."""
    from slurm_mapa.replay.plots import boxplot_png
    from slurm_mapa.replay.stats import Dist

    paper = ("baseline", "topo-aware", "greedy", "preserve")
    groups = {}
    for topo, policies in (("dgx1-v100", POLICIES), ("torus2d-16", paper), ("cubemesh-16", paper)):
        pooled = []
        for policy in policies:
            merged = simulate(generate("paper", 0), [Node("n", preset(topo))], policy)  # an empty result to fill
            merged.eff_sensitive, merged.eff_insensitive, merged.runtime_sensitive = Dist(), Dist(), Dist()
            decider = Decider()
            for seed in range(1, seeds + 1):
                r = simulate(generate("paper", 300, seed=seed, load=4), [Node("n", preset(topo))], policy, decider=decider)
                for src, dst in ((r.eff_sensitive, merged.eff_sensitive), (r.eff_insensitive, merged.eff_insensitive)):
                    for v in src.values:
                        dst.add(v)
            pooled.append(merged)
            f = merged.eff_sensitive.five()
            print(f"| {topo} | {policy} | " + " | ".join(f"{f[k]:.1f}" for k in ("min", "p25", "median", "p75", "max")) + " |")
        groups[topo] = pooled
    boxplot_png(f"{out_dir}/replay-fig13-dgx1-sensitive.png", [("dgx1-v100", groups["dgx1-v100"])],
                title="sensitive jobs, paper workload (figure 13c)")
    boxplot_png(f"{out_dir}/replay-fig13-dgx1-insensitive.png", [("dgx1-v100", groups["dgx1-v100"])], what="insensitive",
                title="insensitive jobs, paper workload (figure 13d)")
    boxplot_png(f"{out_dir}/replay-fig18-16gpu.png", [("torus2d-16", groups["torus2d-16"]), ("cubemesh-16", groups["cubemesh-16"])],
                title="sensitive jobs on 16-GPU topologies (figure 18)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("speed", "memory", "figures"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--policy", default="preserve")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--topologies", default="dgx1-v100,torus2d-16")
    parser.add_argument("--policies", default=",".join(POLICIES), help="for speed (default: all)")
    args = parser.parse_args()
    if args.what == "figures":
        figures(args.seeds, args.out)
    elif args.what == "speed":
        speed(args.jobs or 20_000, args.topologies.split(","), args.nodes, tuple(args.policies.split(",")))
    else:
        memory(args.jobs or 1_000_000, args.policy, args.topologies.split(",")[0], args.nodes)


if __name__ == "__main__":
    main()
