"""Fakes of Slurm's commands for the hooks' and the agent's tests: a strict scontrol and squeue for
one node (FakeSlurm), the environment slurmd gives a Prolog (env_for), a fake scontrol script."""

from __future__ import annotations

import json
import os
import time

from slurm_mapa.slurm.text.commands import CommandFailed


class FakeSlurm:
    """scontrol and squeue for one node; any other command fails the test."""

    def __init__(self, node="dgx1"):
        self.node = node
        self.running: set[str] = set()
        self.admin: dict[str, str] = {}
        self.scripts: dict[str, str] = {}
        self.calls: list[list[str]] = []
        self.broken: set[str] = set()
        self.gres: dict[str, list[str]] = {}
        self.states: dict[str, list[str]] = {}  # job -> its job_state (none: the record has no state)
        self.node_counts: dict[str, int] = {}  # job -> its node_count (none: the record has none)
        self.gone: set[str] = set()  # jobs slurmctld no longer knows

    def record(self, job: str) -> dict:
        """Job ``job``'s JSON record, as scontrol and squeue print it (the fields the hooks read)."""
        return {"job_id": int(job), "admin_comment": self.admin.get(job, ""), "batch_flag": job in self.scripts,
                "gres_detail": self.gres.get(job, []), **({"job_state": self.states[job]} if job in self.states else {}),
                **({"node_count": {"set": True, "infinite": False, "number": self.node_counts[job]}}
                   if job in self.node_counts else {})}

    def __call__(self, argv):
        self.calls.append(list(argv))
        program = os.path.basename(argv[0])
        if program in self.broken:
            raise CommandFailed(f"{program} timed out after 5 s")
        if program == "squeue" and argv[1:3] == ["--noheader", "--nodelist"] and argv[3] == self.node:
            return "".join(f"{job}\n" for job in sorted(self.running))
        if program == "scontrol" and argv[1:4] == ["--json", "show", "job"]:
            if "," in argv[4] or argv[4] in self.gone:  # scontrol takes one job id (Slurm 26.05.5)
                raise CommandFailed("scontrol exited 1: scontrol_print_job error: Invalid job id specified")
            return json.dumps({"jobs": [self.record(argv[4])]})
        if program == "squeue" and argv[1:3] == ["--json", "--states=all"] and argv[3].startswith("--jobs="):
            known = [job for job in argv[3][len("--jobs="):].split(",") if job not in self.gone]
            if not known:  # squeue fails only when it knows none of them
                raise CommandFailed("squeue exited 1: slurm_load_jobs error: Invalid job id specified")
            return json.dumps({"jobs": [self.record(job) for job in known], "errors": []})
        if program == "scontrol" and argv[1:3] == ["write", "batch_script"]:
            if argv[3] not in self.scripts:
                raise CommandFailed("scontrol write batch_script exited 1: no script")
            return self.scripts[argv[3]]
        if program == "scontrol" and argv[1] == "update" and argv[2].startswith("job=") and argv[3].startswith("AdminComment="):
            self.admin[argv[2][4:]] = argv[3][len("AdminComment="):]
            return ""
        raise AssertionError(f"unexpected command {argv}")


def env_for(job, gpus, comment=""):
    return {"SLURM_JOB_ID": job, "SLURMD_NODENAME": "dgx1", "SLURM_JOB_GPUS": gpus, "SLURM_JOB_COMMENT": comment}


def eventually(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


FAKE_SCONTROL = """#!/bin/sh
if [ "$1 $2 $3" = "--json show job" ]; then
  echo '{"jobs": [{"admin_comment": "mapa:topology=ring sensitive=yes", "batch_flag": true, "job_state": ["RUNNING"]}]}'
fi
exit 0
"""
