"""Recorded MAPA decisions against what every policy would have chosen in the same state.

The Prolog records, next to its choice, the free GPUs it chose from (``free=`` in the
AdminComment). That set is the state each policy is asked about. For older records without it,
the state is rebuilt from the log: each job holds the GPUs MAPA recorded for it from its real
start to its real end, on its real node, which works only when every job running there recorded
its GPUs, and only as well as sacct's whole-second times order the events. "same GPUs" counts
identical sets; "as good" counts sets that score as high on the job's Preserve objective
(effective bandwidth for sensitive multi-GPU jobs, else preserved bandwidth). A decision recorded
under the CPU affinity rule (``affinity=`` and ``slurm=``) is re-made under the same rule, with
the job's CPUs those its cgroup held (``cpus=``) or else those of the same Slurm GPUs;
round-robin's stateful path ignores affinity.
"""

from __future__ import annotations

import heapq
from math import inf
from typing import Callable, Iterable, Iterator, Sequence

from ..core.search import score_placement
from .directives import request_for
from .jobs import Job
from .simulate import Decider, Node

_EPS = 1e-6
_MEMO_LIMIT = 1_000_000  # entries of each audit memo before it starts again (memory stays bounded)


class _OutOfOrder(Exception):
    """A job starts before an event the streamed audit already took: sort the whole log instead."""


def _sorted_events(jobs: Iterable[Job]) -> Iterator[tuple[float, int, int, Job]]:
    events = []
    for index, job in enumerate(jobs):
        if job.start is None or job.node is None:
            continue
        events.append((job.start + job.runtime, 0, index, job))  # ends first at equal times
        events.append((job.start, 1, index, job))
    events.sort(key=lambda e: e[:3])  # then the log's order, as a stable sort on (time, kind) gives
    return iter(events)


def _streamed_events(jobs: Iterable[Job]) -> Iterator[tuple[float, int, int, Job]]:
    """The events of :func:`_sorted_events` in the same order, holding only the jobs running or about
    to start: a log in submit order has no job that starts before the latest submit seen, so every
    event earlier than it can be taken. Raises _OutOfOrder on a log where that does not hold."""
    pending: list = []
    taken_before = -inf
    for index, job in enumerate(jobs):
        if job.start is None or job.node is None:
            continue
        end = job.start + job.runtime
        if min(job.start, end) < taken_before:
            raise _OutOfOrder
        heapq.heappush(pending, (end, 0, index, job))
        heapq.heappush(pending, (job.start, 1, index, job))
        if job.submit > taken_before:
            taken_before = job.submit
            while pending and pending[0][0] < taken_before:
                yield heapq.heappop(pending)
    while pending:
        yield heapq.heappop(pending)


def audit(jobs: Iterable[Job], nodes: Sequence[Node], policies: Sequence[str], decider: Decider,
          again: Callable[[], Iterable[Job]] | None = None) -> dict:
    """Every recorded decision against what each policy would have chosen (module docstring).

    ``jobs`` is read as a stream when it is in submit order (a sacct log is); otherwise the log is
    read again with ``again()`` and its events sorted whole (without ``again``, ``jobs`` is kept
    in a list first).
    """
    if again is None:
        jobs = list(jobs)
        again = lambda: jobs  # noqa: E731
    try:
        return _audit(_streamed_events(jobs), nodes, policies, decider)
    except _OutOfOrder:
        return _audit(_sorted_events(again()), nodes, policies, decider)


def _audit(events: Iterator[tuple[float, int, int, Job]], nodes: Sequence[Node], policies: Sequence[str],
           decider: Decider) -> dict:
    by_name = {n.name: n for n in nodes}
    busy: dict[str, int] = {}
    unknown: dict[str, int] = {}
    skipped: dict[str, int] = {}
    free_sets = {"recorded": 0, "rebuilt": 0, "rebuilt_differs_from_recorded": 0}
    rows = {p: {"same_set": 0, "as_good": 0, "bw_rec": 0.0, "bw_pol": 0.0, "n_bw": 0} for p in policies}
    compared = 0
    # memos: a recorded set's best order (per set and request; graph: the node's) and its score in a free set
    orders: dict = {}
    scores: dict = {}
    for _, kind, _, job in events:
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
        graph_node = by_name.get(node)
        size = graph_node.graph.size if graph_node is not None else 0
        # The free set the start/end times suggest (None when jobs without a record share the node).
        rebuilt_mask = ((1 << size) - 1) & ~busy.get(node, 0) if unknown.get(node, 0) <= 0 else None
        free_mask = None
        running_masks: tuple[int, ...] = ()  # the running jobs the Prolog saw, with its recorded free set only
        reason = None
        if graph_node is None:
            reason = "node not in the cluster"
        elif max(job.recorded) >= size or (job.recorded_free and max(job.recorded_free) >= size):
            reason = "recorded GPU beyond the node's GPUs"
        elif job.recorded_policy == "fallback":
            reason = "the Prolog fell back (no policy decision)"
        elif job.recorded_free:
            free_mask = sum(1 << g for g in job.recorded_free)
            running_masks = tuple(sorted(sum(1 << g for g in group) for group in job.recorded_running if max(group) < size))
            free_sets["recorded"] += 1
            if rebuilt_mask is not None and rebuilt_mask != free_mask:
                free_sets["rebuilt_differs_from_recorded"] += 1
        elif rebuilt_mask is None:
            reason = "node shared with jobs without a recorded decision"
        elif mask & ~rebuilt_mask:
            reason = "recorded GPUs overlap a running job's"
        else:
            free_mask = rebuilt_mask
            free_sets["rebuilt"] += 1
        if reason is None:
            graph = graph_node.graph
            free = tuple(i for i in range(size) if free_mask >> i & 1)
            request = request_for(job.shape, job.gpus, job.sensitive)
            rid = decider.request_id(request)
            gid = decider.graph_id(graph)
            key = (gid, free_mask, job.recorded, rid)  # the same record in the same state scores the same
            recorded = scores.get(key)
            if recorded is None:
                if len(scores) >= _MEMO_LIMIT:
                    scores.clear()
                    orders.clear()
                order = orders.get((gid, job.recorded, rid))
                if order is None:
                    order = orders[(gid, job.recorded, rid)] = _best_order(graph, job, request, decider)
                recorded = scores[key] = score_placement(graph, free, request.pattern, order, decider.model_for(graph))
            objective = "effective" if job.sensitive and job.gpus > 1 else "preserved"
            compared += 1
            for policy in policies:
                running = running_masks if decider.sees_running(policy) else ()
                # A choice made under the CPU affinity rule is re-made under it, from the same Slurm GPUs.
                found = decider.decide(policy, gid, free_mask, rid, tuple(range(size)) if policy == "round-robin" else None, running,
                                       job.recorded_affinity, job.recorded_slurm if job.recorded_affinity else None,
                                       job.recorded_cpus if job.recorded_affinity else None)
                if found is None:
                    continue
                decision = found[0]
                row = rows[policy]
                if decision.mask == mask:
                    row["same_set"] += 1
                rec_value = recorded.effective_bandwidth if objective == "effective" else recorded.preserved_bandwidth
                # The record is compared by the model that ranked it (the decision's ``ranked``), not the replay's judge.
                pol_value = decision.ranked if objective == "effective" else decision.preserved
                if rec_value is not None and pol_value is not None and abs(rec_value - pol_value) <= _EPS:
                    row["as_good"] += 1
                if recorded.effective_bandwidth is not None and decision.ranked is not None:
                    row["bw_rec"] += recorded.effective_bandwidth
                    row["bw_pol"] += decision.ranked
                    row["n_bw"] += 1
            job.recorded_bw = recorded.effective_bandwidth
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
        busy[node] = busy.get(node, 0) | mask
    return {
        "compared": compared,
        "skipped": sum(skipped.values()),
        "skipped_reasons": skipped,
        "free_sets": free_sets,
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

    # A collective is scored by its set's best order, as every reported number is (core.explain).
    objective = "effective" if (job.sensitive and job.gpus > 1) or request.pattern.scored_by_set else "aggregated"
    found = best_placement(graph, job.recorded, request.pattern, objective, decider.model_for(graph))
    return found.gpus if found is not None else tuple(job.recorded)
