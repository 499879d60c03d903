"""What every policy takes and returns: the request, the two results and the policy signature.

A policy is a function of (hardware graph, free GPUs, request, model) -> :class:`Allocation` or
:class:`NoFit` (:data:`Policy`); :func:`order_within` turns the GPU set a policy chose into an
Allocation, ordered as the best placement of the job's pattern on it. The engine's policies
(:mod:`.policies`), the peers (:mod:`.peers`) and preserve-ahead (:mod:`.ahead`) all build on this.

Owns Request, Allocation, NoFit, Policy and order_within. Imports .effbw, .hardware, .patterns and
.search, never a policy module: the policy modules import it, and :mod:`.policies` imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import InternalError
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import Pattern
from .search import Placement, SearchLimit, best_placement, preserved_bandwidth


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
    name: str, graph: HardwareGraph, free: tuple[int, ...], chosen: Iterable[int], request: Request, model: EffectiveBandwidthModel,
    limit: SearchLimit | None = None,
) -> Allocation:
    """A set some policy chose, ordered as the best placement of the pattern on it, scored against
    ``free``; with a ``limit`` the order is the best found when it runs out (its ``gap`` says so)."""
    chosen = tuple(sorted(chosen))
    if len(set(chosen)) != request.gpus or not set(chosen) <= set(free):
        raise InternalError(f"{name} picked {chosen} from free {free} for {request.gpus} GPU(s)")
    objective = "effective" if request.sensitive and request.gpus > 1 else "aggregated"
    inside = best_placement(graph, chosen, request.pattern, objective, model, limit)
    assert inside is not None
    placement = Placement(
        gpus=inside.gpus,
        aggregated_bandwidth=inside.aggregated_bandwidth,
        link_counts=inside.link_counts,
        effective_bandwidth=inside.effective_bandwidth,
        preserved_bandwidth=preserved_bandwidth(graph, set(free) - set(chosen)),
        gap=inside.gap,
    )
    return Allocation(policy=name, placement=placement, objective=f"set by {name}, order by {objective}")
