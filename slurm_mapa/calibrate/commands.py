"""The `mapa calibrate` command group: plan, fit, default."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..core.model_files import load_model, model_to_toml
from ..errors import InputError
from .fit import fit_bottleneck, fit_model, format_report, measurements_from_files
from .nccl import parse_size
from .plan import default_model, format_plan, load_plan, make_plan, measurement_script


def add_commands(commands: Any) -> None:
    calibrate = commands.add_parser("calibrate", help="measure a GPU server with nccl-tests and fit an effective-bandwidth model")
    sub = calibrate.add_subparsers(dest="calibrate_command", required=True, metavar="SUBCOMMAND")

    plan = sub.add_parser("plan", help="the ring allocations to measure, and a script that measures them")
    plan.add_argument("--topology", required=True, help="a preset name, a topology file or a saved `nvidia-smi topo -m`")
    plan.add_argument("--model", help="count link classes as this model (a file or a bundled name) does (default: one class per link class of the server)")
    plan.add_argument("--min-gpus", type=int, default=2, help="smallest ring (default 2)")
    plan.add_argument("--max-gpus", type=int, help="largest ring (default: every GPU of the server)")
    plan.add_argument("--orders", choices=("nccl", "all"), default="nccl",
                      help="nccl (default): per GPU set the ring NCCL builds; all: every ring order")
    plan.add_argument("--output-dir", help="write plan.json and measure.sh into this folder")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (the input of `calibrate fit --plan`)")
    plan.set_defaults(handler=cmd_plan)

    fit = sub.add_parser("fit", help="fit a model to nccl-tests outputs and write the model file")
    fit.add_argument("results", nargs="+", metavar="RESULTS", help="all_reduce_perf output files, one per planned allocation")
    fit.add_argument("--plan", required=True, help="the plan.json the results were measured from")
    fit.add_argument("--statistic", choices=("peak", "average"), default="peak", help="bus bandwidth per file (default: peak)")
    fit.add_argument("--min-size", default="0", help="only message sizes of at least this many bytes, e.g. 64M (default: all)")
    fit.add_argument("--kind", choices=("bottleneck", "regression"), default=None,
                     help="bottleneck (the default): each ring priced by its slowest link class at its edge count, monotone by "
                          "construction (a measurement that breaks the order is reported and pooled, not fitted through); "
                          "regression: the paper's least-squares terms (--terms), written only if monotone")
    fit.add_argument("--terms", default=None, help="regression terms (implies --kind regression): full (the paper's 14 for 3 "
                                                   "classes; the default), linear, or a list like x1,x2,x1*x2")
    fit.add_argument("--allow-non-monotone", action="store_true",
                     help="write a regression even where a faster link predicts less (to reproduce the paper's model)")
    fit.add_argument("--name", help="model name (default: fitted-<topology>)")
    fit.add_argument("--output", help="write the model file here")
    fit.add_argument("--json", action="store_true", help="machine-readable report")
    fit.set_defaults(handler=cmd_fit)

    measured = sub.add_parser("measured", help="a bandwidth model against the bundled public nccl-tests measurements (docs/measured.md)")
    measured.add_argument("--model", default="judge",
                          help="judge (the replay's link-bound judge; the default), default (each server's default ranking "
                               "model), or a model file or bundled name")
    measured.set_defaults(handler=cmd_measured)

    default = sub.add_parser("default", help="write the default (bottleneck) model of a server, before anyone measures")
    default.add_argument("--topology", required=True, help="a preset name, a topology file or a saved `nvidia-smi topo -m`")
    default.add_argument("--output", help="write the model file here (default: print it)")
    default.set_defaults(handler=cmd_default)


def _graph(spec: str):
    from ..hardware.load import load_topology  # the hardware layer: imported when a command runs

    return load_topology(spec)


def _write(path: str, text: str, *, executable: bool = False) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        if executable:
            os.chmod(path, 0o755)
    except OSError as error:
        raise InputError(f"cannot write {path!r}: {error.strerror}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    graph = _graph(args.topology)
    model = load_model(args.model) if args.model else default_model(graph)
    plan = make_plan(graph, model, max_gpus=args.max_gpus, min_gpus=args.min_gpus, orders=args.orders)
    data = plan.as_dict()
    if args.output_dir:
        try:
            os.makedirs(args.output_dir, exist_ok=True)
        except OSError as error:
            raise InputError(f"cannot create {args.output_dir!r}: {error.strerror}") from None
        _write(os.path.join(args.output_dir, "plan.json"), json.dumps(data, indent=2) + "\n")
        _write(os.path.join(args.output_dir, "measure.sh"), measurement_script(plan), executable=True)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_plan(plan))
        if args.output_dir:
            print(f"wrote {os.path.join(args.output_dir, 'plan.json')} and {os.path.join(args.output_dir, 'measure.sh')}")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    measurements = measurements_from_files(args.results, plan, statistic=args.statistic, min_bytes=parse_size(args.min_size))
    name = args.name or f"fitted-{plan.topology or 'server'}"
    kind = args.kind or ("regression" if args.terms is not None else "bottleneck")
    if kind == "bottleneck" and args.terms is not None:
        raise InputError("--terms are a regression's: drop them, or fit with --kind regression")
    description = f"fitted by mapa calibrate on {len(measurements)} all_reduce_perf runs ({args.statistic} busbw)"
    if kind == "bottleneck":
        report = fit_bottleneck(measurements, class_names=plan.class_names, selectors=plan.selectors, name=name,
                                description=description)
    else:
        report = fit_model(
            measurements,
            class_names=plan.class_names,
            selectors=plan.selectors,
            terms=args.terms or "full",
            name=name,
            description=description,
            check_counts=[run.counts for run in plan.runs],
        )
        non_monotone = [w for w in report.warnings if w.startswith("non-monotone")]
        if args.output and non_monotone and not args.allow_non_monotone:
            print(format_report(report), file=sys.stderr)
            raise InputError(
                f"the fitted regression is not monotone in link quality ({non_monotone[0]}; see the report above): it would "
                f"rank slower links first, so {args.output} was not written. Fit a bottleneck model (--kind bottleneck, the "
                f"default), fewer --terms, or pass --allow-non-monotone to write it anyway")
    if args.output:
        comments = (
            f"Fitted by `mapa calibrate fit` on {plan.topology}: {len(measurements)} measurements, {args.statistic} bus bandwidth"
            f" of sizes >= {args.min_size} bytes.",
            f"RMSE {report.rmse:.4f} GB/s, MAE {report.mae:.4f} GB/s, mean relative error {100 * report.mean_relative_error:.2f}%.",
        )
        _write(args.output, model_to_toml(report.model, comments=comments))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
        if args.output:
            print(f"wrote {args.output}")
    if args.json:  # the text report lists them already
        for warning in report.warnings:
            print(f"mapa calibrate: warning: {warning}", file=sys.stderr)
    return 0


def cmd_default(args: argparse.Namespace) -> int:
    graph = _graph(args.topology)
    model = default_model(graph)
    text = model_to_toml(
        model,
        comments=(
            "Default effective-bandwidth model (kind = bottleneck): the predicted bus bandwidth of a pattern is",
            "the bandwidth of the slowest link class its edges use. See docs/calibration.md.",
        ),
    )
    if args.output:
        _write(args.output, text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


def cmd_measured(args: argparse.Namespace) -> int:
    from ..core.model_files import grounded_model
    from ..core.server_models import default_model as server_default
    from .measured import HELD_FACTOR, bundled_reference, held_ratios, judge_points, order_disagreements, table_rows

    reference = bundled_reference()
    if args.model == "judge":
        judged, label = judge_points(reference, grounded_model()), "the link-bound judge"
    elif args.model == "default":
        judged, label = judge_points(reference, None, models_by_graph=server_default), "each server's default ranking model"
    else:
        model = load_model(args.model)
        judged, label = judge_points(reference, model), f"model {model.name}"
    header = ("server", "judged on", "GPUs", "measured GB/s", "model GB/s", "model/measured", "held")
    rows = [header, *table_rows(judged)]
    widths = [min(max(len(row[i]) for row in rows), 48) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell if len(cell) <= width else cell[: width - 3] + "..." for cell, width in zip(row, widths)]
        print("  ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + "  " + row[-1])
    summary = held_ratios(judged)
    outside = [p for p in judged if p.held and not p.agrees]
    if summary is not None:
        low, high, count = summary
        print(f"\n{label} against {count} held public measurements: {low:.2f}x to {high:.2f}x of the measured busbw "
              f"(held to {HELD_FACTOR}x either way; {len(outside)} outside); sources and caveats: docs/measured.md")
    for a, b in order_disagreements(judged):
        print(f"ordered against the measurements: {a.judged_on} {a.gpus} and {b.gpus}")
    return 0
