"""Allocation policies: functions of (hardware graph, free GPUs, request) -> Allocation | NoFit.

* ``baseline``   - the lowest free indices, as nvidia-docker and Slurm without topology hand them out.
* ``topo-aware`` - Amaral et al. (SC'17) as the MAPA artifact re-implements it: the lowest free
  GPUs inside one CPU socket / PCIe domain when the job fits in one, else baseline.
* ``greedy``     - the highest aggregated bandwidth (paper Eq. 1).
* ``preserve``   - MAPA Algorithm 1: bandwidth-sensitive jobs of 2+ GPUs get the highest
  predicted effective bandwidth (Eq. 2), ring jobs among equals the set whose links carry the most
  rings (:mod:`.ring_choice`); every other job the highest preserved bandwidth (Eq. 3).

A policy picks the GPU *set*; the order of the GPUs inside the set (which GPU runs which pattern
vertex) is always the best for the job's pattern, as NCCL would build its ring over whatever GPUs
it gets. So baseline and topo-aware are scored fairly, on their best ring over their set.

Owns the engine's four policies, the registry of every policy (POLICIES, all_policies) and
:func:`select`; imports :mod:`.allocation` and the policy modules (.ahead, .peers), none of which
imports it back. Request, Allocation, NoFit, Policy and order_within live in :mod:`.allocation`
and are re-exported here.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import InputError
from .ahead import AHEAD_POLICIES
from .allocation import Allocation, NoFit, Policy, Request, order_within
from .effbw import EffectiveBandwidthModel
from .server_models import default_model
from .hardware import HardwareGraph
from .peers import PEER_POLICIES
from .ring_choice import RING_OBJECTIVE, best_by_rings, best_by_rings_known, ranks_by_rings
from .search import SearchLimit, best_placement
from .search_limit import OutOfWork


def baseline(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("baseline", request, free)
    return order_within("baseline", graph, free, free[: request.gpus], request, model, limit)


def topo_aware(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("topo-aware", request, free)
    # The first domain (in GPU order) with room, its lowest free GPUs: the artifact's first match.
    for gpu in free:
        same_domain = [g for g in free if graph.domains[g] == graph.domains[gpu]]
        if len(same_domain) >= request.gpus:
            return order_within("topo-aware", graph, free, same_domain[: request.gpus], request, model, limit)
    return order_within("topo-aware", graph, free, free[: request.gpus], request, model, limit)


def greedy(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, *, limit: SearchLimit | None = None
) -> Allocation | NoFit:
    found = best_placement(graph, free, request.pattern, "aggregated", model, limit)
    if found is None:
        return NoFit("greedy", request, free)
    return Allocation(policy="greedy", placement=found, objective="aggregated")


def preserve(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, *, limit: SearchLimit | None = None
) -> Allocation | NoFit:
    objective = "effective" if request.sensitive and request.gpus > 1 else "preserved"
    if objective == "effective" and limit is None and ranks_by_rings(request.pattern, free, model):
        # Every k-set's result known (a warm replay or daemon): the same choice in one pass, without the search.
        known = best_by_rings_known(graph, free, request.pattern, model)
        if known is not None:
            return Allocation(policy="preserve", placement=known, objective=RING_OBJECTIVE)
    found = best_placement(graph, free, request.pattern, objective, model, limit)
    if found is None:
        return NoFit("preserve", request, free)
    if objective == "effective" and found.gap is None and ranks_by_rings(request.pattern, free, model):
        # Among the sets the model ranks equal, the one whose links carry the most rings (.ring_choice).
        return Allocation(policy="preserve", placement=best_by_rings(graph, free, request.pattern, model, found, limit),
                          objective=RING_OBJECTIVE)
    return Allocation(policy="preserve", placement=found, objective=objective)


# select() passes ``limit`` to the policies marked so: preserve and greedy choose with it, the
# others (and the peers and preserve-ahead, marked in their modules) order their set with it.
for _policy in (baseline, topo_aware, greedy, preserve):
    _policy.takes_limit = True  # type: ignore[attr-defined]


POLICIES: dict[str, Policy] = {
    "baseline": baseline,
    "topo-aware": topo_aware,
    "greedy": greedy,
    "preserve": preserve,
}


def all_policies() -> dict[str, Policy]:
    """The engine's policies and the peers it is compared with (slurm-native, nvidia-besteffort, ...)."""
    return {**POLICIES, **PEER_POLICIES, **AHEAD_POLICIES}


def select(
    policy: str,
    graph: HardwareGraph,
    free: Iterable[int],
    request: Request,
    model: EffectiveBandwidthModel | None = None,
    configured: Mapping[str, Policy] | None = None,
    running: Iterable[Iterable[int]] = (),
    limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    """Run ``policy`` on ``free`` GPUs of ``graph``; the one entry point the Prolog, replay and CLI share.

    ``configured``: policies built with site settings (preserve-ahead's size distribution), used
    instead of the default instance of the same name. ``running``: the GPUs of each job running on
    the node; only policies that look at them (preserve-ahead) get them. ``limit``: bounds the
    searches of the policies (preserve and greedy choose with it; the others order their set with
    it); on nodes of more than 16 GPUs preserve-ahead gives way to Preserve, and the allocation's
    ``policy`` says "preserve"; when it runs out the allocation's
    ``placement.gap`` says how far from the optimum the choice can be (None: proven optimal).
    """
    chosen_policy = (configured or {}).get(policy) or POLICIES.get(policy) or all_policies().get(policy)
    if chosen_policy is None:
        raise InputError(f"unknown policy {policy!r} (accepted: {', '.join(all_policies())})")
    free_tuple = tuple(sorted(set(free)))
    for gpu in free_tuple:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
    groups = running_groups(graph, free_tuple, running)
    extra: dict = {}
    if groups and getattr(chosen_policy, "sees_running", False):
        extra["running"] = groups
    if limit is not None and getattr(chosen_policy, "takes_limit", False):
        extra["limit"] = limit
    try:
        return chosen_policy(graph, free_tuple, request, model or default_model(graph), **extra)
    except OutOfWork:
        # A policy that cannot decide on this node (preserve-ahead on more than 16 GPUs): Preserve
        # chooses, within the limit, and the allocation says it was Preserve.
        return preserve(graph, free_tuple, request, model or default_model(graph), limit=limit)


def running_groups(graph: HardwareGraph, free: tuple[int, ...], running: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """The running jobs' GPU sets, checked: on the node, not free, no GPU in two jobs; sorted."""
    seen = set(free)
    groups = []
    for group in running:
        gpus = tuple(sorted(set(group)))
        if not gpus:
            continue
        for gpu in gpus:
            if not 0 <= gpu < graph.size:
                raise InputError(f"running job's GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
            if gpu in seen:
                raise InputError(f"GPU {gpu} is listed as running a job and also as free or held by another job")
            seen.add(gpu)
        groups.append(gpus)
    return tuple(sorted(groups))
