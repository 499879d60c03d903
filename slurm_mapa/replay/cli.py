"""``mapa-replay``: replay sacct logs, MAPA job files or generated workloads through every policy.

    mapa-replay                          the demo: bundled data on a built-in default (= mapa-replay demo)
    mapa-replay run LOG [options]        a sacct --parsable2 / -p / --json log, a public trace
                                         (--format philly|helios|acme|pai|openb), or a MAPA job file
    mapa-replay generate paper|amaral    write a workload in the MAPA job-file format
    mapa-replay policies                 list the policies

This module holds the argument parser and the commands. All file and terminal I/O of the replay
is in it and the modules it calls: :mod:`.sources` (the input), :mod:`.cluster_spec` (the config,
the nodes, the models), :mod:`.run` (one replay and its report). Errors end in one handler here
(``mapa-replay: error: ...``, exit 2). A reader that closes the pipe early (``| head``) ends the
run quietly, with the status a command killed by SIGPIPE has (141).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from typing import Sequence

from .. import version_text
from ..core.affinity import MODES as AFFINITY_MODES
from ..errors import InputError, MapaError, OneLineParser, error_line
from ..hardware.presets import PRESETS
from ..slurm.ring_rate_cache import use_user_cache
from .cluster_spec import _load_config
from .config import parse_config
from .generate import GENERATORS, generate
from .jobfile import write_jobfile
from .headline import POLICY_SUMMARIES, fold_prose, policy_lines
from .run import CsvSink, _replay, prose_width
from .simulate import ALL_POLICIES, INSENSITIVE_CHOICES, NODE_CHOICES, WAIT_RULES, Options
from .sources import (DEFAULT_GENERATED_JOBS, FORMATS, MAX_GENERATED_JOBS, PROG, Source, _check_has_jobs, _counting, _detect,
                      _open_path, _parse_generate, _take)


_Parser = OneLineParser  # argparse errors go through the same handler, one line

def _data_text(name: str) -> str:
    return resources.files("slurm_mapa").joinpath("data/replay").joinpath(name).read_text()


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
    verdicts: list[str] = []  # both reports' verdicts, printed last (after the plots hint)
    handle = open(args.csv, "w", encoding="utf-8") if args.csv else None
    try:
        sink = None
        if handle:
            handle.write(CsvSink.HEADER + "\n")
            sink = CsvSink(handle, DEMO_INPUTS[0])
        code = _replay(args, src, config, f"bundled paper workload (300 jobs, as in section 4 of the MAPA paper, SC'21) on one {args.topology}",
                       csv_sink=sink, collect=documents, verdicts=verdicts)
        if code:
            return code
        sacct = _data_text(DEMO_INPUTS[1])
        args.time_model = None
        args.topology = None
        if args.plot:  # the sacct log's plots beside the paper workload's, not over them
            args.plot = os.path.join(args.plot, "sacct")
        if sink:
            sink.input = DEMO_INPUTS[1]
        if not args.json:
            print()
        code = _replay(args, Source(lambda: iter(sacct.splitlines(True)), "sacct", config), config,
                       f"bundled sacct log ({DEMO_INPUTS[1]})", csv_sink=sink, collect=documents, verdicts=verdicts)
    finally:
        if handle:
            handle.close()
    if not code and args.json:
        print(json.dumps(dict(zip(DEMO_INPUTS, documents)), indent=2))
    elif not code and not args.plot:
        print("\n" + fold_prose("plots: `mapa-replay demo --plot DIR` draws these numbers as box plots in DIR (they need "
                                "matplotlib, the package's `plot` extra: pip install -e '.[plot]' in a checkout); "
                                "`mapa-replay run --help` replays your own sacct log.",
                                prose_width()))
    if not code and not args.json and verdicts:
        print("\n" + "\n\n".join(fold_prose(text, prose_width()) for text in verdicts if text))
    return code


def cmd_generate(args) -> int:
    if not 1 <= args.jobs <= MAX_GENERATED_JOBS:  # as --generate KIND:JOBS: a workload of no job is refused
        raise InputError(f"--jobs {args.jobs}: {args.jobs} is not a job count; accepted: a whole number from 1 to "
                         f"{MAX_GENERATED_JOBS:,} (default {DEFAULT_GENERATED_JOBS}), e.g. --jobs 300")
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
    if args.json:
        print(json.dumps({"policies": list(ALL_POLICIES),
                          "summaries": {name: POLICY_SUMMARIES.get(name) for name in ALL_POLICIES}}))
    else:
        print("\n".join(policy_lines(list(ALL_POLICIES))))
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
                   help="the ranking model (what the policies maximize) for every node: a model file or a bundled name "
                        "(default: the config's `model`, else auto: each node type's own model, as the Prolog ranks)")
    p.add_argument("--judge", metavar="FILE|NAME", default=None,
                   help="the model every reported effective bandwidth is scored by: link-bound (the default: no policy "
                        "ranks with it), 'ranking' (each node's ranking model: the paper's own way), or a model file or "
                        "bundled name")
    p.add_argument("--extrapolate", action="store_true",
                   help="report a fitted judge's own numbers outside the sizes it was fitted on (marked) instead of the link-bound model's")
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
    p.add_argument("--wait-rule", choices=WAIT_RULES, default=Options.wait_rule,
                   help="require: fixed (hold out --require-wait) or cost (hold out while the expected wait for a good node "
                        "is shorter than the time the job would lose on the best node free now, priced by --time-model or "
                        f"the paper's curve) (default {Options.wait_rule})")
    p.add_argument("--wait-limits", type=float, default=0.0, metavar="F",
                   help="require with --wait-rule cost: 0 (default) lets the rule know run times and ends; F (1 to 100) "
                        "prices as `mapa release --wait-rule cost` does in Slurm: time limits of F x each job's run time, "
                        "running jobs ending at their limits, the worst ring free now")
    p.add_argument("--node-weights", action="store_true",
                   help="slurm/prefer/require: nodes publish the preserved bandwidth of their free GPUs as Slurm node "
                        "weights, so jobs take the nodes whose free GPUs are worth least to rings first")
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
    p.add_argument("--wide", action="store_true",
                   help="one table row per policy with every column (142 columns) even in a pipe or a file, where the "
                        "tables are otherwise kept within 120 columns")
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
    gen.add_argument("--jobs", type=int, default=DEFAULT_GENERATED_JOBS,
                     help=f"how many jobs, 1 to {MAX_GENERATED_JOBS:,} (default %(default)s)")
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
        use_user_cache()  # ring-rate tables of topology files: computed once, kept in the user's cache
        return handler(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except MapaError as exc:
        print(error_line(PROG, exc), file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
