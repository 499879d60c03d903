"""``mapa release``: start ``placement=require`` jobs as soon as a good node is free.

job_submit.lua gives a sensitive ``placement=require`` k-GPU job the preference
``mapa_ring<k>`` and a begin time ``wait=`` minutes after submission, which Slurm itself
enforces: the job waits (squeue reason ``BeginTime``) and then runs wherever it fits, preferring
a good node. This command, run on the controller host every few seconds (as root or SlurmUser:
it updates other users' jobs), moves the begin time of such a job to now as soon as a node of one
of its partitions, in service, has the job's feature active (mapa-agent publishes it while a good
k-ring is free there, docs/admin.md "Choosing the node"), so the job goes there at once.

Why not a ``--constraint``: Slurm 24.11 fails a job whose constraint is active on no node it may
use (reason BadConstraints; sbatch says "Requested node configuration is not available"), and
MAPA's features come and go as jobs start and end. The begin time bounds the wait even when this
command is not running.

It finds the directive in the job comment (job_submit.lua only delays a job whose comment it can
read back), parses it strictly and never trusts it further. The parsing and the decision are
pure functions tested on literal squeue and sinfo output; the loop is the edge.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import InputError
from . import commands
from .directive import directive_in_comment

RECORD = "\x1e"  # squeue starts every job's record with this; fields are split by FIELD
FIELD = "\x1f"
SQUEUE_FORMAT = RECORD + FIELD.join(("%A", "%r", "%P", "%f", "%b", "%k"))
SINFO_FORMAT = FIELD.join(("%N", "%P", "%t", "%b"))
MAX_RECORDS = 100_000  # jobs or node lines read in one pass; more is an error, not a silent cut
IN_SERVICE = frozenset({"idle", "mix", "alloc", "comp"})  # sinfo %t states a job may start on
_GPUS_PER_NODE = re.compile(r"gres[/:]gpu(?::[A-Za-z0-9_.\-]{1,64})?:([0-9]{1,3})")


@dataclass(frozen=True)
class WaitingJob:
    job_id: str
    reason: str
    partitions: tuple[str, ...]
    constraint: str  # the job's --constraint, "" when none
    gres: str  # squeue %b, e.g. gres/gpu:4
    comment: str


@dataclass(frozen=True)
class NodeLine:
    node: str
    partition: str
    state: str
    features: frozenset[str]  # active features


def squeue_argv(squeue: str) -> list[str]:
    return [squeue, "--noheader", "--states=PENDING", f"--format={SQUEUE_FORMAT}"]


def sinfo_argv(sinfo: str) -> list[str]:
    return [sinfo, "--noheader", "--Node", f"--format={SINFO_FORMAT}"]


def release_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "update", f"JobId={job_id}", "StartTime=now"]


def _null(text: str) -> str:
    return "" if text == "(null)" else text


def parse_waiting(text: str) -> list[WaitingJob]:
    """The records of ``squeue_argv``'s output. A record that cannot be read (a comment holding
    the separators) is skipped: its job starts at its begin time, as it would without this."""
    _bounded(text, "squeue")
    jobs: list[WaitingJob] = []
    for record in text.split(RECORD)[1:]:
        fields = record.rstrip("\n").split(FIELD)
        if len(fields) != 6 or not commands.is_job_id(fields[0]):
            continue
        job_id, reason, partitions, constraint, gres, comment = fields
        jobs.append(WaitingJob(job_id, reason, tuple(p for p in partitions.split(",") if p), _null(constraint),
                               _null(gres), _null(comment)))
        if len(jobs) > MAX_RECORDS:
            raise commands.CommandFailed(f"more than {MAX_RECORDS} pending jobs in one squeue answer")
    return jobs


def parse_nodes(text: str) -> list[NodeLine]:
    """``sinfo_argv``'s lines: one per node and partition (the default partition's ``*`` dropped)."""
    _bounded(text, "sinfo")
    nodes: list[NodeLine] = []
    for line in text.splitlines():
        fields = line.split(FIELD)
        if len(fields) != 4:
            raise commands.CommandFailed(f"sinfo printed {line[:120]!r} (expected node, partition, state, features)")
        node, partition, state, features = fields
        names = frozenset(name for name in _null(features).split(",") if name)
        if not all(map(commands.is_feature_name, names)):
            raise commands.CommandFailed(f"sinfo printed features {features[:120]!r} that are not feature names")
        nodes.append(NodeLine(node, partition.rstrip("*"), state, names))
        if len(nodes) > MAX_RECORDS:
            raise commands.CommandFailed(f"more than {MAX_RECORDS} lines in one sinfo answer")
    return nodes


def wanted_features(job: WaitingJob) -> frozenset[str] | None:
    """The features a node needs for this job to start there now: its MAPA ring feature and, when
    its own constraint is plain names joined by '&', those; None when the job is not one
    ``mapa release`` handles (not waiting for its begin time, no placement=require directive in
    its comment, no per-node GPU count, or a constraint with '|', counts or brackets)."""
    if job.reason != "BeginTime":
        return None
    try:
        directive = directive_in_comment(job.comment)
    except InputError:
        return None
    match = _GPUS_PER_NODE.search(job.gres)
    if directive is None or directive.placement != "require" or not directive.sensitive or match is None:
        return None
    own = frozenset(job.constraint.split("&")) if job.constraint else frozenset()
    if not all(map(commands.is_feature_name, own)):
        return None
    return own | {f"mapa_ring{int(match.group(1))}"}


def jobs_to_release(jobs: Iterable[WaitingJob], nodes: Iterable[NodeLine]) -> list[tuple[str, str]]:
    """(job id, node) for every waiting placement=require job that a node in service, in one of
    its partitions, has every wanted feature for."""
    by_partition: dict[str, list[NodeLine]] = {}
    for line in nodes:
        if line.state in IN_SERVICE:
            by_partition.setdefault(line.partition, []).append(line)
    found: list[tuple[str, str]] = []
    for job in jobs:
        wanted = wanted_features(job)
        if wanted is None:
            continue
        good = next((line.node for partition in job.partitions for line in by_partition.get(partition, ())
                     if wanted <= line.features), None)
        if good is not None:
            found.append((job.job_id, good))
    return found


def release_once(run: Callable[[list[str]], str], squeue: str = "squeue", sinfo: str = "sinfo", scontrol: str = "scontrol",
                 log: Callable[[str], None] = print) -> int:
    """One pass; the number of jobs released. A job that started or ended meanwhile makes its
    update fail: logged, and the pass goes on."""
    jobs = parse_waiting(run(squeue_argv(squeue)))
    if not any(job.reason == "BeginTime" for job in jobs):
        return 0  # nothing waits: sinfo is not asked
    released = 0
    for job_id, node in jobs_to_release(jobs, parse_nodes(run(sinfo_argv(sinfo)))):
        try:
            run(release_argv(scontrol, job_id))
        except commands.CommandFailed as error:
            log(f"mapa release: job {job_id}: {error}")
            continue
        released += 1
        log(f"mapa release: job {job_id} (placement=require) starts now: {node} has a good placement free")
    return released


def _bounded(text: str, what: str) -> None:
    if len(text) > commands.MAX_OUTPUT_BYTES:
        raise commands.CommandFailed(f"{what} printed {len(text)} characters")


def cmd_release(args: argparse.Namespace) -> int:
    if args.every is not None and not 1 <= args.every <= 3600:
        raise InputError(f"--every must be 1 to 3600 seconds, got {args.every:g}")
    runner = commands.Runner(timeout=args.timeout)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    while True:
        try:
            release_once(runner, args.squeue, args.sinfo, args.scontrol, log)
        except commands.CommandFailed as error:
            log(f"mapa release: {error}")
            if args.every is None:
                return 1
        if args.every is None:
            return 0
        time.sleep(args.every)


def add_commands(commands_parser: Any) -> None:
    release = commands_parser.add_parser(
        "release",
        help="start waiting placement=require jobs as soon as a node with a good placement is free (run on the controller)",
        description="Move the begin time of every pending placement=require job to now when a node in service, in one "
        "of its partitions, has its mapa_ring<k> feature active. Run as root or SlurmUser on the controller host, with "
        "--every (a service) or from a timer; without it a job waits its whole wait= and then runs anyway.",
    )
    release.add_argument("--every", type=float, metavar="SECONDS", help="repeat every SECONDS (default: one pass)")
    release.add_argument("--squeue", default="squeue")
    release.add_argument("--sinfo", default="sinfo")
    release.add_argument("--scontrol", default="scontrol")
    release.add_argument("--timeout", type=float, default=20.0, help="seconds one Slurm command may take (default 20)")
    release.set_defaults(handler=cmd_release)

