"""A fake slurmctld for held GPUs told to Slurm (hooks/held_in_slurm.py): scontrol's reservations
and one node's state, Reason and Comment, as Slurm 24.11 and 26.05 answer them."""

from __future__ import annotations

import json

from slurm_mapa.slurm.text.commands import CommandFailed


class FakeSlurmctld:
    """scontrol's reservations and one node, as slurmctld answers them; ``busy_gpus``: the GPUs
    its jobs hold (a reservation needs a GPU neither a job nor a reservation has)."""

    def __init__(self, node: str = "dgx1", gpus: int = 8) -> None:
        self.node, self.gpus = node, gpus
        self.reservations: dict[str, int] = {}  # name -> its GPU count (all of this node)
        self.state, self.reason, self.comment = {"IDLE"}, "", ""
        self.busy_gpus = 0
        self.down = False
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        if self.down:
            raise CommandFailed("scontrol exited 1: slurm_load_reservations error: Unable to contact slurm controller")
        args = argv[1:]
        if args == ["--json", "show", "reservation"]:
            return json.dumps({"reservations": [{"name": n, "node_list": self.node, "tres": f"cpu=1,gres/gpu={count}"}
                                                for n, count in self.reservations.items()], "errors": []})
        if args == ["--json", "show", "node", self.node]:
            if "NOT_RESPONDING" in self.state and self.calls[-2][1:2] == ["--json"]:
                self.state.discard("NOT_RESPONDING")  # the ping came between two reads
            return json.dumps({"nodes": [{"name": self.node, "state": sorted(self.state), "reason": self.reason,
                                          "comment": self.comment}], "errors": []})
        if args[:2] == ["create", "reservation"]:
            fields = dict(arg.split("=", 1) for arg in args[2:])
            assert fields["TRES"].startswith("gres/gpu=") and fields["Flags"] == "IGNORE_JOBS,OVERLAP" and fields["Users"] == "root"
            count = int(fields["TRES"][len("gres/gpu="):])
            if fields["ReservationName"] in self.reservations:
                raise CommandFailed("scontrol create exited 1: Error creating the reservation: Duplicate reservation name")
            # Busy GPUs, and a drained node (26.05.5 picks a reservation's GPUs among schedulable nodes only).
            if self.busy_gpus + sum(self.reservations.values()) + count > self.gpus or self.state & {"DRAIN", "NOT_RESPONDING"}:
                raise CommandFailed("scontrol create exited 1: Error creating the reservation: Requested nodes are busy")
            self.reservations[fields["ReservationName"]] = count
            return f"Reservation created: {fields['ReservationName']}\n"
        if args[0] == "delete":
            del self.reservations[args[1].split("=", 1)[1]]
            return ""
        if args[:2] == ["update", f"NodeName={self.node}"]:
            fields = dict(arg.split("=", 1) for arg in args[2:])
            if "Comment" in fields:
                self.comment = fields["Comment"]
            if fields.get("State") == "DRAIN":
                self.state.add("DRAIN")
                self.reason = fields["Reason"]
            if fields.get("State") == "UNDRAIN":  # not responding until its next ping, as 26.05.5 does
                self.state.discard("DRAIN")
                self.state.add("NOT_RESPONDING")
                self.reason = ""
            return ""
        raise AssertionError(f"unexpected command {argv}")
