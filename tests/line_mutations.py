"""Single-line corruptions of a pasted table, shared by the nvidia-smi and rocm-smi/amd-smi
parser tests: a parser must refuse each one (quoting the line) or read the same graph."""

from __future__ import annotations

from typing import Iterator, Sequence


def mutations(lines: list[str], other: tuple[str, str], separator: str, extra_cells: Sequence[str] = ()) -> Iterator[tuple[str, list[str]]]:
    """Each line deleted, doubled, swapped or joined with the next, truncated; and in each line
    each cell deleted, doubled, replaced by another link class (``other``: the class put in, and
    the one put in its place where the cell already is that class) or by each of ``extra_cells``."""
    for i, line in enumerate(lines):
        yield f"delete {i}", lines[:i] + lines[i + 1 :]
        yield f"double {i}", lines[: i + 1] + [line] + lines[i + 1 :]
        if i + 1 < len(lines) and lines[i + 1] != line:
            yield f"swap {i}", lines[:i] + [lines[i + 1], line] + lines[i + 2 :]
            yield f"join {i}", lines[:i] + [line + lines[i + 1]] + lines[i + 2 :]
        if len(line.strip()) > 2:
            yield f"truncate {i}", lines[:i] + [line[: len(line) // 2]] + lines[i + 1 :]
        cells = line.split()
        for j, cell in enumerate(cells):
            head, tail = cells[:j], cells[j + 1 :]
            replacement = other[0] if cell != other[0] else other[1]
            for new in (head + tail, head + [cell, cell] + tail, head + [replacement] + tail, *(head + [x] + tail for x in extra_cells)):
                yield f"cell {i}:{j}", lines[:i] + [separator.join(new)] + lines[i + 1 :]
