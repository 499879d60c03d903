"""``mapa-replay``: replay sacct logs, MAPA job files or generated workloads through every policy.

    mapa-replay                          the demo: bundled data on a built-in default (= mapa-replay demo)
    mapa-replay run LOG [options]        a sacct --parsable2 / -p / --json log, or a MAPA job file
    mapa-replay generate paper|amaral    write a workload in the MAPA job-file format
    mapa-replay policies                 list the policies

All file and terminal I/O of the replay is here; errors end in one handler
(``mapa-replay: error: ...``, exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from typing import Callable, Iterable, Iterator, Sequence

from ..core.effbw import paper_model
from ..errors import InputError, MapaError
from ..hardware.presets import PRESETS
from . import report
from .audit import audit
from .config import Config, expand_cluster, graph_of, nodes_for, parse_config
from .generate import GENERATORS, generate
from .jobfile import read_jobfile, write_jobfile
from .jobs import Job, ReadStats
from .plots import boxplot_png, have_matplotlib, series_png
from .sacct import read_sacct_json, read_sacct_text
from .simulate import ALL_POLICIES, Decider, Node, Options, RunResult, simulate
from .timemodel import parse_curve

PROG = "mapa-replay"
DEFAULT_POLICIES = ("baseline", "topo-aware", "greedy", "preserve", "slurm-native", "slurm-native-gpus",
                    "nvidia-besteffort", "first-fit", "round-robin", "hami-topology")
FORMATS = ("auto", "sacct", "json", "jobfile")


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


def _detect(first: str) -> str:
    stripped = first.lstrip()
    if stripped.startswith("{"):
        return "json"
    head = stripped.splitlines()[0].lower() if stripped else ""
    if "|" in head and "jobid" in head:
        return "sacct"
    return "jobfile"


class Source:
    """A re-readable job stream: each policy run reads the input again (streaming, no job list kept)."""

    def __init__(self, opener: Callable[[], Iterable[str]] | None, fmt: str, config: Config, text: str | None = None) -> None:
        self.opener = opener
        self.fmt = fmt
        self.config = config
        self.text = text
        self.stats = ReadStats()
        self._json_jobs: list[Job] | None = None

    def jobs(self, stats: ReadStats | None = None) -> Iterator[Job]:
        stats = stats if stats is not None else ReadStats()
        kwargs = dict(rules=self.config.rules, default_shape=self.config.default_shape, default_sensitive=self.config.default_sensitive)
        if self.fmt == "json":
            if self._json_jobs is None:
                text = self.text if self.text is not None else "".join(self.opener())
                self._json_jobs = list(read_sacct_json(text, self.stats, **kwargs))
            yield from (Job(**{s: getattr(j, s) for s in Job.__slots__}) for j in self._json_jobs)
            return
        lines = self.opener()
        if self.fmt == "sacct":
            yield from read_sacct_text(lines, stats, **kwargs)
        else:
            yield from read_jobfile(lines, stats)


def _open_path(path: str) -> Callable[[], Iterable[str]]:
    if path == "-":
        data = sys.stdin.read()
        return lambda: iter(data.splitlines(True))
    if not os.path.exists(path):
        raise InputError(f"input file {path!r} does not exist")

    def opener():
        with open(path, encoding="utf-8", errors="replace") as handle:
            yield from handle

    return opener


def _progress(policy: str, enabled: bool) -> Callable[[int], None] | None:
    if not enabled:
        return None

    def show(count: int) -> None:
        sys.stderr.write(f"\r{PROG}: {policy:<18} {count:>10,} jobs")
        sys.stderr.flush()

    return show


def _run_all(source: Source, nodes: list[Node], policies: Sequence[str], options: Options, *, csv_path: str | None,
             progress: bool) -> list[RunResult]:
    decider = Decider(options.model, configured=options.configured)
    results = []
    csv_handle = open(csv_path, "w", encoding="utf-8") if csv_path else None
    try:
        if csv_handle:
            csv_handle.write(report.CSV_HEADER + "\n")
        first = True
        for policy in policies:
            stats = source.stats if first else ReadStats()
            on_record = (lambda rec: csv_handle.write(report.csv_row(rec) + "\n")) if csv_handle else None
            result = simulate(source.jobs(stats), nodes, policy, options, decider=decider, on_record=on_record,
                              on_progress=_progress(policy, progress))
            if progress:
                sys.stderr.write("\n")
            results.append(result)
            first = False
    finally:
        if csv_handle:
            csv_handle.close()
    return results


def _node_names(source: Source) -> list[str]:
    names: dict[str, None] = {}
    for job in source.jobs(ReadStats()):
        if job.node is not None:
            names.setdefault(job.node, None)
    return list(names)


def _build_nodes(args, source: Source, config: Config) -> list[Node]:
    if args.cluster:
        return [Node(name, graph_of(topo)) for name, topo in expand_cluster(args.cluster)]
    if source.fmt in ("sacct", "json"):
        names = _node_names(source)
        if names:
            return nodes_for(names, config, args.topology)
    if config.cluster:
        return [Node(name, graph_of(topo)) for name, topo in config.cluster]
    topo = args.topology or "dgx1-v100"
    if topo not in PRESETS:
        raise InputError(f"unknown topology preset {topo!r} (accepted: {', '.join(PRESETS)})")
    return [Node(f"node{i + 1}", graph_of(topo)) for i in range(args.nodes)]


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
    os.makedirs(args.plot, exist_ok=True)
    files = []
    for what in ("sensitive", "insensitive"):
        path = os.path.join(args.plot, f"effbw-{what}.png")
        boxplot_png(path, [(label, results)], what=what, title=f"effective bandwidth of {what} jobs")
        files.append(path)
    path = os.path.join(args.plot, "over-time.png")
    series_png(path, results, title=label)
    files.append(path)
    if any(r.runtime_sensitive.count for r in results):
        path = os.path.join(args.plot, "runtime-sensitive.png")
        boxplot_png(path, [(label, results)], what="runtime", title="run time of sensitive jobs")
        files.append(path)
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


def _replay(args, source: Source, config: Config, label: str) -> int:
    policies = _policies(args.policies)
    nodes = _build_nodes(args, source, config)
    options = Options(
        backfill=args.backfill,
        time_model=parse_curve(args.time_model) if args.time_model is not None else None,
        pin_nodes=not args.no_pin,
        model=paper_model(),
        configured=_configured_ahead(args, source, config),
    )
    progress = args.progress or (args.progress is None and sys.stderr.isatty() and not args.json)
    results = _run_all(source, nodes, policies, options, csv_path=args.csv, progress=bool(progress and source.fmt != "json"))
    out: dict = {
        "input": label,
        "nodes": [{"name": n.name, "topology": n.graph.name} for n in nodes],
        "read": source.stats.as_dict(),
        "options": {"backfill": options.backfill, "pin_nodes": options.pin_nodes,
                    "time_model": [list(p) for p in options.time_model.points] if options.time_model else None},
        "policies": [report.summary(r) for r in results],
    }
    topo_names = sorted({n.graph.name for n in nodes})
    parts = [
        f"{label}: {len(nodes)} node(s) ({', '.join(topo_names)}); {source.stats.summary()}",
        report.table(results),
    ]
    if options.time_model is not None:
        rows = report.table3(results)
        if rows:
            out["table3"] = rows
            parts.append("speed-up over baseline (paper's Table 3: run time at MIN/25th/50th/75th/MAX, throughput)\n" + report.table3_text(rows))
    if source.fmt in ("sacct", "json"):
        jobs = [j for j in source.jobs(ReadStats()) if j.recorded is not None or j.start is not None]
        if any(j.recorded is not None for j in jobs):
            result = audit(jobs, nodes, policies, Decider(options.model, configured=options.configured))
            out["recorded_decisions"] = result
            parts.append(report.audit_text(result))
    notes: list[str] = []
    _plots(args, label, results, out, notes)
    if args.csv:
        notes.append(f"per-job CSV written to {args.csv}")
    parts.extend(notes)
    if source.stats.malformed_total:
        parts.append(f"note: {source.stats.malformed_total} malformed record(s) were skipped (see 'read' above)")
    _emit(args, out, parts)
    return 0


def _load_config(path: str | None) -> Config:
    if not path:
        return Config()
    if not os.path.exists(path):
        raise InputError(f"config file {path!r} does not exist")
    with open(path, encoding="utf-8") as handle:
        return parse_config(handle.read(), path)


def cmd_run(args) -> int:
    config = _load_config(args.config)
    if args.generate:
        kind, _, count = args.generate.partition(":")
        jobs = int(count) if count.isdigit() else 300
        src = Source(None, "generated", config)
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
    return _replay(args, Source(opener, fmt, config), config, args.input)


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
        yield job


def cmd_demo(args) -> int:
    config = parse_config(_data_text("demo.toml"), "bundled demo.toml")
    text = _data_text("paper-dgx1-300.jobs")
    src = Source(lambda: iter(text.splitlines(True)), "jobfile", config)
    args.topology = args.topology or "dgx1-v100"
    args.time_model = "default" if args.time_model is None else args.time_model
    code = _replay(args, src, config, f"bundled paper workload (300 jobs, section 4) on one {args.topology}")
    if code or args.json:
        return code
    sacct = _data_text("sample-sacct.txt")
    args.time_model = None
    args.topology = None
    args.plot = None
    print()
    return _replay(args, Source(lambda: iter(sacct.splitlines(True)), "sacct", config), config, "bundled sacct log (sample-sacct.txt)")


def cmd_generate(args) -> int:
    patterns = tuple(p.strip() for p in args.patterns.split(",") if p.strip())
    jobs = generate(args.kind, args.jobs, seed=args.seed, patterns=patterns, load=args.load,
                    min_gpus=args.min_gpus, max_gpus=args.max_gpus)
    lines = write_jobfile(jobs)
    if args.output and args.output != "-":
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.writelines(lines)
        if args.json:
            print(json.dumps({"written": args.output, "jobs": args.jobs, "kind": args.kind, "seed": args.seed}))
    else:
        sys.stdout.writelines(lines)
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
    p.add_argument("--nodes", type=int, default=1, help="node count for job files and generated workloads (default 1)")
    p.add_argument("--cluster", help="nodes as COUNTxPRESET or NAME:PRESET, comma-separated (e.g. 2xdgx1-v100,1xtorus2d-16)")
    p.add_argument("--config", help="TOML config: node patterns to presets, site rules, defaults")
    p.add_argument("--time-model", nargs="?", const="default", default=None, metavar="CURVE",
                   help="run times depend on effective bandwidth (BW:SLOWDOWN points, default: the paper's curve)")
    p.add_argument("--backfill", action="store_true", help="let later jobs start when the queue head does not fit")
    p.add_argument("--ahead-sizes", metavar="GPUS:WEIGHT,...|log",
                   help="preserve-ahead's likely job sizes, e.g. 1:0.5,2:0.3,4:0.2, or 'log' to learn them from the input (default: uniform 1..5)")
    p.add_argument("--ahead-tolerance", type=float, default=None, metavar="FRACTION",
                   help="preserve-ahead: how much of a sensitive job's best it may give up for the future (default 0)")
    p.add_argument("--no-pin", action="store_true", help="do not keep sacct jobs on their recorded node")
    p.add_argument("--csv", help="write one CSV row per job and policy to this file")
    p.add_argument("--plot", metavar="DIR", help="write PNG box plots to DIR (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    p.add_argument("--progress", action="store_true", default=None, help="show a progress bar (default: on a terminal)")
    p.add_argument("--seed", type=int, default=1, help="seed of --generate (default 1)")
    p.add_argument("--load", type=float, default=1.0, help="arrival density of generated workloads (default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Replay GPU jobs through MAPA and peer allocation policies.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    demo = sub.add_parser("demo", help="replay the bundled data (the default command)")
    _common(demo)
    run = sub.add_parser("run", help="replay a sacct log, sacct --json output or a MAPA job file")
    run.add_argument("input", nargs="?", help="the input file ('-' for stdin)")
    run.add_argument("--format", default="auto", choices=FORMATS)
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
    gen.add_argument("--json", action="store_true")
    pol = sub.add_parser("policies", help="list the policies")
    pol.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            argv = ["demo", *argv]
        args = parser.parse_args(argv)
        handler = {"demo": cmd_demo, "run": cmd_run, "generate": cmd_generate, "policies": cmd_policies}[args.command]
        return handler(args)
    except MapaError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
