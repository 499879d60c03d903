"""Clusters with NVLink domains and their replay (issue 51, first step).

A domain cluster is a list of nodes grouped into NVLink domains: ``--cluster 4xgb200-nvl72`` is
four GB200 NVL72 racks of 18 compute trays (``gb200-nvl72-tray``: 4 GPUs each), every rack one
domain; ``gb200-nvl36x2`` racks are two domains of 9 trays. A cluster can also be read from
Slurm's own block topology (``--cluster topology.conf`` or ``topology.yaml``: each block one
domain, its nodes of ``--topology``, by default the tray).

:func:`simulate_domains` replays jobs on it, node by node: FIFO with head-of-line blocking (with
``backfill`` later jobs may start while the head waits), each job's nodes chosen by a domain policy
of :mod:`slurm_mapa.core.domains`. A multi-node job takes ``gpus`` GPUs on each of ``nodes`` nodes;
a one-node job packs into a tray. What is measured: for sensitive multi-node jobs that fit one
domain, how many got one; the GPUs stranded (free while the queue's head waits: free but unusable
by it), as a mean over time; waits.
"""

from __future__ import annotations

import heapq
import os
import random
from collections import deque
from dataclasses import dataclass, field
from math import inf
from typing import Iterable, Iterator, Sequence

from ..core.domains import DOMAIN_POLICIES, effective_need, one_domain, place
from ..errors import InputError
from ..slurm.text.topology import parse_block_topology
from .config import graph_of
from .jobs import Job
from .options import Node

TRAY = "gb200-nvl72-tray"
# rack kind -> (trays per rack, domains per rack)
RACKS = {"gb200-nvl72": (18, 1), "gb200-nvl36x2": (18, 2)}


@dataclass
class DomainCluster:
    nodes: list[Node]
    domains: list[list[int]]  # node indices per domain, in node order
    names: list[str]  # one per domain
    block_sizes: tuple[int, ...] = ()
    source: str = ""

    @property
    def capacity(self) -> int:
        return min(node.graph.size for node in self.nodes)

    @property
    def largest_domain(self) -> int:
        return max(len(d) for d in self.domains)


def is_domain_cluster(spec: str | None) -> bool:
    """Whether ``--cluster`` names racks with NVLink domains or a Slurm block topology file."""
    if not spec:
        return False
    if os.path.isfile(spec) and spec.endswith((".conf", ".yaml", ".yml")):
        return True
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    return bool(parts) and all(p.partition("x")[2] in RACKS for p in parts)


def rack_cluster(spec: str) -> DomainCluster:
    """``4xgb200-nvl72`` or ``2xgb200-nvl72,1xgb200-nvl36x2``: racks in order, trays named ``nvlR-TT``."""
    nodes: list[Node] = []
    domains: list[list[int]] = []
    names: list[str] = []
    graph = graph_of(TRAY)
    rack = 0
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        count, _, kind = part.partition("x")
        if not count.isdigit() or int(count) < 1 or kind not in RACKS:
            raise InputError(f"--cluster part {part!r} (accepted: COUNTxRACK, RACK one of {', '.join(RACKS)})")
        trays, per_rack = RACKS[kind]
        for _ in range(int(count)):
            rack += 1
            size = trays // per_rack
            for k in range(per_rack):
                names.append(f"nvl{rack}" + (f"{'ab'[k]}" if per_rack > 1 else ""))
                domains.append([])
                for t in range(k * size, (k + 1) * size):
                    domains[-1].append(len(nodes))
                    nodes.append(Node(f"nvl{rack}-{t + 1:02d}", graph))
    return DomainCluster(nodes, domains, names, (), spec)


def file_cluster(path: str, topology: str | None = None) -> DomainCluster:
    """The blocks of a topology.conf / topology.yaml file as domains, every node a ``topology``."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1 << 20)
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--cluster {path}: cannot read it: {error}") from None
    blocks = parse_block_topology(text, path)
    graph = graph_of(topology or TRAY)
    nodes: list[Node] = []
    domains: list[list[int]] = []
    for _, members in blocks.blocks:
        domains.append(list(range(len(nodes), len(nodes) + len(members))))
        nodes += [Node(name, graph) for name in members]
    return DomainCluster(nodes, domains, [name for name, _ in blocks.blocks], blocks.block_sizes, path)


def domain_cluster(spec: str, topology: str | None = None) -> DomainCluster:
    if os.path.isfile(spec):
        return file_cluster(spec, topology)
    return rack_cluster(spec)


# --- a generated multi-node workload -----------------------------------------------------------


def multinode_jobs(jobs: int, seed: int = 1, load: float = 1.0) -> Iterator[Job]:
    """Half one-node jobs (1-4 GPUs of a tray, a third of them sensitive), half multi-node jobs of
    whole trays (2, 4, 8, 16 or 18 nodes; 70 % sensitive); service times uniform on 5..60, Poisson
    arrivals whose mean gap (1.65 / ``load``) loads four NVL72 racks (288 GPUs) about fully."""
    rng = random.Random(seed)
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(load / 1.65)
        service = float(rng.randint(5, 60))
        if rng.random() < 0.5:
            yield Job(str(i), round(t, 3), service, rng.randint(1, 4), "ring", rng.random() < 1 / 3, 1,
                      task="small.sh", source="generator")
        else:
            nodes = rng.choices((2, 4, 8, 16, 18), weights=(30, 30, 20, 15, 5))[0]
            yield Job(str(i), round(t, 3), service, 4, "ring", rng.random() < 0.7, nodes, task="multinode.sh",
                      source="generator")


# --- the replay ----------------------------------------------------------------------------------


@dataclass
class DomainResult:
    policy: str
    jobs: int = 0
    started: int = 0
    dropped: int = 0
    stuck: int = 0
    fit: int = 0  # sensitive multi-node jobs that fit one domain
    kept: int = 0  # ... and were placed inside one
    spread: int = 0  # multi-node jobs of any kind placed over more than one domain
    waits: list[float] = field(default_factory=list)
    sensitive_waits: list[float] = field(default_factory=list)  # sensitive multi-node jobs
    stranded_area: float = 0.0
    covered: float = 0.0
    first_submit: float = inf
    last_end: float = -inf

    def summary(self) -> dict:
        def mean(values: Sequence[float]) -> float | None:
            return round(sum(values) / len(values), 3) if values else None

        def median(values: Sequence[float]) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            mid = len(ordered) // 2
            return round(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2, 3)

        return {
            "policy": self.policy,
            "one_domain_sensitive": {"fit": self.fit, "kept": self.kept,
                                     "share": round(self.kept / self.fit, 4) if self.fit else None},
            "multi_node_spread": self.spread,
            "wait_mean": mean(self.waits),
            "wait_median": median(self.waits),
            "wait_max": round(max(self.waits), 3) if self.waits else None,
            "sensitive_multi_node_wait_mean": mean(self.sensitive_waits),
            "stranded_gpus_mean": round(self.stranded_area / self.covered, 3) if self.covered else 0.0,
            "makespan": round(self.last_end - self.first_submit, 3) if self.started else None,
            "jobs": self.jobs, "started": self.started, "dropped": self.dropped, "stuck": self.stuck,
        }


def simulate_domains(jobs: Iterable[Job], cluster: DomainCluster, policy: str, *, seed: int = 1,
                     backfill: bool = False, backfill_depth: int = 64) -> DomainResult:
    """Replay ``jobs`` (in submit order) on ``cluster`` with the domain policy ``policy``."""
    if policy not in DOMAIN_POLICIES:
        raise InputError(f"unknown domain policy {policy!r} (accepted: {', '.join(DOMAIN_POLICIES)})")
    result = DomainResult(policy)
    capacity = cluster.capacity
    largest = cluster.largest_domain
    free = [[capacity] * len(domain) for domain in cluster.domains]
    total_free = capacity * len(cluster.nodes)
    rng = random.Random(seed)
    queue: deque = deque()  # (job, need)
    running: list = []  # heap of (end, seq, placement, gpus)
    seq = 0
    pending = sorted(jobs, key=lambda job: job.submit)
    arrival = 0
    last_t: float | None = None
    stranded = 0

    def try_start(job: Job, need: str, t: float) -> bool:
        nonlocal seq, total_free
        placement = place(policy, free, capacity, job.nodes, job.gpus, need, rng=rng, block_sizes=cluster.block_sizes)
        if placement is None:
            return False
        for d, j in placement:
            free[d][j] -= job.gpus
        total_free -= job.gpus * job.nodes
        end = t + job.runtime
        heapq.heappush(running, (end, seq, placement, job.gpus))
        seq += 1
        result.started += 1
        result.waits.append(t - job.submit)
        result.last_end = max(result.last_end, end)
        if job.nodes > 1:
            inside = one_domain(placement)
            result.spread += not inside
            if job.sensitive:
                result.sensitive_waits.append(t - job.submit)
                if job.nodes <= largest:
                    result.fit += 1
                    result.kept += inside
        return True

    while True:
        t = min(pending[arrival].submit if arrival < len(pending) else inf, running[0][0] if running else inf)
        if t == inf:
            result.stuck = len(queue)
            break
        if last_t is not None and t > last_t:
            result.stranded_area += stranded * (t - last_t)
            result.covered += t - last_t
        last_t = t
        while running and running[0][0] <= t:
            _, _, placement, gpus = heapq.heappop(running)
            for d, j in placement:
                free[d][j] += gpus
            total_free += gpus * len(placement)
        while arrival < len(pending) and pending[arrival].submit <= t:
            job = pending[arrival]
            arrival += 1
            result.jobs += 1
            result.first_submit = min(result.first_submit, job.submit)
            if job.gpus > capacity or job.nodes > len(cluster.nodes) or job.gpus < 1 or job.nodes < 1:
                result.dropped += 1
                continue
            queue.append((job, effective_need(getattr(job, "domain", None), job.sensitive, job.nodes, largest)))
        index = scanned = 0
        while index < len(queue):
            job, need = queue[index]
            if try_start(job, need, t):
                del queue[index]
                continue
            if not backfill:
                break
            scanned += 1
            if scanned > backfill_depth:
                break
            index += 1
        stranded = total_free if queue else 0
    return result
