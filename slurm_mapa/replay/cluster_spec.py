"""The replayed cluster: the --config file, the nodes and the models that price them.

The nodes come from --cluster, else the log's own node names (mapped by the config), else the
config's [cluster], else --nodes N of --topology; ``--nodes auto`` sizes the cluster from the
log's peak of GPUs in use at once (:func:`log_peak`, which also warns when the replayed cluster
is smaller than the log's).
"""

from __future__ import annotations

import heapq
import os
from math import ceil, inf
from typing import Callable, Iterable, Iterator

from ..core.effbw import EffectiveBandwidthModel
from ..core.model_files import load_model
from ..errors import InputError
from ..hardware.presets import PRESETS
from ..hardware.load import unknown_topology
from .config import Config, expand_cluster, graph_of, nodes_for, parse_config
from .jobs import Job, ReadStats
from .simulate import Node
from .sources import LOG_FORMATS, Source

DEFAULT_AUTO_TOPOLOGY = "dgx1-v100"
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
        raise unknown_topology(topo)
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
            raise unknown_topology(topo)
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
