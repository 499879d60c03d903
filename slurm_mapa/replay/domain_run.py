"""``mapa-replay run`` on a cluster with NVLink domains (issue 51): every domain policy, one report.

The headline comes first: the share of the sensitive multi-node jobs that fit one domain and got
one, MAPA's and the others'. Then one row per policy: that share, multi-node jobs spread over
domains, waits, the GPUs stranded (free while the queue's head waits) as a mean over time. JSON:
``policies[*].one_domain_sensitive`` = {fit, kept, share}.
"""

from __future__ import annotations

import json
import sys

from ..core.domains import DOMAIN_POLICIES
from ..errors import InputError
from .domains import DomainCluster, DomainResult, domain_cluster, simulate_domains
from .jobs import ReadStats
from .sources import Source

LABELS = {"mapa": "MAPA", "block": "Slurm topology/block", "first-fit": "first-fit", "random": "random"}

# What the replay assumes; printed with the report and kept in its JSON.
ASSUMPTIONS = (
    "a job runs as long as in the input whatever its placement (no time model across domains yet): "
    "waits differ only where a policy cannot place a job that another can",
    "inside a domain every GPU reaches every other at 900 GB/s per direction (NVLink 5, 18 links x 50 GB/s); "
    "across domains the traffic goes over the network, assumed 50 GB/s per GPU (one 400 Gb/s NIC per GPU): "
    "an assumption, not a measurement, and not used in the run times",
    "stranded GPUs: all free GPUs while the queue's head waits (none while the queue is empty)",
    "first-fit and random do not see domains (Slurm without topology/block); block and MAPA hold a job that "
    "needs one domain until one has room",
)


def _policies(text: str | None) -> list[str]:
    if not text or text.strip().lower() == "all":
        return list(DOMAIN_POLICIES)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in DOMAIN_POLICIES]
    if unknown:
        raise InputError(f"--policies {', '.join(unknown)}: on a cluster with NVLink domains the policies are "
                         f"{', '.join(DOMAIN_POLICIES)}")
    return chosen


def _pct(result: DomainResult) -> str:
    return f"{100 * result.kept / result.fit:.0f}%" if result.fit else "n/a"


def headline(results: list[DomainResult]) -> str:
    """``multi-node sensitive jobs kept inside one NVLink domain: MAPA X% (k of n that fit one), the others ...``"""
    mapa = next((r for r in results if r.policy == "mapa"), None)
    others = [r for r in results if r is not mapa]
    text = "multi-node sensitive jobs kept inside one NVLink domain: "
    if mapa is not None:
        text += f"MAPA {_pct(mapa)} ({mapa.kept} of {mapa.fit} that fit one)"
        if others:
            text += ", the others: " + ", ".join(f"{LABELS[r.policy]} {_pct(r)}" for r in others)
    else:
        text += ", ".join(f"{LABELS[r.policy]} {_pct(r)}" for r in others)
    return text


def _fmt(value) -> str:
    return "-" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))


def table(rows: list[dict]) -> str:
    head = ("policy", "one domain", "spread", "wait mean", "wait median", "sens. multi wait", "stranded GPUs", "makespan", "stuck")
    lines = [head]
    for row in rows:
        one = row["one_domain_sensitive"]
        lines.append((LABELS[row["policy"]], f"{one['kept']}/{one['fit']}", _fmt(row["multi_node_spread"]),
                      _fmt(row["wait_mean"]), _fmt(row["wait_median"]), _fmt(row["sensitive_multi_node_wait_mean"]),
                      _fmt(row["stranded_gpus_mean"]), _fmt(row["makespan"]), _fmt(row["stuck"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


def describe(cluster: DomainCluster) -> str:
    sizes = sorted({len(d) for d in cluster.domains})
    return (f"{len(cluster.nodes)} node(s) ({', '.join(sorted({n.graph.name for n in cluster.nodes}))}, "
            f"{cluster.capacity} GPUs each) in {len(cluster.domains)} NVLink domain(s) of "
            f"{'/'.join(map(str, sizes))} nodes" + (f"; BlockSizes={','.join(map(str, cluster.block_sizes))}" if cluster.block_sizes else ""))


def domain_replay(args, source: Source, label: str, *, collect: list[dict] | None = None) -> int:
    """Replay ``source`` on the domain cluster of ``--cluster`` with every domain policy and report it."""
    cluster = domain_cluster(args.cluster, getattr(args, "topology", None))
    policies = _policies(getattr(args, "policies", None))
    seed = getattr(args, "seed", 1)
    backfill = bool(getattr(args, "backfill", False))
    results = []
    for i, policy in enumerate(policies):
        stats = source.stats if i == 0 else ReadStats()
        results.append(simulate_domains(source.jobs(stats), cluster, policy, seed=seed, backfill=backfill))
    if not any(r.started for r in results):
        raise InputError(f"{label}: no job fits this cluster ({describe(cluster)})")
    rows = [r.summary() for r in results]
    line = headline(results)
    doc = {
        "input": label,
        "headline": [line],
        "cluster": {"source": cluster.source, "nodes": len(cluster.nodes), "gpus_per_node": cluster.capacity,
                    "domains": [{"name": name, "nodes": len(members)} for name, members in zip(cluster.names, cluster.domains)],
                    "block_sizes": list(cluster.block_sizes)},
        "read": source.stats.as_dict(),
        "options": {"backfill": backfill, "seed": seed},
        "assumptions": list(ASSUMPTIONS),
        "policies": rows,
    }
    if getattr(args, "json", False):
        if collect is not None:
            collect.append(doc)
        else:
            print(json.dumps(doc, indent=2))
        return 0
    parts = [line, f"{label}: {describe(cluster)}; {source.stats.summary()}", table(rows),
             "assumed: " + "\n  ".join(ASSUMPTIONS)]
    print("\n\n".join(parts), file=sys.stdout)
    return 0
