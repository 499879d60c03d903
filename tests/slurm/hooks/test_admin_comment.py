"""The AdminComment record's writes (hooks/admin_comment.py): a finished job is not asked to
change, and the records loop reads the jobs of a turn in one call."""

from __future__ import annotations

import pytest
from fake_slurm import FakeSlurm

from slurm_mapa.slurm.hooks.admin_comment import record_decision
from slurm_mapa.slurm.hooks.job_context import PrologContext
from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.text.commands import MAX_JOBS_PER_READ, CommandFailed, job_finished, reading_jobs_at_once, show_job_argv
from slurm_mapa.slurm.text.decision import Decision, parse_decisions
from slurm_mapa.slurm.text.directive import parse_directive

SCONTROL = "/usr/bin/scontrol"


@pytest.mark.parametrize("state, finished", [
    (["RUNNING"], False), (["PENDING"], False), (["SUSPENDED"], False), (["RUNNING", "CONFIGURING"], False),
    (["COMPLETED"], True), (["FAILED", "COMPLETING"], True), (["CANCELLED"], True), (["TIMEOUT"], True),
    (["OUT_OF_MEMORY"], True), ("COMPLETED", True), ("RUNNING", False), (None, False), ([], False), ([3], False),
])
def test_a_job_is_finished_in_any_base_state_past_suspended(state, finished):
    assert job_finished({} if state is None else {"job_state": state}) is finished


def _record(slurm: FakeSlurm, job: str, nodes: int = 1) -> tuple[bool, list[str]]:
    logs: list[str] = []
    ctx = PrologContext(job_id=job, node="dgx1", slurm_gpus=(), env_comment="", nodes_in_job=nodes)
    decision = Decision("dgx1", (2, 3), "preserve")
    done = record_decision(ctx, parse_directive("topology=ring sensitive=yes"), decision, HookConfig(), slurm, logs.append,
                           sleep=lambda seconds: None)
    return done, logs


def test_a_finished_job_is_read_but_not_asked_to_change():
    slurm = FakeSlurm()
    slurm.states["7"] = ["COMPLETED"]
    done, logs = _record(slurm, "7")
    assert done and [call[1:3] for call in slurm.calls] == [["--json", "show"]]  # no update: slurmctld would refuse it
    assert "ended before its AdminComment record was written" in logs[0]
    slurm.states["8"] = ["RUNNING"]
    done, _ = _record(slurm, "8")
    assert done and parse_decisions(slurm.admin["8"])["dgx1"].gpus == (2, 3)


def test_the_records_of_a_turn_are_read_in_one_call():
    slurm = FakeSlurm()
    run = reading_jobs_at_once(slurm, SCONTROL, ["11", "12", "13", "12"])
    assert slurm.calls == [[SCONTROL, "--json", "show", "job", "11,12,13"]]
    for job in ("11", "12", "13"):
        assert _record_with(run, job)
    shows = [call for call in slurm.calls if call[1:3] == ["--json", "show"]]
    assert len(shows) == 1 and len([call for call in slurm.calls if call[1] == "update"]) == 3
    assert all(parse_decisions(slurm.admin[job])["dgx1"].gpus == (2, 3) for job in ("11", "12", "13"))
    run(show_job_argv(SCONTROL, "11"))  # a second read of a job asks slurmctld again (the answer may have changed)
    assert slurm.calls[-1] == show_job_argv(SCONTROL, "11")
    assert reading_jobs_at_once(slurm, SCONTROL, ["14"]) is slurm  # one job: nothing to gain
    many = [str(n) for n in range(100, 200)]
    reading_jobs_at_once(slurm, SCONTROL, many)
    assert slurm.calls[-1][4] == ",".join(many[:MAX_JOBS_PER_READ])


def _record_with(run, job: str) -> bool:
    ctx = PrologContext(job_id=job, node="dgx1", slurm_gpus=(), env_comment="", nodes_in_job=1)
    return record_decision(ctx, parse_directive("topology=ring sensitive=yes"), Decision("dgx1", (2, 3), "preserve"), HookConfig(),
                           run, [].append, sleep=lambda seconds: None)


class Failing(FakeSlurm):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def __call__(self, argv, *args, **kwargs):
        if argv[1:4] == ["--json", "show", "job"] and "," in argv[4]:
            self.calls.append(list(argv))
            raise CommandFailed(self.message)
        return super().__call__(argv, *args, **kwargs)


def test_a_gone_job_in_the_list_makes_each_job_read_alone():
    slurm = Failing("scontrol --json show job exited 1: scontrol_print_job error: Invalid job id specified")
    run = reading_jobs_at_once(slurm, SCONTROL, ["21", "22"])
    assert run is slurm  # the plain runner: each record reads its own job, as without the batch
    assert _record_with(run, "21") and slurm.calls[-2] == show_job_argv(SCONTROL, "21")


def test_an_unanswered_list_fails_each_read_without_asking_again():
    slurm = Failing("scontrol: error: Unable to contact slurm controller (connect failure)")
    run = reading_jobs_at_once(slurm, SCONTROL, ["31", "32"])
    assert not _record_with(run, "31") and not _record_with(run, "32")  # both wait in the journal
    assert len(slurm.calls) == 1
