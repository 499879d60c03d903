"""Slurm's side of a held GPU (issue 50): the text MAPA writes into slurmctld and reads back.

Slurm cannot drain one GPU (``gres_get_node_drain()`` answers "N/A" in every release), and it
refuses a lower GPU count on a node whose gres.conf names device files (``_node_reconfig_test()``
in src/interfaces/gres.c: "the only valid new counts are the current count or zero", 24.11 and
26.05 alike). What both releases do take is a reservation of GPUs of one node
(``scontrol create reservation Nodes=NODE TRES=gres/gpu=N``): slurmctld picks N GPUs it sees free,
with one core beside them, and keeps every job outside the reservation off them
(``job_test_resv()`` in src/slurmctld/reservation.c). So MAPA keeps one reservation per node with a
held GPU, ``mapa_held_<node>``, of as many GPUs as are held, for nobody (``Users=root``); Slurm
counts that many GPUs fewer on the node while MAPA's Prolog keeps the held indices themselves out
of every job. One reservation, not one per GPU: 24.11 gives each reservation a core of its own.
slurmctld does not change a reservation's GPU count in place (`scontrol update ReservationName=...
TRES=...` answers "Reservation updated." and keeps the old count, 26.05.5), so a new count is a
new reservation, made right after the old one is deleted.

The node says why: its ``Comment`` carries ``mapa-held: GPU 3 (XID 79 twice)`` after whatever
else it says; its ``Reason`` does only when MAPA drains the node, which it does when every GPU is
held, or while Slurm cannot reserve a held GPU because jobs use all of the node's GPUs (a
reservation is refused then: "Requested nodes are busy"). A drain of MAPA's is lifted (``UNDRAIN``)
as soon as it is not needed; anyone else's drain is never touched.

Everything here is pure: argv builders, parsers of `scontrol --json show reservation` and
`scontrol --json show node NODE`, and the plan of what to change (docs/admin.md, "Holding out a
failing GPU"). hooks/held_in_slurm.py runs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from .commands import CommandFailed, json_list

RESERVATION_PREFIX = "mapa_held_"
MARK = "mapa-held:"  # starts MAPA's part of a node's Comment, and the Reason of MAPA's drain
BUSY = "Requested nodes are busy"  # slurmctld's ESLURM_NODES_BUSY text: no GPU of the node is free to reserve
MAX_TEXT = 1000  # characters of MAPA's Comment or Reason (a node of 16 GPUs, each with a long reason, fits)
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class NodeView:
    """What slurmctld says of the node: its state names (IDLE, MIXED, DRAIN, RESERVED, ...), its
    Reason and its Comment (empty when unset)."""

    states: frozenset[str]
    reason: str
    comment: str

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.states

    @property
    def drained_by_mapa(self) -> bool:
        return self.drained and self.reason.startswith(MARK)


@dataclass(frozen=True)
class NodePlan:
    """The node updates that make Slurm's view match the held GPUs: a new Comment (None: leave
    it), a drain with this Reason (None: none), and whether to lift MAPA's own drain."""

    comment: str | None = None
    drain: str | None = None
    undrain: bool = False

    def __bool__(self) -> bool:
        return self.comment is not None or self.drain is not None or self.undrain


def check_node_name(node: str) -> str:
    """``node`` if it is a plain Slurm node name (letters, digits, '.', '_', '-'); ValueError otherwise."""
    if not _NODE.fullmatch(node):
        raise ValueError(f"node name {node[:60]!r} (accepted: letters, digits, '.', '_', '-', at most 100)")
    return node


def reservation_name(node: str) -> str:
    return f"{RESERVATION_PREFIX}{check_node_name(node)}"


def _one_line(text: str) -> str:
    """``text`` with no control characters (a hold's reason is printable already: belt and braces)."""
    return "".join(c if c.isprintable() else " " for c in text)


def held_text(holds: Mapping[int, str]) -> str:
    """``mapa-held: GPU 3 (XID 79 twice); GPU 5 (no reason given)``, or "" when nothing is held;
    at most MAX_TEXT characters (a longer one ends with "...")."""
    if not holds:
        return ""
    text = MARK + " " + "; ".join(f"GPU {gpu} ({_one_line(reason) or 'no reason given'})" for gpu, reason in sorted(holds.items()))
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def split_comment(comment: str) -> tuple[str, str]:
    """A node's Comment as (what others wrote, MAPA's part): MAPA's part runs from MARK to the end."""
    at = comment.find(MARK)
    if at < 0:
        return comment, ""
    return comment[:at].rstrip(), comment[at:]


def merged_comment(comment: str, ours: str) -> str:
    """The node's Comment with MAPA's part replaced by ``ours`` (removed when ""); others' text kept, first."""
    theirs, _ = split_comment(comment)
    return f"{theirs} {ours}" if theirs and ours else theirs or ours


def drain_reason(holds: Mapping[int, str], gpu_count: int, unreserved: Sequence[int]) -> str:
    """The Reason of MAPA's drain: every GPU held, or held GPUs Slurm could not reserve yet."""
    why = (f"all {gpu_count} GPUs held" if len(holds) >= gpu_count else
           f"Slurm cannot reserve held GPU {','.join(map(str, sorted(unreserved)))} while jobs use the node's GPUs; "
           "drained until it can")
    text = f"{MARK} {why}: " + "; ".join(f"GPU {gpu} ({_one_line(reason) or 'no reason given'})" for gpu, reason in sorted(holds.items()))
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def reservation_change(held: int, reserved: int | None) -> tuple[bool, int]:
    """Whether to delete MAPA's reservation of the node (it reserves ``reserved`` GPUs; None: there
    is none), and how many GPUs the new one reserves (0: none), for ``held`` held GPUs."""
    if (reserved is None and held == 0) or (held > 0 and held == reserved):
        return False, 0
    return reserved is not None, held


def node_plan(holds: Mapping[int, str], gpu_count: int, unreserved: Sequence[int], view: NodeView) -> NodePlan:
    """What to change on the node, given the held GPUs (index -> reason), the node's GPU count, the
    held GPUs Slurm has no reservation for (it refused one: the node is busy), and the node as read.

    Drains only when every GPU is held or a held GPU could not be reserved, and never over someone
    else's drain (its Reason is theirs); lifts only MAPA's own drain."""
    comment = merged_comment(view.comment, held_text(holds))
    plan_comment = comment if comment != view.comment else None
    needs_drain = bool(holds) and (len(holds) >= gpu_count or bool(unreserved))
    if needs_drain:
        reason = drain_reason(holds, gpu_count, unreserved)
        if view.drained and not view.drained_by_mapa:
            return NodePlan(plan_comment)  # an admin's drain already keeps jobs off; its Reason stays theirs
        return NodePlan(plan_comment, drain=reason if (not view.drained or view.reason != reason) else None)
    return NodePlan(plan_comment, undrain=view.drained_by_mapa)


# --- argv --------------------------------------------------------------------------------------

def show_reservations_argv(scontrol: str) -> list[str]:
    return [scontrol, "--json", "show", "reservation"]


def show_node_json_argv(scontrol: str, node: str) -> list[str]:
    return [scontrol, "--json", "show", "node", check_node_name(node)]


def create_reservation_argv(scontrol: str, node: str, count: int) -> list[str]:
    """``count`` GPUs of ``node`` reserved for nobody, from now on: IGNORE_JOBS (the node's running
    jobs do not stop it: slurmctld still takes GPUs they leave free), OVERLAP (a site's own
    reservation of the node does not stop it either). Slurm makes an infinite duration a year:
    the agent creates it again if it ends. The node's Comment names the GPUs and why."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1024:
        raise ValueError(f"GPU count {count!r} (accepted: 1 to 1024)")
    return [scontrol, "create", "reservation", f"ReservationName={reservation_name(node)}", f"Nodes={node}",
            f"TRES=gres/gpu={count}", "StartTime=now", "Duration=infinite", "Users=root", "Flags=IGNORE_JOBS,OVERLAP",
            f"Comment={MARK} {count} held GPU(s) of {node}, named in the node's Comment; `mapa gpu release` on {node} ends it"]


def delete_reservation_argv(scontrol: str, node: str) -> list[str]:
    return [scontrol, "delete", f"ReservationName={reservation_name(node)}"]


def node_update_argv(scontrol: str, node: str, plan: NodePlan) -> list[list[str]]:
    """The `scontrol update NodeName=NODE` calls of ``plan``: the Comment (with the drain, in one
    call), and the drain or its lifting (``State=UNDRAIN``: leaves a DOWN node down)."""
    base = [scontrol, "update", f"NodeName={check_node_name(node)}"]
    comment = [f"Comment={plan.comment}"] if plan.comment is not None else []
    calls = []
    if plan.drain is not None:
        calls.append(base + ["State=DRAIN", f"Reason={plan.drain}"] + comment)
    elif comment:
        calls.append(base + comment)
    if plan.undrain:
        calls.append(base + ["State=UNDRAIN"])
    return calls


# --- parsing -----------------------------------------------------------------------------------

def parse_held_reservation(text: str, node: str) -> int | None:
    """How many GPUs MAPA's reservation of ``node`` reserves in `scontrol --json show reservation`
    (its ``tres``, e.g. ``cpu=1,gres/gpu=2``; 0 when it names none); None: there is none. Others'
    reservations, and MAPA's of other nodes, are left out. CommandFailed for output that is not
    Slurm's reservation list."""
    name = reservation_name(node)
    for record in json_list(text, "scontrol --json show reservation", "reservations"):
        if isinstance(record, dict) and record.get("name") == name:
            found = re.search(r"(?:^|,)gres/gpu=([0-9]{1,4})(?:,|$)", _text(record.get("tres")))
            return int(found.group(1)) if found else 0
    return None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def parse_node_view(text: str, node: str) -> NodeView:
    """Node ``node``'s state, Reason and Comment in `scontrol --json show node NODE` (``state`` is
    a list of names from data_parser v0.0.40 on, a string before). CommandFailed if it is not there."""
    for record in json_list(text, "scontrol --json show node", "nodes"):
        if isinstance(record, dict) and record.get("name") == node:
            state = record.get("state")
            names = [state] if isinstance(state, str) else [s for s in state if isinstance(s, str)] if isinstance(state, list) else []
            return NodeView(frozenset(names), _text(record.get("reason")), _text(record.get("comment")))
    raise CommandFailed(f"scontrol --json show node {node} printed no record of node {node}")
