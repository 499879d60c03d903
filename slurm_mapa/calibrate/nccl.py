"""Parse nccl-tests output (``all_reduce_perf`` and friends) as the tool really prints it.

The output is a block of ``#`` header lines (the parameters, one ``Rank`` line per GPU, the
column headers), one table row per message size (out-of-place then in-place time, algbw,
busbw and error count; older releases have no ``root`` or ``redop`` column and an ``error``
instead of a ``#wrong`` column), then ``# Out of bounds values`` and ``# Avg bus bandwidth``.
Lines that mpirun prefixes with ``[1,0]<stdout>:`` and NCCL INFO lines in between are accepted.

rccl-tests (AMD) prints the same table; its extra lines (``rccl-tests: Version ...``, RCCL and
HIP version lines, ``# Errors with asterisks ...``, ``# Collective test concluded: ...``) are
accepted. A file that holds two test runs (rows after ``Collective test concluded`` or after a
second column header) is refused: its rows would mix two measurements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError

_MPI_PREFIX = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_NGPUS = re.compile(r"\bnGpus\s+(\d+)")
_NTHREAD = re.compile(r"\bnThread\s+(\d+)")
_RANK = re.compile(r"^#\s*Rank\s+\d+")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded\s*:\s*(\S+)")
_INT = re.compile(r"^\d+$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Row:
    size: int  # bytes
    out_of_place_busbw: float
    in_place_busbw: float | None  # None when the in-place half is missing

    @property
    def busbw(self) -> float:
        """The better of the out-of-place and in-place bus bandwidths of this size."""
        return max(self.out_of_place_busbw, self.in_place_busbw or 0.0)


@dataclass(frozen=True)
class NcclResult:
    rows: tuple[Row, ...]
    avg_busbw: float | None  # the "# Avg bus bandwidth" line
    ranks: int | None  # the number of "# Rank" lines (GPUs), else nThread x nGpus
    source: str = ""

    def bus_bandwidth(self, statistic: str = "peak", min_bytes: int = 0) -> float:
        """Peak or average bus bandwidth (GB/s) over the sizes of at least ``min_bytes``.

        Each size counts the better of its out-of-place and in-place values.
        """
        rows = [row for row in self.rows if row.size >= min_bytes]
        if not rows:
            raise InputError(
                f"{self.source}: no message size of at least {min_bytes} bytes "
                f"(largest: {max(row.size for row in self.rows)} bytes); lower --min-size or measure larger sizes"
            )
        values = [row.busbw for row in rows]
        if statistic == "peak":
            return max(values)
        if statistic == "average":
            return sum(values) / len(values)
        raise InputError(f"unknown statistic {statistic!r} (accepted: peak, average)")


def parse_size(text: str) -> int:
    """``1G``, ``64M``, ``8`` (bytes, binary units as nccl-tests reads them)."""
    match = _SIZE.match(text)
    if not match:
        raise InputError(f"message size {text!r}: expected bytes such as 8, 64K, 1M or 1G")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _columns(line: str) -> list[str] | None:
    """The column names of a header line such as ``#  size  count  type  redop  root  time ...``."""
    tokens = line.lstrip("#").split()
    if len(tokens) >= 6 and tokens[0] == "size" and tokens[1] == "count" and "busbw" in tokens:
        return tokens
    return None


def parse_nccl_tests(text: str, *, source: str = "nccl-tests output") -> NcclResult:
    columns: list[str] | None = None
    rows: list[Row] = []
    avg: float | None = None
    ranks = 0
    threads = gpus = None
    concluded: str | None = None
    for raw in text.splitlines():
        line = _MPI_PREFIX.sub("", raw).strip()
        if not line:
            continue
        if line.startswith("#"):
            found = _columns(line)
            if found:
                if rows:
                    raise InputError(f"{source}: a second table starts at {raw.strip()!r}; expected one test run per file")
                columns = found
            elif match := _CONCLUDED.match(line):
                concluded = match.group(1)
            elif match := _AVG.match(line):
                avg = float(match.group(1))
            elif _RANK.match(line):
                ranks += 1
            else:
                if match := _NGPUS.search(line):
                    gpus = int(match.group(1))
                if match := _NTHREAD.search(line):
                    threads = int(match.group(1))
            continue
        tokens = line.split()
        if len(tokens) < 6 or not _INT.match(tokens[0]) or not _INT.match(tokens[1]):
            continue  # NCCL INFO lines, shell noise
        if concluded is not None:
            raise InputError(
                f"{source}: a result row {raw.strip()!r} after '# Collective test concluded: {concluded}'; expected one "
                f"test run per file"
            )
        rows.append(_row(tokens, columns, source=source, line=raw))
    if not rows:
        raise InputError(f"{source}: no nccl-tests result rows found (expected lines such as '1048576  262144  float  sum  -1  ...')")
    if not ranks and gpus is not None:
        ranks = gpus * (threads or 1)
    return NcclResult(rows=tuple(rows), avg_busbw=avg, ranks=ranks or None, source=source)


def _row(tokens: list[str], columns: list[str] | None, *, source: str, line: str) -> Row:
    if columns is None:
        # No header seen: infer the layout from the token count (13: with root, 12: with redop, 11: neither).
        layouts = {
            13: [7, 11],
            12: [6, 10],
            11: [5, 9],
            9: [7],  # one half only (e.g. -R or in-place disabled), with root
        }
        positions = layouts.get(len(tokens))
    else:
        positions = [index for index, name in enumerate(columns) if name == "busbw"]
        if len(tokens) < len(columns):
            positions = [p for p in positions if p < len(tokens)]
    if not positions:
        raise InputError(f"{source}: cannot read the busbw column of {line.strip()!r}")
    try:
        values = [float(tokens[p]) for p in positions]
    except (ValueError, IndexError):
        raise InputError(f"{source}: bad busbw value in {line.strip()!r}") from None
    return Row(size=int(tokens[0]), out_of_place_busbw=values[0], in_place_busbw=values[1] if len(values) > 1 else None)
