"""Slurm node features from MAPA: which good placements a node has free (issue 15).

Slurm picks the node, MAPA the GPUs inside it. To let Slurm pick a node where a good placement is
free, each node publishes features (``scontrol update NodeName=... ActiveFeatures=...``) and jobs
ask for them with ``--prefer`` (soft) or ``--constraint`` (hard). This module is the pure part:
which features a node has, as a function of plain data.

* ``mapa_ring<k>`` - a k-GPU ring whose predicted effective bandwidth is at least ``threshold`` x
  the best idle k-ring of the fleet (the best over the fleet's node types, every GPU free) is free
  on this node. A sensitive k-GPU job prefers it.
* ``mapa_noring<k>`` - the complement, published exactly when ``mapa_ring<k>`` is not (the node
  has no such ring free, fewer than k free GPUs included). Slurm's constraint expressions have no
  NOT, so a job that wants to stay *off* the nodes with a good k-ring needs a feature of its own.
  The two together always make one of each pair active, so a job's preference or constraint names
  a feature that is active somewhere unless every node agrees (then Slurm falls back, or for a
  hard constraint the wait bound relaxes it).

Every size k in ``best`` gets one of the pair, so a node publishes exactly ``len(best)``
features; :func:`feature_names` lists every name a node may ever publish (slurm.conf
``Features=``, which must hold them for ``scontrol update ... ActiveFeatures=`` to accept them).

Patterns other than ring: the features describe rings by default, and a job with another
pattern of k GPUs uses ``mapa_ring<k>`` as its proxy (NCCL builds rings for all-reduce whatever
the job names, and a ring's predicted bandwidth tracks how richly a set is linked). A site that
wants features of another shape passes ``shape=``; the names become ``mapa_<shape><k>`` and
``mapa_no<shape><k>`` (non-alphanumeric characters of the shape replaced by ``_``), e.g.
``mapa_tree4``. The score is the best placement of that pattern on the free GPUs
(:func:`~.search.best_placement`, objective ``effective``), so a rank-order shape is scored on its
best mapping, as MAPA would place it.

The model: one for every node type (a site's `model`), or each node type's own (a function of
the graph: each server's default model, true to its links, issue 38); a node's rings are then
compared with the fleet's best in GB/s, each priced by its own server's model.

Sizes outside the model's fitted range are ranked by the model's own prediction there: the
features only compare a node with the fleet's idle best, and for k equal to a node's size the
answer (the whole node is free) does not depend on the model.

Decisions are cached per (graph, free set, size, shape, model): a node of n GPUs has at most 2^n
free sets, so an agent republishing after every start and end, or the replay at every pass, pays
each search once.

Owns the node features; imports .effbw, .hardware, .patterns, .placement and .search.

>>> from slurm_mapa.hardware.presets import preset
>>> from slurm_mapa.core.server_models import default_model
>>> dgx = preset("dgx1-v100")
>>> best = fleet_best([dgx], (2, 4), default_model)
>>> node_features(dgx, range(8), best, default_model)
('mapa_ring2', 'mapa_ring4')
>>> node_features(dgx, (0, 5, 6), best, default_model)
('mapa_ring2', 'mapa_noring4')
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping, Union

from ..errors import InputError
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .patterns import SHAPES, make_pattern
from .placement import preserved_bandwidth
from .search import best_placement

# One model for every node type, or a function giving each node type's own.
ModelFor = Union[EffectiveBandwidthModel, Callable[[HardwareGraph], EffectiveBandwidthModel]]


def _model_of(model: ModelFor, graph: HardwareGraph) -> EffectiveBandwidthModel:
    return model if isinstance(model, EffectiveBandwidthModel) else model(graph)

__all__ = [
    "DEFAULT_THRESHOLD",
    "PREFIX",
    "best_free",
    "clear_cache",
    "complement_name",
    "feature_name",
    "feature_names",
    "fleet_best",
    "good_free_at",
    "has_good",
    "node_features",
]

PREFIX = "mapa_"
DEFAULT_THRESHOLD = 0.9
_EPS = 1e-9
_CACHE_LIMIT = 500_000
_cache: dict = {}


def _token(shape: str) -> str:
    if shape not in SHAPES:
        raise InputError(f"unknown pattern {shape!r} (accepted: {', '.join(SHAPES)})")
    return re.sub(r"[^A-Za-z0-9]", "_", shape)


def feature_name(k: int, shape: str = "ring") -> str:
    """``mapa_ring4``: a good k-GPU placement of ``shape`` is free."""
    return f"{PREFIX}{_token(shape)}{k}"


def complement_name(k: int, shape: str = "ring") -> str:
    """``mapa_noring4``: no good k-GPU placement of ``shape`` is free."""
    return f"{PREFIX}no{_token(shape)}{k}"


def feature_names(sizes: Iterable[int], shape: str = "ring") -> tuple[str, ...]:
    """Every feature a node may publish for ``sizes`` (what slurm.conf's ``Features=`` must list)."""
    names: list[str] = []
    for k in sorted(set(sizes)):
        names += [feature_name(k, shape), complement_name(k, shape)]
    return tuple(names)


def _mask(graph: HardwareGraph, free: Iterable[int] | int) -> int:
    if isinstance(free, int):
        if free < 0 or free >> graph.size:
            raise InputError(f"free mask {free:#x} names GPUs that are not on {graph.name} (GPUs 0..{graph.size - 1})")
        return free
    mask = 0
    for gpu in free:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")
        mask |= 1 << gpu
    return mask


def best_free(graph: HardwareGraph, free: Iterable[int] | int, k: int, model: ModelFor,
              shape: str = "ring") -> float | None:
    """The highest predicted effective bandwidth of a k-GPU ``shape`` on the free GPUs (a set or a
    bit mask); None when fewer than k are free (or the pattern has no edges, e.g. k = 1)."""
    mask = _mask(graph, free)
    if k < 2 or mask.bit_count() < k:
        return None
    model = _model_of(model, graph)
    key = (graph, mask, k, shape, model)
    if key in _cache:
        return _cache[key]
    gpus = tuple(i for i in range(graph.size) if mask >> i & 1)
    placed = best_placement(graph, gpus, make_pattern(shape, k), "effective", model)
    value = placed.effective_bandwidth if placed is not None else None
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = value
    return value


def clear_cache() -> None:
    _cache.clear()


def fleet_best(graphs: Iterable[HardwareGraph], sizes: Iterable[int], model: ModelFor,
               shape: str = "ring") -> dict[int, float]:
    """Per size k: the best idle k-GPU ``shape`` of the fleet (over its distinct node types, all GPUs
    free). Sizes no node can hold (or k < 2) are left out: no node could ever publish them."""
    distinct = list(dict.fromkeys(graphs))
    best: dict[int, float] = {}
    for k in sorted(set(sizes)):
        values = [best_free(g, (1 << g.size) - 1, k, model, shape) for g in distinct]
        values = [v for v in values if v is not None]
        if values:
            best[k] = max(values)
    return best


def has_good(graph: HardwareGraph, free: Iterable[int] | int, k: int, fleet_k: float, model: ModelFor,
             threshold: float = DEFAULT_THRESHOLD, shape: str = "ring") -> bool:
    """Whether a k-GPU ``shape`` of at least ``threshold`` x ``fleet_k`` GB/s is free."""
    value = best_free(graph, free, k, model, shape)
    return value is not None and value >= threshold * fleet_k - _EPS


def node_features(graph: HardwareGraph, free: Iterable[int] | int, best: Mapping[int, float],
                  model: ModelFor, threshold: float = DEFAULT_THRESHOLD,
                  shape: str = "ring") -> tuple[str, ...]:
    """The features a node publishes: for each size k of ``best`` (from :func:`fleet_best`),
    ``mapa_ring<k>`` if a good k-ring is free, else ``mapa_noring<k>``; sorted by k."""
    if not 0 < threshold <= 1:
        raise InputError(f"feature threshold must be a fraction in (0, 1], got {threshold:g}")
    mask = _mask(graph, free)
    out = []
    for k in sorted(best):
        good = has_good(graph, mask, k, best[k], model, threshold, shape)
        out.append(feature_name(k, shape) if good else complement_name(k, shape))
    return tuple(out)


def good_free_at(graph: HardwareGraph, free: Iterable[int] | int, ends: Iterable[tuple[float, Iterable[int]]], k: int,
                 fleet_k: float, model: ModelFor, threshold: float = DEFAULT_THRESHOLD,
                 shape: str = "ring") -> float | None:
    """When the node is expected to have a good k-GPU ``shape`` free (issue 40's wait rule): 0.0 when
    one is free now; else the end time (as given in ``ends``: the running jobs' (end time, GPUs)) of
    the job after whose end, the jobs freeing their GPUs in end order, one is; None when none would
    be (the node is too small, or the GPUs it needs are held by jobs left out of ``ends``, e.g.
    jobs whose end is not known). Jobs that end together free their GPUs together."""
    mask = _mask(graph, free)
    if has_good(graph, mask, k, fleet_k, model, threshold, shape):
        return 0.0
    for end, gpus in sorted(((float(end), _mask(graph, gpus)) for end, gpus in ends), key=lambda pair: pair[0]):
        mask |= gpus
        if has_good(graph, mask, k, fleet_k, model, threshold, shape):
            return end
    return None


# Slurm keeps a node's weight in 32 bits and reserves the top values (INFINITE, NO_VAL); MAPA's
# weights stay far below them, a site's base included.
MAX_NODE_WEIGHT = 2**31 - 1


def node_weight(graph: HardwareGraph, free: Iterable[int] | int, base: int = 0) -> int:
    """The Slurm node weight of cluster-level Preserve (issue 40): ``base`` + 1 + the preserved
    bandwidth (the paper's Eq. 3, in the graph's GB/s, rounded down) of the node's free GPUs.
    Slurm gives a job the lowest-weight nodes that can run it (slurm.conf(5), ``Weight``), so jobs
    fill the nodes whose free GPUs are worth least to the next ring first: PCIe nodes before NVLink
    ones, fragmented nodes before whole ones. ``base`` keeps a site's own tiers in order (e.g. 0
    for one generation, 1000000 for the next). The replay's ``--node-weights`` uses the same number.

    >>> from slurm_mapa.hardware.presets import preset
    >>> dgx = preset("dgx1-v100")
    >>> node_weight(dgx, ()), node_weight(dgx, (0, 1)) < node_weight(dgx, (0, 1, 2, 3))
    (1, True)
    """
    mask = _mask(graph, free)
    return weight_of_preserved(preserved_bandwidth(graph, [g for g in range(graph.size) if mask >> g & 1]), base)


def weight_of_preserved(preserved: float, base: int = 0) -> int:
    """:func:`node_weight` from the preserved bandwidth (GB/s) of the free GPUs, as the replay has it."""
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise InputError(f"node weight base must be a whole number >= 0, got {base!r}")
    return min(MAX_NODE_WEIGHT, base + 1 + int(preserved + _EPS))
