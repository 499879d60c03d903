"""Decision time of the policies, from an idle node (the worst case: every GPU free).

    .venv/bin/python benchmarks/bench_decision.py [--repeat N] [--max-gpus K]     # prints a Markdown table

Each cell is the median over N decisions in one warm process (caches of the first call, such
as the model file and the 16-GPU subset tables, are built before timing). All cells run side by
side in the same process, so ratios between them are meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.hardware.presets import preset

CASES = [("dgx1-v100", range(1, 9)), ("dgx-a100", range(1, 9)), ("torus2d-16", range(1, 17)), ("cubemesh-16", range(1, 17))]
POLICIES = [("preserve", True), ("preserve", False), ("greedy", True), ("baseline", True), ("topo-aware", True)]


def median_ms(graph, k, policy, sensitive, repeat):
    request = Request(make_pattern("ring", k), sensitive)
    select(policy, graph, range(graph.size), request)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        select(policy, graph, range(graph.size), request)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--max-gpus", type=int, default=16)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
    header = ["topology", "GPUs"] + [f"{p}{' (sensitive)' if s and p == 'preserve' else ' (insensitive)' if p == 'preserve' else ''}" for p, s in POLICIES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, sizes in CASES:
        graph = preset(name)
        for k in sizes:
            if k > args.max_gpus:
                continue
            cells = [f"{median_ms(graph, k, policy, sensitive, args.repeat):.2f}" for policy, sensitive in POLICIES]
            print(f"| {name} | {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
