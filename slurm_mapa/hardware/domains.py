"""A GPU's NUMA domain, from what a discovery tool reports: its NUMA node, else its CPU affinity,
else the socket groups its link matrix implies (used by the nvidia-smi, NVML, AMD and rocm-smi
readers alike)."""

from __future__ import annotations

from ..core.links import PCIE_LEVELS


def infer_domains(
    size: int, links: dict[tuple[int, int], str], cpu: tuple[str, ...] | None, numa: tuple[str, ...] | None
) -> list[int]:
    """Domains: the NUMA Affinity column, else groups of equal CPU affinity, else socket groups
    read from the matrix.

    Without CPU columns: a PCIe path short of ``SYS`` (PIX, PXB, PHB, NODE) puts two GPUs in one
    domain, ``SYS`` in two. NVLink cells hide the PCIe path, and NVLinks may cross sockets (a
    DGX-1's cube-mesh does), so an NVLink pair joins two groups only when no ``SYS`` pair
    would end up inside the joined group.
    """
    if numa is not None and all(value.isdigit() for value in numa):
        return [int(value) for value in numa]
    if cpu is not None and all(value not in ("", "N/A") for value in cpu):
        order: dict[str, int] = {}
        return [order.setdefault(value, len(order)) for value in cpu]
    parent = list(range(size))

    def find(gpu: int) -> int:
        while parent[gpu] != gpu:
            parent[gpu] = parent[parent[gpu]]
            gpu = parent[gpu]
        return gpu

    apart = {(a, b) for (a, b), token in links.items() if token == "SYS"}
    for (a, b), token in sorted(links.items()):
        if token in ("PIX", "PXB", "PHB", "NODE"):
            parent[find(a)] = find(b)
    for (a, b), token in sorted(links.items()):
        if token in PCIE_LEVELS or find(a) == find(b):
            continue
        group_a = {gpu for gpu in range(size) if find(gpu) == find(a)}
        group_b = {gpu for gpu in range(size) if find(gpu) == find(b)}
        if not any((min(x, y), max(x, y)) in apart for x in group_a for y in group_b):
            parent[find(a)] = find(b)
    order = {}
    return [order.setdefault(find(gpu), len(order)) for gpu in range(size)]
