"""Peer allocators, re-implemented from their published behaviour, as policies with the engine's signature.

Every peer picks a GPU *set*; like the engine's ``baseline`` and ``topo-aware`` it is then scored on
the best ring (or other pattern) over that set, as NCCL would build it, so peers are compared
fairly on the set they choose. Each is written from its project's published source and behaviour
(cited per policy below and in docs/replay.md); no code of those projects is used.

* ``slurm-native``       - Slurm 24.11 ``select/cons_tres`` for ``--gres=gpu:N`` with ``Links=``:
  ``_pick_gres_topo`` with its ascending sort, i.e. after the first GPU it takes the GPUs with the
  FEWEST links to the ones already picked (``_update_and_sort_by_links`` in
  ``src/plugins/select/cons_tres/gres_select_filter.c``: an ascending sort, the same in 26.05). Links = bonded NVLink count, 0 for PCIe.
* ``slurm-native-gpus``  - the same Slurm for ``--gpus=N`` (``_set_job_bits1``): all free GPUs, anchor
  on the best-linked pair, drop the weakest-linked to the anchor until N remain.
* ``nvidia-besteffort``  - go-gpuallocator's best-effort policy as the NVIDIA k8s device plugin uses
  it: the partition of all free GPUs into groups of N with the highest summed pair score, then its
  best group. Modelled WITH the padding fix of go-gpuallocator PR #80 (a padded group is never
  returned; as shipped it can return fewer GPUs than asked and the plugin crashes), and AS
  DEPLOYED on NVSwitch boxes (NVML reports the switch as the NVLink peer, so NVSwitch pairs count 0
  NVLinks). :func:`besteffort_pick` also offers the shipped behaviour and "intended" NVSwitch.
* ``first-fit``          - the MCL scheduler's first-fit device policy applied to a whole job: fill
  the current (lowest) device and move on only when it is full. With exclusive whole GPUs this is
  the lowest free indices, i.e. the same set as ``baseline``.
* ``round-robin``        - the MCL scheduler's round-robin policy: a queue of devices; each GPU of
  the job is the first free device in the queue, which then moves to the back. The queue is state:
  the replay simulator keeps it per node (:func:`round_robin_pick`); the stateless policy here
  (for ``mapa select``) rebuilds it as "the devices after the highest busy GPU first".
* ``hami-topology``      - HAMi's ``topology-aware`` policy: the candidates in HAMi's visiting order
  (from the end of the device list: descending index); 1 GPU -> the candidate with the smallest
  summed pair score to the other candidates; N>1 -> the N-combination with the largest summed pair
  score (first maximum). NVSwitch pairs count min(links) NVLinks, as HAMi's ``GetNVLink`` does.

Pair score (go-gpuallocator, HAMi): PCIe level SYS 10, NODE 20, PHB 30, PXB 40, PIX 50, plus 100
per NVLink. An NVLink pair keeps its PCIe entry too; the hardware graph does not record the PCIe
level under an NVLink, so we take PHB (30) inside a CPU domain and SYS (10) across.

Owns the peer policies (PEER_POLICIES, STATEFUL); imports .allocation, .effbw and .hardware, never
:mod:`.policies`, which imports this module for its registry.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations
from typing import Callable, Sequence

from ..errors import InputError
from .effbw import EffectiveBandwidthModel
from .hardware import HardwareGraph
from .allocation import Allocation, NoFit, Policy, Request, order_within
from .search_limit import SearchLimit

PCIE_SCORES = {"SYS": 10, "NODE": 20, "PHB": 30, "PXB": 40, "PIX": 50}
NVLINK_SCORE = 100
_NVLINK_PAIR_PCIE_SAME_DOMAIN = 30
_NVLINK_PAIR_PCIE_CROSS_DOMAIN = 10


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def pair_scores(graph: HardwareGraph, nvswitch: str = "intended") -> tuple[tuple[int, ...], ...]:
    """go-gpuallocator / HAMi pair scores of every GPU pair (0 on the diagonal).

    ``nvswitch="deployed"``: NVSwitch pairs count no NVLink (what go-gpuallocator sees through NVML);
    ``"intended"``: they count their link number, as HAMi's fork does.
    """
    if nvswitch not in ("deployed", "intended"):
        raise InputError(f"nvswitch mode {nvswitch!r} (accepted: deployed, intended)")
    n = graph.size
    rows = []
    for a in range(n):
        row = []
        for b in range(n):
            if a == b:
                row.append(0)
                continue
            link = graph.link(a, b)
            if link.kind == "pcie":
                row.append(PCIE_SCORES[link.level])
                continue
            same = bool(graph.domains) and graph.domains[a] == graph.domains[b]
            pcie = _NVLINK_PAIR_PCIE_SAME_DOMAIN if same else _NVLINK_PAIR_PCIE_CROSS_DOMAIN
            links = link.links if (link.kind == "nvlink" or nvswitch == "intended") else 0
            row.append(pcie + NVLINK_SCORE * links)
        rows.append(tuple(row))
    return tuple(rows)


@lru_cache(maxsize=64)
def slurm_links(graph: HardwareGraph) -> tuple[tuple[int, ...], ...]:
    """What ``Links=`` (or AutoDetect=nvml) gives Slurm: the NVLink count of each pair, -1 for itself."""
    return tuple(
        tuple(-1 if a == b else (graph.link(a, b).links if graph.link(a, b).is_nvlink else 0) for b in range(graph.size))
        for a in range(graph.size)
    )


# --------------------------------------------------------------------------------------------
# Slurm 24.11 cons_tres
# --------------------------------------------------------------------------------------------


def slurm_node_pick(links: Sequence[Sequence[int]], free: Sequence[int], need: int) -> list[int] | None:
    """``_set_node_bits`` -> ``_pick_gres_topo`` (any-socket pass) for ``need`` GPUs, with a stable sort.

    Returns the picked GPUs in pick order, or None when fewer than ``need`` are free.
    """
    n = len(links)
    free_set = set(free)
    if need > len(free_set):
        return None
    busy = set(range(n)) - free_set
    order = list(range(n))
    counter = [0] * n
    selected: list[int] = []
    pos = 0
    while pos < len(order) and len(selected) < need:
        g = order[pos]
        if g in busy or g in selected:
            pos += 1
            continue
        selected.append(g)
        for other in range(n):
            if other != g and other not in busy:
                counter[other] += links[g][other]
        order.sort(key=lambda gpu: counter[gpu])  # stable, ascending: Slurm's comparator
        pos = 1
    return selected if len(selected) == need else None


def slurm_job_pick(links: Sequence[Sequence[int]], free: Sequence[int], want: int) -> list[int] | None:
    """``_set_job_bits1`` on one node: keep the anchor of the best-linked pair and its best peers."""
    selected = sorted(set(free))
    if want > len(selected):
        return None
    if want <= 1 or len(selected) == want:
        return selected[:want]
    best = None
    anchor = selected[0]
    for i, s in enumerate(selected):
        for g in selected[i + 1 :]:
            if best is None or links[s][g] > best:
                best, anchor = links[s][g], s
    while len(selected) > want:
        weakest = min((g for g in selected if g != anchor), key=lambda g: links[anchor][g])  # first on ties
        selected.remove(weakest)
    return selected


def slurm_native(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    picked = slurm_node_pick(slurm_links(graph), free, request.gpus)
    if picked is None:
        return NoFit("slurm-native", request, free)
    return order_within("slurm-native", graph, free, picked, request, model, limit)


def slurm_native_gpus(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    picked = slurm_job_pick(slurm_links(graph), free, request.gpus)
    if picked is None:
        return NoFit("slurm-native-gpus", request, free)
    return order_within("slurm-native-gpus", graph, free, picked, request, model, limit)


# --------------------------------------------------------------------------------------------
# NVIDIA go-gpuallocator best-effort
# --------------------------------------------------------------------------------------------


def _set_score(scores: Sequence[Sequence[int]], group: Sequence[int | None]) -> int:
    real = [g for g in group if g is not None]
    return sum(scores[a][b] for i, a in enumerate(real) for b in real[i + 1 :])


def iterate_partitions(devices: Sequence[int | None], size: int):
    """go-gpuallocator's partition enumeration (pad with None, first element fixed, all-or-no padding)."""
    if size <= 0 or size > len(devices):
        return
    if size == 1:
        for d in devices:
            yield [[d]]
        return
    padded = list(devices) + [None] * ((size - len(devices) % size) % size)
    padding = padded.count(None)

    def rec(remaining: list, acc: list):
        if len(remaining) == size:
            yield acc + [remaining]
            return
        first, rest = remaining[0], remaining[1:]
        for combo in combinations(range(len(rest)), size - 1):
            group = [first] + [rest[i] for i in combo]
            nils = sum(1 for g in group if g is None)
            if nils != 0 and nils != padding:
                continue
            chosen = set(combo)
            yield from rec([rest[i] for i in range(len(rest)) if i not in chosen], acc + [group])

    yield from rec(padded, [])


def besteffort_pick_bruteforce(
    scores: Sequence[Sequence[int]], available: Sequence[int], size: int, required: Sequence[int] = (), *, fix_padding: bool = True
) -> list[int | None]:
    """The literal algorithm (every partition); exponential, for tests and small nodes."""
    available = list(available)
    required = list(required)
    if size <= 0 or len(available) < size or len(required) > size or len(required) > len(available):
        return []
    best_partition, best_score = None, 0
    for partition in iterate_partitions(available, size):
        if not any(None not in g and set(required) <= set(g) for g in partition):
            continue
        score = sum(_set_score(scores, g) for g in partition)
        if best_partition is None or score > best_score:
            best_partition, best_score = partition, score
    if best_partition is None:
        return []
    kept = [g for g in best_partition if set(required) <= set(g) and (not fix_padding or None not in g)]
    if not kept:
        return []
    best = kept[0]
    for g in kept[1:]:
        if _set_score(scores, g) > _set_score(scores, best):
            best = g
    return list(best)


def _groups_with_first(rest: list[int], first: int, size: int, padded: Sequence[int | None], padding: int) -> list[tuple[int, ...]]:
    """The other members of the groups go-gpuallocator tries with position ``first``, in its order
    (``combinations(rest, size - 1)``), but only those it keeps: a group holds no padding or all
    of it. Made directly instead of filtered from every combination (C(29, 14) of them for 15
    GPUs of 16)."""
    real = [i for i in rest if padded[i] is not None]
    nils = [i for i in rest if padded[i] is None]
    first_nils = 1 if padded[first] is None else 0
    groups = []
    for wanted in sorted({0 - first_nils, padding - first_nils}):
        if 0 <= wanted <= len(nils) and wanted <= size - 1:
            groups += [tuple(sorted(r + n)) for r in combinations(real, size - 1 - wanted) for n in combinations(nils, wanted)]
    return sorted(groups)


def besteffort_pick(
    scores: Sequence[Sequence[int]], available: Sequence[int], size: int, required: Sequence[int] = (), *, fix_padding: bool = True
) -> list[int | None]:
    """go-gpuallocator best-effort ``Allocate``; the same result as the literal algorithm.

    Without required devices the best partition is found by dynamic programming over the
    remaining devices (the enumeration is lexicographic, so the first maximal partition is the
    first group, in enumeration order, that reaches the optimum, followed by the first maximal
    partition of the rest). With required devices the literal enumeration runs.
    """
    available = list(available)
    if required:
        return besteffort_pick_bruteforce(scores, available, size, required, fix_padding=fix_padding)
    if size <= 0 or len(available) < size:
        return []
    if size == 1:
        return [available[0]]
    padded: list[int | None] = available + [None] * ((size - len(available) % size) % size)
    padding = padded.count(None)
    count = len(padded)

    @lru_cache(maxsize=None)
    def best(mask: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
        # mask: positions of ``padded`` still to be grouped
        positions = [i for i in range(count) if mask >> i & 1]
        if len(positions) == size:
            group = tuple(positions)
            return _set_score(scores, [padded[i] for i in group]), (group,)
        first, rest = positions[0], positions[1:]
        top: tuple[int, tuple[tuple[int, ...], ...]] | None = None
        for combo in _groups_with_first(rest, first, size, padded, padding):
            group = (first, *combo)
            rest_mask = mask
            for i in group:
                rest_mask &= ~(1 << i)
            sub_score, sub_groups = best(rest_mask)
            total = _set_score(scores, [padded[i] for i in group]) + sub_score
            if top is None or total > top[0]:
                top = (total, (group, *sub_groups))
        assert top is not None
        return top

    _, groups = best((1 << count) - 1)
    partition = [[padded[i] for i in g] for g in groups]
    kept = [g for g in partition if not fix_padding or None not in g]
    if not kept:
        return []
    chosen = kept[0]
    for g in kept[1:]:
        if _set_score(scores, g) > _set_score(scores, chosen):
            chosen = g
    return chosen


def nvidia_besteffort(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("nvidia-besteffort", request, free)
    picked = besteffort_pick(pair_scores(graph, "deployed"), free, request.gpus)
    if len(picked) != request.gpus or None in picked:  # pragma: no cover - the padding fix prevents it
        return NoFit("nvidia-besteffort", request, free)
    return order_within("nvidia-besteffort", graph, free, [g for g in picked if g is not None], request, model, limit)


# --------------------------------------------------------------------------------------------
# MCL scheduler device policies
# --------------------------------------------------------------------------------------------


def first_fit(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    if request.gpus > len(free):
        return NoFit("first-fit", request, free)
    return order_within("first-fit", graph, free, sorted(free)[: request.gpus], request, model, limit)


def round_robin_pick(queue: Sequence[int], free: Sequence[int], need: int) -> tuple[list[int], tuple[int, ...]] | None:
    """Take ``need`` GPUs: each the first free device in ``queue``, which then moves to the back."""
    free_set = set(free)
    if need > len(free_set):
        return None
    order = list(queue)
    picked: list[int] = []
    for _ in range(need):
        for i, gpu in enumerate(order):
            if gpu in free_set and gpu not in picked:
                picked.append(gpu)
                order.append(order.pop(i))
                break
    return picked, tuple(order)


def default_queue(size: int, free: Sequence[int]) -> tuple[int, ...]:
    """The stateless approximation of the round-robin queue: the devices after the highest busy GPU first."""
    busy = sorted(set(range(size)) - set(free))
    start = (busy[-1] + 1) % size if busy else 0
    return tuple((start + i) % size for i in range(size))


def round_robin(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    result = round_robin_pick(default_queue(graph.size, free), free, request.gpus)
    if result is None:
        return NoFit("round-robin", request, free)
    return order_within("round-robin", graph, free, result[0], request, model, limit)


# --------------------------------------------------------------------------------------------
# HAMi topology-aware
# --------------------------------------------------------------------------------------------


def hami_pick(scores: Sequence[Sequence[int]], candidates: Sequence[int], need: int) -> list[int] | None:
    """HAMi ``Fit`` with topology: all candidates if exactly ``need``; the worst-connected single card;
    or the first combination with the largest summed pair score."""
    candidates = list(candidates)
    if need > len(candidates) or need <= 0:
        return None
    if len(candidates) == need:
        return candidates
    if need == 1:
        best, best_total = candidates[0], None
        for d in candidates:
            total = sum(scores[d][o] for o in candidates if o != d)
            if best_total is None or total < best_total:
                best, best_total = d, total
        return [best]
    best_combo, best_score = None, -1
    for combo in combinations(candidates, need):
        total = sum(scores[a][b] for i, a in enumerate(combo) for b in combo[i + 1 :])
        if total > best_score:
            best_combo, best_score = combo, total
    return list(best_combo) if best_combo else None


def hami_topology(
    graph: HardwareGraph, free: tuple[int, ...], request: Request, model: EffectiveBandwidthModel, limit: SearchLimit | None = None,
) -> Allocation | NoFit:
    picked = hami_pick(pair_scores(graph, "intended"), sorted(free, reverse=True), request.gpus)
    if picked is None:
        return NoFit("hami-topology", request, free)
    return order_within("hami-topology", graph, free, picked, request, model, limit)


PEER_POLICIES: dict[str, Policy] = {
    "slurm-native": slurm_native,
    "slurm-native-gpus": slurm_native_gpus,
    "nvidia-besteffort": nvidia_besteffort,
    "first-fit": first_fit,
    "round-robin": round_robin,
    "hami-topology": hami_topology,
}
# Their sets are their own algorithms' (some exponential, as in the originals); the limit bounds
# only the ordering of a sensitive job's set, the exact search on big nodes.
for _policy in PEER_POLICIES.values():
    _policy.takes_limit = True  # type: ignore[attr-defined]

#: Policies whose real decision depends on state beyond the free set (the replay keeps it per node).
STATEFUL: dict[str, Callable[..., object]] = {"round-robin": round_robin_pick}
