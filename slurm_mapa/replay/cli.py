"""``mapa-replay``: replay sacct logs, MAPA job files or generated workloads through every policy.

    mapa-replay                          the demo: bundled data on a built-in default (= mapa-replay demo)
    mapa-replay run LOG [options]        a sacct --parsable2 / -p / --json log, a public trace
                                         (--format philly|helios|acme|pai|openb), or a MAPA job file
    mapa-replay generate paper|amaral    write a workload in the MAPA job-file format
    mapa-replay policies                 list the policies

All file and terminal I/O of the replay is here; errors end in one handler
(``mapa-replay: error: ...``, exit 2). A reader that closes the pipe early (``| head``) ends the
run quietly, with the status a command killed by SIGPIPE has (141).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import sys
import zlib
from dataclasses import dataclass, replace
from math import ceil, inf
from importlib import resources
from typing import Callable, Iterable, Iterator, Sequence, TextIO

from ..core.effbw import EffectiveBandwidthModel, grounded_model, load_model
from .. import version_text
from ..errors import InputError, MapaError
from ..hardware.presets import PRESETS
from . import report
from .audit import audit
from .config import Config, expand_cluster, graph_of, nodes_for, parse_config
from .generate import GENERATORS, generate
from .jobfile import read_jobfile, write_jobfile
from .jobs import Job, ReadStats
from .plots import have_matplotlib, write_plots
from .sacct import SACCT_FIELDS, read_sacct_json, read_sacct_text
from ..core.affinity import DEFAULT_MAX_LOSS as AFFINITY_MAX_LOSS
from ..core.affinity import MODES as AFFINITY_MODES
from .simulate import ALL_POLICIES, INSENSITIVE_CHOICES, NODE_CHOICES, Decider, Node, Options, RunResult, simulate
from .timemodel import parse_curve
from .traces import TRACE_FORMATS, detect_csv, read_philly, trace_reader

PROG = "mapa-replay"
DEFAULT_POLICIES = ("baseline", "topo-aware", "greedy", "preserve", "slurm-native", "slurm-native-gpus",
                    "nvidia-besteffort", "first-fit", "round-robin", "hami-topology")
FORMATS = ("auto", "sacct", "json", "jobfile", *TRACE_FORMATS)
LOG_FORMATS = ("sacct", "json", *TRACE_FORMATS)  # logs of real clusters: recorded times, maybe node names
DEFAULT_AUTO_TOPOLOGY = "dgx1-v100"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse errors go through the same handler
        raise InputError(message)


def _data_text(name: str) -> str:
    return resources.files("slurm_mapa").joinpath("data/replay").joinpath(name).read_text()


def _policies(text: str | None) -> list[str]:
    if not text:
        return list(DEFAULT_POLICIES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(ALL_POLICIES)
    bad = [p for p in names if p not in ALL_POLICIES]
    if bad:
        raise InputError(f"unknown policy {', '.join(bad)} (accepted: {', '.join(ALL_POLICIES)}, or all)")
    return names


def _node_choices(text: str | None) -> list[str]:
    names = [c.strip() for c in (text or "first-fit").split(",") if c.strip()]
    if names == ["all"]:
        return list(NODE_CHOICES)
    bad = [c for c in names if c not in NODE_CHOICES]
    if bad or not names:
        raise InputError(f"unknown node choice {', '.join(bad) or repr(text)} (accepted: {', '.join(NODE_CHOICES)}, or all)")
    return list(dict.fromkeys(names))


def _feature_sizes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 2:
        raise InputError(f"--feature-sizes {text!r} (accepted: comma-separated ring sizes of 2 GPUs or more, e.g. 2,3,4,8)")
    return sizes


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
            if self.share and job.source == "default" and job.gpus >= 2 and not job.sensitive and _share_pick(job.id, self.share):
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


def _progress(policy: str, enabled: bool) -> Callable[[int], None] | None:
    if not enabled:
        return None

    def show(count: int) -> None:
        sys.stderr.write(f"\r{PROG}: {policy:<18} {count:>10,} jobs")
        sys.stderr.flush()

    return show


def _run_all(source: Source, nodes: list[Node], policies: Sequence[str], options: Options, *, csv_path: str | None,
             progress: bool, node_choices: Sequence[str] = ("first-fit",), csv_sink: CsvSink | None = None) -> list[RunResult]:
    """``csv_sink``: rows go to this already open file, after the sink's input column, instead of ``csv_path``."""
    decider = Decider(options.model, configured=options.configured, extrapolate=options.extrapolate)
    results = []
    csv_handle = open(csv_path, "w", encoding="utf-8") if csv_path and csv_sink is None else None
    try:
        if csv_handle:
            csv_handle.write(report.CSV_HEADER + "\n")
        first = True
        for choice in node_choices:
            run_options = replace(options, node_choice=choice)
            for policy in policies:
                stats = source.stats if first else ReadStats()
                if csv_sink is not None:
                    on_record = csv_sink.write
                elif csv_handle:
                    on_record = lambda rec: csv_handle.write(report.csv_row(rec) + "\n")  # noqa: E731
                else:
                    on_record = None
                label = policy if choice == "first-fit" else f"{policy}/{choice}"
                result = simulate(source.jobs(stats), nodes, policy, run_options, decider=decider, on_record=on_record,
                                  on_progress=_progress(label, progress))
                if progress:
                    sys.stderr.write("\n")
                results.append(result)
                first = False
    finally:
        if csv_handle:
            csv_handle.close()
    return results


@dataclass
class CsvSink:
    """One CSV file for several inputs (the demo's two): an ``input`` column first, naming each row's input."""

    handle: TextIO
    input: str = ""

    HEADER = "input," + report.CSV_HEADER

    def write(self, rec) -> None:
        self.handle.write(f"{self.input},{report.csv_row(rec)}\n")


def log_peak(jobs: Iterable[Job], again: Callable[[], Iterable[Job]] | None = None) -> dict:
    """What the log itself ran at once: the peak of GPUs in use (recorded start/end) and when.

    The events are (time, end before start, change), taken in sorted order. A log in submit order
    (as sacct writes it) is read as a stream: no job starts before it was submitted, so every event
    earlier than the latest submit seen can be taken now, and only the jobs still running or about
    to start are held. Should a job start before an event already taken (a log out of order), the
    events are sorted whole instead, from ``again()`` (a second read of the log), or without it
    from the jobs read so far, which are then kept.
    """
    kept: list[Job] | None = [] if again is None else None
    pending: list = []  # events not yet taken, a heap
    taken_before = -inf  # every event earlier than this has been taken
    widest = seen = 0
    peak = used = 0
    at = None
    jobs = iter(jobs)
    for job in jobs:
        if kept is not None:
            kept.append(job)
        widest = max(widest, job.nodes)
        if job.start is None:
            continue
        if job.start < taken_before:  # out of order: fall back to sorting every event
            return _log_peak_sorted(again() if again is not None else [*(kept or ()), *jobs])
        seen += 1
        gpus = job.gpus * job.nodes
        heapq.heappush(pending, (job.start, 1, gpus))
        heapq.heappush(pending, (job.start + job.runtime, 0, -gpus))  # ends sort before starts at the same time
        if job.submit > taken_before and job.submit <= job.start:
            taken_before = job.submit
            while pending and pending[0][0] < taken_before:
                t, _, change = heapq.heappop(pending)
                used += change
                if used > peak:
                    peak, at = used, t
    while pending:
        t, _, change = heapq.heappop(pending)
        used += change
        if used > peak:
            peak, at = used, t
    return {"peak_gpus": peak, "at": at, "jobs_with_times": seen, "widest_job_nodes": widest}


def _log_peak_sorted(jobs: Iterable[Job]) -> dict:
    events = []
    widest = 0
    for job in jobs:
        widest = max(widest, job.nodes)
        if job.start is None:
            continue
        gpus = job.gpus * job.nodes
        events.append((job.start, 1, gpus))
        events.append((job.start + job.runtime, 0, -gpus))  # ends sort before starts at the same time
    events.sort()
    peak = used = 0
    at = None
    for t, _, change in events:
        used += change
        if used > peak:
            peak, at = used, t
    return {"peak_gpus": peak, "at": at, "jobs_with_times": len(events) // 2, "widest_job_nodes": widest}


def _parse_nodes(text: str | None) -> int | str | None:
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise InputError(f"--nodes {text!r} (accepted: a node count of 1 or more, or 'auto' to size the cluster from the log)")
    return count


def _preset_nodes(topology: str | None, count: int) -> list[Node]:
    topo = topology or DEFAULT_AUTO_TOPOLOGY
    if topo not in PRESETS and not os.path.isfile(topo):
        raise InputError(f"unknown topology preset {topo!r} (accepted: a topology file or one of {', '.join(PRESETS)})")
    return [Node(f"node{i + 1}", graph_of(topo)) for i in range(count)]


def _build_nodes(args, source: Source, config: Config, label: str) -> tuple[list[Node], list[str], dict | None]:
    """The replayed cluster, the header lines that say how it was made, and the log's own peak (logs only)."""
    notes: list[str] = []
    nodes_arg = _parse_nodes(args.nodes)
    is_log = source.fmt in LOG_FORMATS
    seen_names: dict[str, None] = {}  # the log's node names in order of first appearance, noted on the same pass

    def noting(jobs: Iterable[Job]) -> Iterator[Job]:
        for job in jobs:
            if job.node is not None:
                seen_names.setdefault(job.node, None)
            yield job

    peak = log_peak(noting(source.jobs(ReadStats())), lambda: noting(source.jobs(ReadStats()))) if is_log else None
    if args.cluster:
        nodes = [Node(name, graph_of(topo)) for name, topo in expand_cluster(args.cluster)]
    elif is_log and (names := list(seen_names)):
        nodes = nodes_for(names, config, args.topology)
    elif config.cluster:
        nodes = [Node(name, graph_of(topo)) for name, topo in config.cluster]
    elif is_log and nodes_arg is None:
        raise InputError(
            f"{label} names no nodes, so it would replay on one node and every job would queue behind the others; "
            "say which cluster to replay it on: --nodes N (with --topology PRESET), --cluster COUNTxPRESET[,...], "
            "a config with a [cluster] section (--config FILE), or --nodes auto to size the cluster from the log's own "
            "peak of GPUs in use at once"
        )
    elif nodes_arg == "auto":
        if not is_log or not peak or not peak["jobs_with_times"]:
            raise InputError("--nodes auto sizes the cluster from a log's recorded start and end times; this input has none "
                             "(accepted: --nodes N or --cluster)")
        topo = args.topology or DEFAULT_AUTO_TOPOLOGY
        size = graph_of(topo).size if (topo in PRESETS or os.path.isfile(topo)) else 0
        if not size:
            raise InputError(f"unknown topology preset {topo!r} (accepted: a topology file or one of {', '.join(PRESETS)})")
        count = max(1, ceil(peak["peak_gpus"] / size), peak["widest_job_nodes"])
        nodes = _preset_nodes(topo, count)
        notes.append(
            f"cluster sized from the log (--nodes auto): at most {peak['peak_gpus']} GPUs were in use at once, "
            f"so {count} x {topo} ({size} GPUs each" + (", --topology not given: assumed" if not args.topology else "") + ")"
        )
    else:
        nodes = _preset_nodes(args.topology, nodes_arg if isinstance(nodes_arg, int) else 1)
    if peak and peak["jobs_with_times"]:
        total = sum(n.graph.size for n in nodes)
        if peak["peak_gpus"] > total:
            notes.append(
                f"warning: the replayed cluster has {total} GPUs but the log had {peak['peak_gpus']} in use at once: "
                "jobs will queue where they did not, so waits and makespan are not comparable with the log's "
                "(give the real cluster with --cluster or --config, or --nodes auto)"
            )
    return nodes, notes, peak


def _emit(args, out: dict, text_parts: list[str]) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(p for p in text_parts if p))


def _plots(args, label: str, results: list[RunResult], out: dict, notes: list[str]) -> None:
    if not args.plot:
        return
    if not have_matplotlib():
        notes.append("plots skipped: matplotlib is not installed (pip install 'slurm-mapa[plot]')")
        return
    files = write_plots(args.plot, label, results)
    out["plots"] = files
    notes.append("plots written: " + ", ".join(files))


def _configured_ahead(args, source: Source, config: Config) -> dict | None:
    """preserve-ahead with --ahead-sizes (GPUS:WEIGHT,... or 'log': learnt from the input) and
    --ahead-tolerance, else the config's [preserve_ahead]; None when all are defaults."""
    tolerance = args.ahead_tolerance if args.ahead_tolerance is not None else config.ahead_tolerance
    if args.ahead_sizes is None and config.ahead_sizes is None and not tolerance:
        return None
    from ..core.ahead import make_preserve_ahead, parse_sizes, sizes_from_jobs

    if not 0 <= tolerance <= 1:
        raise InputError(f"--ahead-tolerance must be a fraction from 0 to 1, got {tolerance}")
    sizes = config.ahead_sizes
    if args.ahead_sizes == "log":
        sizes = sizes_from_jobs(job.gpus for job in source.jobs(ReadStats()))
        print(f"preserve-ahead sizes learnt from the input: {', '.join(f'{k}:{v:g}' for k, v in sizes.items())}", file=sys.stderr)
    elif args.ahead_sizes is not None:
        sizes = parse_sizes(args.ahead_sizes)
    return {"preserve-ahead": make_preserve_ahead(sizes, tolerance)}


def _model(args, config: Config) -> EffectiveBandwidthModel | None:
    """--model FILE|NAME, else the config's `model` (the hooks' key); None ("auto", or neither):
    each node type is priced by its own model, as the Prolog prices it (hardware.load)."""
    if args.model and args.model != "auto":
        return load_model(args.model)
    if args.model == "auto":
        return None
    if config.model and config.model != "auto":
        path = config.model
        if not os.path.isabs(path) and not os.path.isfile(path) and config.source_dir:
            candidate = os.path.join(config.source_dir, path)
            if os.path.isfile(candidate):
                path = candidate
        return load_model(path)
    return None


def _models_used(model: EffectiveBandwidthModel | None, nodes) -> list[EffectiveBandwidthModel]:
    """The models that price the replay: the one given, else each node type's own (distinct, by name)."""
    if model is not None:
        return [model]
    from ..hardware.load import model_for_topology

    found: dict[str, EffectiveBandwidthModel] = {}
    for graph in {node.graph for node in nodes}:
        chosen = model_for_topology(graph)
        found.setdefault(chosen.name, chosen)
    return [found[name] for name in sorted(found)]


def _model_line(model: EffectiveBandwidthModel, extrapolate: bool) -> str:
    line = f"model: {model.name}"
    if model.fitted_gpus is None:
        return line + " (no fitted range stated)"
    low, high = model.fitted_gpus
    line += f", fitted on {low}-{high} GPU patterns; "
    if extrapolate:
        return line + "other sizes are its extrapolations (--extrapolate), marked * below"
    grounded = grounded_model()
    return line + (f"other sizes come from the {grounded.name} model ({grounded.efficiency:g} x the slowest GPU's link "
                   "bandwidth to its set), marked * below; --extrapolate keeps the model's own numbers")


def _directive_lines(stats: ReadStats, share: float | None) -> list[str]:
    counts = stats.sources
    if not counts:
        return []
    names = {"directive": "from the log (#MAPA / --comment / AdminComment)", "rule": "from site rules",
             "default": "site default", "file": "from the job file", "generator": "from the generator"}
    lines = ["directives: " + ", ".join(f"{counts[k]} {names.get(k, k)}" for k in names if counts.get(k))]
    if share is not None:
        lines.append(
            f"assumption (--sensitive-share {share:g}): {stats.assumed_sensitive} of the jobs with 2+ GPUs on a node and no "
            "directive or rule are taken as bandwidth-sensitive, picked by a hash of the job id (the same jobs for every policy)"
        )
    return lines


def _replay(args, source: Source, config: Config, label: str, *, csv_sink: CsvSink | None = None,
            collect: list[dict] | None = None) -> int:
    """Replay ``source`` and print the report (``collect``: append the JSON document to it instead
    of printing it under --json; ``csv_sink``: the CSV rows go there, see :class:`CsvSink`)."""
    policies = _policies(args.policies)
    nodes, cluster_notes, peak = _build_nodes(args, source, config, label)
    model = _model(args, config)
    models = _models_used(model, nodes)
    extrapolate = bool(getattr(args, "extrapolate", False))
    node_choices = _node_choices(args.node_choice)
    if args.require_wait < 0:
        raise InputError(f"--require-wait must be 0 minutes or more, got {args.require_wait:g}")
    if not 0 < args.feature_threshold <= 1:
        raise InputError(f"--feature-threshold must be a fraction in (0, 1], got {args.feature_threshold:g}")
    affinity, affinity_max_loss = _affinity(args, config)
    options = Options(
        affinity=affinity,
        affinity_max_loss=affinity_max_loss,
        insensitive=args.insensitive_choice,
        feature_threshold=args.feature_threshold,
        feature_sizes=_feature_sizes(args.feature_sizes),
        require_wait=args.require_wait * 60.0,
        backfill=args.backfill,
        time_model=parse_curve(args.time_model) if args.time_model is not None else None,
        pin_nodes=not args.no_pin,
        model=model,
        configured=_configured_ahead(args, source, config),
        extrapolate=extrapolate,
    )
    progress = args.progress or (args.progress is None and sys.stderr.isatty() and not args.json)
    results = _run_all(source, nodes, policies, options, csv_path=args.csv,
                       progress=bool(progress and source.fmt not in ("json", "philly")), node_choices=node_choices,
                       csv_sink=csv_sink)
    share = getattr(args, "sensitive_share", None)
    warnings = [n for n in cluster_notes if n.startswith("warning:")]
    out: dict = {
        "input": label,
        "nodes": [{"name": n.name, "topology": n.graph.name} for n in nodes],
        "read": source.stats.as_dict(),
        "options": {"backfill": options.backfill, "pin_nodes": options.pin_nodes,
                    "time_model": [list(p) for p in options.time_model.points] if options.time_model else None,
                    "sensitive_share": share, "extrapolate": extrapolate,
                    "node_choice": node_choices,
                    "cpu_affinity": {"mode": affinity, "max_loss": affinity_max_loss} if affinity else None,
                    "node_features": {"threshold": options.feature_threshold,
                                      "sizes": list(options.feature_sizes) if options.feature_sizes else "2..largest node",
                                      "insensitive_jobs_prefer": options.insensitive,
                                      "require_wait_s": options.require_wait}},
        "model": {"name": ",".join(m.name for m in models), "per_node_type": model is None,
                  "fitted_gpus": list(models[0].fitted_gpus) if len(models) == 1 and models[0].fitted_gpus else None,
                  "models": [{"name": m.name, "basis": m.basis or None, "fitted_gpus": list(m.fitted_gpus) if m.fitted_gpus else None}
                             for m in models],
                  "outside_fitted_range": "extrapolated" if extrapolate else grounded_model().name},
        "cluster": {"notes": [n for n in cluster_notes if not n.startswith("warning:")],
                    "log_peak_gpus": peak["peak_gpus"] if peak else None},
        "warnings": warnings,
        "policies": [report.summary(r) for r in results],
    }
    topo_names = sorted({n.graph.name for n in nodes})
    header = [f"{label}: {len(nodes)} node(s) ({', '.join(topo_names)}); {source.stats.summary()}"]
    header += _directive_lines(source.stats, share)
    header += cluster_notes
    header += [_model_line(m, extrapolate) for m in models]
    if affinity:
        header.append(_affinity_line(affinity, affinity_max_loss, results))
    parts = ["\n".join(header), report.table(results)]
    dropped = report.dropped_text(results)
    if dropped:
        parts.append(dropped)
    if options.time_model is None:
        note = ("note: without --time-model every job runs as long as it did in the input under every policy, so waits, "
                "makespan and jobs/h differ between policies only where one cannot place a job that another can; "
                "they are not an effect of the placement (--time-model makes sensitive jobs slower on poor bandwidth)")
        parts.append(note)
        out["notes"] = [note]
    parts.append(report.by_gpus_text(results))
    if options.time_model is not None:
        rows = report.table3(results)
        if rows:
            out["table3"] = rows
            parts.append("speed-up over baseline (paper's Table 3: run time at MIN/25th/50th/75th/MAX, throughput)\n" + report.table3_text(rows))
    if source.fmt in ("sacct", "json"):
        if any(j.recorded is not None for j in source.jobs(ReadStats())):  # stops at the first record
            # streamed: the log is read again (not held) and again only if it is out of submit order
            result = audit(source.jobs(ReadStats()), nodes, policies,
                           Decider(options.model, configured=options.configured, extrapolate=extrapolate),
                           again=lambda: source.jobs(ReadStats()))
            out["recorded_decisions"] = result
            parts.append(report.audit_text(result))
    notes: list[str] = []
    _plots(args, label, results, out, notes)
    if args.csv:
        notes.append(f"per-job CSV written to {args.csv}")
    parts.extend(notes)
    if source.stats.malformed_total:
        parts.append(f"note: {source.stats.malformed_total} malformed record(s) were skipped (see 'read' above)")
    if source.stats.notes:
        parts.append("reader assumptions: " + "; ".join(f"{n} x {what}" for what, n in sorted(source.stats.notes.items())))
    if collect is not None and args.json:
        collect.append(out)
    else:
        _emit(args, out, parts)
    return 0


def _affinity(args, config: Config) -> tuple[str | None, float]:
    """(mode or None, max_loss): --affinity, else the config's [affinity], else not modelled."""
    mode = getattr(args, "affinity", None)
    max_loss = getattr(args, "affinity_max_loss", None)
    if mode is None and config.affinity is not None:
        mode = config.affinity[0]
        max_loss = config.affinity[1] if max_loss is None else max_loss
    if mode is None and max_loss is not None:
        raise InputError("--affinity-max-loss is a setting of --affinity prefer (give --affinity too)")
    max_loss = AFFINITY_MAX_LOSS if max_loss is None else max_loss
    if not 0 <= max_loss <= 1:
        raise InputError(f"--affinity-max-loss must be a fraction from 0 to 1, got {max_loss:g}")
    return mode, float(max_loss)


def _affinity_line(mode: str, max_loss: float, results: Sequence[RunResult]) -> str:
    counts = "; ".join(f"{r.label} {r.affinity_local} local / {r.affinity_remote} not" for r in results)
    setting = f"prefer, max loss {max_loss:g}" if mode == "prefer" else mode
    return (f"CPU affinity: {setting}; each job's CPUs modelled as those of the lowest-numbered free GPUs "
            f"(nodes without CPU affinity count every GPU as local); jobs on GPUs local to their CPUs: {counts}")


MAX_CONFIG_BYTES = 1 << 20


def _load_config(path: str | None) -> Config:
    """--config FILE, or InputError with one line naming the file, what is wrong and what is accepted."""
    if not path:
        return Config()
    source = f"--config {path}"
    accepted = "accepted: a UTF-8 TOML file with [nodes], [cluster], [defaults], [[rules]] (docs/replay.md)"
    if not os.path.exists(path):
        raise InputError(f"{source}: no such file; {accepted}")
    if not os.path.isfile(path):
        raise InputError(f"{source}: {'is a directory' if os.path.isdir(path) else 'not a regular file'}; {accepted}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise InputError(f"{source}: cannot read it: {error.strerror or error}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"{source} is larger than {MAX_CONFIG_BYTES} bytes; {accepted}, up to 1 MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{source}: byte {raw[error.start]:#04x} at offset {error.start} is not UTF-8; {accepted}") from None
    config = parse_config(text, source)
    config.source_dir = os.path.dirname(os.path.abspath(path))
    return config


def _share(args) -> float | None:
    share = getattr(args, "sensitive_share", None)
    if share is not None and not 0 <= share <= 1:
        raise InputError(f"--sensitive-share must be a fraction from 0 to 1, got {share:g}")
    return share


def cmd_run(args) -> int:
    config = _load_config(args.config)
    if args.generate:
        kind, jobs = _parse_generate(args.generate)
        src = Source(None, "generated", config, share=_share(args))
        src.jobs = lambda stats=None: _counting(generate(kind, jobs, seed=args.seed, load=args.load), stats if stats is not None else src.stats)  # type: ignore[method-assign]
        return _replay(args, src, config, f"generated {kind} workload ({jobs} jobs, seed {args.seed})")
    if not args.input:
        raise InputError("run needs an input file (sacct text or JSON, or a MAPA job file; '-' for stdin) or --generate KIND[:JOBS]")
    opener = _open_path(args.input)
    fmt = args.format
    if fmt == "auto":
        head = "".join(_take(opener(), 5))
        fmt = _detect(head)
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r} (accepted: {', '.join(FORMATS)})")
    source = Source(opener, fmt, config, share=_share(args))
    _check_has_jobs(source, args.input, detected=args.format == "auto")
    return _replay(args, source, config, args.input)


ACCEPTED_INPUT = (
    "accepted: sacct --parsable2 output with its header line (docs/replay.md: `sacct --parsable2 -X -a -S YYYY-MM-DD "
    f"-o {SACCT_FIELDS} > jobs.sacct`), `sacct --json` output, a MAPA job file "
    f"(numGpus,topology,arrivalTime,serviceTime,bwSensitive), or a public trace with --format {'|'.join(TRACE_FORMATS)}"
)
_FORMAT_NAMES = {"sacct": "sacct --parsable2 text", "json": "sacct --json output", "jobfile": "a MAPA job file"}
_SACCT_TABLE_RULE = re.compile(r"^\s*-{3,}(?: +-{3,})+\s*$")  # the dashed line under sacct's default table header


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


DEMO_INPUTS = ("paper-dgx1-300.jobs", "sample-sacct.txt")  # the demo's bundled inputs, in the order it replays them


def cmd_demo(args) -> int:
    config = parse_config(_data_text("demo.toml"), "bundled demo.toml")
    text = _data_text(DEMO_INPUTS[0])
    src = Source(lambda: iter(text.splitlines(True)), "jobfile", config)
    args.topology = args.topology or "dgx1-v100"
    args.time_model = "default" if args.time_model is None else args.time_model
    # Two inputs, one report each: --json prints one document keyed by input, --csv one file whose
    # first column names each row's input.
    documents: list[dict] = []
    handle = open(args.csv, "w", encoding="utf-8") if args.csv else None
    try:
        sink = None
        if handle:
            handle.write(CsvSink.HEADER + "\n")
            sink = CsvSink(handle, DEMO_INPUTS[0])
        code = _replay(args, src, config, f"bundled paper workload (300 jobs, section 4) on one {args.topology}",
                       csv_sink=sink, collect=documents)
        if code:
            return code
        sacct = _data_text(DEMO_INPUTS[1])
        args.time_model = None
        args.topology = None
        args.plot = None
        if sink:
            sink.input = DEMO_INPUTS[1]
        if not args.json:
            print()
        code = _replay(args, Source(lambda: iter(sacct.splitlines(True)), "sacct", config), config,
                       f"bundled sacct log ({DEMO_INPUTS[1]})", csv_sink=sink, collect=documents)
    finally:
        if handle:
            handle.close()
    if not code and args.json:
        print(json.dumps(dict(zip(DEMO_INPUTS, documents)), indent=2))
    return code


def cmd_generate(args) -> int:
    patterns = tuple(p.strip() for p in args.patterns.split(",") if p.strip())
    jobs = generate(args.kind, args.jobs, seed=args.seed, patterns=patterns, load=args.load,
                    min_gpus=args.min_gpus, max_gpus=args.max_gpus)
    if args.output and args.output != "-":
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.writelines(write_jobfile(jobs))
        if args.json:
            print(json.dumps({"written": args.output, "jobs": args.jobs, "kind": args.kind, "seed": args.seed}))
    elif args.json:
        # The job file's columns, one object per job (the job file itself is what stdout gets without --json).
        workload = [{"gpus": job.gpus, "shape": job.shape, "submit": job.submit, "runtime": job.runtime,
                     "sensitive": job.sensitive, "task": job.task} for job in jobs]
        print(json.dumps({"kind": args.kind, "seed": args.seed, "jobs": len(workload), "workload": workload}, indent=2))
    else:
        sys.stdout.writelines(write_jobfile(jobs))
    return 0


def cmd_policies(args) -> int:
    rows = {name: ALL_POLICIES[name].__module__ for name in ALL_POLICIES}
    if args.json:
        print(json.dumps({"policies": list(ALL_POLICIES)}))
    else:
        for name, module in rows.items():
            print(f"{name:<20} {module}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", help="comma-separated policies (default: all ten; 'all' for every registered one)")
    p.add_argument("--topology", help=f"topology preset of every node ({', '.join(PRESETS)})")
    p.add_argument("--nodes", default=None, metavar="N|auto",
                   help="node count (of --topology) for inputs that name no nodes: job files and generated workloads "
                        "(default 1), logs without node names (required, or 'auto': sized from the log's peak of GPUs in use)")
    p.add_argument("--cluster", help="nodes as COUNTxPRESET or NAME:PRESET, comma-separated (e.g. 2xdgx1-v100,1xtorus2d-16)")
    p.add_argument("--config", help="TOML config: node patterns to presets, site rules, defaults")
    p.add_argument("--time-model", nargs="?", const="default", default=None, metavar="CURVE",
                   help="run times depend on effective bandwidth (BW:SLOWDOWN points, default: the paper's curve)")
    p.add_argument("--backfill", action="store_true", help="let later jobs start when the queue head does not fit")
    p.add_argument("--model", metavar="FILE|NAME",
                   help="effective-bandwidth model for every node: a model file or a bundled name (default: the config's "
                        "`model`, else auto: each node type's own model, as the Prolog prices it)")
    p.add_argument("--extrapolate", action="store_true",
                   help="report the model's own numbers outside the sizes it was fitted on (marked) instead of the link-bound model's")
    p.add_argument("--sensitive-share", type=float, default=None, metavar="F",
                   help="assume a share F (0-1) of the jobs with 2+ GPUs on a node and no directive or rule are "
                        "bandwidth-sensitive, picked by a hash of the job id")
    p.add_argument("--ahead-sizes", metavar="GPUS:WEIGHT,...|log",
                   help="preserve-ahead's likely job sizes, e.g. 1:0.5,2:0.3,4:0.2, or 'log' to learn them from the input (default: uniform 1..5)")
    p.add_argument("--ahead-tolerance", type=float, default=None, metavar="FRACTION",
                   help="preserve-ahead: how much of a sensitive job's best it may give up for the future (default 0)")
    p.add_argument("--node-choice", metavar="CHOICE[,...]",
                   help="how the node is chosen, comma-separated to compare: first-fit (the first node with room, the "
                        "default), slurm (select/cons_tres' tightest fit for equal weights), prefer (Slurm --prefer on "
                        "MAPA's node features: sensitive k-GPU jobs prefer mapa_ring<k>), require (sensitive jobs "
                        f"--constraint mapa_ring<k> until --require-wait), or all ({', '.join(NODE_CHOICES)})")
    p.add_argument("--require-wait", type=float, default=60.0, metavar="MINUTES",
                   help="require: how long a sensitive job holds out for a node with its feature before the constraint "
                        "is relaxed to a preference (default 60; generated workloads' times are read as seconds)")
    p.add_argument("--feature-threshold", type=float, default=0.9, metavar="F",
                   help="mapa_ring<k> = a k-GPU ring of at least F x the fleet's best idle k-ring is free (default 0.9)")
    p.add_argument("--feature-sizes", metavar="K,...", help="ring sizes the nodes publish features for (default 2 .. the largest node)")
    p.add_argument("--insensitive-choice", choices=INSENSITIVE_CHOICES, default=Options.insensitive,
                   help="prefer/require: what insensitive and 1-GPU jobs prefer: best-fit (nothing: Slurm's tightest fit), "
                        "complement (mapa_noring<k> of their size), complement-min (mapa_noring<smallest size>) "
                        f"(default {Options.insensitive})")
    p.add_argument("--affinity", choices=AFFINITY_MODES, default=None,
                   help="CPU affinity in the decision: strict (only GPUs local to the job's CPUs), prefer (local unless "
                        "that loses more than --affinity-max-loss), ignore (count only); each job's CPUs are modelled as "
                        "those of the lowest-numbered free GPUs (default: the config's [affinity], else not modelled)")
    p.add_argument("--affinity-max-loss", type=float, default=None, metavar="FRACTION",
                   help="prefer: the fraction of the predicted bandwidth a local choice may give up (default 0.1)")
    p.add_argument("--no-pin", action="store_true", help="do not keep sacct jobs on their recorded node")
    p.add_argument("--csv", help="write one CSV row per job and policy to this file")
    p.add_argument("--plot", metavar="DIR", help="write PNG box plots to DIR (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    p.add_argument("--progress", action="store_true", default=None, help="show a progress bar (default: on a terminal)")
    p.add_argument("--seed", type=int, default=1, help="seed of --generate (default 1)")
    p.add_argument("--load", type=float, default=1.0, help="arrival density of generated workloads (default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Replay GPU jobs through MAPA and peer allocation policies.")
    parser.add_argument("--version", action="version", version=version_text(PROG))
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    demo = sub.add_parser("demo", help="replay the bundled data (the default command)")
    _common(demo)
    run = sub.add_parser("run", help="replay a sacct log, sacct --json output, a public trace or a MAPA job file")
    run.add_argument("input", nargs="?", help="the input file ('-' for stdin)")
    run.add_argument("--format", default="auto", choices=FORMATS,
                     help="input format (default: detected): sacct text, sacct --json, a MAPA job file, or a public trace: "
                          "philly (cluster_job_log JSON), helios (cluster_log.csv), acme (AcmeTrace trace_*.csv), "
                          "pai (pai_task_table.csv), openb (openb_pod_list_*.csv)")
    run.add_argument("--generate", metavar="KIND[:JOBS]", help=f"replay a generated workload instead ({', '.join(GENERATORS)})")
    _common(run)
    gen = sub.add_parser("generate", help="write a generated workload as a MAPA job file")
    gen.add_argument("kind", choices=GENERATORS)
    gen.add_argument("--jobs", type=int, default=300)
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--patterns", default="ring", help="comma-separated patterns drawn uniformly (default ring)")
    gen.add_argument("--load", type=float, default=1.0)
    gen.add_argument("--min-gpus", type=int, default=1)
    gen.add_argument("--max-gpus", type=int, default=5)
    gen.add_argument("-o", "--output", help="output file (default stdout)")
    gen.add_argument("--json", action="store_true",
                     help="print the workload as JSON (with -o: what was written) instead of the job file")
    pol = sub.add_parser("policies", help="list the policies")
    pol.add_argument("--json", action="store_true")
    return parser


def _quiet_stdout() -> None:
    """The reader of stdout is gone (``| head``): point stdout at /dev/null so the interpreter's
    final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            argv = ["demo", *argv]
        args = parser.parse_args(argv)
        handler = {"demo": cmd_demo, "run": cmd_run, "generate": cmd_generate, "policies": cmd_policies}[args.command]
        return handler(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except MapaError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
