"""The replay's inputs: opening a file or stdin, telling its format, re-reading it as a job stream.

:class:`Source` is what every policy run reads from (each pass opens the input again: no job list
is kept). An input in which no reader finds a job is refused here with one line that says what it
looks like and what is accepted, so that it never replays as zero jobs. Generated workloads
(``run --generate KIND[:JOBS]``) are parsed here too.
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from typing import Callable, Iterable, Iterator

from ..errors import InputError
from .config import Config
from .generate import GENERATORS
from .jobfile import read_jobfile
from .jobs import Job, ReadStats
from .sacct import SACCT_FIELDS, read_sacct_json, read_sacct_text
from .traces import TRACE_FORMATS, detect_csv, read_philly, trace_reader

PROG = "mapa-replay"  # the command's name, as its messages give it
FORMATS = ("auto", "sacct", "json", "jobfile", *TRACE_FORMATS)
LOG_FORMATS = ("sacct", "json", *TRACE_FORMATS)  # logs of real clusters: recorded times, maybe node names


ACCEPTED_INPUT = (
    "accepted: sacct --parsable2 output with its header line (docs/replay.md: `sacct --parsable2 -X -a -S YYYY-MM-DD "
    f"-o {SACCT_FIELDS} > jobs.sacct`), `sacct --json` output, a MAPA job file "
    f"(numGpus,topology,arrivalTime,serviceTime,bwSensitive), or a public trace with --format {'|'.join(TRACE_FORMATS)}"
)
_FORMAT_NAMES = {"sacct": "sacct --parsable2 text", "json": "sacct --json output", "jobfile": "a MAPA job file"}
_SACCT_TABLE_RULE = re.compile(r"^\s*-{3,}(?: +-{3,})+\s*$")  # the dashed line under sacct's default table header


def _detect(first: str) -> str:
    stripped = first.lstrip()
    if stripped.startswith("{"):
        return "json"
    if stripped.startswith("["):
        return "philly"
    head = stripped.splitlines()[0].lower() if stripped else ""
    if "|" in head and "jobid" in head:
        return "sacct"
    return detect_csv(head) or "jobfile"


def _share_pick(job_id: str, share: float) -> bool:
    """The deterministic --sensitive-share draw: a hash of the job id, the same on every run and policy."""
    return zlib.crc32(job_id.encode("utf-8", "replace")) / 2**32 < share


class Source:
    """A re-readable job stream: each policy run reads the input again (streaming, no job list kept).

    ``share``: the --sensitive-share assumption, applied here so every reader and every pass sees
    the same jobs as sensitive.
    """

    def __init__(self, opener: Callable[[], Iterable[str]] | None, fmt: str, config: Config, text: str | None = None,
                 share: float | None = None) -> None:
        self.opener = opener
        self.fmt = fmt
        self.config = config
        self.text = text
        self.share = share
        self.stats = ReadStats()
        self._cached: list[Job] | None = None

    def jobs(self, stats: ReadStats | None = None) -> Iterator[Job]:
        stats = stats if stats is not None else ReadStats()
        for job in self._read(stats):
            stats.sources[job.source] += 1
            if self.share and job.source == "default" and job.gpus >= 2 and not job.sensitive:
                stats.share_candidates += 1
                if _share_pick(job.id, self.share):
                    job.sensitive = True
                    stats.assumed_sensitive += 1
            yield job

    def _read(self, stats: ReadStats) -> Iterator[Job]:
        kwargs = dict(rules=self.config.rules, default_shape=self.config.default_shape, default_sensitive=self.config.default_sensitive)
        if self.fmt in ("json", "philly"):
            if self._cached is None:
                text = self.text if self.text is not None else "".join(self.opener())
                reader = read_sacct_json if self.fmt == "json" else read_philly
                self._cached = list(reader(text, self.stats, **kwargs))
            yield from (Job(**{s: getattr(j, s) for s in Job.__slots__}) for j in self._cached)
            return
        lines = self.opener()
        if self.fmt == "sacct":
            yield from read_sacct_text(lines, stats, **kwargs)
        elif self.fmt in TRACE_FORMATS:
            yield from trace_reader(self.fmt)(lines, stats, **kwargs)
        else:
            yield from read_jobfile(lines, stats)


def _open_path(path: str) -> Callable[[], Iterable[str]]:
    if path == "-":
        stdin = getattr(sys.stdin, "buffer", None)  # bytes, decoded as files are: a stray byte is not fatal
        data = stdin.read().decode("utf-8", "replace") if stdin is not None else sys.stdin.read()
        return lambda: iter(data.splitlines(True))
    if not os.path.exists(path):
        raise InputError(f"input file {path!r} does not exist; {ACCEPTED_INPUT}")
    if os.path.isdir(path):
        raise InputError(f"input file {path!r} is a directory; {ACCEPTED_INPUT}")

    return _FileOpener(path)


class _FileOpener:
    """Opens the input file again for each pass (lines decoded as UTF-8, a stray byte replaced)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> Iterator[str]:
        with open(self.path, encoding="utf-8", errors="replace") as handle:
            yield from handle

    def head_bytes(self, size: int = 1 << 16) -> bytes:
        with open(self.path, "rb") as handle:
            return handle.read(size)


def _check_has_jobs(source: Source, path: str, *, detected: bool) -> None:
    """InputError unless the input holds at least one job to replay: a file that is empty, binary,
    sacct's fixed-width table or anything else no reader understands must not replay as zero jobs.

    Stops at the first job, so a good log costs one record; only input with no job is read through.
    Lines that cannot be read beside good ones are counted and reported by the replay, as before.
    """
    name = "stdin" if path == "-" else repr(path)
    stats = ReadStats()
    try:
        for _ in source.jobs(stats):
            return
    except InputError as error:
        _refuse_empty(source, name)
        why = "; ".join([*_what_it_looks_like(source), str(error)])
        raise InputError(f"input {name} holds no job records {PROG} can read ({why}); {ACCEPTED_INPUT}") from None
    _refuse_empty(source, name)
    if source.fmt in ("json", "philly"):
        stats = source.stats  # these readers fill the source's own counters on their one read
    as_what = _FORMAT_NAMES.get(source.fmt, f"a {source.fmt} trace")
    if source.fmt == "jobfile" and detected:
        as_what += ", the format left when no other is recognised"
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.skipped.items()))
    if stats.skipped and not stats.malformed:
        raise InputError(f"input {name} holds no GPU job to replay (read as {as_what}: skipped {skipped}); "
                         "accepted: a log of jobs that were allocated GPUs (gres/gpu=N in AllocTRES or ReqTRES)")
    read = f"read as {as_what}: no job"
    if stats.malformed:
        reason, count = stats.malformed.most_common(1)[0]
        read += (f", {stats.malformed_total} malformed record(s), most often {reason[:120]!r} "
                 f"({count}, first at line {stats.examples.get(reason)})")
    if skipped:
        read += f", skipped {skipped}"
    why = "; ".join([*_what_it_looks_like(source), read])
    raise InputError(f"input {name} holds no job records {PROG} can read ({why}); {ACCEPTED_INPUT}")


def _refuse_empty(source: Source, name: str) -> None:
    if not any(line.strip() for line in source.opener()):
        raise InputError(f"input {name} is empty; {ACCEPTED_INPUT}")


def _what_it_looks_like(source: Source) -> list[str]:
    """Why an input with no readable job may be so: it is not text, or it is sacct's fixed-width table."""
    found = []
    raw = source.opener.head_bytes() if isinstance(source.opener, _FileOpener) else b""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        if bad.reason != "unexpected end of data":  # not merely a character cut at the end of the sample
            found.append(f"it is not text: byte {raw[bad.start]:#04x} at offset {bad.start} is not UTF-8")
    head = _take(source.opener(), 50)
    if any(_SACCT_TABLE_RULE.match(line) and "jobid" in above.lower() for above, line in zip(head, head[1:])):
        found.append("it is sacct's default fixed-width table, which cuts columns to width: run sacct with --parsable2")
    return found


DEFAULT_GENERATED_JOBS = 300
MAX_GENERATED_JOBS = 10_000_000


def _parse_generate(text: str) -> tuple[str, int]:
    """--generate KIND[:JOBS] -> (kind, jobs): JOBS a whole number from 1, 300 when left out."""
    kind, colon, count = text.partition(":")
    accepted = (f"accepted: KIND or KIND:JOBS, KIND one of {', '.join(GENERATORS)} and JOBS a whole number from 1 to "
                f"{MAX_GENERATED_JOBS:,} (default {DEFAULT_GENERATED_JOBS}), e.g. paper:300")
    if kind not in GENERATORS:
        raise InputError(f"--generate {text[:60]!r}: unknown workload {kind[:30]!r}; {accepted}")
    if not colon:
        return kind, DEFAULT_GENERATED_JOBS
    if not (count.isascii() and count.isdigit() and len(count) <= 9) or not 1 <= int(count) <= MAX_GENERATED_JOBS:
        raise InputError(f"--generate {text[:60]!r}: {count[:30]!r} is not a job count; {accepted}")
    return kind, int(count)


def _take(lines: Iterable[str], n: int) -> list[str]:
    out = []
    for line in lines:
        out.append(line)
        if len(out) >= n:
            break
    return out


def _counting(jobs: Iterable[Job], stats: ReadStats) -> Iterator[Job]:
    for job in jobs:
        stats.jobs += 1
        stats.sources[job.source] += 1
        yield job
