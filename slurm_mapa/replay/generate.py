"""Workload generators, seeded and reproducible.

* ``paper``  - the MAPA paper's section 4 workload: GPUs uniform on 1..5, a uniform mix of the six
  Caffe networks of figure 5 (AlexNet, Inception-v3, ResNet-50, VGG-16 sensitive; CaffeNet,
  GoogleNet insensitive), ring patterns (or a uniform choice among the patterns asked for), service
  times uniform on 5..24 and arrivals uniform over the expected busy span, sorted, as the
  reference generator draws them.
* ``amaral`` - Amaral et al. (SC'17): Poisson arrivals (exponential gaps, mean 10), GPUs 1 +
  Binomial(2, 0.39) (1..3), the same network mix for sensitivity.
"""

from __future__ import annotations

import random
from typing import Iterator, Sequence

from ..core.patterns import SHAPES
from ..errors import InputError
from .jobs import Job

NETWORKS = ("alexnet", "inception-v3", "resnet-50", "vgg16", "googlenet", "caffenet")
SENSITIVE = {"alexnet": True, "inception-v3": True, "resnet-50": True, "vgg16": True, "googlenet": False, "caffenet": False}
GENERATORS = ("paper", "amaral")


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
    rng = random.Random(seed)
    if kind == "paper":
        span = (min_service + max_service) / 2 * jobs / load
        drawn = []
        for i in range(jobs):
            net = rng.choice(NETWORKS)
            drawn.append(
                (
                    rng.uniform(0, span),
                    rng.randint(min_gpus, max_gpus),
                    rng.choice(list(patterns)),
                    rng.randint(min_service, max_service),
                    net,
                )
            )
        arrivals = sorted(d[0] for d in drawn)
        for i, (arrival, (_, gpus, shape, service, net)) in enumerate(zip(arrivals, drawn)):
            yield Job(str(i), float(round(arrival)), float(service), gpus, shape, SENSITIVE[net], task=f"{net}.sh", source="generator")
        return
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_gap)
        net = rng.choice(NETWORKS)
        gpus = min(max_gpus, max(min_gpus, 1 + sum(rng.random() < 0.39 for _ in range(2))))
        service = rng.randint(min_service, max_service)
        yield Job(str(i), round(t, 3), float(service), gpus, rng.choice(list(patterns)), SENSITIVE[net], task=f"{net}.sh", source="generator")
