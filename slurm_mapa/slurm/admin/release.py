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
read back), parses it strictly and never trusts it further.

Why two squeue calls: the comment (and the job name, and the constraint) are written by the job's
user and may hold any character, the separators and newlines of a ``--format`` line included, so
a comment read from such a line could carry a forged record naming another user's job, which this
command (an administrator) would then start. So the text format carries only what users cannot
write (``%A %r``: job id, then the reason), and a job's user-writable fields are read only from
``squeue --json`` (Slurm 24.11 and later), whose strings are escaped; each JSON record is checked
again (one of the ids asked for, pending, reason BeginTime), so nothing of the first call is
trusted beyond choosing which jobs to ask about. sinfo's fields (node and partition names, states,
active features) are the administrator's and mapa-agent's, so its separator format stays.

The parsing and the decision are pure functions tested on literal squeue and sinfo output; the
loop is the edge.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

from ...core.wait_rule import SlowdownCurve, holding_pays, loss_if_started_now
from ...errors import InputError
from ..text import commands
from ..text.directive import directive_in_comment
from ..text.outlook import RingOutlook, extra_of_node, parse_outlook

FIELD = "\x1f"  # sinfo's fields are split by this (no sinfo field is user-writable)
PENDING_FORMAT = "%A %r"  # job id, one space, the reason (which may hold spaces): nothing users write
SINFO_FORMAT = FIELD.join(("%N", "%P", "%t", "%b"))
MAX_RECORDS = 100_000  # jobs or node lines read in one pass; more is an error, not a silent cut
# Job ids per `squeue --json --jobs=...`: a 24.11 record is several KiB of indented JSON, so a
# batch stays well under commands.MAX_OUTPUT_BYTES (and one hostile job, a huge comment, spoils
# only its own batch).
JSON_BATCH = 100
IN_SERVICE = frozenset({"idle", "mix", "alloc", "comp"})  # sinfo %t states a job may start on
_GPUS_PER_NODE = re.compile(r"gres[/:]gpu(?::[A-Za-z0-9_.\-]{1,64})?:([0-9]{1,3})")


@dataclass(frozen=True)
class WaitingJob:
    job_id: str
    reason: str
    partitions: tuple[str, ...]
    constraint: str  # the job's --constraint, "" when none
    gres: str  # the job's tres_per_node (squeue %b), e.g. gres/gpu:4
    comment: str
    time_limit_s: float | None = None  # None: unset or infinite


@dataclass(frozen=True)
class NodeLine:
    node: str
    partition: str
    state: str
    features: frozenset[str]  # active features


def squeue_argv(squeue: str) -> list[str]:
    """The pending jobs, with only fields no user can write (see the module docstring)."""
    return [squeue, "--noheader", "--states=PENDING", f"--format={PENDING_FORMAT}"]


def squeue_json_argv(squeue: str, job_ids: Iterable[str]) -> list[str]:
    """These pending jobs' whole records, as JSON (the data_parser is Slurm's default: v0.0.42 in
    24.11). ValueError for anything but plain job ids (no option may be smuggled in)."""
    ids = list(job_ids)
    if not ids or not all(map(commands.is_job_id, ids)):
        raise ValueError(f"job ids {ids[:5]!r} (accepted: one or more ids of 1 to 12 digits)")
    return [squeue, "--json", "--states=PENDING", f"--jobs={','.join(ids)}"]


def sinfo_argv(sinfo: str) -> list[str]:
    return [sinfo, "--noheader", "--Node", f"--format={SINFO_FORMAT}"]


def release_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "update", f"JobId={job_id}", "StartTime=now"]


def _null(text: str) -> str:
    return "" if text == "(null)" else text


def parse_pending(text: str) -> list[tuple[str, str]]:
    """``squeue_argv``'s lines as (job id, reason), each id once, in squeue's order. The reason is
    the rest of the line after the first space (Slurm's reasons may hold spaces). CommandFailed,
    naming the line, for a line that is not ``<job id> <reason>``."""
    _bounded(text, "squeue")
    pending: dict[str, str] = {}
    for line in text.split("\n"):  # not splitlines(): it also splits at \x1c-\x1e, \x85, ...
        if not line.strip():
            continue
        job_id, space, reason = line.partition(" ")
        if not space or not commands.is_job_id(job_id):
            raise commands.CommandFailed(f"squeue printed {line[:120]!r} (expected a job id, a space and the reason)")
        pending.setdefault(job_id, reason.rstrip("\r"))
        if len(pending) > MAX_RECORDS:
            raise commands.CommandFailed(f"more than {MAX_RECORDS} pending jobs in one squeue answer")
    return list(pending.items())


def parse_waiting_json(text: str, asked: Collection[str]) -> list[WaitingJob]:
    """The jobs of ``squeue_json_argv``'s output that are among ``asked``, pending and waiting for
    their begin time, in squeue's order (each once): so a squeue that ignored ``--jobs`` or
    ``--states``, or a job that started meanwhile, changes nothing.

    A job whose record lacks one of the fields read, or holds it with another type, is skipped:
    it starts at its begin time, as it would without this command. CommandFailed for output that
    is too long, not JSON, not an object with a ``jobs`` list, or that reports errors.
    """
    wanted, seen = set(asked), set()
    jobs: list[WaitingJob] = []
    for record in commands.job_records(text, "squeue --json"):
        job = _waiting_job(record)
        if job is not None and job.job_id in wanted and job.job_id not in seen:
            seen.add(job.job_id)
            jobs.append(job)
    return jobs


def _waiting_job(record: object) -> WaitingJob | None:
    """One ``.jobs[]`` record as a WaitingJob, or None unless it is a pending job waiting for its
    begin time with every field read present and of Slurm's type."""
    if not isinstance(record, dict):
        return None
    job_id, reason = record.get("job_id"), record.get("state_reason")
    texts = [record.get(key) for key in ("partition", "features", "tres_per_node", "comment")]
    # bool is an int to Python, never a job id.
    if type(job_id) is not int or not 0 < job_id < 10**12 or not all(isinstance(t, str) for t in texts):
        return None
    if "PENDING" not in commands.job_states(record) or reason != "BeginTime":
        return None
    partitions, constraint, gres, comment = texts
    return WaitingJob(str(job_id), reason, tuple(p for p in partitions.split(",") if p), constraint, gres, comment,
                      commands.job_time_limit_s(record))


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


def nodes_argv(scontrol: str) -> list[str]:
    """Every node, one line each: their GPUs (Gres=) and MAPA's ring outlook (Extra=, text/outlook.py)."""
    return [scontrol, "--oneliner", "show", "nodes"]


@dataclass(frozen=True)
class NodeOutlook:
    gpus: int  # the node's GPUs (Gres=gpu...:N summed), 0 when it shows none
    rings: dict[str, RingOutlook]  # what its mapa-agent published; {} when nothing (or not MAPA's)


_GRES_GPUS = re.compile(r"(?:^|,)gpu(?::[A-Za-z0-9_.\-]{1,64})?:([0-9]{1,4})")


def parse_node_outlooks(text: str) -> dict[str, NodeOutlook]:
    """``nodes_argv``'s lines as node name -> NodeOutlook. A node whose Extra is not MAPA's outlook
    counts as publishing none. CommandFailed for output too long, or a line that does not start with NodeName=."""
    _bounded(text, "scontrol show nodes")
    found: dict[str, NodeOutlook] = {}
    for line in text.split("\n"):
        if not line.strip():
            continue
        name = re.match(r"NodeName=(\S+)", line)  # first on the line (admin text later on it may hold anything)
        if name is None:
            raise commands.CommandFailed(f"scontrol show nodes printed {line[:120]!r} (expected one node per line, NodeName= first)")
        gres = re.findall(r"(?:^|\s)Gres=(\S*)", line)
        gpus = sum(int(n) for n in _GRES_GPUS.findall(re.sub(r"\([^)]*\)", "", gres[0]))) if len(gres) == 1 else 0
        try:
            rings = parse_outlook(extra_of_node(line))
        except commands.CommandFailed:
            rings = {}
        found[name.group(1)] = NodeOutlook(gpus, rings)
        if len(found) > MAX_RECORDS:
            raise commands.CommandFailed(f"more than {MAX_RECORDS} nodes in one scontrol answer")
    return found


def holding_out_costs_more(jobs: Iterable[WaitingJob], nodes: Iterable[NodeLine], outlooks: dict[str, NodeOutlook],
                           queued: int, now: float, curve: SlowdownCurve) -> list[tuple[str, str]]:
    """(job id, why) for every waiting placement=require job that should start now, where Slurm puts
    it, rather than hold out for a good ring (issue 40's cost rule, core/wait_rule.py): the expected
    wait (when its nodes' outlooks expect a good ring free, counting the jobs holding out for the
    same ring before it, in the order given) is no shorter than what starting now would lose (its
    time limit x the slowdown on a ring free now against the fleet's best, scaled for the ``queued``
    jobs behind it). Slurm, not this command, then picks the node among those with room, so the
    ring free now is priced at the worst of them (an assumption against starting now). A job
    holds out, as before, when no node of its partitions can run it now (none publishes k GPUs
    free), or it has no time limit."""
    in_service = [line for line in nodes if line.state in IN_SERVICE]
    ahead: dict[str, int] = {}
    found: list[tuple[str, str]] = []
    for job in jobs:
        wanted = wanted_features(job)
        if wanted is None:
            continue
        ring = next(name for name in wanted if name.startswith("mapa_ring"))
        own = wanted - {ring}
        names = {line.node for line in in_service if line.partition in job.partitions and own <= line.features}
        rings = [outlooks[name].rings[ring] for name in sorted(names) if name in outlooks and ring in outlooks[name].rings]
        free_now = [entry.now for entry in rings if entry.now is not None]
        if not free_now or job.time_limit_s is None:
            continue
        k = int(ring[len("mapa_ring"):])
        total = sum(outlooks[name].gpus for name in names if name in outlooks)
        loss = loss_if_started_now(job.time_limit_s, min(free_now), max(entry.best for entry in rings), curve,
                                   queued, k, total)
        times = sorted(entry.good_at for entry in rings if entry.good_at is not None)  # 0: free now
        wait = max(times[min(ahead.get(ring, 0), len(times) - 1)] - now, 0.0) if times else math.inf
        if loss > 0 and holding_pays(wait, loss):
            ahead[ring] = ahead.get(ring, 0) + 1
            continue
        expected = "no node expects one" if math.isinf(wait) else f"expected in {max(wait, 0):.0f} s"
        found.append((job.job_id, f"a good {k}-GPU ring is {expected}; starting now (a ring of {min(free_now):g} GB/s "
                                  f"or better) loses {loss:.0f} s"))
    return found


def release_once(run: Callable[[list[str]], str], squeue: str = "squeue", sinfo: str = "sinfo", scontrol: str = "scontrol",
                 log: Callable[[str], None] = print, curve: SlowdownCurve | None = None,
                 clock: Callable[[], float] = time.time) -> int:
    """One pass; the number of jobs released. A job that started or ended meanwhile makes its
    update fail: logged, and the pass goes on. A ``squeue --json`` batch that fails leaves its
    jobs to their begin time; the other batches go on, and the pass then raises CommandFailed."""
    pending = parse_pending(run(squeue_argv(squeue)))
    ids = [job_id for job_id, reason in pending if reason == "BeginTime"]
    jobs: list[WaitingJob] = []
    failed: list[str] = []
    for start in range(0, len(ids), JSON_BATCH):
        batch = ids[start:start + JSON_BATCH]
        try:
            jobs += parse_waiting_json(run(squeue_json_argv(squeue, batch)), batch)
        except commands.CommandFailed as error:
            failed.append(str(error))
    released = 0
    if any(wanted_features(job) is not None for job in jobs):  # else sinfo is not asked
        nodes = parse_nodes(run(sinfo_argv(sinfo)))
        good = jobs_to_release(jobs, nodes)
        why = {job_id: f"{node} has a good placement free" for job_id, node in good}
        holding = [job for job in jobs if job.job_id not in why]
        if curve is not None and any(wanted_features(job) is not None for job in holding):
            outlooks = parse_node_outlooks(run(nodes_argv(scontrol)))
            why.update(holding_out_costs_more(holding, nodes, outlooks, len(pending) - 1, clock(), curve))
        for job_id, reason in why.items():
            try:
                run(release_argv(scontrol, job_id))
            except commands.CommandFailed as error:
                log(f"mapa release: job {job_id}: {error}")
                continue
            released += 1
            log(f"mapa release: job {job_id} (placement=require) starts now: {reason}")
    if failed:
        raise commands.CommandFailed(f"squeue --json failed for {len(failed)} batch(es) of jobs waiting for their begin "
                                     f"time (they start then): {failed[0]}")
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

    curve = None
    if args.wait_rule == "cost":
        from ...replay.timemodel import parse_curve

        curve = parse_curve(args.time_curve or "default")
    elif args.time_curve is not None:
        raise InputError("--time-curve prices holding out under --wait-rule cost; give --wait-rule cost too")
    while True:
        try:
            release_once(runner, args.squeue, args.sinfo, args.scontrol, log, curve)
        except commands.CommandFailed as error:
            hint = ("; give --squeue, --sinfo or --scontrol with the command's path (each runs from PATH by default)"
                    if str(error).startswith("cannot run ") else "")
            log(f"mapa release: error: {error}{hint}")
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
    release.add_argument("--squeue", default="squeue", help="the squeue to run (default: squeue on PATH)")
    release.add_argument("--sinfo", default="sinfo", help="the sinfo to run (default: sinfo on PATH)")
    release.add_argument("--scontrol", default="scontrol", help="the scontrol to run (default: scontrol on PATH)")
    release.add_argument("--timeout", type=float, default=20.0, help="seconds one Slurm command may take (default 20)")
    release.add_argument("--wait-rule", choices=("fixed", "cost"), default="fixed",
                         help="fixed (default): a job waits for a good node until its wait= begin time; cost: it also "
                         "starts at once on the best node free when the expected wait for a good one (the nodes' "
                         "outlooks: [features] outlook = true) is longer than what starting there would lose "
                         "(docs/admin.md, \"Waiting only when it pays\")")
    release.add_argument("--time-curve", default=None, metavar="BW:SLOWDOWN,...",
                         help="with --wait-rule cost: how much slower a sensitive job runs at each effective bandwidth "
                         "(GB/s, as the nodes publish it), e.g. 12.3:3,25:1.8,50:1; default: the paper's curve")
    release.set_defaults(handler=cmd_release)

