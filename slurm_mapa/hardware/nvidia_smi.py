"""``nvidia-smi topo -m`` and ``nvidia-smi -L``: a strict parser.

Pure functions only: text in, a :class:`SmiTopology` out (the hardware graph plus the facts the
text carries: NICs and their links, CPU and NUMA affinity). The way back, a graph printed as
this text, is :mod:`.nvidia_smi_format`; the mock ``nvidia-smi`` prints it, and it round-trips
through the parser to the same graph.

What the parser accepts, from real pastes (tests/data/nvidia-smi/):

* tab- or space-aligned columns, headers whose names are glued together (``GPU0GPU1mlx5_0``),
  lines before the matrix that are comments (``# ...``), blank, a command line naming
  ``nvidia-smi`` in any prompt (bare, ``$ ...``, ``[user@host ~]$ ...``, ``(base) user@host:~$
  ...``, ``PS C:\\> nvidia-smi.exe ...``), or the ``nvidia-smi -L`` lines of the same paste
  (``GPU 0: NVIDIA B200 (UUID: ...)``: they give the NVLink generation); and the shell's bare
  prompt as the last line (``root@node:~#``: hardware/pasted.py);
* old and new legends (``SOC`` is read as ``SYS``), ``NV<n>`` for any bonded count, a legend or
  none, and the ``NIC Legend`` block of newer drivers;
* NIC rows and columns (``mlx5_0``, ``NIC0``, ...): kept as facts, never GPU pairs;
* ``CPU Affinity``, ``NUMA Affinity`` and ``GPU NUMA ID`` columns in any subset; in tab-separated
  rows each value is read by its tab position (nvidia-smi's extra empty cell before GPU NUMA ID
  is dropped), so a missing value is never taken for a blank one;
* the terminal styling nvidia-smi puts around the header even when it writes to a file
  (``ESC[4m ... ESC[0m``, seen on a real H100 in 2026).

What it refuses (an :class:`InputError` that quotes the line and says what was expected): a
row whose cell count does not fit the header, a diagonal that is not ``X``, an unknown link
token, an asymmetric matrix (a single changed cell is caught this way), a missing or repeated
GPU row, a header that does not name the rows in order, and any stray text after the matrix
that is not legend.

The NVLink generation (bandwidth per link) comes from the GPU model (``-L``); without it the
reading uses 25 GB/s per link (NVLink 2 to 4) and says in ``notes`` that this is a guess.

NVSwitch: nvidia-smi prints a pair on an NVSwitch fabric as ``NV<n>`` like a direct link. A GPU
whose ``NV`` counts add up to more NVLink ports than it has (:func:`~.nvlink.nvlink_ports` of
its generation, at least its largest single bond) must sit on a switch; pairs of two such GPUs
become ``NVS<n>`` (:mod:`.nvlink`). A 2-GPU NVSwitch system cannot be told from a bridged pair this way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..core.hardware import HardwareGraph, build_graph
from ..core.links import Bandwidths, parse_link
from ..errors import InputError
from .domains import infer_domains
from .nvlink import FALLBACK_GENERATION, classify_switches, generation_guess_note, nvlink_generation_of, nvlink_ports
from .pasted import without_trailing_prompt

ATTRIBUTE_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_DEVICE_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]*$")
_LEGEND_ENTRY = re.compile(r"^\s*(X|NV#|NV\d+|NVS#|SOC|SYS|NODE|PHB|PXB|PIX|NVB|NV|NIC\d*)\s*=\s*\S.*$")
_NIC_LEGEND_ENTRY = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
# A command line naming nvidia-smi, whatever the prompt before it ("$ ", "[user@host ~]$ ",
# "(base) user@host:~$ ", "PS C:\\> ", none) and whatever follows (topo -m, topo --matrix).
_COMMAND = re.compile(r"(?:^|[\s$#>:\]\\/])nvidia-smi(?:\.exe)?(?=\s|$|;|&|\|)", re.IGNORECASE)
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


@dataclass(frozen=True)
class SmiTopology:
    """What one ``nvidia-smi topo -m`` text says.

    ``graph`` holds the GPU pairs. ``nics`` names the NIC rows (as printed: ``mlx5_0`` or
    ``NIC0``), ``nic_names`` maps ``NIC<n>`` to the device name from the NIC legend, and
    ``nic_links`` holds every pair that involves a NIC as ``{(row, column): token}``.
    Affinities are the raw column values per GPU (``None`` where the column is absent).
    """

    graph: HardwareGraph
    nics: tuple[str, ...] = ()
    nic_names: dict[str, str] = field(default_factory=dict)
    nic_links: dict[tuple[str, str], str] = field(default_factory=dict)
    cpu_affinity: tuple[str, ...] | None = None
    numa_affinity: tuple[str, ...] | None = None
    gpu_numa_id: tuple[str, ...] | None = None
    notes: tuple[str, ...] = ()
    gpu_models: tuple[str, ...] = ()  # from `nvidia-smi -L` lines in the same paste


@dataclass(frozen=True)
class GpuListEntry:
    """One ``GPU n: <name> (UUID: GPU-...)`` line of ``nvidia-smi -L``."""

    index: int
    name: str
    uuid: str


def _where(number: int, line: str) -> str:
    return f"line {number}: {line.rstrip()!r}"


def _is_preamble(line: str) -> bool:
    stripped = line.strip()
    return (
        not stripped
        or stripped.startswith("#")
        or bool(_COMMAND.search(stripped))
        or bool(_GPU_LIST_LINE.match(stripped))
        or bool(_MIG_LIST_LINE.match(line))
    )


def _despace(text: str) -> str:
    return "".join(text.split())


def parse_topo_matrix(
    text: str, *, name: str | None = None, nvlink_generation: int | None = None, source: str | None = None
) -> SmiTopology:
    """Parse the text of ``nvidia-smi topo -m`` (see the module docstring for what is accepted).

    ``nvlink_generation`` (from the GPU model, see :func:`nvlink_generation_of`) sets the
    graph's bandwidths and how many NVLink ports a GPU has; without it generation 2 bandwidths
    are used and a switch is recognised only above the largest port count of any GPU.
    ``source`` (a file name) prefixes error messages and is the default ``name``.
    """
    try:
        return _parse_topo_matrix(text, name=name or source or "nvidia-smi", nvlink_generation=nvlink_generation)
    except InputError as error:
        if source:
            raise InputError(f"{source}: {error}") from None
        raise


_SGR = re.compile(r"\x1b\[[0-9;]*m")
_Row = tuple[int, str, list[str]]  # a matrix row: its line number, its device label, its cells


def _parse_topo_matrix(text: str, *, name: str, nvlink_generation: int | None) -> SmiTopology:
    # The steps read the text from the top (preamble, header, rows, what follows, the cells, the
    # attribute values): the first fault met is the one reported.
    lines, header_at = _find_header(text)
    models = _preamble_models(lines[:header_at])
    if nvlink_generation is None and models:
        nvlink_generation = _common_generation(models)
    header = lines[header_at]
    _check_header(header, header_at)
    rows, end = _matrix_rows(lines, header_at)
    _check_trailer(lines, end)
    nic_names = _nic_legend(lines, end)
    labels, attributes, gpu_rows, nic_rows = _check_rows(rows, lines, header_at, header)
    tokens, values = _link_cells(rows, lines, labels, gpu_rows, attributes)
    gpu_count = len(gpu_rows)
    columns = _attribute_values(values, rows, lines, gpu_count, attributes)
    gpu_links = {
        (a, b): _canonical(tokens[(a, b)]) for a in range(gpu_count) for b in range(a + 1, gpu_count)
    }
    gpu_links = classify_switches(gpu_links, gpu_count, nvlink_ports(nvlink_generation))
    cpu = tuple(columns["CPU Affinity"]) if "CPU Affinity" in columns else None
    numa = tuple(columns["NUMA Affinity"]) if "NUMA Affinity" in columns else None
    gpu_numa = tuple(columns["GPU NUMA ID"]) if "GPU NUMA ID" in columns else None
    graph_affinity = cpu if cpu is not None and all(value not in ("", "N/A") for value in cpu) else None
    if models and len(models) != gpu_count:
        raise InputError(
            f"nvidia-smi topo -m: the `nvidia-smi -L` lines before the matrix list {len(models)} GPUs but the "
            f"matrix has {gpu_count}; expected the same GPUs in both"
        )
    graph = build_graph(
        name,
        gpu_count,
        gpu_links,
        bandwidths=Bandwidths(nvlink_generation=nvlink_generation or FALLBACK_GENERATION),
        domains=infer_domains(gpu_count, gpu_links, cpu, numa),
        cpu_affinity=graph_affinity,
    )
    notes = []
    if nvlink_generation is None and any(parse_link(token).is_nvlink for token in gpu_links.values()):
        notes.append(generation_guess_note(models))
    nics = tuple(label for _, label, _ in nic_rows)
    if nic_names:
        numbered = {nic for nic in nics if re.match(r"^NIC\d+$", nic)}
        if set(nic_names) != numbered:
            raise InputError(
                f"nvidia-smi topo -m: the NIC Legend names {', '.join(sorted(nic_names)) or 'nothing'} but the "
                f"matrix has the NIC rows {', '.join(sorted(numbered)) or 'none'}; expected one legend entry per NIC<n>"
            )
    nic_links = {
        (labels[a], labels[b]): _canonical(token)
        for (a, b), token in tokens.items()
        if a < b and (a >= gpu_count or b >= gpu_count)
    }
    return SmiTopology(
        graph=graph,
        nics=nics,
        nic_names=nic_names,
        nic_links=nic_links,
        cpu_affinity=cpu,
        numa_affinity=numa,
        gpu_numa_id=gpu_numa,
        notes=tuple(notes),
        gpu_models=tuple(models),
    )


def _find_header(text: str) -> tuple[list[str], int]:
    """The lines of the text and the index of the header line (the first that is not preamble)."""
    # nvidia-smi underlines the header with terminal escapes even when its output is not a
    # terminal (seen on an H100, 2026): drop those; any other control sequence is refused.
    text = without_trailing_prompt(_SGR.sub("", text))
    if "\x1b" in text:
        at = text.index("\x1b")
        line_no = text.count("\n", 0, at) + 1
        raise InputError(f"nvidia-smi topo -m, line {line_no}: a terminal control sequence other than text styling; save the plain output")
    lines = text.splitlines()
    header_at = None
    for number, line in enumerate(lines):
        if _is_preamble(line):
            continue
        header_at = number
        break
    if header_at is None:
        raise InputError(
            "nvidia-smi topo -m: no header line naming the columns (GPU0 GPU1 ...) found; "
            "expected the output of `nvidia-smi topo -m`"
        )
    return lines, header_at


def _check_header(header: str, header_at: int) -> None:
    """The header names GPU0 and is not itself a matrix row."""
    header_words = header.split()
    if "GPU0" not in _despace(header) or (len(header_words) > 1 and header_words[1] == "X"):
        raise InputError(
            f"nvidia-smi topo -m, {_where(header_at + 1, header)}: expected the header line naming the columns "
            f"(GPU0 GPU1 ... CPU Affinity) before the matrix; only blank lines, '#' comments, a command "
            f"line naming nvidia-smi and `nvidia-smi -L` lines may come before it"
        )


def _matrix_rows(lines: list[str], header_at: int) -> tuple[list[_Row], int]:
    """The matrix rows, (line number, device label, cells) each, up to the legend (blank lines are
    skipped), and the index of the line where the matrix ends."""
    rows: list[_Row] = []
    number = header_at + 1
    while number < len(lines):
        line = lines[number]
        stripped = line.strip()
        if stripped.startswith(("Legend", "NIC Legend")):
            break
        number += 1
        if not stripped:
            continue
        cells = stripped.split()
        label = cells[0]
        if not _DEVICE_LABEL.match(label) or label == "X":
            raise InputError(
                f"nvidia-smi topo -m, {_where(number, line)}: {label!r} is not a device label "
                f"(expected a matrix row starting with GPU<n>, NIC<n> or a NIC name such as mlx5_0)"
            )
        rows.append((number, label, cells[1:]))
    return rows, number


def _check_rows(
    rows: list[_Row], lines: list[str], header_at: int, header: str
) -> tuple[list[str], tuple[str, ...], list[_Row], list[_Row]]:
    """The rows checked against each other and the header: (labels, attribute columns, GPU rows, NIC rows)."""
    if not rows:
        raise InputError(f"nvidia-smi topo -m, {_where(header_at + 1, header)}: no matrix rows follow the header")
    labels = [label for _, label, _ in rows]
    seen: set[str] = set()
    for line_no, label, _ in rows:
        if label in seen:
            raise InputError(
                f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: device {label} has a second row "
                f"(expected one row per device)"
            )
        seen.add(label)

    # The header must name the rows in order, then the attribute columns.
    glued = _despace(header)
    device_part = "".join(labels)
    for line_no, label, _ in rows:
        if label not in glued:
            raise InputError(
                f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: {label!r} starts a row but the "
                f"header has no such column; expected a matrix row of a device named in the header, blank "
                f"lines or the legend"
            )
    if not glued.startswith(device_part):
        raise InputError(
            f"nvidia-smi topo -m, {_where(header_at + 1, header)}: the header does not name the matrix rows in "
            f"order; expected the columns {' '.join(labels)} (then CPU Affinity, NUMA Affinity, GPU NUMA ID "
            f"as printed)"
        )
    missing = re.match(r"(?:(?:GPU|NIC)\d+)+", glued[len(device_part):])
    if missing:  # the header names devices no row follows: a truncated paste, not a bad header (issue 52)
        names = re.findall(r"(?:GPU|NIC)\d+", missing.group(0))
        raise InputError(
            f"nvidia-smi topo -m: the header names {len(labels) + len(names)} devices but the matrix has rows only for "
            f"{' '.join(labels)}; the rows of {' '.join(names)} are missing (a truncated copy?); expected the whole "
            "output, one row per device the header names (save it with `nvidia-smi topo -m > FILE`)"
        )
    attributes = _attribute_columns(glued[len(device_part) :], header_at + 1, header)

    gpu_rows = [(line_no, label, cells) for line_no, label, cells in rows if _GPU_LABEL.match(label)]
    nic_rows = [(line_no, label, cells) for line_no, label, cells in rows if not _GPU_LABEL.match(label)]
    if not gpu_rows:
        raise InputError(f"nvidia-smi topo -m, {_where(header_at + 1, header)}: no GPU rows (GPU0, GPU1, ...)")
    if rows[: len(gpu_rows)] != gpu_rows:
        first_nic = nic_rows[0]
        raise InputError(
            f"nvidia-smi topo -m, {_where(first_nic[0], lines[first_nic[0] - 1])}: a NIC row comes before a "
            f"GPU row; expected the GPU rows first, as nvidia-smi prints them"
        )
    for position, (line_no, label, _) in enumerate(gpu_rows):
        if label != f"GPU{position}":
            raise InputError(
                f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: expected the row of GPU{position}, "
                f"found {label} (GPU rows must be GPU0, GPU1, ... in order)"
            )
    return labels, attributes, gpu_rows, nic_rows


def _link_cells(
    rows: list[_Row], lines: list[str], labels: list[str], gpu_rows: list[_Row], attributes: tuple[str, ...]
) -> tuple[dict[tuple[int, int], str], list[list[str]]]:
    """The link token of every pair (checked: X on the diagonal only, known, symmetric) and the
    attribute values of each GPU row."""
    size = len(labels)
    tokens: dict[tuple[int, int], str] = {}
    values: list[list[str]] = []
    for row_index, (line_no, label, cells) in enumerate(rows):
        is_gpu = row_index < len(gpu_rows)
        extra = len(cells) - size
        if is_gpu:
            # An empty cell (two tabs) vanishes when splitting on whitespace, so a GPU row may carry
            # fewer attribute values only where the absent ones were blank; never more.
            if not 0 <= extra <= len(attributes) or (attributes and extra < _required_attributes(attributes)):
                raise InputError(
                    f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: expected {size} link cells"
                    + (f" and the values of {', '.join(attributes)}" if attributes else "")
                    + f" after {label}, found {len(cells)} cells"
                )
        elif extra not in (0, len(attributes)):
            raise InputError(
                f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: expected {size} link cells after "
                f"{label}, found {len(cells)}"
            )
        for column, cell in enumerate(cells[:size]):
            if column == row_index:
                if cell != "X":
                    raise InputError(
                        f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: the cell of {label} with "
                        f"itself is {cell!r}; expected X"
                    )
                continue
            if cell == "X":
                raise InputError(
                    f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: X off the diagonal (column "
                    f"{labels[column]}); expected a link class such as NV2, PIX or SYS"
                )
            try:
                parse_link(cell)
            except InputError as error:
                raise InputError(f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: {error}") from None
            tokens[(row_index, column)] = cell.upper()
        row_values = cells[size:]
        if is_gpu and attributes:
            tabbed = _tab_separated_values(lines[line_no - 1], size)
            if tabbed is not None:
                row_values = _values_by_tabs(tabbed, attributes, line_no, lines[line_no - 1], label)
        values.append(row_values if is_gpu else [])

    for (a, b), token in tokens.items():
        other = tokens[(b, a)]
        if _canonical(token) != _canonical(other):
            line_no = rows[max(a, b)][0]
            raise InputError(
                f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: {labels[a]}-{labels[b]} is "
                f"{token} but {labels[b]}-{labels[a]} is {other}; expected a symmetric matrix"
            )
    return tokens, values


def _attribute_values(
    values: list[list[str]], rows: list[_Row], lines: list[str], gpu_count: int, attributes: tuple[str, ...]
) -> dict[str, list[str]]:
    """Each attribute column's value per GPU, checked (the same columns in every GPU row)."""
    counts = {len(values[gpu]) for gpu in range(gpu_count)}
    if len(counts) > 1:
        for gpu in range(1, gpu_count):
            if len(values[gpu]) != len(values[0]):
                line_no = rows[gpu][0]
                raise InputError(
                    f"nvidia-smi topo -m, {_where(line_no, lines[line_no - 1])}: {len(values[gpu])} values for "
                    f"{', '.join(attributes)} where GPU0 has {len(values[0])}; expected the same columns in every "
                    f"GPU row"
                )
    columns: dict[str, list[str]] = {column: [] for column in attributes}
    for gpu in range(gpu_count):
        row_values = values[gpu]
        if len(row_values) < len(attributes):
            # Blank trailing cells only: fill the blanks from the right, after the required ones.
            row_values = row_values + [""] * (len(attributes) - len(row_values))
        for column, value in zip(attributes, row_values):
            columns[column].append(value)
    for column, entries in columns.items():
        for gpu, value in enumerate(entries):
            _check_attribute(column, value, rows[gpu][0], lines[rows[gpu][0] - 1])
    return columns


def _preamble_models(lines: list[str]) -> list[str]:
    """GPU models of `nvidia-smi -L` lines pasted before the matrix, checked to be GPU 0, 1, ..."""
    models: list[str] = []
    for number, line in enumerate(lines, start=1):
        match = _GPU_LIST_LINE.match(line.strip())
        if not match:
            continue
        if int(match.group(1)) != len(models):
            raise InputError(
                f"nvidia-smi -L, {_where(number, line)}: expected GPU {len(models)} next, found GPU {match.group(1)}"
            )
        models.append(match.group(2).strip())
    return models


def _common_generation(models: list[str]) -> int | None:
    generations = {nvlink_generation_of(model) for model in models}
    return generations.pop() if len(generations) == 1 else None


def _canonical(token: str) -> str:
    return parse_link(token).token


def _tab_separated_values(line: str, size: int) -> list[str] | None:
    """The attribute cells of a tab-separated row (blanks kept), or None if the row is not laid out by tabs."""
    parts = [part.strip() for part in line.split("\t")]
    if len(parts) < 1 + size or not all(parts[: 1 + size]):
        return None
    return parts[1 + size :]


def _values_by_tabs(cells: list[str], attributes: tuple[str, ...], line_no: int, line: str, label: str) -> list[str]:
    """Attribute values from tab positions, so that a missing value is not mistaken for a blank one.

    nvidia-smi prints an extra empty cell before GPU NUMA ID (``0\t\tN/A``); empty cells beyond
    the header's columns are dropped, and every column must have its cell (blank or not).
    """
    cells = list(cells)
    while len(cells) > len(attributes) and "" in cells:
        cells.remove("")
    if len(cells) != len(attributes):
        raise InputError(
            f"nvidia-smi topo -m, {_where(line_no, line)}: {len(cells)} value(s) after the link cells of {label}; "
            f"expected one for each of {', '.join(attributes)}"
        )
    return cells


def _required_attributes(attributes: tuple[str, ...]) -> int:
    # CPU Affinity and NUMA Affinity are printed for every GPU; GPU NUMA ID may be blank.
    return sum(1 for column in attributes if column != "GPU NUMA ID")


def _attribute_columns(tail: str, line_no: int, header: str) -> tuple[str, ...]:
    found: list[str] = []
    rest = tail
    for column in ATTRIBUTE_COLUMNS:
        key = column.replace(" ", "")
        if rest.startswith(key):
            found.append(column)
            rest = rest[len(key) :]
    if rest:
        raise InputError(
            f"nvidia-smi topo -m, {_where(line_no, header)}: unexpected {rest!r} after the device columns; "
            f"expected only {', '.join(ATTRIBUTE_COLUMNS)} (in that order, any of them)"
        )
    return tuple(found)


def _check_attribute(column: str, value: str, line_no: int, line: str) -> None:
    if value in ("", "N/A"):
        if column == "CPU Affinity" and value == "":
            raise InputError(f"nvidia-smi topo -m, {_where(line_no, line)}: the CPU Affinity value is missing")
        return
    if column == "CPU Affinity" and not _CPU_LIST.match(value):
        raise InputError(
            f"nvidia-smi topo -m, {_where(line_no, line)}: CPU Affinity {value!r} is not a CPU list "
            f"(expected e.g. 0-19,40-59 or N/A)"
        )
    if column in ("NUMA Affinity", "GPU NUMA ID") and not _CPU_LIST.match(value):
        raise InputError(
            f"nvidia-smi topo -m, {_where(line_no, line)}: {column} {value!r} is not a NUMA node number "
            f"(expected e.g. 0, or N/A)"
        )


def _check_trailer(lines: list[str], start: int) -> None:
    """After the matrix only blank lines and legend text may follow."""
    for number in range(start, len(lines)):
        line = lines[number]
        stripped = line.strip()
        if (
            not stripped
            or stripped in ("Legend:", "NIC Legend:")
            or _LEGEND_ENTRY.match(line)
            or _NIC_LEGEND_ENTRY.match(line)
        ):
            continue
        raise InputError(
            f"nvidia-smi topo -m, {_where(number + 1, line)}: unexpected text after the matrix; expected blank "
            f"lines, 'Legend:' with entries such as '  SYS = ...', or 'NIC Legend:' with entries such as "
            f"'  NIC0: mlx5_0'"
        )


def _nic_legend(lines: list[str], start: int) -> dict[str, str]:
    names: dict[str, str] = {}
    for number in range(start, len(lines)):
        match = _NIC_LEGEND_ENTRY.match(lines[number])
        if match:
            if match.group(1) in names:
                raise InputError(
                    f"nvidia-smi topo -m, {_where(number + 1, lines[number])}: {match.group(1)} is named twice "
                    f"in the NIC Legend"
                )
            names[match.group(1)] = match.group(2)
    return names


# --- nvidia-smi -L ----------------------------------------------------------------------------

_GPU_LIST_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$")
_MIG_LIST_LINE = re.compile(r"^\s+MIG .+\(UUID: MIG-[^)]*\)\s*$")


def parse_gpu_list(text: str) -> list[GpuListEntry]:
    """Parse ``nvidia-smi -L``; MIG lines are accepted and skipped."""
    entries: list[GpuListEntry] = []
    for number, line in enumerate(without_trailing_prompt(text).splitlines(), start=1):
        if not line.strip() or line.strip().startswith("#") or _MIG_LIST_LINE.match(line):
            continue
        match = _GPU_LIST_LINE.match(line)
        if not match:
            raise InputError(
                f"nvidia-smi -L, {_where(number, line)}: expected 'GPU <n>: <model> (UUID: GPU-...)'"
            )
        index = int(match.group(1))
        if index != len(entries):
            raise InputError(f"nvidia-smi -L, {_where(number, line)}: expected GPU {len(entries)} next, found GPU {index}")
        entries.append(GpuListEntry(index=index, name=match.group(2).strip(), uuid=match.group(3)))
    if not entries:
        raise InputError("nvidia-smi -L: no GPU lines; expected 'GPU <n>: <model> (UUID: GPU-...)' per GPU")
    return entries


def parse_discovery(topo_text: str, list_text: str | None = None, *, name: str = "nvidia-smi") -> SmiTopology:
    """Parse ``topo -m`` with the NVLink generation taken from ``-L`` (when given and known)."""
    generation = None
    if list_text is not None:
        entries = parse_gpu_list(list_text)
        generations = {nvlink_generation_of(entry.name) for entry in entries}
        known = generations - {None}
        if len(known) == 1:
            generation = known.pop()
        result = parse_topo_matrix(topo_text, name=name, nvlink_generation=generation)
        if len(entries) != result.graph.size:
            raise InputError(
                f"nvidia-smi -L lists {len(entries)} GPUs but topo -m shows {result.graph.size}; "
                f"expected the same GPUs in both"
            )
        if generation is None and result.notes:
            models = [entry.name for entry in entries]
            notes = tuple(generation_guess_note(models) if "NVLink generation unknown" in note else note for note in result.notes)
            result = replace(result, notes=notes)
        return result
    return parse_topo_matrix(topo_text, name=name, nvlink_generation=generation)
