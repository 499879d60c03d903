"""Readers of the public GPU-cluster traces scheduling research uses (``mapa-replay run --format``).

Each reader turns one record into the fields a sacct line has and hands them to the sacct
reader's job builder, so skips, site rules, defaults and counters work the same for every input.
The layouts are the ones each trace documents (its README); no trace data ships with the package.

* ``philly``: Microsoft Philly ``cluster_job_log`` (JSON list). A job runs from its first attempt's
  start to its last attempt's end, on the servers of its last attempt (``detail``: ``ip`` and
  ``gpus`` per server).
* ``helios``: SenseTime Helios ``cluster_log.csv`` (job_id, user, vc, gpu_num, cpu_num, node_num,
  state, submit_time, start_time, end_time, ...). ``gpu_num`` is the job's total.
* ``acme``: Shanghai AI Lab AcmeTrace ``trace_seren.csv`` / ``trace_kalos.csv`` (job_id, user,
  node_num, gpu_num, ..., submit_time, start_time, end_time, ...): Helios' columns, no ``vc``.
* ``pai``: Alibaba PAI 2020 ``pai_task_table.csv`` (no header line: job_name, task_name, inst_num,
  status, start_time, end_time, plan_cpu, plan_mem, plan_gpu, gpu_type). ``plan_gpu`` is per
  instance in percent of a GPU; each instance is taken to run on its own node; the table has no
  submit time, so a task counts as submitted when it started.
* ``openb``: Alibaba ``openb_pod_list_*.csv`` of cluster-trace-gpu-v2023 (name, cpu_milli,
  memory_mib, num_gpu, gpu_milli, gpu_spec, qos, pod_phase, creation_time, deletion_time,
  scheduled_time; times in seconds). Files without the three time columns cannot be replayed.

What a reader assumes (a fractional GPU share rounded up to a whole GPU, instances on separate
nodes, no submit time) is counted in ``ReadStats.notes`` and printed with the results.
"""

from __future__ import annotations

import csv
import json
from math import ceil
from typing import Callable, Iterable, Iterator, Mapping

from ..errors import InputError
from .jobs import Job, ReadStats
from .sacct import make_job

TRACE_FORMATS = ("philly", "helios", "acme", "pai", "openb")
PAI_COLUMNS = ("job_name", "task_name", "inst_num", "status", "start_time", "end_time", "plan_cpu", "plan_mem", "plan_gpu", "gpu_type")
_NEEDS = {
    "helios": ("job_id", "gpu_num", "submit_time", "start_time", "end_time"),
    "acme": ("job_id", "gpu_num", "submit_time", "start_time", "end_time"),
    "openb": ("name", "num_gpu", "creation_time", "scheduled_time", "deletion_time"),
}
FRACTIONAL = "fractional GPU share rounded up to whole GPUs"


def _rows(lines: Iterable[str], fmt: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, {column: value}) of a CSV with a header, checked for the columns ``fmt`` needs."""
    reader = csv.reader(line for line in lines)
    header: list[str] | None = None
    for row in reader:
        if not row or not any(cell.strip() for cell in row):
            continue
        if header is None:
            header = [cell.strip().lower() for cell in row]
            if header and header[0] in ("", "unnamed: 0"):  # a pandas index column
                header[0] = "_index"
            missing = [c for c in _NEEDS[fmt] if c not in header]
            if missing:
                raise InputError(
                    f"line {reader.line_num}: not the header line of a {fmt} trace (got {','.join(row)[:120]!r}); "
                    f"it needs the columns {', '.join(_NEEDS[fmt])} (missing: {', '.join(missing)})"
                )
            continue
        yield reader.line_num, dict(zip(header, (cell.strip() for cell in row)))
    if header is None:
        raise InputError(f"no {fmt} header line found (the input is empty); the first line must name the columns")


def _whole(text: str, what: str) -> int:
    value = float(text)
    if value != value or value < 0:  # NaN or negative
        raise ValueError(what)
    return int(value)


def _build(values: Mapping[str, str], stats: ReadStats, where, kwargs) -> Job | None:
    return make_job(values, kwargs["rules"], stats, where, kwargs["default_shape"], kwargs["default_sensitive"])


def read_helios(lines: Iterable[str], stats: ReadStats, *, fmt: str = "helios", **kwargs) -> Iterator[Job]:
    """Jobs of a Helios ``cluster_log.csv`` or an AcmeTrace ``trace_*.csv`` (same columns, Acme has no vc)."""
    for number, row in _rows(lines, fmt):
        try:
            gpus = _whole(row.get("gpu_num", ""), "gpu_num")
            nodes = _whole(row.get("node_num") or "1", "node_num")
        except ValueError as exc:
            stats.bad(f"unreadable {exc.args[0]}", number)
            continue
        values = {
            "jobid": row["job_id"], "user": row.get("user", ""), "account": row.get("vc", ""), "jobname": row.get("type", ""),
            "state": row.get("state", ""), "submit": row["submit_time"], "start": row["start_time"], "end": row["end_time"],
            "nnodes": str(max(1, nodes)), "alloctres": f"gres/gpu={gpus}" if gpus else "",
        }
        job = _build(values, stats, number, kwargs)
        if job is not None:
            yield job


def read_openb(lines: Iterable[str], stats: ReadStats, **kwargs) -> Iterator[Job]:
    """Pods of an openb pod list; a pod asking for part of one GPU (gpu_milli < 1000) takes a whole GPU."""
    for number, row in _rows(lines, "openb"):
        try:
            gpus = _whole(row.get("num_gpu", ""), "num_gpu")
            milli = _whole(row.get("gpu_milli") or "1000", "gpu_milli")
        except ValueError as exc:
            stats.bad(f"unreadable {exc.args[0]}", number)
            continue
        phase = row.get("pod_phase", "")
        scheduled = row.get("scheduled_time", "")
        if phase.lower() == "pending" or scheduled in ("", "0", "nan"):
            stats.skip("never started")
            continue
        if gpus == 1 and 0 < milli < 1000:
            stats.notes[FRACTIONAL] += 1
        values = {
            "jobid": row["name"], "jobname": row.get("qos", ""), "state": phase.upper(), "submit": row["creation_time"],
            "start": scheduled, "end": row["deletion_time"], "nnodes": "1", "alloctres": f"gres/gpu={gpus}" if gpus else "",
        }
        job = _build(values, stats, number, kwargs)
        if job is not None:
            yield job


def read_pai(lines: Iterable[str], stats: ReadStats, **kwargs) -> Iterator[Job]:
    """Tasks of PAI's ``pai_task_table.csv`` (with or without its header line)."""
    reader = csv.reader(line for line in lines)
    seen_any = False
    for row in reader:
        if not row or not any(cell.strip() for cell in row):
            continue
        number = reader.line_num
        cells = [cell.strip() for cell in row]
        if not seen_any and [c.lower() for c in cells] == list(PAI_COLUMNS):
            seen_any = True
            continue
        seen_any = True
        if len(cells) != len(PAI_COLUMNS):
            stats.bad(f"{len(cells)} fields for the {len(PAI_COLUMNS)} columns of pai_task_table ({','.join(PAI_COLUMNS)})", number)
            continue
        row_map = dict(zip(PAI_COLUMNS, cells))
        try:
            share = float(row_map["plan_gpu"] or 0)
            instances = _whole(row_map["inst_num"] or "1", "inst_num")
        except ValueError:
            stats.bad("unreadable plan_gpu or inst_num", number)
            continue
        if share != share or share <= 0:  # NaN or no GPU
            stats.skip("no GPUs")
            continue
        per_instance = ceil(share / 100 - 1e-9)
        if share % 100:
            stats.notes[FRACTIONAL] += 1
        instances = max(1, instances)
        if instances > 1:
            stats.notes["instances of one task taken to run on separate nodes"] += 1
        stats.notes["no submit time in the PAI task table: submitted when started"] += 1
        values = {
            "jobid": f"{row_map['job_name']}/{row_map['task_name']}", "jobname": row_map["task_name"],
            "state": row_map["status"].upper(), "submit": row_map["start_time"], "start": row_map["start_time"],
            "end": row_map["end_time"], "nnodes": str(instances), "alloctres": f"gres/gpu={per_instance * instances}",
        }
        job = _build(values, stats, number, kwargs)
        if job is not None:
            yield job
    if not seen_any:
        raise InputError("the PAI task table is empty (accepted: pai_task_table.csv rows of " + ",".join(PAI_COLUMNS) + ")")


_PAI_STATES = {"terminated", "failed", "running", "waiting", "interrupted"}
_PHILLY_STATES = {"pass": "COMPLETED", "killed": "CANCELLED", "failed": "FAILED"}


def read_philly(text: str, stats: ReadStats, **kwargs) -> Iterator[Job]:
    """Jobs of Philly's ``cluster_job_log`` (a JSON list of jobs)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"a Philly cluster_job_log must be JSON: {exc}") from None
    if not isinstance(data, list):
        raise InputError("a Philly cluster_job_log is a JSON list of jobs ({\"jobid\", \"submitted_time\", \"attempts\": [...]})")
    for index, job in enumerate(data):
        where = f"[{index}]"
        if not isinstance(job, dict) or "jobid" not in job:
            stats.bad("job entry is not an object with a jobid", where)
            continue
        attempts = [a for a in job.get("attempts") or [] if isinstance(a, dict)]
        if not attempts:
            stats.skip("never started")
            continue
        last = attempts[-1]
        detail = [d for d in last.get("detail") or [] if isinstance(d, dict)]
        per_server = [len(d.get("gpus") or []) for d in detail]
        gpus = sum(per_server)
        if per_server and len(set(per_server)) > 1:
            stats.notes["multi-server jobs with unequal GPUs per server (replayed with the largest share on every server)"] += 1
        values = {
            "jobid": str(job["jobid"]), "user": str(job.get("user") or ""), "account": str(job.get("vc") or ""),
            "state": _PHILLY_STATES.get(str(job.get("status", "")).lower(), str(job.get("status", "")).upper()),
            "submit": str(job.get("submitted_time") or ""), "start": str(attempts[0].get("start_time") or ""),
            "end": str(last.get("end_time") or ""), "nnodes": str(max(1, len(detail))),
            "alloctres": f"gres/gpu={max(per_server) * len(per_server)}" if gpus else "",
            "nodelist": str(detail[0].get("ip") or "") if detail else "",
        }
        made = _build(values, stats, where, kwargs)
        if made is not None:
            yield made


def trace_reader(fmt: str) -> Callable[..., Iterator[Job]]:
    return {"helios": read_helios, "acme": lambda lines, stats, **kw: read_helios(lines, stats, fmt="acme", **kw),
            "openb": read_openb, "pai": read_pai}[fmt]


def detect_csv(header: str) -> str | None:
    """The trace format a CSV header line names, or None."""
    names = [c.strip().lower() for c in header.split(",")]
    if {"gpu_num", "submit_time", "start_time"} <= set(names):
        return "helios" if "vc" in names else "acme"
    if {"num_gpu", "creation_time"} <= set(names):
        return "openb"
    if names == list(PAI_COLUMNS):
        return "pai"
    if len(names) == len(PAI_COLUMNS) and names[3] in _PAI_STATES:  # PAI ships its rows without a header
        return "pai"
    return None


__all__ = ["TRACE_FORMATS", "read_helios", "read_openb", "read_pai", "read_philly", "trace_reader", "detect_csv"]
