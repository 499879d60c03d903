"""CPU affinity in the decision (issue 14 item 4): prefer the GPUs close to the job's CPUs.

A GPU is *local* to a job when its CPU affinity (``HardwareGraph.cpu_affinity``, the list
nvidia-smi prints, e.g. ``0-19,40-59``) shares at least one CPU with the CPUs the job holds on
the node. Data the job's processes move to and from a distant GPU cross the socket link, so
Slurm can bind GPUs to cores (gres.conf ``Cores=``) and, with ``--gres-flags=enforce-binding``,
refuses GPUs that are not local. This module puts that rule into the policy decision:

* ``strict``  - only local GPUs are candidates. When fewer are free than the job asks for, the
  answer is :class:`AffinityNoFit` (a :class:`~.allocation.NoFit` whose reason says so).
  ``enforce_binding=True`` (Slurm's ``--gres-flags=enforce-binding``) means ``strict``.
* ``prefer``  - the default. The policy runs on all free GPUs; when its choice is local, that is
  the answer. Otherwise it runs again on the local free GPUs, and the local choice is kept unless
  it loses more than ``max_loss`` of the value of the choice over all GPUs
  (:func:`loss_fraction`); then the choice over all GPUs is taken.
* ``ignore``  - the plain policy; the explanation still says whether its GPUs are local.

The value compared is what MAPA's Algorithm 1 maximises (:func:`predicted_value`): the
predicted effective bandwidth for a bandwidth-sensitive job of 2+ GPUs, the preserved bandwidth
(Eq. 3, over *all* the node's free GPUs) for every other job. These are model predictions.

The policy is never re-implemented here: it is called (through a callable, normally
:func:`~.policies.select`) on ``free`` restricted to the local GPUs. A policy whose objective
depends on the GPUs left free (Preserve's preserved bandwidth) then sees only the local GPUs,
so it optimises what stays free among them; the preserved bandwidth this module reports and
compares is recomputed over all free GPUs.

Everything counts as local (and the explanation says why) when the topology has no CPU
affinity or the job's CPUs are unknown (``job_cpus=None``).

CPU ids: :func:`parse_cpu_ids` reads the syntax of Slurm's ``CPU_IDs=`` (``scontrol show job
-d``) and of a cgroup's ``cpuset.cpus``. The ids must be in the numbering of the topology's CPU
affinity (Linux CPU ids, as nvidia-smi prints them). ``scontrol``'s CPU_IDs are Slurm's
*abstract* ids, which match Linux's only on some layouts; the job's cgroup ``cpuset.cpus`` is in
Linux ids. Translating is the caller's job.

Owns the affinity rule; imports .allocation, .hardware and .search, and :mod:`.policies`
(:func:`~.policies.select`) only inside :func:`select_with_affinity`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

from ..errors import InputError, toml_text
from .allocation import Allocation, NoFit, Request
from .hardware import HardwareGraph
from .search import preserved_bandwidth

__all__ = [
    "MODES",
    "DEFAULT_MODE",
    "DEFAULT_MAX_LOSS",
    "AffinityExplanation",
    "AffinityNoFit",
    "decide",
    "gpu_cpus",
    "local_gpus",
    "loss_fraction",
    "modelled_job_cpus",
    "parse_cpu_ids",
    "predicted_value",
    "select_with_affinity",
    "settings_from_table",
]

MODES = ("strict", "prefer", "ignore")
DEFAULT_MODE = "prefer"
# 0.1: a job keeps at least 90% of the best predicted value, the bar a node must clear to publish
# a mapa_ring<k> feature (features.DEFAULT_THRESHOLD), so a job steered to a node for its ring does
# not give the ring up for locality. docs/policies.md shows 0.1 and 0.25.
DEFAULT_MAX_LOSS = 0.1
# Slurm counts a node's CPUs in 16 bits; a job's CPU list on one node is a few hundred characters.
MAX_CPU_ID = 65535
MAX_CPU_LIST_CHARS = 65536
_DIGITS = 9

_ITEM = re.compile(r"(0|[1-9][0-9]{0,4})(?:-(0|[1-9][0-9]{0,4}))?")
_ACCEPTED = "CPU ids and ranges separated by commas, e.g. 0-3,40-43 (Slurm's CPU_IDs= syntax)"


def parse_cpu_ids(text: str) -> frozenset[int]:
    """Slurm's CPU list (``0-3,40-43``; a leading ``CPU_IDs=`` is accepted) -> the CPU ids.

    Strict: decimal ids without sign, spaces or leading zeros, ranges ``a-b`` with a <= b, no
    empty item; ids up to 65535 and text up to 65536 characters.

    >>> sorted(parse_cpu_ids("CPU_IDs=0-2,40"))
    [0, 1, 2, 40]
    """
    if not isinstance(text, str):
        raise InputError(f"CPU list must be text, got {type(text).__name__} (accepted: {_ACCEPTED})")
    if len(text) > MAX_CPU_LIST_CHARS:
        raise InputError(f"CPU list is {len(text)} characters long (accepted: at most {MAX_CPU_LIST_CHARS}: {_ACCEPTED})")
    body = text[len("CPU_IDs="):] if text.startswith("CPU_IDs=") else text
    if not body:
        raise InputError(f"CPU list {text!r} is empty (accepted: {_ACCEPTED})")
    ids: set[int] = set()
    for item in body.split(","):
        match = _ITEM.fullmatch(item)
        if match is None:
            raise InputError(f"CPU list {_shown(text)}: {_shown(item)} is not a CPU id or a range a-b (accepted: {_ACCEPTED})")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high > MAX_CPU_ID:
            raise InputError(f"CPU list {_shown(text)}: CPU {high} is beyond {MAX_CPU_ID} (accepted: ids 0..{MAX_CPU_ID})")
        if high < low:
            raise InputError(f"CPU list {_shown(text)}: range {item!r} runs backwards (accepted: a-b with a <= b)")
        ids.update(range(low, high + 1))
    return frozenset(ids)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


@lru_cache(maxsize=64)
def gpu_cpus(graph: HardwareGraph) -> tuple[frozenset[int], ...] | None:
    """The CPU ids of each GPU's affinity, or None when the topology has none."""
    if not graph.cpu_affinity:
        return None
    out = []
    for gpu, text in enumerate(graph.cpu_affinity):
        try:
            out.append(parse_cpu_ids(text))
        except InputError as error:
            raise InputError(f"topology {graph.name!r}: cpu_affinity of GPU {gpu}: {error}") from None
    return tuple(out)


def local_gpus(graph: HardwareGraph, free: Iterable[int], job_cpus: frozenset[int] | None) -> tuple[tuple[int, ...], str]:
    """(the free GPUs local to ``job_cpus``, why every GPU counts as local or "" when affinity decided)."""
    free_sorted = tuple(sorted(set(free)))
    if job_cpus is None:
        return free_sorted, "the job's CPUs are unknown: every GPU counts as local"
    cpus = gpu_cpus(graph)
    if cpus is None:
        return free_sorted, f"topology {graph.name} has no CPU affinity: every GPU counts as local"
    return tuple(g for g in free_sorted if 0 <= g < graph.size and cpus[g] & job_cpus), ""


def predicted_value(request: Request, allocation: Allocation) -> tuple[str, float]:
    """(name, value) of what the affinity rule compares: MAPA Algorithm 1's objective.

    ``effective``: the predicted effective bandwidth of a sensitive job of 2+ GPUs;
    ``preserved``: the bandwidth among the GPUs left free (Eq. 3) for every other job.
    """
    placement = allocation.placement
    if request.sensitive and request.gpus > 1 and placement.effective_bandwidth is not None:
        return "effective", placement.effective_bandwidth
    return "preserved", placement.preserved_bandwidth


def loss_fraction(local_value: float, best_value: float) -> float:
    """How much of ``best_value`` (the choice over all free GPUs) the local choice gives up.

    ``max(0, (best - local) / best)``, rounded to 1e-9; 0 when ``best`` is 0 or less (nothing to
    lose) or the local choice is as good or better. ``prefer`` keeps the local choice when this is
    at most ``max_loss``: with ``max_loss = 0.25`` a local ring of 30 GB/s is kept against 40
    (loss 0.25), one of 29.9 is not.
    """
    if best_value <= 0:
        return 0.0
    return max(0.0, round((best_value - local_value) / best_value, _DIGITS))


@dataclass(frozen=True)
class AffinityExplanation:
    """What the affinity rule did, as plain data for logs (:meth:`as_dict`)."""

    mode: str  # the mode applied: strict, prefer or ignore (enforce-binding is strict)
    local_gpus: tuple[int, ...]  # the free GPUs local to the job's CPUs
    local: bool | None  # whether every chosen GPU is local; None when nothing fits
    loss: float | None  # prefer: the local choice's loss fraction against the choice over all GPUs
    value: str | None  # what the loss compares: "effective" or "preserved"
    note: str  # one line for humans

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "local_gpus": list(self.local_gpus),
            "local": self.local,
            "loss": self.loss,
            "value": self.value,
            "note": self.note,
        }


@dataclass(frozen=True)
class AffinityNoFit(NoFit):
    """Strict affinity: too few free GPUs are local to the job's CPUs."""

    local: tuple[int, ...] = ()

    @property
    def reason(self) -> str:
        return (
            f"{self.request.gpus} GPU(s) requested ({self.request.pattern.name}), only {len(self.local)} free GPU(s) "
            f"local to the job's CPUs: {','.join(map(str, self.local)) or 'none'} "
            f"(strict CPU affinity; free: {','.join(map(str, self.free)) or 'none'})"
        )


RunPolicy = Callable[[tuple[int, ...]], "Allocation | NoFit"]


def decide(
    run: RunPolicy,
    graph: HardwareGraph,
    free: Iterable[int],
    request: Request,
    job_cpus: frozenset[int] | None,
    mode: str = DEFAULT_MODE,
    *,
    max_loss: float = DEFAULT_MAX_LOSS,
    enforce_binding: bool = False,
    policy: str = "affinity",
) -> tuple[Allocation | NoFit, AffinityExplanation]:
    """The affinity rule around ``run(free_subset)``, one call of the policy on a set of free GPUs.

    Returns the allocation (or no fit) and the explanation. An allocation chosen on the local
    GPUs alone carries the preserved bandwidth over all ``free`` GPUs. ``policy`` names the
    policy in a strict no-fit.
    """
    check_settings(mode, max_loss)
    applied = "strict" if enforce_binding else mode
    free_sorted = tuple(sorted(set(free)))
    local, why_all = local_gpus(graph, free_sorted, job_cpus)
    local_set = set(local)

    def explained(result: Allocation | NoFit, *, loss: float | None = None, value: str | None = None, note: str) -> tuple:
        is_local = None if isinstance(result, NoFit) else set(result.gpus) <= local_set
        return result, AffinityExplanation(applied, local, is_local, loss, value, note if applied == "ignore" else why_all or note)

    if applied == "ignore" or local == free_sorted:
        result = run(free_sorted)
        note = "affinity ignored" if applied == "ignore" else "every free GPU is local to the job's CPUs"
        return explained(result, note=note)
    if applied == "strict":
        if len(local) < request.gpus:
            return explained(AffinityNoFit(policy, request, free_sorted, local), note="too few local GPUs")
        return explained(_rescored(graph, free_sorted, run(local)), note="strict: local GPUs only")
    best = run(free_sorted)
    if isinstance(best, Allocation) and set(best.gpus) <= local_set:  # nothing to give up: running on the local GPUs
        return explained(best, loss=0.0, value=predicted_value(request, best)[0], note="prefer: the policy's own choice is local")
    if len(local) < request.gpus:
        return explained(best, note=f"prefer: only {len(local)} free GPU(s) are local, the job needs {request.gpus}")
    near = _rescored(graph, free_sorted, run(local))
    if isinstance(near, NoFit):
        return explained(best, note="prefer: the policy found no placement on the local GPUs")
    if isinstance(best, NoFit):
        return explained(near, note="prefer: local GPUs (no placement over all GPUs)")
    value, best_value = predicted_value(request, best)
    _, near_value = predicted_value(request, near)
    loss = loss_fraction(near_value, best_value)
    if loss > max_loss:
        return explained(best, loss=loss, value=value,
                         note=f"prefer: the local choice would lose {loss:.1%} of the {value} bandwidth (more than {max_loss:.0%})")
    return explained(near, loss=loss, value=value, note=f"prefer: local GPUs, {loss:.1%} of the {value} bandwidth given up")


def _rescored(graph: HardwareGraph, free: tuple[int, ...], result: Allocation | NoFit) -> Allocation | NoFit:
    """An allocation made on a subset of ``free``, with its preserved bandwidth over all of ``free``."""
    if isinstance(result, NoFit):
        return result
    kept = preserved_bandwidth(graph, set(free) - set(result.gpus))
    return replace(result, placement=replace(result.placement, preserved_bandwidth=kept))


def select_with_affinity(
    policy: str,
    graph: HardwareGraph,
    free: Iterable[int],
    request: Request,
    job_cpus: frozenset[int] | None,
    mode: str = DEFAULT_MODE,
    *,
    max_loss: float = DEFAULT_MAX_LOSS,
    enforce_binding: bool = False,
    model=None,
    configured: Mapping | None = None,
    running: Iterable[Iterable[int]] = (),
    limit=None,
) -> tuple[Allocation | NoFit, AffinityExplanation]:
    """:func:`~.policies.select` under the affinity rule (:func:`decide`); the same arguments plus the
    job's CPUs. ``limit`` (a search.SearchLimit) bounds each search the rule makes."""
    from .policies import select  # here: reading settings (config.py) need not load every policy

    running_groups = tuple(tuple(group) for group in running)
    free_tuple = tuple(free)
    for gpu in free_tuple:
        if not 0 <= gpu < graph.size:
            raise InputError(f"free GPU {gpu} is not on {graph.name} (GPUs 0..{graph.size - 1})")

    def run(subset: tuple[int, ...]) -> Allocation | NoFit:
        return select(policy, graph, subset, request, model, configured, running_groups, limit)

    return decide(run, graph, free_tuple, request, job_cpus, mode, max_loss=max_loss, enforce_binding=enforce_binding, policy=policy)


def check_settings(mode: str, max_loss: float) -> None:
    if mode not in MODES:
        raise InputError(f"unknown affinity mode {mode!r} (accepted: {', '.join(MODES)})")
    if isinstance(max_loss, bool) or not isinstance(max_loss, (int, float)) or not 0 <= max_loss <= 1:
        raise InputError(f"affinity max_loss must be a fraction from 0 to 1, got {max_loss!r}")


def settings_from_table(table: object, source: str) -> tuple[str, float]:
    """(mode, max_loss) from a config's ``[affinity]`` table: ``mode = "prefer"``, ``max_loss = 0.1``."""
    if table is None:
        table = {}
    if not isinstance(table, Mapping) or set(table) - {"mode", "max_loss"}:
        raise InputError(f'{source}: [affinity] takes mode = "strict" | "prefer" | "ignore" and max_loss = a fraction from 0 to 1')
    mode = table.get("mode", DEFAULT_MODE)
    if not isinstance(mode, str) or mode not in MODES:
        raise InputError(f"{source}: [affinity] mode must be one of {', '.join(MODES)}, got {toml_text(mode)}")
    max_loss = table.get("max_loss", DEFAULT_MAX_LOSS)
    if isinstance(max_loss, bool) or not isinstance(max_loss, (int, float)) or not 0 <= max_loss <= 1:
        raise InputError(f"{source}: [affinity] max_loss must be a fraction from 0 to 1, got {toml_text(max_loss)}")
    return mode, float(max_loss)


def cpus_of_slurms_gpus(graph: HardwareGraph, slurm_gpus: Iterable[int]) -> frozenset[int] | None:
    """The job's CPUs as the Prolog can know them without asking slurmctld: the CPU affinity of the
    GPUs *Slurm* picked for it. With --gres-flags=enforce-binding Slurm gives a job only cores
    bound to its GPUs, so the job's cores lie in these sockets; without it cons_tres prefers such
    cores, and this is an assumption. Comparing within the topology's own CPU numbering keeps
    Slurm's abstract core ids out of it. None (every GPU local) when the topology has no CPU
    affinity or Slurm's GPUs are not on it."""
    cpus = gpu_cpus(graph)
    picked = tuple(slurm_gpus)
    if cpus is None or not picked or not all(0 <= gpu < graph.size for gpu in picked):
        return None
    return frozenset().union(*(cpus[gpu] for gpu in picked))


def modelled_job_cpus(graph: HardwareGraph, free: Iterable[int], gpus: int) -> frozenset[int] | None:
    """The replay's model of a job's CPUs: those of the GPUs Slurm's lowest-index pick would give it.

    Assumption (not Slurm's algorithm): select/cons_tres gives the job cores on the socket(s) of
    the ``gpus`` lowest-numbered free GPUs, i.e. every CPU in their affinity. Real Slurm picks
    cores first (lowest free cores, socket by socket) and the replay does not track which cores
    are busy. None (everything local) when the topology has no CPU affinity or too few GPUs are free.
    """
    cpus = gpu_cpus(graph)
    picked = sorted(set(free))[:gpus]
    if cpus is None or len(picked) < gpus:
        return None
    return frozenset().union(*(cpus[g] for g in picked))
