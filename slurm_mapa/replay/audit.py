"""Recorded MAPA decisions against what every policy would have chosen in the same state.

The real history is rebuilt from the log: each job holds the GPUs MAPA recorded for it from its
real start to its real end, on its real node. At each recorded job's start, the node's free GPUs
are known (if every job running there recorded its GPUs), and every policy is asked what it would
choose there. "same GPUs" counts identical sets; "as good" counts sets that score as high on the
job's Preserve objective (effective bandwidth for sensitive multi-GPU jobs, else preserved bandwidth).
"""

from __future__ import annotations

from typing import Sequence

from ..core.search import score_placement
from .directives import request_for
from .jobs import Job
from .simulate import Decider, Node

_EPS = 1e-6


def audit(jobs: Sequence[Job], nodes: Sequence[Node], policies: Sequence[str], decider: Decider) -> dict:
    by_name = {n.name: n for n in nodes}
    events = []
    for job in jobs:
        if job.start is None or job.node is None:
            continue
        events.append((job.start + job.runtime, 0, job))  # ends first at equal times
        events.append((job.start, 1, job))
    events.sort(key=lambda e: (e[0], e[1]))
    busy: dict[str, int] = {}
    unknown: dict[str, int] = {}
    skipped: dict[str, int] = {}
    rows = {p: {"same_set": 0, "as_good": 0, "bw_rec": 0.0, "bw_pol": 0.0, "n_bw": 0} for p in policies}
    compared = 0
    for _, kind, job in events:
        node = job.node
        if kind == 0:
            if job.recorded is not None:
                mask = sum(1 << g for g in job.recorded)
                busy[node] = busy.get(node, 0) & ~mask
            else:
                unknown[node] = unknown.get(node, 0) - 1
            continue
        if job.recorded is None:
            unknown[node] = unknown.get(node, 0) + 1
            continue
        mask = sum(1 << g for g in job.recorded)
        reason = None
        graph_node = by_name.get(node)
        if graph_node is None:
            reason = "node not in the cluster"
        elif unknown.get(node, 0) > 0:
            reason = "node shared with jobs without a recorded decision"
        elif busy.get(node, 0) & mask:
            reason = "recorded GPUs overlap a running job's"
        elif max(job.recorded) >= graph_node.graph.size:
            reason = "recorded GPU beyond the node's GPUs"
        if reason is None:
            graph = graph_node.graph
            full = (1 << graph.size) - 1
            free_mask = full & ~busy.get(node, 0)
            free = tuple(i for i in range(graph.size) if free_mask >> i & 1)
            request = request_for(job.shape, job.gpus, job.sensitive)
            rid = decider.request_id(request)
            gid = decider.graph_id(graph)
            recorded = score_placement(graph, free, request.pattern, _best_order(graph, job, request, decider), decider.model)
            objective = "effective" if job.sensitive and job.gpus > 1 else "preserved"
            compared += 1
            for policy in policies:
                found = decider.decide(policy, gid, free_mask, rid, tuple(range(graph.size)) if policy == "round-robin" else None)
                if found is None:
                    continue
                decision = found[0]
                row = rows[policy]
                if decision.mask == mask:
                    row["same_set"] += 1
                rec_value = recorded.effective_bandwidth if objective == "effective" else recorded.preserved_bandwidth
                pol_value = decision.effective if objective == "effective" else decision.preserved
                if rec_value is not None and pol_value is not None and abs(rec_value - pol_value) <= _EPS:
                    row["as_good"] += 1
                if recorded.effective_bandwidth is not None and decision.effective is not None:
                    row["bw_rec"] += recorded.effective_bandwidth
                    row["bw_pol"] += decision.effective
                    row["n_bw"] += 1
            job.recorded_bw = recorded.effective_bandwidth
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
        busy[node] = busy.get(node, 0) | mask
    return {
        "compared": compared,
        "skipped": sum(skipped.values()),
        "skipped_reasons": skipped,
        "policies": {
            p: {
                "same_set": r["same_set"],
                "as_good": r["as_good"],
                "recorded_mean_bw": round(r["bw_rec"] / r["n_bw"], 3) if r["n_bw"] else None,
                "policy_mean_bw": round(r["bw_pol"] / r["n_bw"], 3) if r["n_bw"] else None,
            }
            for p, r in rows.items()
        },
    }


def _best_order(graph, job: Job, request, decider: Decider) -> tuple[int, ...]:
    from ..core.search import best_placement

    objective = "effective" if job.sensitive and job.gpus > 1 else "aggregated"
    found = best_placement(graph, job.recorded, request.pattern, objective, decider.model)
    return found.gpus if found is not None else tuple(job.recorded)
