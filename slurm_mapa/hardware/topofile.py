"""The TOML topology file: a GPU server an admin can keep under version control.

Format (every key but ``gpus`` is optional)::

    name = "dgx1-v100"
    description = "NVIDIA DGX-1 V100"
    gpus = 8
    vendor = "nvidia"                # or "amd": device files /dev/dri/renderD*, ROCR_VISIBLE_DEVICES
    nvlink_generation = 2            # bandwidth per NVLink; 1 P100, 2 V100, 3 A100, 4 H100, 5 B200
    default_link = "SYS"             # the class of every pair not under [links]; a PCIe level or XGMI0
    domains = [0, 0, 0, 0, 1, 1, 1, 1]          # socket / NUMA node of each GPU
    cpu_affinity = ["0-19,40-59", ...]          # CPU list of each GPU, as nvidia-smi prints it
    minor_numbers = [0, 1, ...]                 # /dev/nvidiaN (AMD: /dev/dri/renderDN) of each GPU
                                                # (default: its index; AMD: 128 + its index)
    uuids = ["GPU-...", ...]                    # as NVML / nvidia-smi -L print them
    pci_bus_ids = ["00000000:07:00.0", ...]

    [links]
    "0-1" = "NV1"                    # a GPU pair "a-b" (either order, once) and its link class
    "0-3" = "NV2"

    [bandwidth]                      # overrides, GB/s in one direction
    nvlink_per_link = 25.0           # per NVLink of this file's generation
    PIX = 12.0                       # any PCIe level: PIX, PXB, PHB, NODE, SYS
    xgmi_per_link = 50.0             # per xGMI link (MI250X 50, MI300X 64)
    xgmi_relayed = 25.0              # an XGMI0 pair (default: half a link)

GPUs are numbered 0..gpus-1 in nvidia-smi order (PCI bus order). Reading and writing are pure:
:func:`topology_from_toml_text` / :func:`graph_from_toml_text` and :func:`graph_to_toml`.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..core.hardware import HardwareGraph, build_graph
from ..core.links import PCIE_LEVELS, Bandwidths, parse_link

VENDORS = ("nvidia", "amd")
# The first render node minor: /dev/dri/renderD128 is the first GPU's (DRM numbering).
RENDER_MINOR_BASE = 128
from ..errors import InputError, toml_text

_PAIR = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_TOP_KEYS = {
    "name",
    "description",
    "vendor",
    "gpus",
    "nvlink_generation",
    "default_link",
    "domains",
    "cpu_affinity",
    "minor_numbers",
    "uuids",
    "pci_bus_ids",
    "links",
    "bandwidth",
}
_BANDWIDTH_KEYS = {"nvlink_per_link", "xgmi_per_link", "xgmi_relayed", *PCIE_LEVELS}


@dataclass(frozen=True)
class Topology:
    """A hardware graph plus the per-GPU device facts a topology file may carry."""

    graph: HardwareGraph
    minor_numbers: tuple[int, ...] | None = None
    uuids: tuple[str, ...] | None = None
    pci_bus_ids: tuple[str, ...] | None = None
    vendor: str | None = None  # None: "amd" when the graph has xGMI links, else "nvidia"
    notes: tuple[str, ...] = ()  # what the reader guessed, said to whoever reads the topology

    @property
    def gpu_vendor(self) -> str:
        return self.vendor or graph_vendor(self.graph)

    def minor(self, gpu: int) -> int:
        """The device file number of GPU ``gpu``: ``/dev/nvidiaN``, or ``/dev/dri/renderDN`` on
        AMD (the index, or 128 + the index on AMD, when not recorded)."""
        if self.minor_numbers is not None:
            return self.minor_numbers[gpu]
        return RENDER_MINOR_BASE + gpu if self.gpu_vendor == "amd" else gpu

    def device_file(self, gpu: int) -> str:
        """The device file Slurm's gres.conf names for GPU ``gpu``."""
        if self.gpu_vendor == "amd":
            return f"/dev/dri/renderD{self.minor(gpu)}"
        return f"/dev/nvidia{self.minor(gpu)}"


def graph_vendor(graph: HardwareGraph) -> str:
    """"amd" when any pair is an xGMI class, else "nvidia"."""
    return "amd" if any(graph.link(a, b).is_xgmi for a, b in graph.pairs()) else "nvidia"


def _fail(source: str, message: str) -> InputError:
    return InputError(f"topology file {source}: {message}")


def _line_of(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return f" (line {line.strip()!r})"
    return ""


def topology_from_toml_text(text: str, *, source: str = "<text>") -> Topology:
    """Read a topology file's text; errors quote the offending entry and say what is accepted.

    Parsed once per text: mapa-agent reads the node's file on every request (it may change), and
    parsing it took about 20 ms of the agent's CPU per request under a burst (docs/benchmarks.md,
    "Job start under a burst"). The Topology is frozen, so sharing it is safe."""
    return _topology_from_toml_text(text, source)


@lru_cache(maxsize=16)
def _topology_from_toml_text(text: str, source: str) -> Topology:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise _fail(source, f"not valid TOML: {error}") from None
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(
            source,
            f"unknown key {unknown[0]!r}{_line_of(text, unknown[0])}; accepted keys: {', '.join(sorted(_TOP_KEYS))}",
        )
    if "gpus" not in data:
        raise _fail(source, "missing 'gpus = <number of GPUs>'")
    size = data["gpus"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise _fail(source, f"'gpus' must be a positive integer, got {toml_text(size)}")
    name = data.get("name", source)
    if not isinstance(name, str) or not name:
        raise _fail(source, f"'name' must be a non-empty string, got {toml_text(name)}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _fail(source, f"'description' must be a string, got {toml_text(description)}")
    vendor = data.get("vendor")
    if vendor is not None and vendor not in VENDORS:
        raise _fail(source, f"'vendor' must be one of {', '.join(VENDORS)}, got {toml_text(vendor)}")
    default_link = data.get("default_link", "SYS")
    if not isinstance(default_link, str):
        raise _fail(source, f"'default_link' must be a PCIe level such as \"SYS\", got {toml_text(default_link)}")

    links_table = data.get("links", {})
    if not isinstance(links_table, dict):
        raise _fail(source, "'links' must be a table of \"a-b\" = \"<link class>\" entries")
    links: dict[tuple[int, int], str] = {}
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for key, value in links_table.items():
        entry = f'"{key}" = {value!r}'
        match = _PAIR.match(key)
        if not match:
            raise _fail(source, f"link {entry}: the key must be a GPU pair \"a-b\" such as \"0-1\"")
        a, b = int(match.group(1)), int(match.group(2))
        if not isinstance(value, str):
            raise _fail(source, f"link {entry}: the value must be a link class string such as \"NV2\" or \"PIX\"")
        for gpu in (a, b):
            if gpu >= size:
                raise _fail(source, f"link {entry}: unknown GPU {gpu} (this file has GPUs 0..{size - 1})")
        if a == b:
            raise _fail(source, f"link {entry}: links GPU {a} to itself; expected two different GPUs")
        try:
            link = parse_link(value)
        except InputError as error:
            raise _fail(source, f"link {entry}: {error}") from None
        pair = (min(a, b), max(a, b))
        if pair in seen and parse_link(seen[pair][1]) != link:
            raise _fail(
                source,
                f"conflicting entries for GPUs {pair[0]}-{pair[1]}: \"{seen[pair][0]}\" = {seen[pair][1]!r} and "
                f"{entry}",
            )
        seen[pair] = (key, value)
        links[(a, b)] = link.token

    generation = data.get("nvlink_generation", 2)
    bandwidths = _bandwidths(source, generation, data.get("bandwidth", {}))

    def per_gpu(key: str, kind: type, what: str) -> tuple | None:
        if key not in data:
            return None
        value = data[key]
        if not isinstance(value, list) or len(value) != size:
            raise _fail(source, f"'{key}' must be a list of {size} {what} (one per GPU), got {toml_text(value)}")
        for item in value:
            if not isinstance(item, kind) or isinstance(item, bool):
                raise _fail(source, f"'{key}': {item!r} is not {what}")
        return tuple(value)

    domains = per_gpu("domains", int, "integers")
    cpu_affinity = per_gpu("cpu_affinity", str, "CPU list strings")
    minors = per_gpu("minor_numbers", int, "integers")
    uuids = per_gpu("uuids", str, "strings")
    bus_ids = per_gpu("pci_bus_ids", str, "strings")
    if minors is not None and len(set(minors)) != len(minors):
        raise _fail(source, f"'minor_numbers' repeats a number: {list(minors)}")
    try:
        graph = build_graph(
            name,
            size,
            links,
            default_link=default_link,
            bandwidths=bandwidths,
            domains=domains,
            cpu_affinity=cpu_affinity,
            description=description,
        )
    except InputError as error:
        raise _fail(source, str(error)) from None
    if vendor == "nvidia" and graph_vendor(graph) == "amd":
        raise _fail(source, "vendor = \"nvidia\" but the links name xGMI classes; expected vendor = \"amd\"")
    return Topology(graph=graph, minor_numbers=minors, uuids=uuids, pci_bus_ids=bus_ids, vendor=vendor)


def _bandwidths(source: str, generation: Any, table: Any) -> Bandwidths:
    if not isinstance(generation, int) or isinstance(generation, bool):
        raise _fail(source, f"'nvlink_generation' must be an integer (1 P100 ... 5 B200), got {toml_text(generation)}")
    if not isinstance(table, dict):
        raise _fail(source, "'bandwidth' must be a table such as [bandwidth] nvlink_per_link = 25.0")
    unknown = sorted(set(table) - _BANDWIDTH_KEYS)
    if unknown:
        raise _fail(
            source,
            f"unknown bandwidth key {unknown[0]!r}; accepted: nvlink_per_link, xgmi_per_link, xgmi_relayed, "
            f"{', '.join(PCIE_LEVELS)}",
        )
    for key, value in table.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise _fail(source, f"bandwidth {key} = {value!r}: expected a positive number of GB/s")
    base = Bandwidths()
    per_link = dict(base.nvlink_per_link)
    if "nvlink_per_link" in table:
        per_link[generation] = float(table["nvlink_per_link"])
    pcie = dict(base.pcie)
    for level in PCIE_LEVELS:
        if level in table:
            pcie[level] = float(table[level])
    xgmi = dict(xgmi_per_link=float(table["xgmi_per_link"])) if "xgmi_per_link" in table else {}
    if "xgmi_relayed" in table:
        xgmi["xgmi_relayed"] = float(table["xgmi_relayed"])
    try:
        return Bandwidths(nvlink_generation=generation, nvlink_per_link=per_link, pcie=pcie, **xgmi)
    except InputError as error:
        raise _fail(source, str(error)) from None


def graph_from_toml_text(text: str, *, source: str = "<text>") -> HardwareGraph:
    """The hardware graph of a topology file's text."""
    return topology_from_toml_text(text, source=source).graph


def _toml_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _toml_list(values: tuple | list) -> str:
    return "[" + ", ".join(_toml_string(v) if isinstance(v, str) else str(v) for v in values) + "]"


def _default_link(graph: HardwareGraph) -> str:
    counts = Counter(graph.link(a, b).token for a, b in graph.pairs() if not graph.link(a, b).is_nvlink)
    if not counts:
        return "SYS"
    best = max(counts.values())
    # On a tie take the longest path, the usual "everything else" of a server (XGMI0 last).
    order = (*PCIE_LEVELS, "XGMI0")
    return max((level for level, count in counts.items() if count == best), key=order.index)


def graph_to_toml(
    graph: HardwareGraph,
    *,
    minor_numbers: tuple[int, ...] | list[int] | None = None,
    uuids: tuple[str, ...] | list[str] | None = None,
    pci_bus_ids: tuple[str, ...] | list[str] | None = None,
    comment: str = "",
    vendor: str | None = None,
) -> str:
    """A topology file for the graph; reading it back gives the same graph."""
    out = []
    for line in comment.splitlines():
        out.append(f"# {line}".rstrip())
    out.append(f"name = {_toml_string(graph.name)}")
    if graph.description:
        out.append(f"description = {_toml_string(graph.description)}")
    vendor = vendor or graph_vendor(graph)
    if vendor != "nvidia":
        out.append(f"vendor = {_toml_string(vendor)}")
    out.append(f"gpus = {graph.size}")
    out.append(f"nvlink_generation = {graph.bandwidths.nvlink_generation}")
    default = _default_link(graph)
    out.append(f"default_link = {_toml_string(default)}")
    out.append(f"domains = {_toml_list(graph.domains)}")
    if graph.cpu_affinity:
        out.append(f"cpu_affinity = {_toml_list(graph.cpu_affinity)}")
    if minor_numbers is not None:
        out.append(f"minor_numbers = {_toml_list(list(minor_numbers))}")
    if uuids is not None:
        out.append(f"uuids = {_toml_list(list(uuids))}")
    if pci_bus_ids is not None:
        out.append(f"pci_bus_ids = {_toml_list(list(pci_bus_ids))}")
    out.append("")
    out.append("[links]")
    for a, b in graph.pairs():
        token = graph.link(a, b).token
        if token != default:
            out.append(f'"{a}-{b}" = "{token}"')
    overrides = _bandwidth_overrides(graph.bandwidths)
    if overrides:
        out.append("")
        out.append("[bandwidth]")
        for key, value in overrides.items():
            out.append(f"{key} = {value!r}")
    return "\n".join(out) + "\n"


def topology_to_toml(topology: Topology, *, comment: str = "") -> str:
    return graph_to_toml(
        topology.graph,
        minor_numbers=topology.minor_numbers,
        uuids=topology.uuids,
        pci_bus_ids=topology.pci_bus_ids,
        comment=comment,
        vendor=topology.vendor,
    )


def _bandwidth_overrides(bandwidths: Bandwidths) -> dict[str, float]:
    base = Bandwidths(nvlink_generation=bandwidths.nvlink_generation)
    overrides: dict[str, float] = {}
    generation = bandwidths.nvlink_generation
    if bandwidths.nvlink_per_link[generation] != base.nvlink_per_link[generation]:
        overrides["nvlink_per_link"] = float(bandwidths.nvlink_per_link[generation])
    for level in PCIE_LEVELS:
        if bandwidths.pcie[level] != base.pcie[level]:
            overrides[level] = float(bandwidths.pcie[level])
    if bandwidths.xgmi_per_link != base.xgmi_per_link:
        overrides["xgmi_per_link"] = float(bandwidths.xgmi_per_link)
    if bandwidths.xgmi_relayed is not None:
        overrides["xgmi_relayed"] = float(bandwidths.xgmi_relayed)
    return overrides


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    """The same content as the TOML file, as a JSON-ready dict (every pair listed)."""
    graph = topology.graph
    data: dict[str, Any] = {
        "name": graph.name,
        "description": graph.description,
        "vendor": topology.gpu_vendor,
        "gpus": graph.size,
        "nvlink_generation": graph.bandwidths.nvlink_generation,
        "domains": list(graph.domains),
        "cpu_affinity": list(graph.cpu_affinity),
        "links": graph.link_tokens(),
        "bandwidth_matrix": graph.bandwidth_matrix(),
    }
    if topology.minor_numbers is not None:
        data["minor_numbers"] = list(topology.minor_numbers)
    if topology.uuids is not None:
        data["uuids"] = list(topology.uuids)
    if topology.pci_bus_ids is not None:
        data["pci_bus_ids"] = list(topology.pci_bus_ids)
    if topology.gpu_vendor == "amd":
        data["xgmi_per_link"] = graph.bandwidths.xgmi_per_link
    if topology.notes:
        data["notes"] = list(topology.notes)
    return data
