"""Every policy on big nodes under the Prolog's search limit (issue 28): the slowest decision per
(node, policy), through select() with SearchLimit(seconds=0.2) as the Prolog calls it.

Each decision list runs twice: cold (a fresh process, as an in-process Prolog) and warm (the same
decisions again, as mapa-agent meets them after its warm-up). Nodes: bench_bignode's (the 16-GPU presets, four 8-GPU NVSwitch islands, a 4x8 torus, a 64-GPU
NVSwitch node). Decisions: ring jobs of 2, 4, 8, 12, 16, 24, half and all-but-one GPUs,
sensitive and not, on the idle node or a random free set (seeded). A decision past ``--cap``
seconds is stopped (SIGALRM) and shown as "> cap": the peers' own set searches are their
originals' exponential algorithms, which no limit bounds.

    .venv/bin/python benchmarks/bench_policies_bignode.py [--cap 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_bignode import graphs  # noqa: E402

from slurm_mapa.core.patterns import make_pattern  # noqa: E402
from slurm_mapa.core.policies import Request, all_policies, select  # noqa: E402
from slurm_mapa.core.search import SearchLimit  # noqa: E402
from slurm_mapa.core.server_models import matching_model  # noqa: E402

PROLOG_LIMIT_S = 0.2


class _Stopped(Exception):
    pass


def _stop(*_):
    raise _Stopped()


def _disarm() -> None:
    """Stop the timer. An alarm that fires as a decision ends can land here, inside the finally
    that disarms it (seen with --cap 0.05 on a loaded machine): the decision is over, so that
    alarm is dropped rather than raised out of the benchmark."""
    while True:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        except _Stopped:
            continue


def cases(size: int, rng: random.Random):
    for k in sorted({2, 4, 8, 12, 16, 24, size // 2, size - 1}):
        if not 1 <= k < size:
            continue
        for sensitive in (False, True):
            free = tuple(range(size)) if rng.random() < 0.5 else tuple(sorted(rng.sample(range(size), rng.randint(k, size))))
            yield Request(make_pattern("ring", k), sensitive=sensitive), free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=3.0, help="seconds before a decision is stopped")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # The core imports numpy lazily, inside a decision; an alarm that stops a decision during that
    # first import leaves numpy half-loaded, and no later import in this process can load it again.
    # So it is imported before any decision is timed (mapa-agent has it loaded after its warm-up).
    import numpy  # noqa: F401

    signal.signal(signal.SIGALRM, _stop)
    rng = random.Random(args.seed)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"limit {PROLOG_LIMIT_S} s per decision, cap {args.cap} s")
    print("| node | GPUs | policy | decisions | slowest ms, cold | slowest ms, warm | its job (warm) | chosen by another policy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, graph in graphs().items():
        model = matching_model(graph)
        todo = list(cases(graph.size, rng))
        for policy in all_policies():
            shown, worst_case, others = [], "", 0
            for warm in (False, True):  # warm: the same decisions again, as mapa-agent meets them
                worst = 0.0
                for request, free in todo:
                    started = time.monotonic()
                    limit = SearchLimit(seconds=PROLOG_LIMIT_S, clock=time.monotonic, until=started + PROLOG_LIMIT_S)
                    try:
                        # Armed inside the try: under load the timer may fire before the next line runs.
                        signal.setitimer(signal.ITIMER_REAL, args.cap)
                        result = select(policy, graph, free, request, model, limit=limit)
                        took = time.monotonic() - started
                        others += warm and getattr(result, "policy", policy) != policy
                    except _Stopped:
                        took = float("inf")
                    finally:
                        _disarm()
                    if took > worst:
                        worst = took
                        worst_case = f"{request.gpus} of {len(free)} free, {'sensitive' if request.sensitive else 'insensitive'}"
                shown.append(f"> {args.cap * 1000:.0f}" if worst == float("inf") else f"{worst * 1000:.0f}")
                if worst == float("inf"):
                    shown.append("not run")  # an unbounded search would only be stopped again
                    break
            print(f"| {name} | {graph.size} | {policy} | {len(todo)} | {shown[0]} | {shown[1]} | {worst_case} | {others} |", flush=True)

if __name__ == "__main__":
    main()
