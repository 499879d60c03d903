"""The MAPA reference job file (``numGpus,topology,arrivalTime,serviceTime,bwSensitive,task``).

Comma-separated, no header, one job per line; the job id is the 0-based line index (blank lines
and ``#`` comments are skipped but still count as lines, as the reference does not have them).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from ..core.patterns import SHAPES
from .jobs import Job, ReadStats

_MAPA_SHAPES = {"clique": "all"}


def read_jobfile(lines: Iterable[str], stats: ReadStats | None = None) -> Iterator[Job]:
    stats = stats if stats is not None else ReadStats()
    index = 0
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            stats.bad(f"{len(parts)} fields (numGpus,topology,arrivalTime,serviceTime,bwSensitive[,task] expected)", number)
            continue
        try:
            gpus = int(parts[0])
            arrival = float(parts[2])
            service = float(parts[3])
        except ValueError:
            stats.bad("non-numeric numGpus, arrivalTime or serviceTime", number)
            continue
        shape = _MAPA_SHAPES.get(parts[1].lower(), parts[1].lower())
        if shape not in SHAPES:
            stats.bad(f"unknown topology {parts[1]!r}", number)
            continue
        if parts[4] not in ("0", "1"):
            stats.bad("bwSensitive is not 0 or 1", number)
            continue
        if gpus < 1 or service < 0 or arrival < 0:
            stats.bad("numGpus < 1 or negative time", number)
            continue
        stats.jobs += 1
        yield Job(
            id=str(index),
            submit=arrival,
            runtime=service,
            gpus=gpus,
            shape=shape,
            sensitive=parts[4] == "1",
            task=parts[5] if len(parts) > 5 else "",
            source="file",
        )
        index += 1


def write_jobfile(jobs: Iterable[Job]) -> Iterator[str]:
    """The reference format, one line per job (times written as integers when they are whole)."""
    for job in jobs:
        arrival = int(job.submit) if float(job.submit).is_integer() else job.submit
        service = int(job.runtime) if float(job.runtime).is_integer() else job.runtime
        yield f"{job.gpus},{job.shape},{arrival},{service},{int(job.sensitive)},{job.task}\n"
