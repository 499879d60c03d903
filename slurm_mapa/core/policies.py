"""Allocation policies: functions of (hardware graph, free GPUs, request) -> Allocation | NoFit.

* ``baseline``   - the lowest free indices, as nvidia-docker and Slurm without topology hand them out.
* ``topo-aware`` - Amaral et al. (SC'17) as the MAPA artifact re-implements it: the lowest free
  GPUs inside one CPU socket / PCIe domain when the job fits in one, else baseline.
* ``greedy``     - the highest aggregated bandwidth (paper Eq. 1).
* ``preserve``   - MAPA Algorithm 1: bandwidth-sensitive jobs of 2+ GPUs get the highest
  predicted effective bandwidth (Eq. 2); every other job the highest preserved bandwidth (Eq. 3).

A policy picks the GPU *set*; the order of the GPUs inside the set (which GPU runs which pattern
vertex) is always the best for the job's pattern, as NCCL would build its ring over whatever GPUs
it gets. So baseline and topo-aware are scored fairly, on their best ring over their set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..errors import InputError, InternalError
from .effbw import EffectiveBandwidthModel, paper_model
from .hardware import HardwareGraph
from .patterns import Pattern
from .search import Placement, best_placement, preserved_bandwidth


@dataclass(frozen=True)
class Request:
    """What a job asks of one node: a pattern over ``pattern.size`` GPUs and its sensitivity."""

    pattern: Pattern
    sensitive: bool

    @property
    def gpus(self) -> int:
        return self.pattern.size


@dataclass(frozen=True)
class Allocation:
    policy: str
    placement: Placement
    objective: str

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.placement.gpus


@dataclass(frozen=True)
class NoFit:
    """The normal "does not fit" result: names the request and the free GPUs."""

    policy: str
    request: Request
    free: tuple[int, ...]

    @property
    def reason(self) -> str:
        return (
            f"{self.request.gpus} GPU(s) requested ({self.request.pattern.name}), "
            f"only {len(self.free)} free: {','.join(map(str, self.free)) or 'none'}"
        )


Policy = Callable[[HardwareGraph, tuple[int, ...], Request, EffectiveBandwidthModel], "Allocation | NoFit"]


def order_within(
    name: str, graph: HardwareGraph, free: tuple[int, ...], chosen: Iterable[int], request: Request, model: EffectiveBandwidthModel
) -> Allocation:
    """A set some policy chose, ordered as the best placement of the pattern on it, scored against ``free``."""
    chosen = tuple(sorted(chosen))
    if len(set(chosen)) != request.gpus or not set(chosen) <= set(free):
        raise InternalError(f"{name} picked {chosen} from free {free} for {request.gpus} GPU(s)")
    objective = "effective" if request.sensitive and request.gpus > 1 else "aggregated"
    inside = best_placement(graph, chosen, request.pattern, objective, model)
    assert inside is not None
    placement = Placement(
        gpus=inside.gpus,
        aggregated_bandwidth=inside.aggregated_bandwidth,
        link_counts=inside.link_counts,
        effective_bandwidth=inside.effective_bandwidth,
        preserved_bandwidth=preserved_bandwidth(graph, set(free) - set(chosen)),
    )
    return Allocation(policy=name, placement=placement, objective=f"set by {name}, order by {objective}")


def baseline(graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("baseline", request, free)
    return order_within("baseline", graph, free, free[: request.gpus], request, model)


def topo_aware(graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("topo-aware", request, free)
    # The first domain (in GPU order) with room, its lowest free GPUs: the artifact's first match.
    for gpu in free:
        same_domain = [g for g in free if graph.domains[g] == graph.domains[gpu]]
        if len(same_domain) >= request.gpus:
            return order_within("topo-aware", graph, free, same_domain[: request.gpus], request, model)
    return order_within("topo-aware", graph, free, free[: request.gpus], request, model)


def greedy(graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel) -> Allocation | NoFit:
    found = best_placement(graph, free, request.pattern, "aggregated", model)
    if found is None:
        return NoFit("greedy", request, free)
    return Allocation(policy="greedy", placement=found, objective="aggregated")


def preserve(graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel) -> Allocation | NoFit:
    objective = "effective" if request.sensitive and request.gpus > 1 else "preserved"
    found = best_placement(graph, free, request.pattern, objective, model)
    if found is None:
        return NoFit("preserve", request, free)
    return Allocation(policy="preserve", placement=found, objective=objective)


POLICIES: dict[str, Policy] = {
    "baseline": baseline,
    "topo-aware": topo_aware,
    "greedy": greedy,
    "preserve": preserve,
}


def all_policies() -> dict[str, Policy]:
    """The engine's policies and the peers it is compared with (slurm-native, nvidia-besteffort, ...)."""
    from .ahead import AHEAD_POLICIES  # builds on this module too
    from .peers import PEER_POLICIES  # the peers build on this module

    return {**POLICIES, **PEER_POLICIES, **AHEAD_POLICIES}


def select(
    policy: str,
    graph: HardwareGraph,
    free: Iterable[int],
    request: Request,
    model: EffectiveBandwidthModel | None = None,
    configured: Mapping[str, Policy] | None = None,
    running: Iterable[Iterable[int]] = (),
) -> Allocation | NoFit:
    """Run ``policy`` on ``free`` GPUs of ``graph``; the one entry point the Prolog, replay and CLI share.

    ``configured``: policies built with site settings (preserve-ahead's size distribution), used
    instead of the default instance of the same name. ``running``: the GPUs of each job running on
    the node; only policies that look at them (preserve-ahead) get them.
    """
    chosen_policy = (configured or {}).get(policy) or POLICIES.get(policy) or all_policies().get(policy)
    if chosen_policy is None:
        raise InputError(f"unknown policy {policy!r} (accepted: {', '.join(all_policies())})")
    free_tuple = tuple(sorted(set(free)))
    for gpu in free_tuple:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
    groups = running_groups(graph, free_tuple, running)
    if groups and getattr(chosen_policy, "sees_running", False):
        return chosen_policy(graph, free_tuple, request, model or paper_model(), running=groups)
    return chosen_policy(graph, free_tuple, request, model or paper_model())


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
