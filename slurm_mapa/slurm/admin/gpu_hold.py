"""``mapa gpu hold|release|list``: hold one GPU of this node out of every new job (issue 50).

Slurm cannot drain one GPU of a node; MAPA chooses which GPUs each job gets, so the Prolog leaves
a held GPU out of every new job's choice while the node keeps running (hooks/gpu_health.py). Run
on the node as root, like ``mapa hooks``: the record is root's, beside the ledger
(node_state/held_gpus.py). A job already running on a GPU when it is held keeps it until it ends.

Each hold and release also tells slurmctld at once (hooks/held_in_slurm.py: a reservation of one
GPU per held GPU, the node's Comment, a drain only when every GPU is held); mapa-agent does it
again at every reconcile pass, so a failure here (slurmctld unreachable) is said and mended later.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

from ...errors import InputError
from ..config import DEFAULT_CONFIG_PATH, HookConfig, hook_logger, load_admin_config
from ..hooks.held_in_slurm import tell_slurm
from ..hooks.node_graph import load_graph
from ..node_state import MAX_REASON_CHARS, GpuHold, HeldCorrupt, NodeState, reason_problem
from ..text.commands import Runner, RunCommand
from ..trusted_files import UnsafePath


def make_runner(timeout: float) -> RunCommand:
    """The scontrol runner (tests put a fake Slurm here)."""
    return Runner(timeout=timeout)


def _node(args: argparse.Namespace) -> str:
    return args.node or socket.gethostname().split(".")[0]


def _gpu_index(text: str, config: HookConfig, node: str) -> tuple[int, int]:
    """The GPU index of the command line, checked against the node's topology, and the node's GPU count."""
    graph = load_graph(config, node)
    accepted = f"accepted: a GPU index of node {node} ({graph.name}), 0 to {graph.size - 1}"
    if not (text.isascii() and text.isdigit()) or len(text) > 4:
        raise InputError(f"GPU {text[:40]!r} is not a GPU index; {accepted}")
    gpu = int(text)
    if gpu >= graph.size:
        raise InputError(f"GPU {gpu} is not on node {node}, which has {graph.size} GPUs; {accepted}")
    return gpu, graph.size


def _tell_slurm(config: HookConfig, state: NodeState, node: str, gpu_count: int, log) -> None:
    """Tell slurmctld the held GPUs now; print and log what changed (mapa-agent retries what failed)."""
    told = tell_slurm(config, node, gpu_count, {gpu: hold.reason for gpu, hold in _holds(state).items()},
                      make_runner(config.command_timeout))
    for line in told.lines(node):
        print(line)
        log(f"mapa gpu: {line}")
    if told.problems:
        print("Slurm: mapa-agent tries again at its next reconcile pass; MAPA's Prolog holds the GPU out meanwhile")


def _holds(state: NodeState) -> dict[int, GpuHold]:
    try:
        return state.held_gpus()
    except HeldCorrupt as error:
        raise InputError(f"{state.held_path()} cannot be read ({error}): the hooks hold no GPU out meanwhile; accepted: "
                         "the file `mapa gpu hold` writes (remove it as root, then hold the GPUs again)") from None


def _change(state: NodeState, gpu: int, hold: GpuHold | None) -> GpuHold | None:
    _holds(state)  # a corrupt file is refused with the fix, before the lock
    try:
        return state.set_hold(gpu, hold)
    except (OSError, UnsafePath, TimeoutError) as error:
        raise InputError(f"cannot change {state.held_path()}: {error} (run it as root on the node)") from None


def _jobs_on(state: NodeState, gpu: int) -> list[str]:
    try:
        return sorted((job for job, gpus in state.gpus_in_use().items() if gpu in gpus), key=int)
    except (OSError, UnsafePath):
        return []


def cmd_hold(args: argparse.Namespace) -> int:
    config = load_admin_config(args.config)
    node = _node(args)
    gpu, gpu_count = _gpu_index(args.gpu, config, node)
    problem = reason_problem(args.reason)
    if problem:
        raise InputError(f"--reason: {problem}")
    state = NodeState.of(config)
    before = _change(state, gpu, GpuHold(args.reason, time.time(), "admin"))
    log = hook_logger(config.log)
    if before is not None:
        print(f"GPU {gpu} was held already (since {_when(before.since)}); its reason is now {args.reason!r}")
    else:
        print(f"GPU {gpu} of node {node} is held out of every new job: {args.reason or '(no reason given)'}")
    log(f"mapa gpu hold: GPU {gpu} held out of new jobs by an admin: {args.reason or '(no reason given)'}")
    for job in _jobs_on(state, gpu):
        line = f"GPU {gpu} is held, but running job {job} uses it: the job keeps it until it ends"
        print(line)
        log(f"mapa gpu hold: {line}")
    _tell_slurm(config, state, node, gpu_count, log)
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    config = load_admin_config(args.config)
    node = _node(args)
    gpu, gpu_count = _gpu_index(args.gpu, config, node)
    state = NodeState.of(config)
    held = _holds(state)
    if gpu not in held:
        raise InputError(f"GPU {gpu} of node {node} is not held; held now: {','.join(map(str, sorted(held))) or 'none'}")
    _change(state, gpu, None)
    print(f"GPU {gpu} of node {node} is released: new jobs may get it again")
    log = hook_logger(config.log)
    log(f"mapa gpu release: GPU {gpu} released by an admin")
    _tell_slurm(config, state, node, gpu_count, log)
    return 0


def _when(since: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(since))


def held_list(state: NodeState) -> list[dict[str, Any]]:
    """The held GPUs as `mapa gpu list --json` and `mapa status --json` print them; HeldCorrupt if unreadable."""
    in_use = state.gpus_in_use() if state.jobs_dir.is_dir() else {}
    return [{"gpu": gpu, "reason": hold.reason, "since": hold.since, "since_text": _when(hold.since), "source": hold.source,
             "jobs": sorted((job for job, gpus in in_use.items() if gpu in gpus), key=int)}
            for gpu, hold in sorted(state.held_gpus().items())]


def held_lines(held: list[dict[str, Any]]) -> list[str]:
    return [f"GPU {h['gpu']}: held since {h['since_text']} ({h['source']}): {h['reason'] or '(no reason given)'}"
            + (f"; still used by running job(s) {','.join(h['jobs'])}" if h["jobs"] else "") for h in held]


def cmd_list(args: argparse.Namespace) -> int:
    config = load_admin_config(args.config, trusted=False) if args.config else load_admin_config(
        DEFAULT_CONFIG_PATH, option="", trusted=False)
    state = NodeState.of(config)
    _holds(state)
    held = held_list(state)
    if args.json:
        print(json.dumps({"node": _node(args), "held": held}, indent=2))
    else:
        print("\n".join(held_lines(held)) if held else "no GPU is held")
    return 0


def add_commands(commands: Any) -> None:
    gpu = commands.add_parser("gpu", help="hold one GPU of this node out of every new job, release it, list the held ones")
    sub = gpu.add_subparsers(dest="gpu_command", required=True, metavar="SUBCOMMAND")
    hold = sub.add_parser("hold", help="keep GPU out of every new job on this node (run on the node as root)",
                          description="Hold a GPU out of every new job on this node; running jobs keep their GPUs.")
    release = sub.add_parser("release", help="let new jobs get GPU again (run on the node as root)")
    listing = sub.add_parser("list", help="the GPUs held on this node, with reason and since when")
    for parser in (hold, release):
        parser.add_argument("gpu", metavar="GPU", help="the GPU's index on the node (as in `mapa topo show` and nvidia-smi)")
    hold.add_argument("--reason", default="", help=f"why, for mapa status and mapa doctor (printable, at most {MAX_REASON_CHARS} characters)")
    for parser in (hold, release, listing):
        parser.add_argument("--config", **({"default": str(DEFAULT_CONFIG_PATH)} if parser is not listing else {}),
                            help=f"the hooks' config (default {DEFAULT_CONFIG_PATH})")
        parser.add_argument("--node", help="this node's name in mapa.toml's [nodes] (default: the host's short name)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    hold.set_defaults(handler=cmd_hold)
    release.set_defaults(handler=cmd_release)
    listing.set_defaults(handler=cmd_list)
