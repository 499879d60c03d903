"""Saved ``rocm-smi --showtopo [--shownodesbw]`` and ``amd-smi topology`` text: a strict parser
and a formatter.

Pure functions: text in, an :class:`AmdTopology` out (the hardware graph, the notes on what the
text could not say, and the PCI bus ids when the text names GPUs by them).

Where the link widths come from. Both tools print a link *type* per GPU pair (``XGMI`` or
``PCIE``), a hop count and a weight, and neither tells how many xGMI links join two GPUs:
the hop count is 1 for every pair of one xGMI hive, direct or relayed through a third GPU
(ROCm/rocm-systems#5763; hwloc#775), and the weight counts 15 per xGMI hop, so it does not see
link widths either (ROCm/rocm-systems#7372). The trustworthy source is the bandwidth table:
``rocm-smi --shownodesbw`` ("Bandwidth between two GPUs") and amd-smi's ``NUMA BW TABLE``
print ``min-max`` MB/s per pair, from the amdgpu driver's per-link xGMI bandwidth: ``min`` is
one link, ``max`` is the number of links times one link, and a pair without a direct link has
no bandwidth (``N/A`` or ``0-0``). On an MI250X node that gives 50000-200000 inside a package,
50000-100000 and 50000-50000 between packages (hwloc's rsmi backend, hwloc/rsmi.c). So:

* with a bandwidth table: ``XGMI<max/min>`` per pair, ``XGMI0`` where there is no bandwidth,
  and ``min`` (MB/s) sets the graph's xGMI bandwidth per link;
* without one, when every pair is ``XGMI`` with the same weight: an all-to-all hive, read as
  ``XGMI1`` everywhere (the MI300X/MI325X/MI355X platforms: 7 links per GPU, one to each
  peer), with a note in ``notes``; the per-link bandwidth is the MI300X's 64 GB/s;
* without one otherwise (an MI250X's hive, or a text that names an MI250 product): an error
  that says to save ``--shownodesbw`` too, never a graph with made-up widths.

``PCIE`` pairs get a PCIe level from the hop count, as the ROCm docs define it: 1 -> ``PXB``
(behind one switch), 2 -> ``NODE`` (through the CPU of one socket), 3 or more -> ``SYS``.

What is accepted around the tables: blank lines, ``=====`` banners (titled or not), ``#``
comments, a command line naming ``rocm-smi`` or ``amd-smi`` in any prompt, rocm-smi's footer
lines, a bare shell prompt as the last line (hardware/pasted.py), rocm-smi's ``WARNING: ...``
lines anywhere (ROCm 7's rocm-smi prints ``WARNING: AMD GPU device(s) is/are in a low-power
state. Check power control/runtime_status`` right after its title banner when it takes a GPU to
be in a low-power state, e.g. on MI300-series nodes), amd-smi's ``WARNING: ...`` lines before its
first table (a user missing the render and video groups), a ``Numa
Nodes`` section and a product section with ``GPU[n] : ...`` lines. Anything else, and any table
that is not square, symmetric, labelled in order or made of the expected cells, is an
:class:`InputError` that quotes the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.hardware import HardwareGraph, build_graph
from ..core.links import XGMI_PER_LINK, Bandwidths
from ..errors import InputError
from .pasted import without_trailing_prompt

# rocm-smi section titles -> the key of the table
_ROCM_TABLES = {
    "weight between two gpus": "weight",
    "hops between two gpus": "hops",
    "link type between two gpus": "type",
    "bandwidth between two gpus": "bandwidth",
}
_ROCM_OTHER_SECTIONS = {
    "rocm system management interface",
    "end of rocm smi log",
    "numa nodes",
    "product info",
    "concise info",
}
# amd-smi section titles ("<NAME> TABLE:") -> the key of the table
_AMD_TABLES = {
    "ACCESS": "access",
    "WEIGHT": "weight",
    "HOPS": "hops",
    "LINK TYPE": "type",
    "NUMA BW": "bandwidth",
}
_BANNER = re.compile(r"^=+(?:\s*(.*?)\s*=+)?$")
_AMD_TITLE = re.compile(r"^([A-Z][A-Z ]*[A-Z]) TABLE:$")
_COMMAND = re.compile(r"(?:^|[\s$#>:\]\\/])(?:rocm-smi|amd-smi)(?:\.py)?(?=\s|$|;|&|\|)")
_FOOTER = (
    re.compile(r"^Format:\s*min-max;\s*Units:\s*\w+$", re.IGNORECASE),
    re.compile(r"^\"?0-0\"?\s+min-max bandwidth indicates devices are not connected directly$", re.IGNORECASE),
)
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_BDF_LABEL = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_GPU_INFO = re.compile(r"^GPU\[(\d+)\]\s*:\s*(.*)$")
_NUMA_LINE = re.compile(r"^\(Topology\)\s*Numa (Node|Affinity):\s*(-?\d+)$")
_BANDWIDTH = re.compile(r"^(\d+)-(\d+)$")
_SELF = {"0", "N/A", "SELF", "X", "ENABLED"}
MI300_PER_LINK = XGMI_PER_LINK["mi300x"]


@dataclass(frozen=True)
class AmdTopology:
    """What one saved rocm-smi / amd-smi topology text says."""

    graph: HardwareGraph
    tool: str  # "rocm-smi" or "amd-smi"
    notes: tuple[str, ...] = ()
    pci_bus_ids: tuple[str, ...] | None = None
    numa_nodes: tuple[int, ...] | None = None
    products: tuple[str, ...] = ()


@dataclass
class _Table:
    title: str
    line_no: int  # of the title
    labels: list[str] = field(default_factory=list)
    header_line: int = 0
    rows: list[tuple[int, str, list[str]]] = field(default_factory=list)


def _where(number: int, line: str) -> str:
    return f"line {number}: {line.rstrip()!r}"


def detect_amd_tool(text: str) -> str | None:
    """``"rocm-smi"`` or ``"amd-smi"`` when the text looks like their topology output, else None."""
    for line in text.splitlines():
        stripped = line.strip()
        banner = _BANNER.match(stripped)
        if banner and banner.group(1) and banner.group(1).lower() in (*_ROCM_TABLES, *_ROCM_OTHER_SECTIONS):
            return "rocm-smi"
        title = _AMD_TITLE.match(stripped)
        if title and title.group(1) in _AMD_TABLES:
            return "amd-smi"
    return None


def parse_amd_topology(text: str, *, name: str | None = None, source: str | None = None) -> AmdTopology:
    """Parse saved ``rocm-smi --showtopo [--shownodesbw]`` or ``amd-smi topology`` text."""
    try:
        return _parse(text, name=name or source or "amd")
    except InputError as error:
        if source:
            raise InputError(f"{source}: {error}") from None
        raise


def _parse(text: str, *, name: str) -> AmdTopology:
    text = without_trailing_prompt(text)
    if "\x1b" in text:
        at = text.index("\x1b")
        raise InputError(f"line {text.count(chr(10), 0, at) + 1}: a terminal control sequence; save the plain output")
    tool = detect_amd_tool(text)
    if tool is None:
        raise InputError(
            "no rocm-smi or amd-smi topology table found; expected the output of `rocm-smi --showtopo "
            "--shownodesbw` (sections such as '=== Link Type between two GPUs ===') or `amd-smi topology` "
            "(sections such as 'LINK TYPE TABLE:')"
        )
    lines = text.splitlines()
    tables, numa, products = (_sections_rocm if tool == "rocm-smi" else _sections_amd)(lines)
    if "type" not in tables:
        raise InputError(
            f"{tool}: no link type table; expected "
            + ("'=== Link Type between two GPUs ===' (rocm-smi --showtopo)" if tool == "rocm-smi" else "'LINK TYPE TABLE:'")
        )
    reference = tables["type"]
    size = len(reference.labels)
    for table in tables.values():
        _check_table(table, lines, tool)
        if table.labels != reference.labels:
            raise InputError(
                f"{tool}, {_where(table.header_line, lines[table.header_line - 1])}: the columns "
                f"{' '.join(table.labels)} differ from the link type table's {' '.join(reference.labels)}; "
                f"expected the same GPUs in every table"
            )
    return _assemble(tool, tables, lines, size, numa, products, name)


def _is_noise(stripped: str) -> bool:
    return (
        not stripped
        or stripped.startswith("#")
        or bool(_COMMAND.search(stripped))
        or any(pattern.match(stripped) for pattern in _FOOTER)
    )


def _sections_rocm(lines: list[str]) -> tuple[dict[str, _Table], dict[int, int], dict[int, str]]:
    tables: dict[str, _Table] = {}
    numa: dict[int, int] = {}
    affinity: dict[int, int] = {}
    products: dict[int, str] = {}
    current: _Table | None = None
    section = ""
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("WARNING:"):
            # rocm-smi's warnings (low-power state, no GPUs specified): before the first banner,
            # right after its title banner (ROCm 7 on MI300-series nodes), or between sections.
            # A table row starts with its GPU's label, so no row is taken for one.
            continue
        banner = _BANNER.match(stripped)
        if banner:
            title = (banner.group(1) or "").lower()
            if not title:
                continue
            if title in _ROCM_TABLES:
                key = _ROCM_TABLES[title]
                if key in tables:
                    raise InputError(f"rocm-smi, {_where(number, line)}: a second '{banner.group(1)}' section")
                current = tables[key] = _Table(title=banner.group(1), line_no=number)
                section = key
            elif title in _ROCM_OTHER_SECTIONS:
                current, section = None, title
            else:
                raise InputError(
                    f"rocm-smi, {_where(number, line)}: unknown section; expected Weight, Hops, Link Type or "
                    f"Bandwidth between two GPUs, Numa Nodes or Product Info"
                )
            continue
        if _is_noise(stripped):
            continue
        if current is not None:
            _table_line(current, number, line, "rocm-smi")
            continue
        info = _GPU_INFO.match(stripped)
        if info and section in ("numa nodes", "product info", "concise info"):
            gpu, rest = int(info.group(1)), info.group(2).strip()
            if section == "numa nodes":
                match = _NUMA_LINE.match(rest)
                if not match:
                    raise InputError(
                        f"rocm-smi, {_where(number, line)}: expected 'GPU[n] : (Topology) Numa Node: <n>' "
                        f"or '... Numa Affinity: <n>'"
                    )
                (numa if match.group(1) == "Node" else affinity)[gpu] = int(match.group(2))
            else:
                series = re.match(r"^Card (?:Series|series|Model|model):\s*(.*)$", rest)
                if series:
                    products[gpu] = products.get(gpu, "") + " " + series.group(1).strip()
            continue
        raise InputError(
            f"rocm-smi, {_where(number, line)}: unexpected text; expected a table row of a section such as "
            f"'Link Type between two GPUs', a 'GPU[n] : ...' line, a '====' banner or a blank line"
        )
    # The Numa Affinity is the node whose CPUs are closest (-1 when unknown); prefer it.
    chosen = affinity if affinity and all(value >= 0 for value in affinity.values()) else numa
    return tables, chosen, products


def _sections_amd(lines: list[str]) -> tuple[dict[str, _Table], dict[int, int], dict[int, str]]:
    tables: dict[str, _Table] = {}
    current: _Table | None = None
    ignored = 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        title = _AMD_TITLE.match(stripped)
        if title:
            key = _AMD_TABLES.get(title.group(1))
            if key is None:
                # A table this reader does not use (newer amd-smi adds some): checked for shape only.
                ignored += 1
                key = f"other-{ignored}"
            if key in tables:
                raise InputError(f"amd-smi, {_where(number, line)}: a second '{stripped}' section")
            current = tables[key] = _Table(title=stripped, line_no=number)
            continue
        if _is_noise(stripped) or _BANNER.match(stripped):
            continue
        if current is None and stripped.startswith("WARNING:"):
            continue  # amd-smi's warnings before its tables (e.g. a user missing the render and video groups)
        if current is None:
            raise InputError(
                f"amd-smi, {_where(number, line)}: unexpected text before the first table; expected "
                f"'LINK TYPE TABLE:' and the other tables of `amd-smi topology`"
            )
        _table_line(current, number, line, "amd-smi")
    return {key: table for key, table in tables.items()}, {}, {}


def _table_line(table: _Table, number: int, line: str, tool: str) -> None:
    cells = line.split()
    if not table.labels:
        for label in cells:
            if not (_GPU_LABEL.match(label) or _BDF_LABEL.match(label)):
                raise InputError(
                    f"{tool}, {_where(number, line)}: {label!r} is not a GPU column; expected the header of "
                    f"'{table.title}' naming GPU0 GPU1 ... (or PCI bus ids)"
                )
        table.labels = cells
        table.header_line = number
        return
    table.rows.append((number, cells[0], cells[1:]))


def _check_table(table: _Table, lines: list[str], tool: str) -> None:
    size = len(table.labels)
    if not size:
        raise InputError(f"{tool}, {_where(table.line_no, lines[table.line_no - 1])}: the section has no table")
    gpu_labels = [_GPU_LABEL.match(label) for label in table.labels]
    if all(gpu_labels):
        if [int(match.group(1)) for match in gpu_labels] != list(range(size)):  # type: ignore[union-attr]
            raise InputError(
                f"{tool}, {_where(table.header_line, lines[table.header_line - 1])}: the columns must be "
                f"GPU0 GPU1 ... in order"
            )
    elif any(gpu_labels):
        raise InputError(
            f"{tool}, {_where(table.header_line, lines[table.header_line - 1])}: the columns mix GPU<n> and "
            f"PCI bus ids; expected one or the other"
        )
    elif len(set(label.lower() for label in table.labels)) != size:
        raise InputError(f"{tool}, {_where(table.header_line, lines[table.header_line - 1])}: a column is named twice")
    if len(table.rows) != size:
        where = table.rows[-1][0] if table.rows else table.header_line
        raise InputError(
            f"{tool}, {_where(where, lines[where - 1])}: '{table.title}' has {len(table.rows)} rows for "
            f"{size} columns; expected one row per GPU"
        )
    for index, (number, label, cells) in enumerate(table.rows):
        if label != table.labels[index]:
            raise InputError(
                f"{tool}, {_where(number, lines[number - 1])}: expected the row of {table.labels[index]}, found "
                f"{label!r}"
            )
        if len(cells) != size:
            raise InputError(
                f"{tool}, {_where(number, lines[number - 1])}: expected {size} cells after {label}, found {len(cells)}"
            )
        if cells[index].upper() not in _SELF:
            raise InputError(
                f"{tool}, {_where(number, lines[number - 1])}: the cell of {label} with itself is "
                f"{cells[index]!r}; expected 0, N/A or SELF"
            )
    for a in range(size):
        for b in range(a + 1, size):
            if table.rows[a][2][b] != table.rows[b][2][a]:
                number = table.rows[b][0]
                raise InputError(
                    f"{tool}, {_where(number, lines[number - 1])}: {table.labels[a]}-{table.labels[b]} is "
                    f"{table.rows[a][2][b]!r} but {table.labels[b]}-{table.labels[a]} is "
                    f"{table.rows[b][2][a]!r} in '{table.title}'; expected a symmetric table"
                )


def _cell(table: _Table, a: int, b: int) -> tuple[str, int]:
    number, _label, cells = table.rows[a]
    return cells[b], number


def _integer(table: _Table, a: int, b: int, lines: list[str], tool: str) -> int:
    value, number = _cell(table, a, b)
    if not value.isdigit():
        raise InputError(
            f"{tool}, {_where(number, lines[number - 1])}: {value!r} in '{table.title}' is not a number"
        )
    return int(value)


def _assemble(
    tool: str,
    tables: dict[str, _Table],
    lines: list[str],
    size: int,
    numa: dict[int, int],
    products: dict[int, str],
    name: str,
) -> AmdTopology:
    types = tables["type"]
    bandwidth = tables.get("bandwidth")
    notes: list[str] = []
    kinds: dict[tuple[int, int], str] = {}
    for a in range(size):
        for b in range(a + 1, size):
            value, number = _cell(types, a, b)
            kind = value.upper()
            if kind not in ("XGMI", "PCIE"):
                raise InputError(
                    f"{tool}, {_where(number, lines[number - 1])}: link type {value!r}; expected XGMI or PCIE"
                )
            kinds[(a, b)] = kind
    widths: dict[tuple[int, int], int] = {}
    per_link: set[int] = set()
    if bandwidth is not None:
        for (a, b), kind in kinds.items():
            value, number = _cell(bandwidth, a, b)
            if value.upper() == "N/A":
                low = high = 0
            else:
                match = _BANDWIDTH.match(value)
                if not match:
                    raise InputError(
                        f"{tool}, {_where(number, lines[number - 1])}: bandwidth {value!r}; expected min-max in "
                        f"MB/s such as 50000-200000, 0-0 or N/A"
                    )
                low, high = int(match.group(1)), int(match.group(2))
            if kind == "PCIE":
                continue  # PCIe pairs carry no xGMI links (their bandwidth, if any, is the PCIe link's)
            if high == 0 and low == 0:
                widths[(a, b)] = 0
                continue
            if low <= 0 or high < low or high % low:
                raise InputError(
                    f"{tool}, {_where(number, lines[number - 1])}: bandwidth {value!r} of an XGMI pair; expected "
                    f"min-max with max a whole number of links times min (one link), e.g. 50000-100000"
                )
            widths[(a, b)] = high // low
            per_link.add(low)
        if len(per_link) > 1:
            raise InputError(
                f"{tool}: xGMI links of different speeds ({', '.join(str(v) for v in sorted(per_link))} MB/s per "
                f"link) in one node; expected one speed"
            )
    elif any(kind == "XGMI" for kind in kinds.values()):
        weights = tables.get("weight")
        weight_values = (
            {_integer(weights, a, b, lines, tool) for (a, b) in kinds} if weights is not None else set()
        )
        named = " ".join(products.values())
        all_to_all = all(kind == "XGMI" for kind in kinds.values()) and len(weight_values) <= 1
        if not all_to_all or "MI250" in named.upper() or "MI200" in named.upper():
            raise InputError(
                f"{tool}: the XGMI pairs' link widths are unknown: the link type and hops tables say XGMI and 1 hop "
                f"for direct and relayed pairs alike, and the weights count hops, not links; save the bandwidth "
                f"table too (`rocm-smi --showtopo --shownodesbw`, or `amd-smi topology`, whose NUMA BW TABLE has it)"
            )
        widths = {pair: 1 for pair in kinds}
        notes.append(
            f"{tool} gives no xGMI link widths (no bandwidth table): every pair is XGMI with the same weight, read "
            f"as an all-to-all hive of single links (MI300X, MI325X, MI355X) at {MI300_PER_LINK:g} GB/s per link; "
            f"save `rocm-smi --showtopo --shownodesbw` to read the widths and speed"
        )
    links: dict[tuple[int, int], str] = {}
    hops = tables.get("hops")
    for (a, b), kind in kinds.items():
        if kind == "XGMI":
            links[(a, b)] = f"XGMI{widths[(a, b)]}"
        else:
            count = _integer(hops, a, b, lines, tool) if hops is not None else 3
            links[(a, b)] = "PXB" if count <= 1 else "NODE" if count == 2 else "SYS"
    if per_link:
        xgmi_per_link = per_link.pop() / 1000.0
    elif notes:
        xgmi_per_link = MI300_PER_LINK
    else:
        xgmi_per_link = Bandwidths().xgmi_per_link
    numa_nodes: tuple[int, ...] | None = None
    if numa:
        if sorted(numa) != list(range(size)):
            raise InputError(
                f"{tool}: the Numa Nodes section names GPUs {sorted(numa)}; expected GPU[0]..GPU[{size - 1}]"
            )
        numa_nodes = tuple(numa[gpu] for gpu in range(size))
    if numa_nodes is not None and all(node >= 0 for node in numa_nodes):
        domains = list(numa_nodes)
    else:
        from .domains import infer_domains

        domains = infer_domains(size, links, None, None)
    labels = types.labels
    bus_ids = tuple(label.lower() for label in labels) if _BDF_LABEL.match(labels[0]) else None
    model = sorted(set(products.values()))
    graph = build_graph(
        name,
        size,
        links,
        bandwidths=Bandwidths(xgmi_per_link=xgmi_per_link),
        domains=domains,
        description=f"read from {tool}" + (f": {model[0].strip()}" if len(model) == 1 else ""),
    )
    return AmdTopology(
        graph=graph,
        tool=tool,
        notes=tuple(notes),
        pci_bus_ids=bus_ids,
        numa_nodes=numa_nodes,
        products=tuple(products.get(gpu, "").strip() for gpu in range(size)) if products else (),
    )


# --- formatting (the mock rocm-smi prints this) -----------------------------------------------

_WIDTH = 13


def _banner(title: str, width: int = 80) -> str:
    title = f" {title} " if title else ""
    left = (width - len(title)) // 2
    return "=" * left + title + "=" * (width - left - len(title))


def _matrix(graph: HardwareGraph, cell) -> list[str]:
    out = ["       " + "".join(f"{'GPU' + str(b):<{_WIDTH}}" for b in graph.gpus)]
    for a in graph.gpus:
        out.append(f"{'GPU' + str(a):<7}" + "".join(f"{cell(a, b):<{_WIDTH}}" for b in graph.gpus))
    return out


def _xgmi_hops(graph: HardwareGraph) -> list[list[int]]:
    """Physical xGMI hops between every two GPUs (shortest path over direct xGMI links)."""
    size = graph.size
    far = size + 1
    hops = [[0 if a == b else (1 if graph.link(a, b).is_xgmi and graph.link(a, b).kind == "nvlink" else far)
             for b in range(size)] for a in range(size)]
    for via in range(size):
        for a in range(size):
            for b in range(size):
                if hops[a][via] + hops[via][b] < hops[a][b]:
                    hops[a][b] = hops[a][via] + hops[via][b]
    return hops


def format_showtopo(graph: HardwareGraph, *, bandwidth: bool = True) -> str:
    """``rocm-smi --showtopo [--shownodesbw]`` text for an AMD graph (xGMI and PCIe classes)."""
    out = [_banner("ROCm System Management Interface")]

    hops_over_xgmi = _xgmi_hops(graph)

    def weight(a: int, b: int) -> str:
        # The KFD weight: 15 per physical xGMI hop (ROCm/rocm-systems#7372), 20 per PCIe segment.
        if a == b:
            return "0"
        link = graph.link(a, b)
        if link.is_xgmi:
            return str(15 * hops_over_xgmi[a][b])
        return {"PIX": "20", "PXB": "20", "PHB": "40", "NODE": "40"}.get(link.level, "72")

    def hops(a: int, b: int) -> str:
        if a == b:
            return "0"
        link = graph.link(a, b)
        return "1" if link.is_xgmi else {"PIX": "1", "PXB": "1", "PHB": "2", "NODE": "2"}.get(link.level, "3")

    def kind(a: int, b: int) -> str:
        return "0" if a == b else ("XGMI" if graph.link(a, b).is_xgmi else "PCIE")

    per_link = int(round(graph.bandwidths.xgmi_per_link * 1000))

    def nodes_bw(a: int, b: int) -> str:
        if a == b:
            return "N/A"
        link = graph.link(a, b)
        if not link.is_xgmi or link.kind != "nvlink":
            return "0-0"
        return f"{per_link}-{per_link * link.links}"

    for title, cell in (
        ("Weight between two GPUs", weight),
        ("Hops between two GPUs", hops),
        ("Link Type between two GPUs", kind),
    ):
        out.append(_banner(title))
        out.extend(_matrix(graph, cell))
        out.append("")
    out.append(_banner("Numa Nodes"))
    for gpu in graph.gpus:
        out.append(f"GPU[{gpu}]\t\t: (Topology) Numa Node: {graph.domains[gpu]}")
        out.append(f"GPU[{gpu}]\t\t: (Topology) Numa Affinity: {graph.domains[gpu]}")
    if bandwidth:
        out.append(_banner("Bandwidth between two GPUs"))
        out.extend(_matrix(graph, nodes_bw))
        out.append("Format: min-max; Units: mps")
        out.append('"0-0" min-max bandwidth indicates devices are not connected directly')
    out.append(_banner("End of ROCm SMI Log"))
    return "\n".join(out) + "\n"
