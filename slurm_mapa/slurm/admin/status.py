"""`mapa status` and `mapa explain`: what the hooks decided, for admins.

`mapa status` runs on a compute node (it reads the node's ledger); `mapa explain JOBID` runs
anywhere scontrol works and recomputes the alternatives from the recorded free set.
"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any

from ...core.effbw import EffectiveBandwidthModel
from ...core.model_files import bundled_model, is_bundled_model, paper_model
from ...core.ring_choice import RING_OBJECTIVE, ranks_by_rings, with_ring_rate
from ...core.server_models import out_of_range
from ...core.explain import alternatives
from ...core.policies import Allocation, Request
from ...core.search import Placement, preserved_bandwidth, score_placement
from ...errors import InputError
from ..text.commands import CommandFailed, Runner, is_job_id, parse_job_json, show_job_argv
from ..config import DEFAULT_CONFIG_PATH, HookConfig, load_admin_config, programs_root_may_run
from ..text.decision import parse_decisions, read_admin_comment, record_directive
from ..text.directive import to_request
from ..hooks.node_graph import load_graph
from ..node_state import HeldCorrupt, Ledger, LedgerCorrupt, NodeState, reconcile


def _config(path: str | None) -> HookConfig:
    """--config FILE, else /etc/slurm/mapa.toml; refused with one line if it is unusable. These
    commands only read, so the file need not be root's (the hooks' own check: `mapa hooks`)."""
    if path:
        return load_admin_config(path, trusted=False)
    if not DEFAULT_CONFIG_PATH.exists():
        raise InputError(f"no config at {DEFAULT_CONFIG_PATH} (give --config FILE)")
    return load_admin_config(DEFAULT_CONFIG_PATH, option="", trusted=False)


def node_status(config: HookConfig, node: str) -> dict[str, Any]:
    """Who uses which GPUs: the ledger as the next Prolog will see it (reconciled with the jobs
    directory, which may know more: a killed Prolog's job, a choice made while the lock was stuck)."""
    graph = load_graph(config, node)
    problems = []
    state = NodeState.of(config)
    try:
        ledger = state.read_ledger(graph.size)
    except LedgerCorrupt as error:
        problems.append(f"ledger {config.ledger} is corrupt ({error}); shown as rebuilt from {config.jobs_dir}")
        ledger = Ledger()
    records, _ = state.scan()
    ledger, _ = reconcile(ledger, records, graph.size)
    jobs = []
    for job, holding in sorted(ledger.holdings.items(), key=lambda item: int(item[0])):
        links = [graph.link(a, b).token for i, a in enumerate(holding.gpus) for b in holding.gpus[i + 1 :]]
        # Slurm's own GPUs for the job (what scontrol -d show job calls IDX), from the Prolog's mark.
        record = records.get(job)
        slurm_gpus = list(record.mark.slurm_gpus) if record is not None and record.mark is not None else None
        jobs.append({"job": job, "gpus": list(holding.gpus), "slurm_gpus": slurm_gpus, "policy": holding.policy, "links": links,
                     "note": holding.note})
    free = ledger.free(graph.size)
    from .gpu_hold import held_list

    try:
        held = held_list(state)
    except HeldCorrupt as error:
        held = []
        problems.append(f"held GPUs file {state.held_path()} cannot be read ({error}): the hooks hold no GPU out")
    return {"node": node, "topology": graph.name, "jobs": jobs, "free": list(free), "free_preserved_bandwidth": preserved_bandwidth(graph, free),
            "shared": {str(gpu): owners for gpu, owners in sorted(ledger.shared().items())}, "held": held, "problems": problems}


def cmd_status(args: argparse.Namespace) -> int:
    config = _config(args.config)
    status = node_status(config, args.node or socket.gethostname())
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"{status['node']} ({status['topology']})")
    for job in status["jobs"]:
        slurm = f" (Slurm's: {','.join(map(str, job['slurm_gpus']))})" if job["slurm_gpus"] else ""
        print(f"  job {job['job']}: GPUs {','.join(map(str, job['gpus']))}{slurm} [{job['policy']}] links {' '.join(job['links']) or '-'}")
    print(f"  free: {','.join(map(str, status['free'])) or 'none'}; preserved bandwidth {status['free_preserved_bandwidth']:.1f} GB/s")
    from .gpu_hold import held_lines

    for held, line in zip(status["held"], held_lines(status["held"])):
        print(f"  HELD: {line} (`mapa gpu release {held['gpu']}` lets new jobs have it)")
    for gpu, owners in status["shared"].items():
        print(f"  SHARED: GPU {gpu} is used by jobs {', '.join(owners)} (a killed Prolog); held until all of them end")
    for problem in status["problems"]:
        print(f"  warning: {problem}")
    return 0


def explain_job(config: HookConfig, admin_comment: str) -> list[dict[str, Any]]:
    directive = record_directive(admin_comment)  # MAPA's record may follow an admin's note
    if directive is None:
        raise InputError("the job has no MAPA decision in its AdminComment (did the Prolog run with this config?)")
    out = []
    for node, decision in parse_decisions(admin_comment).items():
        entry: dict[str, Any] = {"node": node, "gpus": list(decision.gpus), "policy": decision.policy, "fallback": decision.fallback,
                                 "free": list(decision.free), "effective_bandwidth": decision.effective,
                                 "model": decision.model or None, "extrapolated": decision.extrapolated,
                                 "aggregated_bandwidth": decision.aggregated, "preserved_bandwidth": decision.preserved,
                                 "slurm_gpus": list(decision.slurm_gpus), "affinity": decision.affinity, "job_cpus": decision.job_cpus,
                                 "isolation": decision.isolation, "isolation_why": decision.why}
        if decision.policy != "fallback" and decision.free:
            graph = load_graph(config, node)
            model = _recorded_model(config, node, graph, decision.model)
            entry["alternatives_model"] = model.name
            request: Request = to_request(directive, len(decision.gpus))
            chosen: Placement = score_placement(graph, decision.free, request.pattern, decision.gpus, model)
            objective = "effective" if request.sensitive and request.gpus > 1 else "preserved"
            if decision.policy == "greedy":
                objective = "aggregated"
            elif objective == "effective" and decision.policy == "preserve" and ranks_by_rings(request.pattern, tuple(decision.free), model):
                objective, chosen = RING_OBJECTIVE, with_ring_rate(graph, chosen)  # the ring-rate tie-break (core.ring_choice)
            allocation = Allocation(policy=decision.policy, placement=chosen, objective=objective)
            entry["alternatives"] = [
                {"gpus": list(alt.placement.gpus), "why_not": alt.reason,
                 "effective_bandwidth": alt.placement.effective_bandwidth, "preserved_bandwidth": alt.placement.preserved_bandwidth,
                 "extrapolated": bool(out_of_range(model, graph, alt.placement.gpus, request.pattern))}
                for alt in alternatives(graph, tuple(decision.free), request, allocation, model)
            ]
        out.append(entry)
    return out


def _recorded_model(config: HookConfig, node: str, graph: Any, recorded: str) -> EffectiveBandwidthModel:
    """The model that priced a recorded decision: the bundled one its ``model=`` names, else the config's for
    the node. A record without ``model=`` was written when the hooks used the paper's model unless `model`
    named a file, so that is what prices it again."""
    from ...hardware.load import resolve_model

    if is_bundled_model(recorded):
        return bundled_model(recorded)
    if recorded:
        return resolve_model(config.model_for(node), graph)
    return resolve_model(config.model, graph) if config.model not in ("", "auto") else paper_model()


def cmd_explain(args: argparse.Namespace) -> int:
    if not is_job_id(args.job):
        raise InputError(f"{args.job!r} is not a job id (digits only)")
    config = _config(args.config)
    refused = programs_root_may_run(config, args.config or DEFAULT_CONFIG_PATH)
    if refused:
        raise InputError(f"not running scontrol: {refused}")
    try:
        job = parse_job_json(Runner(timeout=config.command_timeout)(show_job_argv(config.scontrol, args.job)), args.job)
    except CommandFailed as error:
        raise InputError(f"cannot read job {args.job}: {error}") from None
    admin = str(job.get("admin_comment") or "")
    report = explain_job(config, admin)
    if args.json:
        print(json.dumps({"job": args.job, "admin_comment": admin, "nodes": report}, indent=2))
        return 0
    parts = read_admin_comment(admin)
    print(f"job {args.job}: {parts.directive}")
    if parts.before or parts.after:
        print(f"  admin's note: {' # '.join(filter(None, [parts.before, *parts.after]))}")
    for entry in report:
        line = f"  {entry['node']}: GPUs {','.join(map(str, entry['gpus']))} by {entry['policy']}"
        if entry["fallback"]:
            line += f" (FALLBACK: {entry['fallback']})"
        print(line + f", free then: {','.join(map(str, entry['free']))}")
        if entry["effective_bandwidth"] is not None:
            mark = " EXTRAPOLATED (outside the model's fitted range)" if entry["extrapolated"] else ""
            print(f"    predicted effective bandwidth {entry['effective_bandwidth']:.3f} GB/s{mark} "
                  f"(ranking model {entry['model'] or 'not recorded'}; mapa-replay's 'ranked')")
        if entry["slurm_gpus"]:
            print(f"    Slurm's GPUs: {','.join(map(str, entry['slurm_gpus']))}")
        if entry["affinity"]:
            cpus = f"the job's CPUs {entry['job_cpus']} (its cgroup)" if entry["job_cpus"] else "the CPUs of Slurm's GPUs"
            print(f"    CPU affinity rule: {entry['affinity']}, with {cpus}; alternatives below are ranked without it")
        if entry["isolation"]:
            print(f"    GPU isolation: {entry['isolation']} ({entry['isolation_why']})")
        for alt in entry.get("alternatives", []):
            mark = " [effective bandwidth extrapolated]" if alt["extrapolated"] else ""
            print(f"    instead of {','.join(map(str, alt['gpus']))}: {alt['why_not']}{mark}")
    return 0


def add_commands(commands: Any) -> None:
    status = commands.add_parser("status", help="which job holds which GPUs on this node (run on the node)")
    status.add_argument("node", nargs="?", help="node name (default: this host)")
    status.add_argument("--config", help=f"hook config (default {DEFAULT_CONFIG_PATH})")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=cmd_status)
    explain = commands.add_parser("explain", help="a job's recorded MAPA decision, the alternatives and why they lost")
    explain.add_argument("job", help="job id")
    explain.add_argument("--config", help=f"hook config (default {DEFAULT_CONFIG_PATH})")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(handler=cmd_explain)
