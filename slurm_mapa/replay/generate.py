"""Workload generators, seeded and reproducible.

* ``paper``  - the MAPA paper's section 4 workload: GPUs uniform on 1..5, a uniform mix of the six
  Caffe networks of figure 5 (AlexNet, Inception-v3, ResNet-50, VGG-16 sensitive; CaffeNet,
  GoogleNet insensitive), ring patterns (or a uniform choice among the patterns asked for), service
  times uniform on 5..24 and arrivals uniform over the expected busy span, sorted, as the
  reference generator draws them.
* ``multinode`` - one-node and multi-node jobs for clusters with NVLink domains (issue 51), see
  :func:`slurm_mapa.replay.domains.multinode_jobs`.
* ``amaral`` - Amaral et al. (SC'17): Poisson arrivals (exponential gaps, mean 10), GPUs 1 +
  Binomial(2, 0.39) (1..3), the same network mix for sensitivity.
"""

from __future__ import annotations

import random
from array import array
from typing import Iterator, Sequence

from ..core.patterns import SHAPES
from ..errors import InputError
from .jobs import Job

NETWORKS = ("alexnet", "inception-v3", "resnet-50", "vgg16", "googlenet", "caffenet")
SENSITIVE = {"alexnet": True, "inception-v3": True, "resnet-50": True, "vgg16": True, "googlenet": False, "caffenet": False}
GENERATORS = ("paper", "amaral", "multinode")


def generate(
    kind: str,
    jobs: int,
    *,
    seed: int = 1,
    min_gpus: int = 1,
    max_gpus: int = 5,
    patterns: Sequence[str] = ("ring",),
    min_service: int = 5,
    max_service: int = 24,
    mean_gap: float = 10.0,
    load: float = 1.0,
) -> Iterator[Job]:
    """``jobs`` jobs of the ``kind`` workload. ``load`` > 1 packs arrivals closer (paper only)."""
    if kind not in GENERATORS:
        raise InputError(f"unknown workload generator {kind!r} (accepted: {', '.join(GENERATORS)})")
    if jobs < 0:
        raise InputError(f"job count must be 0 or more, got {jobs}")
    for shape in patterns:
        if shape not in SHAPES:
            raise InputError(f"unknown pattern {shape!r} (accepted: {', '.join(SHAPES)})")
    if not 1 <= min_gpus <= max_gpus:
        raise InputError(f"GPU range {min_gpus}..{max_gpus} is empty")
    if not 0 < min_service <= max_service:
        raise InputError(f"service range {min_service}..{max_service} is empty")
    if load <= 0:
        raise InputError(f"load must be positive, got {load}")
    if kind == "multinode":
        from .domains import multinode_jobs

        yield from multinode_jobs(jobs, seed, load)
        return
    if kind == "paper":
        yield from _paper(jobs, seed, min_gpus, max_gpus, tuple(patterns), min_service, max_service, load)
        return
    rng = random.Random(seed)
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_gap)
        net = rng.choice(NETWORKS)
        gpus = min(max_gpus, max(min_gpus, 1 + sum(rng.random() < 0.39 for _ in range(2))))
        service = rng.randint(min_service, max_service)
        yield Job(str(i), round(t, 3), float(service), gpus, rng.choice(list(patterns)), SENSITIVE[net], task=f"{net}.sh", source="generator")


# Arrival times per counting pass of the paper workload: 2^21 whole time units (8 MiB of counts).
ARRIVAL_WINDOW = 1 << 21


def _paper(jobs: int, seed: int, min_gpus: int, max_gpus: int, patterns: tuple[str, ...], min_service: int,
           max_service: int, load: float) -> Iterator[Job]:
    """The paper workload in memory independent of ``jobs``, the same jobs as drawing them all at once.

    The reference generator draws every job (network, arrival, GPUs, pattern, service), sorts the
    arrivals and hands the i-th smallest, rounded to a whole time unit, to the i-th job drawn.
    Rounding keeps the order, so the submit times are the sorted rounded arrivals: counting how
    many arrivals round to each whole time unit (a pass over the same random draws) gives them in
    order without keeping the draws; a second pass draws the jobs again and pairs them up. A
    workload spread over more than ``ARRIVAL_WINDOW`` time units is counted one window per pass.
    """
    span = (min_service + max_service) / 2 * jobs / load
    shapes = list(patterns)

    def arrivals_in(low: int, width: int) -> array:
        counts = array("I", bytes(4 * width))
        rng = random.Random(seed)
        choice, uniform, randint = rng.choice, rng.uniform, rng.randint
        for _ in range(jobs):  # the same calls as the jobs' draws below, in the same order
            choice(NETWORKS)
            offset = round(uniform(0, span)) - low
            randint(min_gpus, max_gpus)
            choice(shapes)
            randint(min_service, max_service)
            if 0 <= offset < width:
                counts[offset] += 1
        return counts

    def submits() -> Iterator[float]:
        top = round(span)
        for low in range(0, top + 1, ARRIVAL_WINDOW):
            counts = arrivals_in(low, min(ARRIVAL_WINDOW, top + 1 - low))
            for offset, count in enumerate(counts):
                if count:
                    value = float(low + offset)
                    for _ in range(count):
                        yield value

    rng = random.Random(seed)
    choice, uniform, randint = rng.choice, rng.uniform, rng.randint
    times = submits()
    for i in range(jobs):
        net = choice(NETWORKS)
        uniform(0, span)
        gpus = randint(min_gpus, max_gpus)
        shape = choice(shapes)
        service = randint(min_service, max_service)
        yield Job(str(i), next(times), float(service), gpus, shape, SENSITIVE[net], task=f"{net}.sh", source="generator")
