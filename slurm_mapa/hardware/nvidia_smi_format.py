"""A hardware graph printed as ``nvidia-smi topo -m`` and ``nvidia-smi -L`` print it.

The mock ``nvidia-smi`` (scripts/mock-nvidia-smi) and ``mapa topo`` print this text; it parses
back (:mod:`.nvidia_smi`) to the same graph.
"""

from __future__ import annotations

import hashlib

from ..core.hardware import HardwareGraph
from ..core.links import Link

_GENERATION_MODELS = {
    1: "Tesla P100-SXM2-16GB",
    2: "Tesla V100-SXM2-32GB",
    3: "NVIDIA A100-SXM4-80GB",
    4: "NVIDIA H100 80GB HBM3",
    5: "NVIDIA B200",
}

LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _smi_token(link: Link) -> str:
    # nvidia-smi prints NVSwitch pairs as plain NV<n>.
    return f"NV{link.links}" if link.is_nvlink else link.level


def format_topo_matrix(graph: HardwareGraph) -> str:
    """``nvidia-smi topo -m`` text for a graph, tab-separated as the real tool prints it.

    The CPU Affinity column appears when the graph has CPU affinities; NUMA Affinity always
    carries the graph's domains, so that parsing the text gives the same graph back.
    """
    columns = [f"GPU{gpu}" for gpu in graph.gpus]
    header = ["", *columns]
    if graph.cpu_affinity:
        header.append("CPU Affinity")
    header.append("NUMA Affinity")
    out = ["\t".join(header)]
    for a in graph.gpus:
        cells = [f"GPU{a}"]
        for b in graph.gpus:
            cells.append(" X " if a == b else _smi_token(graph.link(a, b)))
        if graph.cpu_affinity:
            cells.append(graph.cpu_affinity[a])
        cells.append(str(graph.domains[a]))
        out.append("\t".join(cells))
    return "\n".join(out) + "\n\n" + LEGEND


def fake_uuid(name: str, gpu: int) -> str:
    """A stable, well-formed GPU UUID for a mock GPU."""
    digest = hashlib.sha256(f"{name}/{gpu}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def format_gpu_list(graph: HardwareGraph, uuids: list[str] | None = None) -> str:
    """``nvidia-smi -L`` text for a graph; the model name tells the NVLink generation."""
    model = _GENERATION_MODELS.get(graph.bandwidths.nvlink_generation, "NVIDIA GPU")
    lines = []
    for gpu in graph.gpus:
        uuid = uuids[gpu] if uuids else fake_uuid(graph.name, gpu)
        lines.append(f"GPU {gpu}: {model} (UUID: {uuid})")
    return "\n".join(lines) + "\n"
