"""Tell slurmctld which GPUs of this node are held (issue 50), with Slurm's own means.

The text and the plan are text/held_slurm.py's (pure); this module reads the held GPUs, asks
slurmctld what it has (MAPA's reservations, the node's state, Reason and Comment), and makes it
match: one reservation of as many GPUs as are held (none when none is), the node's Comment naming the held
GPUs, a drain of the node only when every GPU is held or Slurm cannot reserve a held one yet.
Idempotent: `mapa gpu hold|release` runs it at once, mapa-agent at every reconcile pass (after a
slurmctld restart, a reservation deleted by hand, a held-GPUs file changed by hand).

It never stops a job and never fails its caller: a Slurm command that fails is logged and tried
again at the next pass; MAPA's Prolog keeps the held GPUs out of new jobs meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config import HookConfig
from ..text.commands import CommandFailed, Log, RunCommand
from ..text.held_slurm import (BUSY, NodePlan, create_reservation_argv, delete_reservation_argv, node_plan, node_update_argv,
                               parse_held_reservation, parse_node_view, reservation_change, reservation_name,
                               show_node_json_argv, show_reservations_argv)


@dataclass
class Told:
    """What one pass did: the GPU count of the reservation made (0: none), whether the old one
    was deleted, the held GPUs Slurm could not reserve (busy: the node is drained meanwhile), the
    node update made, the problems met."""

    reserved: int = 0
    deleted: bool = False
    lifted: bool = False  # MAPA's drain lifted to make the reservation (drained again if that failed)
    unreserved: list[int] = field(default_factory=list)
    node: NodePlan = field(default_factory=NodePlan)
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether slurmctld now has what the held GPUs ask for (nothing left to try again)."""
        return not self.problems and not self.unreserved

    def lines(self, node: str) -> list[str]:
        """What changed and what went wrong, one line each, for `mapa gpu hold`."""
        return self.changes(node) + [f"Slurm: {problem}" for problem in self.problems]

    def changes(self, node: str) -> list[str]:
        """What changed in slurmctld, one line each, for the log."""
        out = []
        if self.deleted:
            out.append(f"Slurm: deleted reservation {reservation_name(node)}" + ("" if self.reserved else ": no GPU is held any more"))
        if self.reserved:
            out.append(f"Slurm: reservation {reservation_name(node)} holds {self.reserved} GPU(s) of {node}: "
                       f"Slurm counts {self.reserved} GPU(s) fewer there")
        if self.unreserved:
            out.append(f"Slurm: cannot reserve held GPU {','.join(map(str, self.unreserved))} of {node} while jobs use the "
                       "GPUs there; the node is drained until it can (running jobs go on)")
        if self.node.drain is not None:
            out.append(f"Slurm: node {node} drained: {self.node.drain}")
        if self.node.undrain or (self.lifted and self.node.drain is None):
            out.append(f"Slurm: node {node} no longer drained by MAPA")
        if self.node.comment is not None:
            out.append(f"Slurm: node {node} Comment={self.node.comment!r}")
        return out


RESPOND_TRIES = 20
RESPOND_POLL_S = 0.25


def tell_slurm(config: HookConfig, node: str, gpu_count: int, holds: Mapping[int, str], run: RunCommand,
               sleep: Callable[[float], None] = time.sleep) -> Told:
    """Make slurmctld's view of ``node`` match ``holds`` (held GPU -> reason); what it did."""
    told = Told()
    holds = {gpu: reason for gpu, reason in holds.items() if 0 <= gpu < gpu_count}
    try:
        reserved = parse_held_reservation(run(show_reservations_argv(config.scontrol)), node)
    except (CommandFailed, ValueError) as error:
        told.problems.append(f"cannot read the reservations ({error}); tried again at the next pass")
        return told
    delete, create = reservation_change(len(holds), reserved)
    if delete:
        try:
            run(delete_reservation_argv(config.scontrol, node))
            told.deleted = True
        except CommandFailed as error:
            told.problems.append(f"cannot delete reservation {reservation_name(node)} ({error})")
            create = 0  # the name is taken still: the next pass tries both again
    try:
        view = parse_node_view(run(show_node_json_argv(config.scontrol, node)), node)
    except (CommandFailed, ValueError) as error:
        told.problems.append(f"cannot read node {node} ({error})")
        return told
    if create and view.drained_by_mapa:
        # slurmctld picks a reservation's GPUs among nodes it may schedule on: never a drained one
        # (Slurm 26.05.5 answers "Requested nodes are busy"). MAPA's own drain is lifted for the
        # moment of the request, and made again below if the request still fails.
        # slurmctld also marks a node it takes back from a drain as not responding until its next
        # ping (26.05.5: DRAINED* then "Node dgx1 now responding" a second later): wait for that.
        try:
            run(node_update_argv(config.scontrol, node, NodePlan(undrain=True))[0])
            told.lifted = True
            for _ in range(RESPOND_TRIES):
                view = parse_node_view(run(show_node_json_argv(config.scontrol, node)), node)
                if "NOT_RESPONDING" not in view.states:
                    break
                sleep(RESPOND_POLL_S)
        except (CommandFailed, ValueError) as error:
            told.problems.append(f"cannot lift MAPA's drain of {node} to reserve its held GPUs ({error})")
            create = 0
    if create:
        try:
            run(create_reservation_argv(config.scontrol, node, create))
            told.reserved = create
        except CommandFailed as error:
            if BUSY in str(error):
                told.unreserved = sorted(holds)
            else:
                told.problems.append(f"cannot reserve {create} held GPU(s) ({error}); slurm.conf's AccountingStorageTRES must "
                                     "list gres/gpu for a GPU reservation")
    try:
        told.node = node_plan(holds, gpu_count, told.unreserved, view)
        for argv in node_update_argv(config.scontrol, node, told.node):
            run(argv)
    except (CommandFailed, ValueError) as error:
        told.problems.append(f"cannot update node {node} ({error})")
        told.node = NodePlan()
    return told
