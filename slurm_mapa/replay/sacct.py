"""Readers of ``sacct`` output: ``--parsable2`` / ``-p`` text with its header, and ``--json``.

Both turn each allocated GPU job into a :class:`~.jobs.Job`. Lines that cannot be read are counted
in :class:`~.jobs.ReadStats` by reason (never fatal); only input with no usable header is an error.
Step lines (``123.batch``, ``123.0``) are skipped; array (``123_4``) and heterogeneous (``123+0``)
ids are kept as they are; jobs that never started or hold no GPU are skipped and counted.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Iterable, Iterator, Mapping

from ..errors import InputError
from ..slurm.text.decision import split_admin_comment
from .directives import Intent, SiteRule, match_rule, read_intent
from .jobs import Job, ReadStats

REQUIRED = ("jobid", "submit")
_GPU_TRES = re.compile(r"(?:^|,)gres/gpu(?::([^=,]+))?=(\d+)")
_NODE_TRES = re.compile(r"(?:^|,)node=(\d+)")
SACCT_FIELDS = ("JobID,JobName,User,Account,Partition,Submit,Start,End,Elapsed,State,NNodes,NodeList,"
                "AllocTRES,ReqTRES,Comment,AdminComment")
_ELAPSED = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?$")
_UNKNOWN = {"", "unknown", "none", "n/a", "invalid", "nan", "null"}


def parse_time(text: str) -> float | None:
    """``YYYY-MM-DDTHH:MM:SS`` (read as UTC: only differences matter) or epoch seconds; None for Unknown."""
    text = text.strip()
    if text.lower() in _UNKNOWN:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"time {text!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def parse_elapsed(text: str) -> float | None:
    text = text.strip()
    if text.lower() in _UNKNOWN:
        return None
    match = _ELAPSED.match(text)
    if not match:
        raise ValueError(f"elapsed {text!r}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    if match.group(2) is None:  # MM:SS
        return float(days * 86400 + minutes * 60 + seconds)
    return float(days * 86400 + hours * 3600 + minutes * 60 + seconds)


def gpus_in_tres(text: str) -> int | None:
    """GPUs in a TRES string: ``gres/gpu=N``, else the sum of typed ``gres/gpu:TYPE=N``; None if none."""
    plain = None
    typed = 0
    found_typed = False
    for match in _GPU_TRES.finditer(text or ""):
        if match.group(1) is None:
            plain = int(match.group(2))
        else:
            typed += int(match.group(2))
            found_typed = True
    if plain is not None:
        return plain
    return typed if found_typed else None


def nodes_in_tres(text: str) -> int | None:
    """The node count of a TRES string (``node=2`` in AllocTRES), None if it has none."""
    match = _NODE_TRES.search(text or "")
    return int(match.group(1)) if match else None


def first_node(nodelist: str) -> str | None:
    """The first host of a Slurm host list (``n1``, ``n[1-3,5]``, ``gpu[01-02],cpu1``)."""
    text = (nodelist or "").strip()
    if text.lower() in _UNKNOWN or text.lower() == "none assigned":
        return None
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", text)
    if not match:
        return None
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _intent(values: Mapping[str, str], rules: list[SiteRule], stats: ReadStats, where: int | str) -> tuple[Intent | None, str]:
    for key in ("admincomment", "comment"):
        text = (values.get(key, "") or "").strip()
        if key == "admincomment":
            # MAPA's record may follow an admin's note (decision.py); a text that starts with
            # `mapa:` but has no readable record is still read, so that it is counted as bad.
            text = split_admin_comment(text)[1] or text
        try:
            intent = read_intent(text)
        except Exception as exc:  # InputError from either grammar: count it, fall back to rules/default
            stats.bad(f"bad directive in {key} ({exc})"[:160], where)
            continue
        if intent is not None:
            return intent, "directive"
    if rules:
        fields = {
            "name": values.get("jobname", ""),
            "account": values.get("account", ""),
            "partition": values.get("partition", ""),
            "user": values.get("user", ""),
        }
        intent = match_rule(rules, fields)
        if intent is not None:
            return intent, "rule"
    return None, "default"


def _make_job(values: Mapping[str, str], rules, stats: ReadStats, where, default_shape: str, default_sensitive: bool) -> Job | None:
    """A Job from one record's fields (already lower-cased keys, strings); None when skipped or bad."""
    job_id = values.get("jobid", "").strip()
    if not job_id:
        stats.bad("empty JobID", where)
        return None
    if "." in job_id:
        stats.skip("step lines")
        return None
    state = (values.get("state") or "").strip().upper()
    try:
        submit = parse_time(values.get("submit", ""))
        start = parse_time(values.get("start", "")) if "start" in values else None
        end = parse_time(values.get("end", "")) if "end" in values else None
    except ValueError as exc:
        stats.bad(f"unreadable {exc.args[0].split(' ')[0]}", where)
        return None
    if start is None or state.startswith("PENDING"):
        stats.skip("never started")
        return None
    runtime = None
    if end is not None:
        runtime = end - start
    else:
        try:
            if values.get("elapsedraw", "").strip():
                runtime = float(values["elapsedraw"])
            elif values.get("elapsed", "").strip():
                runtime = parse_elapsed(values["elapsed"])
        except ValueError:
            stats.bad("unreadable elapsed", where)
            return None
        if runtime is None or state.startswith("RUNNING"):
            stats.skip("still running (no End)")
            return None
    if runtime < 0:
        stats.bad("End before Start", where)
        return None
    if submit is None:
        submit = start
    gpus = gpus_in_tres(values.get("alloctres", ""))
    if gpus is None:
        gpus = gpus_in_tres(values.get("reqtres", ""))
    if not gpus:
        stats.skip("no GPUs")
        return None
    nodes = 1
    raw_nodes = (values.get("nnodes") or "").strip()
    if raw_nodes:
        try:
            nodes = max(1, int(raw_nodes))
        except ValueError:
            stats.bad("unreadable NNodes", where)
            return None
    else:  # no NNodes column: the node count Slurm put in the TRES (node=N)
        counted = nodes_in_tres(values.get("alloctres", "")) or nodes_in_tres(values.get("reqtres", ""))
        if counted:
            nodes = counted
    per_node = -(-gpus // nodes)
    intent, source = _intent(values, rules, stats, where)
    shape = default_shape
    sensitive = default_sensitive
    recorded = None
    recorded_free = None
    recorded_policy = None
    recorded_running: tuple[tuple[int, ...], ...] = ()
    recorded_slurm: tuple[int, ...] = ()
    recorded_affinity = None
    recorded_cpus = None
    node = first_node(values.get("nodelist", ""))
    if intent is not None:
        shape = intent.shape or shape
        sensitive = intent.sensitive if intent.sensitive is not None else sensitive
        recorded = intent.recorded
        if recorded is not None and len(recorded) != per_node:
            stats.bad("recorded GPUs do not match the GPU count", where)
            recorded = None
        if recorded is not None:
            recorded_policy = intent.recorded_policy
            if intent.recorded_free is not None and set(recorded) <= set(intent.recorded_free):
                recorded_free = intent.recorded_free
                taken = [g for group in intent.recorded_running for g in group]
                if len(set(taken)) == len(taken) and not set(taken) & set(recorded_free):
                    recorded_running = intent.recorded_running
            if len(intent.recorded_slurm) == per_node:
                recorded_slurm, recorded_affinity = intent.recorded_slurm, intent.recorded_affinity
                recorded_cpus = intent.recorded_cpus
        node = intent.node or node
    stats.jobs += 1
    return Job(
        id=job_id,
        submit=submit,
        runtime=runtime,
        gpus=per_node,
        shape=shape,
        sensitive=sensitive,
        nodes=nodes,
        name=values.get("jobname", ""),
        source=source,
        node=node,
        recorded=recorded,
        recorded_free=recorded_free,
        recorded_policy=recorded_policy,
        recorded_running=recorded_running,
        recorded_slurm=recorded_slurm,
        recorded_affinity=recorded_affinity,
        recorded_cpus=recorded_cpus,
        start=start,
    )


make_job = _make_job  # the trace readers (traces.py) build their jobs the same way


def read_sacct_text(
    lines: Iterable[str],
    stats: ReadStats | None = None,
    *,
    rules: list[SiteRule] | None = None,
    default_shape: str = "ring",
    default_sensitive: bool = False,
    delimiter: str = "|",
) -> Iterator[Job]:
    """Jobs from ``sacct --parsable2`` (or ``-p``) text, header first, any field order."""
    stats = stats if stats is not None else ReadStats()
    rules = rules or []
    header: list[str] | None = None
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        fields = line.split(delimiter)
        if header is None:
            names = [f.strip().lower() for f in fields]
            if names and names[-1] == "":
                names.pop()
            missing = [r for r in REQUIRED if r not in names]
            if missing or not ({"alloctres", "reqtres"} & set(names)) or "start" not in names:
                raise InputError(
                    f"line {number}: not a sacct --parsable2 header (got {line[:120]!r}); it needs the fields "
                    "JobID, Submit, Start, End or Elapsed, and AllocTRES or ReqTRES, e.g. "
                    f"sacct --parsable2 -X -o {SACCT_FIELDS}"
                )
            header = names
            continue
        if len(fields) == len(header) + 1 and fields[-1] == "":
            fields.pop()
        if len(fields) != len(header):
            stats.bad(
                f"{len(fields)} fields for {len(header)} columns" + (" ('|' inside a comment? use --json)" if len(fields) > len(header) else ""),
                number,
            )
            continue
        values = dict(zip(header, fields))
        job = _make_job(values, rules, stats, number, default_shape, default_sensitive)
        if job is not None:
            yield job
    if header is None:
        raise InputError("no sacct header line found (the input is empty); run sacct with --parsable2 and without --noheader")


def _num(value: Any) -> float | None:
    """A number in sacct JSON: plain, or {"set": bool, "infinite": bool, "number": n}."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    return float(value)


def _json_id(job: Mapping[str, Any]) -> str:
    base = str(job.get("job_id", ""))
    array = job.get("array") or {}
    task = _num(array.get("task_id")) if isinstance(array, dict) else None
    if task is not None and _num(array.get("job_id")):
        return f"{int(_num(array.get('job_id')))}_{int(task)}"
    het = job.get("het") or {}
    offset = _num(het.get("job_offset")) if isinstance(het, dict) else None
    if offset is not None and _num(het.get("job_id")):
        return f"{int(_num(het.get('job_id')))}+{int(offset)}"
    return base


def _tres_text(items: Any) -> str:
    if isinstance(items, str):
        return items
    parts = []
    for item in items or []:
        if not isinstance(item, dict):
            continue
        kind, name, count = item.get("type", ""), item.get("name", ""), item.get("count", 0)
        parts.append(f"{kind}/{name}={count}" if name else f"{kind}={count}")
    return ",".join(parts)


def read_sacct_json(
    text: str,
    stats: ReadStats | None = None,
    *,
    rules: list[SiteRule] | None = None,
    default_shape: str = "ring",
    default_sensitive: bool = False,
) -> Iterator[Job]:
    """Jobs from ``sacct --json`` (Slurm 21.08 and later data_parser layouts)."""
    stats = stats if stats is not None else ReadStats()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"sacct --json output is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise InputError('sacct --json output needs a top-level object with a "jobs" list')
    for index, job in enumerate(data["jobs"]):
        where = f"jobs[{index}]"
        if not isinstance(job, dict):
            stats.bad("job entry is not an object", where)
            continue
        times = job.get("time") or {}
        state = job.get("state") or {}
        current = state.get("current") if isinstance(state, dict) else state
        if isinstance(current, list):
            current = " ".join(map(str, current))
        comment = job.get("comment") or {}
        tres = job.get("tres") or {}

        def stamp(key: str) -> str:
            value = _num(times.get(key))
            return "Unknown" if not value else str(value)

        try:
            values = {
                "jobid": _json_id(job),
                "jobname": str(job.get("name", "")),
                "account": str(job.get("account", "")),
                "partition": str(job.get("partition", "")),
                "user": str(job.get("user", "")),
                "state": str(current or ""),
                "submit": stamp("submission"),
                "start": stamp("start"),
                "end": stamp("end"),
                "elapsedraw": str(int(_num(times.get("elapsed")) or 0)),
                "nodelist": str(job.get("nodes", "")),
                "nnodes": str(int(_num(job.get("allocation_nodes")) or 1)),
                "alloctres": _tres_text(tres.get("allocated")),
                "reqtres": _tres_text(tres.get("requested")),
                "admincomment": str(comment.get("administrator") or "") if isinstance(comment, dict) else "",
                "comment": str(comment.get("job") or "") if isinstance(comment, dict) else str(comment),
            }
        except (TypeError, ValueError, AttributeError):
            stats.bad("unreadable job entry", where)
            continue
        made = _make_job(values, rules or [], stats, where, default_shape, default_sensitive)
        if made is not None:
            yield made
