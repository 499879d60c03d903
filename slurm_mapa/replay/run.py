"""One replay: the run's options from the command line, every policy over the input, the report.

:func:`_replay` builds the cluster (:mod:`.cluster_spec`) and the simulator's
:class:`~.simulate.Options`, runs each policy (and node choice) over a fresh read of the input,
and prints the tables (or the JSON document), the recorded decisions' audit, the plots' and the
CSV's notes.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TextIO

from ..core.affinity import DEFAULT_MAX_LOSS as AFFINITY_MAX_LOSS
from ..core.effbw import EffectiveBandwidthModel, LinkBoundModel
from ..core.model_files import GROUNDED_MODEL_NAME as LINK_BOUND
from ..core.model_files import grounded_model, load_model
from ..errors import InputError
from ..extras import install_hint
from . import report
from .audit import audit
from .cluster_spec import _build_nodes, _model, _models_used
from .config import Config
from .domain_run import domain_replay
from .domains import is_domain_cluster
from .headline import fold_prose, headline, verdict
from .jobs import ReadStats
from .plots import have_matplotlib, write_plots
from .results import RunResult
from .simulate import ALL_POLICIES, JUDGE_RANKING, NODE_CHOICES, Decider, Node, Options, simulate
from .sources import PROG, Source
from .timemodel import parse_curve

DEFAULT_POLICIES = ("baseline", "topo-aware", "greedy", "preserve", "slurm-native", "slurm-native-gpus",
                    "nvidia-besteffort", "first-fit", "round-robin", "hami-topology")


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


def _replay(args, source: Source, config: Config, label: str, *, csv_sink: CsvSink | None = None,
            collect: list[dict] | None = None, verdicts: list[str] | None = None) -> int:
    """Replay ``source`` and print the report (``collect``: append the JSON document to it instead
    of printing it under --json; ``csv_sink``: the CSV rows go there, see :class:`CsvSink`;
    ``verdicts``: the closing verdict lines go there, for the caller to print last, instead of
    ending this report)."""
    if is_domain_cluster(getattr(args, "cluster", None)):  # racks with NVLink domains (issue 51): domain policies
        return domain_replay(args, source, label, collect=collect)
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
        wait_rule=getattr(args, "wait_rule", Options.wait_rule),
        wait_limits=getattr(args, "wait_limits", Options.wait_limits),
        node_weights=bool(getattr(args, "node_weights", False)),
        backfill=args.backfill,
        time_model=parse_curve(args.time_model) if args.time_model is not None else None,
        pin_nodes=not args.no_pin,
        model=model,
        configured=_configured_ahead(args, source, config),
        extrapolate=extrapolate,
        judge=_judge(args),
    )
    progress = args.progress or (args.progress is None and sys.stderr.isatty() and not args.json)
    results = _run_all(source, nodes, policies, options, csv_path=args.csv,
                       progress=bool(progress and source.fmt not in ("json", "philly")), node_choices=node_choices,
                       csv_sink=csv_sink)
    _check_some_job_fits(results, source, nodes, label)
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
                                      "require_wait_s": options.require_wait,
                                      "wait_rule": options.wait_rule,
                                      "wait_limits": options.wait_limits,
                                      "node_weights": options.node_weights}},
        "model": {"name": ",".join(m.name for m in models), "per_node_type": model is None,
                  "fitted_gpus": list(models[0].fitted_gpus) if len(models) == 1 and models[0].fitted_gpus else None,
                  "models": [{"name": m.name, "basis": m.basis or None, "fitted_gpus": list(m.fitted_gpus) if m.fitted_gpus else None}
                             for m in models],
                  # the ranking model's own score (ranked_bw_*) is kept outside its range: its extrapolation
                  "outside_fitted_range": "extrapolated"},
        "judge": _judge_summary(options.judge, extrapolate),
        "cluster": {"notes": [n for n in cluster_notes if not n.startswith("warning:")],
                    "log_peak_gpus": peak["peak_gpus"] if peak else None},
        "warnings": warnings,
        "policies": [report.summary(r) for r in results],
    }
    topo_names = sorted({n.graph.name for n in nodes})
    header = [f"{label}: {len(nodes)} node(s) ({', '.join(topo_names)}); {source.stats.summary()}"]
    header += _directive_lines(source.stats, share)
    header += cluster_notes
    header += [_model_line(m) for m in models]
    header.append(_judge_line(options.judge, extrapolate))
    if affinity:
        header.append(_affinity_line(affinity, affinity_max_loss, results))
    width = terminal_width(getattr(args, "wide", False))
    parts = ["\n".join(header), report.table(results, width)]
    dropped = report.dropped_text(results)
    if dropped:
        parts.append(dropped)
    if options.time_model is None:
        note = ("note: without --time-model every job runs as long as it did in the input under every policy, so waits, "
                "makespan and jobs/h differ between policies only where one cannot place a job that another can; "
                "they are not an effect of the placement (--time-model makes sensitive jobs slower on poor bandwidth)")
        parts.append(note)
        out["notes"] = [note]
    parts.append(report.by_gpus_text(results, width))
    if options.time_model is not None:
        rows = report.table3(results)
        if rows:
            out["table3"] = rows
            parts.append("speed-up over baseline (paper's Table 3: run time at MIN/25th/50th/75th/MAX, throughput)\n" + report.table3_text(rows))
    if source.fmt in ("sacct", "json"):
        if any(j.recorded is not None for j in source.jobs(ReadStats())):  # stops at the first record
            # streamed: the log is read again (not held) and again only if it is out of submit order
            result = audit(source.jobs(ReadStats()), nodes, policies,
                           Decider(options.model, configured=options.configured, extrapolate=extrapolate, judge=options.judge),
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
    # First, where a reader starts: what MAPA gained, and under which assumptions (folded by _emit).
    story = headline(out, label)
    if story:
        out["headline"] = story
        parts.insert(0, "\n".join(story))
        # ...and last, where the eye lands when the report stops (the top has scrolled away on a
        # terminal): the verdict again in two or three lines, not the whole headline twice.
        closing = "\n".join(verdict(out, label))
        if verdicts is not None:
            verdicts.append(closing)
        else:
            parts.append(closing)
    if collect is not None and args.json:
        collect.append(out)
    else:
        _emit(args, out, parts)
    return 0


def _check_some_job_fits(results: Sequence[RunResult], source: Source, nodes: Sequence[Node], label: str) -> None:
    """InputError when no job of the input fits any node of the cluster: every policy would replay
    none, and a table of zeros compares nothing (docs/replay.md). Which jobs fit is the same under
    every policy (the simulator drops a job no node could ever hold: RunResult.dropped)."""
    if not results or any(r.jobs or r.stuck for r in results) or not results[0].dropped:
        return
    widest = max(source.jobs(ReadStats()), key=lambda job: (job.gpus, job.nodes), default=None)  # read again: only here
    largest = max(nodes, key=lambda node: node.graph.size)
    job_text = "?" if widest is None else (f"{widest.gpus} GPUs" + (f" on each of {widest.nodes} nodes" if widest.nodes > 1 else ""))
    pinned = results[0].dropped.get("larger than its recorded node", 0)
    pinned_text = (f" ({pinned} larger than the node the log recorded them on: --no-pin replays them on any node)"
                   if pinned else "")
    raise InputError(
        f"no job of {label} fits any node, so no policy would replay one: the largest job asks for {job_text}, the "
        f"{f'largest of the {len(nodes)} nodes' if len(nodes) > 1 else 'only node'} ({largest.name}, {largest.graph.name}) "
        f"has {largest.graph.size} GPUs{pinned_text}; accepted: a cluster whose nodes hold the "
        "jobs (--topology, --cluster, --nodes, or [nodes] and [cluster] in --config) and each multi-node job's node count "
        "(NNodes in the sacct fields, or node=N in AllocTRES)")


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
    decider = Decider(options.model, configured=options.configured, extrapolate=options.extrapolate, judge=options.judge)
    results = []
    csv_handle = open(csv_path, "w", encoding="utf-8") if csv_path and csv_sink is None else None
    try:
        if csv_handle:
            csv_handle.write(report.CSV_HEADER + "\n")
        first = True
        for choice in node_choices:
            # weights model Slurm's own choice: first-fit has none to weigh
            run_options = replace(options, node_choice=choice, node_weights=options.node_weights and choice != "first-fit")
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


def _judge(args) -> EffectiveBandwidthModel | LinkBoundModel | str:
    """--judge: the model every reported effective bandwidth is scored by (issue 38): link-bound
    (the default: no policy ranks with it), ``ranking`` (each node's ranking model, the paper's
    own way), or a model file or bundled name."""
    name = getattr(args, "judge", None) or LINK_BOUND
    if name == LINK_BOUND:
        return grounded_model()
    if name == JUDGE_RANKING:
        return JUDGE_RANKING
    return load_model(name)


def _judge_summary(judge, extrapolate: bool) -> dict:
    if judge == JUDGE_RANKING:
        return {"name": JUDGE_RANKING, "ranks_decisions": True, "fitted_gpus": None}
    from ..calibrate.measured import error_against_measured

    fitted = getattr(judge, "fitted_gpus", None)
    return {"name": judge.name, "ranks_decisions": False, "fitted_gpus": list(fitted) if fitted else None,
            "outside_fitted_range": None if not fitted else "extrapolated" if extrapolate else grounded_model().name,
            "measured": error_against_measured(judge)}


def _judge_line(judge, extrapolate: bool) -> str:
    """What every effective bandwidth below is scored by."""
    if judge == JUDGE_RANKING:
        return ("judged by: each node's ranking model (--judge ranking: the paper's own way; a policy that maximizes "
                "that model scores best by construction)")
    if isinstance(judge, LinkBoundModel):
        return (f"judged by: {judge.name} ({judge.efficiency:g} x the bus bandwidth the set's links can carry: rings "
                "packed over its links, or the slowest GPU's links to the set; no policy ranks with it; --judge to change)")
    line = f"judged by: {judge.name}"
    if judge.fitted_gpus is None:
        return line
    low, high = judge.fitted_gpus
    line += f", fitted on {low}-{high} GPU patterns; "
    if extrapolate:
        return line + "other sizes are its extrapolations (--extrapolate), marked * below"
    grounded = grounded_model()
    return line + (f"other sizes come from the {grounded.name} model ({grounded.efficiency:g} x the bus bandwidth the "
                   "set's links can carry), marked * below; --extrapolate keeps the model's own numbers")


def _model_line(model: EffectiveBandwidthModel) -> str:
    line = f"ranking model: {model.name}"
    if model.fitted_gpus is None:
        return line + " (no fitted range stated)"
    low, high = model.fitted_gpus
    return line + f", fitted on {low}-{high} GPU patterns (its own score, the 'ranked' column, is extrapolated outside them)"


def _directive_lines(stats: ReadStats, share: float | None) -> list[str]:
    counts = stats.sources
    if not counts:
        return []
    names = {"directive": "from the log (#MAPA / --comment / AdminComment)", "rule": "from site rules",
             "default": "site default", "file": "from the job file", "generator": "from the generator"}
    lines = ["directives: " + ", ".join(f"{counts[k]} {names.get(k, k)}" for k in names if counts.get(k))]
    if share is not None:
        lines.append(
            f"assumption (--sensitive-share {share:g}): {stats.assumed_sensitive} of the {stats.share_candidates} jobs with 2+ "
            "GPUs on a node and no directive or rule are taken as bandwidth-sensitive, picked by a hash of the job id (the "
            "same jobs for every policy)"
        )
    return lines


def _affinity_line(mode: str, max_loss: float, results: Sequence[RunResult]) -> str:
    counts = "; ".join(f"{r.label} {r.affinity_local} local / {r.affinity_remote} not" for r in results)
    setting = f"prefer, max loss {max_loss:g}" if mode == "prefer" else mode
    return (f"CPU affinity: {setting}; each job's CPUs modelled as those of the lowest-numbered free GPUs "
            f"(nodes without CPU affinity count every GPU as local); jobs on GPUs local to their CPUs: {counts}")


def _emit(args, out: dict, text_parts: list[str]) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        width = prose_width()
        print("\n\n".join(fold_prose(p, width) for p in text_parts if p))


PIPED_WIDTH = 120  # a pipe or a file: tables at most this wide (the main one in two halves), prose at 100


def terminal_width(wide: bool = False) -> int | None:
    """The width the tables are laid out for: COLUMNS, else the terminal's; a pipe or a file gets
    PIPED_WIDTH (issue 52: 142-column tables in a saved report); ``wide`` (--wide): no limit."""
    if wide:
        return None
    return shutil.get_terminal_size((0, 0)).columns or PIPED_WIDTH


def prose_width() -> int:
    """The width prose is folded at: COLUMNS, else the terminal's, else 100."""
    return shutil.get_terminal_size((100, 24)).columns


def _plots(args, label: str, results: list[RunResult], out: dict, notes: list[str]) -> None:
    if not args.plot:
        return
    if not have_matplotlib():
        notes.append(f"plots skipped: matplotlib is not installed ({install_hint('plot')})")
        return
    files = write_plots(args.plot, label, results, time_model=getattr(args, "time_model", None) is not None)
    out["plots"] = files
    notes.append("plots written: " + ", ".join(files))
