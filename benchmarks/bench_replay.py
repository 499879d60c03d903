"""Replay speed and memory: jobs per second per policy on 8- and 16-GPU nodes, and peak memory of a
streamed one-million-job sacct log.

    .venv/bin/python benchmarks/bench_replay.py speed [--jobs 20000]
    .venv/bin/python benchmarks/bench_replay.py memory [--jobs 1000000] [--policy preserve]
    .venv/bin/python benchmarks/bench_replay.py figures [--seeds 5] [--model NAME] [--judge NAME|ranking]
    .venv/bin/python benchmarks/bench_replay.py judged [--jobs 3000] [--seeds 5] [--nodes 1,4] [--loads 1,2,4,8]
    .venv/bin/python benchmarks/bench_replay.py trade [--jobs 3000] [--seeds 5]

``speed`` replays the paper workload (arrivals packed 4x per node, so nodes are busy and free sets
vary) on a cluster of 4 nodes of one topology: once cold (memo empty, seed 1), then timed warm on a
second workload (seed 2, generated before the clock starts). Jobs/s = decisions/s: every job is
one decision.
``memory`` writes nothing to disk: it makes sacct --parsable2 text line by line, reads it with the
sacct reader and replays it, and prints the peak resident memory of the process (ru_maxrss).
``judged`` (issue 38): the paper workload on DGX-1 V100 nodes for each node count and arrival
density, each node type's default ranking model, judged by the link-bound model: per job size, the
sensitive jobs' p10 and median under MAPA (preserve) and the best peer at each, and the share of
sensitive jobs whose GPUs hold a ring over NVLinks only; seeds pooled.
``trade``: where MAPA's 3-GPU jobs lose their NVLink triangles: the share of them on one under
MAPA, under hami-topology, and under MAPA with hami-topology's choice for one kind of job only
(5-GPU sensitive jobs; insensitive jobs), on 4 nodes at densities 2 and 4 and 1 node at 1.
"""

from __future__ import annotations

import argparse
import os
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


def figures(seeds: int, out_dir: str | None, model_name: str | None = None, judge_name: str | None = None) -> None:
    """The docs' figures: sensitive jobs' effective bandwidth, 300-job paper workloads, ``seeds`` seeds pooled.
    ``model_name``: one ranking model for every node (None: each node type's own); ``judge_name``: what
    judges (None: the link-bound model; "ranking": the ranking model, as the paper judged). The paper's
    figures are reproduced with ``--model mapa-paper-dgx1 --judge ranking``; ``out_dir`` None: no plots."""
    from slurm_mapa.core.model_files import load_model
    from slurm_mapa.replay.plots import boxplot_png
    from slurm_mapa.replay.simulate import JUDGE_RANKING
    from slurm_mapa.replay.stats import Dist

    model = load_model(model_name) if model_name else None
    judge = JUDGE_RANKING if judge_name == "ranking" else load_model(judge_name) if judge_name else None

    paper = ("baseline", "topo-aware", "greedy", "preserve")
    groups = {}
    for topo, policies in (("dgx1-v100", POLICIES), ("torus2d-16", paper), ("cubemesh-16", paper)):
        pooled = []
        for policy in policies:
            decider = Decider(model, judge=judge)
            merged = simulate(generate("paper", 0), [Node("n", preset(topo))], policy, decider=decider)  # an empty result to fill
            merged.eff_sensitive, merged.eff_insensitive, merged.runtime_sensitive = Dist(), Dist(), Dist()
            for seed in range(1, seeds + 1):
                r = simulate(generate("paper", 300, seed=seed, load=4), [Node("n", preset(topo))], policy, decider=decider)
                for src, dst in ((r.eff_sensitive, merged.eff_sensitive), (r.eff_insensitive, merged.eff_insensitive)):
                    for v in src.values:
                        dst.add(v)
            pooled.append(merged)
            f = merged.eff_sensitive.five()
            print(f"| {topo} | {policy} | " + " | ".join(f"{f[k]:.1f}" for k in ("min", "p25", "median", "p75", "max")) + " |")
        groups[topo] = pooled
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    boxplot_png(f"{out_dir}/replay-fig13-dgx1-sensitive.png", [("dgx1-v100", groups["dgx1-v100"])],
                title="sensitive jobs, paper workload (figure 13c)")
    boxplot_png(f"{out_dir}/replay-fig13-dgx1-insensitive.png", [("dgx1-v100", groups["dgx1-v100"])], what="insensitive",
                title="insensitive jobs, paper workload (figure 13d)")
    boxplot_png(f"{out_dir}/replay-fig18-16gpu.png", [("torus2d-16", groups["torus2d-16"]), ("cubemesh-16", groups["cubemesh-16"])],
                title="sensitive jobs on 16-GPU topologies (figure 18)")


PEERS = tuple(p for p in POLICIES if p != "preserve")


def judged(jobs: int, seeds: int, node_counts: list[int], loads: list[float]) -> None:
    from slurm_mapa.replay.stats import Dist

    graph = preset("dgx1-v100")
    print("| nodes | load | GPUs | MAPA p10 | best peer p10 | MAPA median | best peer median | MAPA fast rings | peers' best fast rings |")
    print("|---|---|---|---|---|---|---|---|---|")
    for nodes in node_counts:
        cluster = [Node(f"n{i}", graph) for i in range(nodes)]
        for load in loads:
            pooled: dict[str, dict[int, list]] = {}
            decider = Decider()
            for policy in ("preserve", *PEERS):
                sizes = pooled[policy] = {}
                for seed in range(1, seeds + 1):
                    result = simulate(generate("paper", jobs, seed=seed, load=load), cluster, policy, Options(), decider=decider)
                    for k, size in result.by_gpus.items():
                        if k < 2:
                            continue
                        dist, checked, fast = sizes.setdefault(k, [Dist(), 0, 0])
                        for value in size.eff_sensitive.values:
                            dist.add(value)
                        sizes[k][1] += size.ring_checked
                        sizes[k][2] += size.fast_ring
            for k in sorted(pooled["preserve"]):
                mapa, _, _ = pooled["preserve"][k]

                def best(q):
                    value = max(pooled[p][k][0].quantile(q) for p in PEERS)
                    return value, [p for p in PEERS if pooled[p][k][0].quantile(q) == value]

                def share(policy):
                    _, checked, fast = pooled[policy][k]
                    return fast / checked if checked else 0.0

                cells = []
                for q in (0.1, 0.5):
                    value, who = best(q)
                    ours = mapa.quantile(q)
                    mark = "**" if ours > value + 1e-9 else ""
                    cells += [f"{mark}{ours:.1f}{mark}", f"{value:.1f} ({who[0]}{' +' + str(len(who) - 1) if len(who) > 1 else ''})"]
                peers_share = max(share(p) for p in PEERS)
                print(f"| {nodes} | {load:g} | {k} | " + " | ".join(cells) + f" | {share('preserve'):.0%} | {peers_share:.0%} |")


def trade(jobs: int, seeds: int) -> None:
    import slurm_mapa.replay.simulate as simulator
    from slurm_mapa.core.peers import PEER_POLICIES
    from slurm_mapa.core.policies import POLICIES

    mapa, peer = POLICIES["preserve"], PEER_POLICIES["hami-topology"]

    def peer_for_5(graph, free, request, model, **_):
        chosen = peer if request.sensitive and request.gpus == 5 else mapa
        return chosen(graph, free, request, model)

    def peer_for_insensitive(graph, free, request, model, **_):
        chosen = mapa if request.sensitive and request.gpus > 1 else peer
        return chosen(graph, free, request, model)

    variants = {"preserve": "preserve", "hami-topology": "hami-topology",
                "preserve, hami's 5-GPU choice": "bench-peer-for-5", "preserve, hami's insensitive choice": "bench-peer-insensitive"}
    simulator.ALL_POLICIES.update({"bench-peer-for-5": peer_for_5, "bench-peer-insensitive": peer_for_insensitive})
    graph = preset("dgx1-v100")
    print("| nodes | load | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for nodes, load in ((4, 2.0), (4, 4.0), (1, 1.0)):
        cluster = [Node(f"n{i}", graph) for i in range(nodes)]
        decider = Decider()
        cells = []
        for policy in variants.values():
            fast = checked = 0
            for seed in range(1, seeds + 1):
                size = simulate(generate("paper", jobs, seed=seed, load=load), cluster, policy, Options(), decider=decider).by_gpus.get(3)
                if size is not None:
                    fast, checked = fast + size.fast_ring, checked + size.ring_checked
            cells.append(f"{fast / checked:.0%}" if checked else "-")
        print(f"| {nodes} | {load:g} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("speed", "memory", "figures", "judged", "trade"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="docs/img", help="where the figures go ('none': no plots)")
    parser.add_argument("--model", help="figures: one ranking model for every node (default: each node type's own)")
    parser.add_argument("--judge", help="figures: the judging model, or 'ranking' (default: link-bound)")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--policy", default="preserve")
    parser.add_argument("--nodes", help="node count (default 4; judged: a comma-separated list, default 1,4)")
    parser.add_argument("--loads", default="1,2,4,8", help="judged: arrival densities")
    parser.add_argument("--topologies", default="dgx1-v100,torus2d-16")
    parser.add_argument("--policies", default=",".join(POLICIES), help="for speed (default: all)")
    args = parser.parse_args()
    if args.what == "trade":
        trade(args.jobs or 3000, args.seeds)
    elif args.what == "judged":
        judged(args.jobs or 3000, args.seeds, [int(n) for n in (args.nodes or "1,4").split(",")],
               [float(x) for x in args.loads.split(",")])
    elif args.what == "figures":
        figures(args.seeds, None if args.out == "none" else args.out, args.model, args.judge)
    elif args.what == "speed":
        speed(args.jobs or 20_000, args.topologies.split(","), int(args.nodes or 4), tuple(args.policies.split(",")))
    else:
        memory(args.jobs or 1_000_000, args.policy, args.topologies.split(",")[0], int(args.nodes or 4))


if __name__ == "__main__":
    main()
