"""The `mapa` command: topologies, allocation decisions, and (through plugins) Slurm tooling.

Every error reaches the user through one handler: `mapa: error: ...` on stderr, exit status 2
for bad input. A request that does not fit is a normal answer, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from . import version_text
from .core.effbw import EffectiveBandwidthModel
from .core.server_models import out_of_range
from .core.explain import alternatives, reported_allocation
from .core.hardware import HardwareGraph
from .core.policies import Allocation, NoFit, Request, all_policies, select
from .core.model_files import GROUNDED_MODEL_NAME
from .errors import InputError, MapaError, OneLineParser, error_line
from .hardware.load import load_topology, resolve_model
from .slurm.admin.status import add_commands as add_admin_commands
from .slurm.ring_rate_cache import use_user_cache
from .slurm.text.commands import parse_gpu_indices
from .slurm.text.directive import parse_directive, to_request

EXIT_NO_FIT = 1
EXIT_BAD_INPUT = 2


GPU_LIST_FORM = "GPU indices and ranges separated by commas, e.g. 0,2-3, each GPU once"


def _parse_gpu_list(text: str, option: str = "--free") -> tuple[int, ...]:
    """`0,2,3` or ranges `0-3,6` into GPU indices; an empty item (`0,,5`, `0,`) is refused here,
    though Slurm's lists, which the hooks read with the same parser, may have them."""
    parts = text.split(",")
    if text.strip() and any(not part.strip() for part in parts):
        position = next(i for i, part in enumerate(parts, 1) if not part.strip())
        raise InputError(f"{option}: {text[:60]!r} has an empty item (item {position}); accepted: {GPU_LIST_FORM}")
    try:
        return parse_gpu_indices(text)
    except ValueError as error:
        raise InputError(f"{option}: {error}") from None


def _check_on_node(gpus: Sequence[int], graph: HardwareGraph, option: str) -> None:
    """Every GPU of a command-line list is one of the topology's."""
    for gpu in gpus:
        if gpu >= graph.size:
            raise InputError(f"{option}: GPU {gpu} is not on {graph.name}; accepted: GPUs 0 to {graph.size - 1} "
                             f"({GPU_LIST_FORM})")


def _parse_running(text: str | None) -> tuple[tuple[int, ...], ...]:
    """`0,1/4-6`: the GPUs of each running job, jobs separated by `/`."""
    if not text:
        return ()
    groups = tuple(_parse_gpu_list(part, "--running") for part in text.split("/"))
    if not all(groups):
        raise InputError(f"--running: {text!r} has an empty job (accepted: e.g. 0,1/4-6, one GPU list per job)")
    return groups


# --- select ---------------------------------------------------------------------------------


def allocation_as_dict(result: Allocation | NoFit, graph: HardwareGraph, free: Sequence[int], request: Request, model: EffectiveBandwidthModel) -> dict[str, Any]:
    base: dict[str, Any] = {
        "topology": graph.name,
        "free": list(free),
        "request": {"gpus": request.gpus, "topology": request.pattern.name, "sensitive": request.sensitive},
    }
    if isinstance(result, NoFit):
        return base | {"fits": False, "policy": result.policy, "gpus": [], "reason": result.reason}
    placement = result.placement
    return base | {
        "fits": True,
        "policy": result.policy,
        "objective": result.objective,
        "gpus": list(placement.gpus),
        "aggregated_bandwidth": placement.aggregated_bandwidth,
        "effective_bandwidth": placement.effective_bandwidth,
        "preserved_bandwidth": placement.preserved_bandwidth,
        "ring_rate": placement.ring_rate,
        "judged_bandwidth": _judged(graph, request, placement),
        "judge": GROUNDED_MODEL_NAME,
        "link_counts": dict(zip(model.class_names, placement.link_counts)),
        "link_classes": {name: list(links) for name, links in zip(model.class_names, model.selectors)},
        "model": model.name,
        "model_basis": model.basis or "unstated",
        **extrapolation_fields(model, graph, placement.gpus, request),
    }


def _judged(graph: HardwareGraph, request: Request, placement: Any) -> float | None:
    """The set's judged bandwidth: what mapa-replay scores it by (its default judge, link-bound)."""
    from .core.model_files import grounded_model

    if placement.effective_bandwidth is None or request.pattern.size < 2 or not request.pattern.edges:
        return None
    return grounded_model().predict(graph, tuple(placement.gpus), request.pattern)


def extrapolation_fields(model: EffectiveBandwidthModel, graph: HardwareGraph, gpus: Sequence[int], request: Request) -> dict[str, Any]:
    """``extrapolated`` (the effective bandwidth lies outside the model's fitted range) and why."""
    why = out_of_range(model, graph, tuple(gpus), request.pattern)
    return {"extrapolated": bool(why), "extrapolated_why": list(why)}


def _configured(args: argparse.Namespace) -> dict:
    """preserve-ahead built with --ahead-sizes / --ahead-tolerance, when given."""
    if args.ahead_sizes is None and not args.ahead_tolerance:
        return {}
    from .core.ahead import make_preserve_ahead, parse_sizes

    if args.policy != "preserve-ahead":
        raise InputError("--ahead-sizes and --ahead-tolerance are settings of --policy preserve-ahead")
    sizes = parse_sizes(args.ahead_sizes) if args.ahead_sizes is not None else None
    return {"preserve-ahead": make_preserve_ahead(sizes, args.ahead_tolerance)}


def cmd_select(args: argparse.Namespace) -> int:
    graph = load_topology(args.topology)
    model = resolve_model(args.model, graph)
    free = _parse_gpu_list(args.free) if args.free is not None else tuple(graph.gpus)
    _check_on_node(free, graph, "--free")
    directive = parse_directive(args.directive)
    gpus = args.gpus if args.gpus is not None else directive.gpus
    if gpus is None:
        raise InputError("how many GPUs? give --gpus K or gpus=K in the directive")
    if not 1 <= gpus <= graph.size:  # no free set could ever hold it: the request is wrong for this server
        # one message for 0, 9 and 99 on an 8-GPU server (99 used to meet the pattern's own limit first)
        raise InputError(f"{gpus} GPUs asked of {graph.name}, which has {graph.size}; accepted: 1 to {graph.size} "
                         f"(a request that does not fit the free GPUs now exits 1)")
    request = to_request(directive, gpus)
    running = _parse_running(args.running)
    _check_on_node([gpu for job in running for gpu in job], graph, "--running")
    why = None
    if args.job_cpus is not None or args.affinity is not None or args.affinity_max_loss is not None:
        result, why = _select_with_affinity(args, graph, free, request, model, running)
    else:
        result = select(args.policy, graph, free, request, model, _configured(args), running)
    if isinstance(result, Allocation):
        result = reported_allocation(graph, request, result, model)  # one number per GPU set for collectives
    out = allocation_as_dict(result, graph, free, request, model)
    if why is not None:
        out["affinity"] = why.as_dict()
    if args.explain and isinstance(result, Allocation):
        out["alternatives"] = [
            {
                "gpus": list(alt.placement.gpus),
                "aggregated_bandwidth": alt.placement.aggregated_bandwidth,
                "effective_bandwidth": alt.placement.effective_bandwidth,
                "preserved_bandwidth": alt.placement.preserved_bandwidth,
                "why_not": alt.reason,
                **extrapolation_fields(model, graph, alt.placement.gpus, request),
            }
            for alt in alternatives(graph, tuple(sorted(free)), request, result, model)
        ]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(_format_selection(out))
    return 0 if out["fits"] else EXIT_NO_FIT


def _select_with_affinity(args: argparse.Namespace, graph: HardwareGraph, free: Sequence[int], request: Request,
                          model: EffectiveBandwidthModel, running: tuple[tuple[int, ...], ...]):
    """--job-cpus / --affinity / --affinity-max-loss: the policy under the CPU affinity rule."""
    from .core.affinity import DEFAULT_MAX_LOSS, DEFAULT_MODE, parse_cpu_ids, select_with_affinity

    try:
        job_cpus = parse_cpu_ids(args.job_cpus) if args.job_cpus is not None else None
    except InputError as error:
        raise InputError(f"--job-cpus: {error}") from None
    mode = args.affinity or DEFAULT_MODE
    max_loss = args.affinity_max_loss if args.affinity_max_loss is not None else DEFAULT_MAX_LOSS
    return select_with_affinity(args.policy, graph, free, request, job_cpus, mode, max_loss=max_loss, model=model,
                                configured=_configured(args), running=running)


def _fmt(value: float | None) -> str:
    return "n/a (1 GPU)" if value is None else f"{value:.3f} GB/s"


def extrapolated_text(out: dict[str, Any]) -> str:
    """`` (EXTRAPOLATED: 8 GPUs (fitted on 2-5))`` after a figure outside its model's fitted range, else ""."""
    return f" (EXTRAPOLATED: {'; '.join(out['extrapolated_why'])})" if out.get("extrapolated") else ""


def model_text(out: dict[str, Any]) -> str:
    return f"{out['model']}, {out['model_basis']}"


def _format_selection(out: dict[str, Any]) -> str:
    req = out["request"]
    lines = [
        f"{out['topology']}: {req['gpus']} GPU(s), topology={req['topology']} sensitive={'yes' if req['sensitive'] else 'no'}, "
        f"free {','.join(map(str, out['free'])) or 'none'}"
    ]
    if not out["fits"]:
        lines.append(f"{out['policy']}: does not fit: {out['reason']}")
        if "affinity" in out:
            lines.append(_affinity_text(out["affinity"]))
        return "\n".join(lines)
    lines += [
        f"{out['policy']} ({out['objective']}): GPUs {','.join(map(str, out['gpus']))} (pattern order)",
        f"  predicted            {_fmt(out['effective_bandwidth'])}{extrapolated_text(out)} (effective bandwidth by the "
        "ranking model: what MAPA ranks sets by; mapa-replay's 'ranked')",
        *([f"  ring rate            {_fmt(out['ring_rate'])} (the bus bandwidth rings can carry over the set's links; "
           "breaks the model's ties)"] if out.get("ring_rate") is not None else []),
        *([f"  judged               {_fmt(out['judged_bandwidth'])} ({out['judge']}, 0.8 x the ring rate: what "
           "mapa-replay's effective-BW columns show)"] if out.get("judged_bandwidth") is not None else []),
        f"  aggregated bandwidth {_fmt(out['aggregated_bandwidth'])} (the sum of the set's link bandwidths)",
        f"  preserved bandwidth  {_fmt(out['preserved_bandwidth'])} (the link bandwidth among the GPUs left free)",
        f"  link counts          {_link_counts(out)}: the pattern's edges per link class "
        f"(model {model_text(out)})",
    ]
    if "affinity" in out:
        lines.append(_affinity_text(out["affinity"]))
    for alt in out.get("alternatives", []):
        mark = " [effective bandwidth extrapolated]" if alt.get("extrapolated") else ""
        lines.append(f"  instead of {','.join(map(str, alt['gpus']))}: {alt['why_not']}{mark}")
    return "\n".join(lines)


def _link_counts(out: dict[str, Any]) -> str:
    """``x1=3 (NV2), x2=1 (NV1), x3=0 (SYS)``: each count named by the links its class counts."""
    classes = out.get("link_classes") or {}
    return ", ".join(f"{name}={count}" + (f" ({'/'.join(classes[name])})" if classes.get(name) else "")
                     for name, count in out["link_counts"].items())


def _affinity_text(why: dict[str, Any]) -> str:
    local = {True: "yes", False: "no", None: "-"}[why["local"]]
    return (f"  CPU affinity         {why['mode']}: local GPUs {','.join(map(str, why['local_gpus'])) or 'none'}, "
            f"chosen local: {local} ({why['note']})")


# --- entry point ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mapa", description="Topology-aware GPU allocation for Slurm (MAPA).")
    parser.add_argument("--version", action="version", version=version_text("mapa"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    topo = commands.add_parser("topo", help="show or discover GPU server topologies")
    topo_commands = topo.add_subparsers(dest="topo_command", required=True, metavar="SUBCOMMAND")

    sel = commands.add_parser("select", help="choose GPUs for one job on one node")
    sel.add_argument("--topology", required=True, help="a preset name or a topology file")
    sel.add_argument("--free", help="free GPUs, e.g. 0,2,3 or 0-3,6 (default: all)")
    sel.add_argument("--gpus", type=int, help="GPUs the job needs on this node (or gpus= in the directive)")
    sel.add_argument("--directive", default="", help='the job\'s MAPA directive, e.g. "topology=ring sensitive=yes"')
    sel.add_argument("--policy", default="preserve", choices=list(all_policies()), help="allocation policy (default: preserve)")
    sel.add_argument("--ahead-sizes", metavar="GPUS:WEIGHT,...",
                     help="preserve-ahead: the likely job sizes, e.g. 1:0.5,2:0.3,4:0.2 (default: uniform 1..5)")
    sel.add_argument("--ahead-tolerance", type=float, default=0.0, metavar="FRACTION",
                     help="preserve-ahead: how much of a sensitive job's best it may give up for the future (default 0)")
    sel.add_argument("--running", metavar="GPUS/GPUS...",
                     help="preserve-ahead: the GPUs of each job running on the node, e.g. 0,1/4-6 (default: none)")
    sel.add_argument("--job-cpus", metavar="LIST",
                     help="the job's CPUs on the node in the topology's CPU numbering, Slurm's CPU_IDs= syntax, e.g. 0-3,40-43 "
                          "(default: unknown, every GPU counts as local)")
    sel.add_argument("--affinity", choices=["strict", "prefer", "ignore"],
                     help="CPU affinity: strict (only GPUs local to --job-cpus), prefer (local unless that loses more than "
                          "--affinity-max-loss of the predicted bandwidth), ignore (default: prefer)")
    sel.add_argument("--affinity-max-loss", type=float, metavar="FRACTION",
                     help="prefer: the fraction of the predicted bandwidth a local choice may give up (default 0.1)")
    sel.add_argument("--model", help="an effective-bandwidth model file or a bundled model's name, e.g. mapa-dgx1-v100 "
                                     "(default: the topology's own model, docs/engine.md)")
    sel.add_argument("--explain", action="store_true", help="also show the best alternatives and why they lost")
    sel.add_argument("--json", action="store_true", help="machine-readable output")
    sel.set_defaults(handler=cmd_select)

    add_admin_commands(commands)
    from .slurm.admin.install import add_commands as add_hook_commands
    add_hook_commands(commands)
    from .slurm.admin.doctor import add_commands as add_doctor_commands
    add_doctor_commands(commands)
    from .slurm.admin.gpu_hold import add_commands as add_gpu_commands
    add_gpu_commands(commands)
    from .slurm.admin.release import add_commands as add_release_commands
    add_release_commands(commands)
    from .slurm.admin.contrib import add_commands as add_contrib_commands
    add_contrib_commands(commands)
    from .calibrate.commands import add_commands as add_calibrate_commands
    add_calibrate_commands(commands)
    _add_plugin_commands(commands, topo_commands)
    return parser


def _add_plugin_commands(commands: Any, topo_commands: Any) -> None:
    """Commands that live next to the code they drive: topo show/discover and gres-conf."""
    from .hardware.commands import add_commands

    add_commands(commands, topo_commands)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        use_user_cache()  # ring-rate tables of topology files: computed once, kept in the user's cache
        return int(args.handler(args))
    except MapaError as error:
        print(error_line("mapa", error), file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
