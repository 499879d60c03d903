"""gres.conf lines for a GPU server, and the mapping between GPU numberings.

Numbering (docs/hardware.md, "Index mapping"): a topology numbers its GPUs as nvidia-smi and
NVML do, in PCI bus order. :func:`gres_conf_text` writes one ``Name=gpu File=/dev/nvidiaN`` line per
GPU in that order, with N the GPU's minor number, so Slurm's GPU index (the order of the File
entries) is the topology's index. Jobs are bound with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and the
same indices in ``CUDA_VISIBLE_DEVICES`` (:func:`binding_environment`); CUDA's default order,
"fastest first", would otherwise renumber the GPUs.

AMD GPUs (a topology whose vendor is ``amd``: xGMI links, or ``vendor = "amd"`` in its file)
are declared as Slurm's ``AutoDetect=rsmi`` declares them (src/plugins/gpu/rsmi/gpu_rsmi.c):
``File=/dev/dri/renderD<minor>``, one line per GPU in ROCm's order, with ``Flags=amd_gpu_env``
so that Slurm sets only ``ROCR_VISIBLE_DEVICES`` (gres.conf(5): the ROCm runtime applies
``ROCR_VISIBLE_DEVICES`` first and then ``CUDA_VISIBLE_DEVICES`` on what is left, so setting
both global lists selects the wrong GPUs). The binding then exports ``ROCR_VISIBLE_DEVICES``
with the topology indices and ``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` /
``GPU_DEVICE_ORDINAL`` as ``0..k-1``: positions among the GPUs ROCr left visible.

``Cores=`` is written in Slurm's core numbering, not in the CPU (hardware thread) ids that
nvidia-smi prints: slurmd stops with ``fatal: Invalid gres data for gpu, Cores=...`` when a core
is out of range. :class:`CpuLayout` says how CPU ids map to cores on the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.hardware import HardwareGraph
from ..errors import InputError
from .topofile import Topology

LINKS_NOTE = (
    "Slurm (24.11 to 26.05) uses Links= only when a gres.conf line of the GRES also has Type= or Cores=; "
    "without them it keeps no per-GPU topology and hands GPUs out first-fit (src/interfaces/gres.c)."
)


@dataclass(frozen=True)
class CpuLayout:
    """How a node's CPU ids map to Slurm core ids.

    ``cores`` is the core count Slurm knows for the node (Sockets x CoresPerSocket in
    slurm.conf). ``numbering`` is how Linux numbers the hardware threads: ``split`` (x86: thread
    t of core c is CPU ``c + t * cores``) or ``packed`` (POWER: CPU ``c * threads_per_core + t``).
    """

    cores: int
    threads_per_core: int = 1
    numbering: str = "split"
    sockets: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.cores, int) or self.cores < 1:
            raise InputError(f"core count must be a positive integer, got {self.cores!r}")
        if not isinstance(self.threads_per_core, int) or self.threads_per_core < 1:
            raise InputError(f"threads per core must be a positive integer, got {self.threads_per_core!r}")
        if not isinstance(self.sockets, int) or self.sockets < 1 or self.cores % self.sockets:
            raise InputError(f"socket count must divide the {self.cores} cores, got {self.sockets!r}")
        if self.numbering not in ("split", "packed"):
            raise InputError(f"CPU numbering must be 'split' or 'packed', got {self.numbering!r}")

    def core_of(self, cpu: int) -> int:
        if not 0 <= cpu < self.cores * self.threads_per_core:
            raise InputError(
                f"CPU {cpu} is beyond the node's {self.cores} cores x {self.threads_per_core} thread(s); "
                f"give the node's real core count and threads per core"
            )
        if self.numbering == "split":
            return cpu % self.cores
        return cpu // self.threads_per_core


# The real servers' CPU layouts (used for the generated gres_conf/ files; the mini cluster's
# nodes declare the same core counts in slurm.conf).
PRESET_CPU_LAYOUTS: dict[str, CpuLayout] = {
    "dgx1-v100": CpuLayout(cores=40, threads_per_core=2, numbering="split", sockets=2),  # 2 x 20-core Xeon E5-2698 v4
    "summit": CpuLayout(cores=44, threads_per_core=4, numbering="packed", sockets=2),  # 2 x 22-core POWER9, SMT4
    "dgx-a100": CpuLayout(cores=128, threads_per_core=2, numbering="split", sockets=2),  # 2 x 64-core EPYC 7742
    "hgx-h100": CpuLayout(cores=104, threads_per_core=2, numbering="split", sockets=2),  # 2 x 52-core Xeon 8480+ class
    "mi250x": CpuLayout(cores=64, threads_per_core=2, numbering="split", sockets=1),  # 1 x 64-core EPYC 7A53 "Trento"
}

_CPU_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> list[int]:
    """``0-19,40-59`` -> the sorted CPU ids."""
    ids: set[int] = set()
    for part in text.split(","):
        match = _CPU_RANGE.match(part.strip())
        if not match:
            raise InputError(f"CPU list {text!r}: {part!r} is not a number or a range a-b")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise InputError(f"CPU list {text!r}: range {part!r} runs backwards")
        ids.update(range(low, high + 1))
    return sorted(ids)


def format_cpu_list(ids: list[int] | set[int]) -> str:
    """Sorted ids -> ``0-19,40-59``."""
    ordered = sorted(set(ids))
    parts = []
    start = previous = None
    for value in ordered:
        if start is None:
            start = previous = value
        elif value == previous + 1:
            previous = value
        else:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = previous = value
    if start is not None:
        parts.append(f"{start}" if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def slurm_cores(cpu_affinity: str, layout: CpuLayout) -> str:
    """The ``Cores=`` value for a GPU whose CPU affinity (nvidia-smi's list) is ``cpu_affinity``.

    slurmd rejects a node whose Cores= do not cover whole sockets ("doesn't match socket
    boundaries"), so every socket the affinity touches is taken whole: a POWER9 Summit node's
    GPUs are bound to 21 of a socket's 22 cores, and still get the full socket.
    """
    touched = {layout.core_of(cpu) for cpu in parse_cpu_list(cpu_affinity)}
    per_socket = layout.cores // layout.sockets
    sockets = {core // per_socket for core in touched}
    return format_cpu_list({core for socket in sockets for core in range(socket * per_socket, (socket + 1) * per_socket)})


def links_value(graph: HardwareGraph, gpu: int) -> str:
    """Slurm's ``Links=`` for one GPU: NVLinks to each GPU by index, -1 for itself, 0 for PCIe."""
    values = []
    for other in graph.gpus:
        if other == gpu:
            values.append("-1")
        else:
            link = graph.link(gpu, other)
            values.append(str(link.links if link.is_nvlink else 0))
    return ",".join(values)


def gres_conf_lines(
    topology: Topology | HardwareGraph,
    *,
    layout: CpuLayout | None = None,
    gres_type: str | None = None,
    links: bool = True,
    node_name: str | None = None,
) -> list[str]:
    """The ``Name=gpu`` lines, one per GPU in topology order (= Slurm's GPU index)."""
    if isinstance(topology, HardwareGraph):
        topology = Topology(graph=topology)
    graph = topology.graph
    if gres_type is not None and not re.match(r"^[A-Za-z0-9_.-]+$", gres_type):
        raise InputError(f"GRES type {gres_type!r}: expected letters, digits, '_', '.' or '-'")
    if node_name is not None and not re.match(r"^[A-Za-z0-9_.\[\],-]+$", node_name):
        raise InputError(f"node name {node_name!r}: expected a Slurm host name or host list")
    lines = []
    for gpu in graph.gpus:
        fields = []
        if node_name:
            fields.append(f"NodeName={node_name}")
        fields.append("Name=gpu")
        if gres_type:
            fields.append(f"Type={gres_type}")
        fields.append(f"File={topology.device_file(gpu)}")
        if topology.gpu_vendor == "amd":
            fields.append("Flags=amd_gpu_env")
        if layout is not None and graph.cpu_affinity:
            fields.append(f"Cores={slurm_cores(graph.cpu_affinity[gpu], layout)}")
        if links:
            fields.append(f"Links={links_value(graph, gpu)}")
        lines.append(" ".join(fields))
    return lines


def gres_conf_text(
    topology: Topology | HardwareGraph,
    *,
    layout: CpuLayout | None = None,
    gres_type: str | None = None,
    links: bool = True,
    node_name: str | None = None,
    generated_by: str = "mapa gres-conf",
) -> str:
    """A whole gres.conf: explanatory comments, ``AutoDetect=off`` and the GPU lines."""
    graph = topology.graph if isinstance(topology, Topology) else topology
    lines = gres_conf_lines(topology, layout=layout, gres_type=gres_type, links=links, node_name=node_name)
    amd = (topology.gpu_vendor if isinstance(topology, Topology) else Topology(graph=graph).gpu_vendor) == "amd"
    head = [f"# gres.conf for {graph.name} ({graph.size} GPUs), generated by `{generated_by}`."]
    if amd:
        head.append("# One line per GPU in ROCm (HIP) order: Slurm's GPU index i is GPU i of the topology.")
        head.append("# Flags=amd_gpu_env: Slurm sets only ROCR_VISIBLE_DEVICES (gres.conf(5): ROCm applies it before")
        head.append("# CUDA_VISIBLE_DEVICES, so both global lists would pick the wrong GPUs).")
    else:
        head.append("# One line per GPU in nvidia-smi (PCI bus) order: Slurm's GPU index i is GPU i of the topology.")
    if links and amd:
        head.append("# Links= gives the xGMI links to every GPU by index (-1: itself, 0: no direct link).")
    if links:
        if not amd:
            head.append("# Links= gives the NVLinks to every GPU by index (-1: itself, 0: PCIe only).")
        head.append("# NOTE: " + LINKS_NOTE)
        if gres_type is None and not (layout is not None and graph.cpu_affinity):
            head.append("# NOTE: these lines have neither Type= nor Cores=, so Slurm ignores their Links=.")
    if layout is not None and graph.cpu_affinity:
        head.append(
            f"# Cores= are Slurm core ids ({layout.cores} cores, {layout.threads_per_core} thread(s) per core, "
            f"{layout.numbering} CPU numbering), converted from the GPUs' CPU affinity."
        )
    elif graph.cpu_affinity:
        head.append("# Cores= left out: give the node's core count (--cores) to convert the CPU affinity.")
    return "\n".join(head + ["AutoDetect=off", *lines]) + "\n"


def binding_environment(
    gpus: list[int] | tuple[int, ...], uuids: tuple[str, ...] | None = None, *, vendor: str = "nvidia"
) -> dict[str, str]:
    """The environment that binds a job to topology GPUs ``gpus`` whatever the runtime's own order.

    NVIDIA: indices with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` by default (they then mean what
    nvidia-smi and NVML mean); UUIDs instead when ``uuids`` (per topology GPU) are given.

    AMD: ``ROCR_VISIBLE_DEVICES`` holds the topology indices (or UUIDs) in pattern order; the
    HIP/OpenCL-level lists (``HIP_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES`` - HIP reads it
    too - and ``GPU_DEVICE_ORDINAL``) are applied by the runtime after ROCr's, to the GPUs ROCr
    left visible, so they are ``0..k-1``. This is what the TaskProlog prints on an AMD node.
    """
    if uuids is not None:
        visible = ",".join(uuids[gpu] for gpu in gpus)
    else:
        visible = ",".join(str(gpu) for gpu in gpus)
    if vendor == "amd":
        local = ",".join(str(position) for position in range(len(gpus)))
        return {
            "ROCR_VISIBLE_DEVICES": visible,
            "HIP_VISIBLE_DEVICES": local,
            "CUDA_VISIBLE_DEVICES": local,
            "GPU_DEVICE_ORDINAL": local,
        }
    if vendor != "nvidia":
        raise InputError(f"GPU vendor {vendor!r}: expected nvidia or amd")
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible}


_DEVICE_FILE = re.compile(r"^/dev/(?:nvidia|dri/renderD)(\d+)$")


def gpu_of_device_file(topology: Topology, path: str) -> int:
    """The topology GPU behind ``/dev/nvidiaN`` or (AMD) ``/dev/dri/renderDN``, by minor number."""
    match = _DEVICE_FILE.match(path.strip())
    expected = "/dev/dri/renderD<N>" if topology.gpu_vendor == "amd" else "/dev/nvidia<N>"
    if not match or not path.strip().startswith(expected.split("<")[0]):
        raise InputError(f"device file {path!r}: expected {expected}")
    minor = int(match.group(1))
    for gpu in topology.graph.gpus:
        if topology.minor(gpu) == minor:
            return gpu
    raise InputError(f"device file {path!r}: no GPU of {topology.graph.name} has minor number {minor}")


def parse_gres_conf_files(text: str) -> list[str]:
    """The ``File=`` device paths of ``Name=gpu`` lines, in order (Slurm's GPU index order)."""
    files: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.split("#", 1)[0].strip()
        if not stripped:
            continue
        fields = dict(
            field.split("=", 1) if "=" in field else (field, "") for field in stripped.split()
        )
        lowered = {key.lower(): value for key, value in fields.items()}
        if lowered.get("name") != "gpu":
            continue
        path = lowered.get("file")
        if not path:
            raise InputError(f"gres.conf line {number}: {line.strip()!r}: a gpu line without File=")
        files.append(path)
    return files
