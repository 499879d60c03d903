"""The AdminComment record's writes (hooks/admin_comment.py): a finished job is not asked to
change, and the records loop reads the jobs of a turn in one call (`squeue --json --jobs=...`:
scontrol takes one job id)."""

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
SQUEUE = "/usr/bin/squeue"


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
    run = reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["11", "12", "13", "12"])
    assert slurm.calls == [[SQUEUE, "--json", "--states=all", "--jobs=11,12,13"]]
    for job in ("11", "12", "13"):
        assert _record_with(run, job)
    reads = [call for call in slurm.calls if call[0] in (SCONTROL, SQUEUE) and call[1] == "--json"]
    assert len(reads) == 1 and len([call for call in slurm.calls if call[1] == "update"]) == 3
    assert all(parse_decisions(slurm.admin[job])["dgx1"].gpus == (2, 3) for job in ("11", "12", "13"))
    run(show_job_argv(SCONTROL, "11"))  # a second read of a job asks slurmctld again (the answer may have changed)
    assert slurm.calls[-1] == show_job_argv(SCONTROL, "11")
    assert reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["14"]) is slurm  # one job: nothing to gain
    many = [str(n) for n in range(100, 200)]
    reading_jobs_at_once(slurm, SQUEUE, SCONTROL, many)
    assert slurm.calls[-1][3] == "--jobs=" + ",".join(many[:MAX_JOBS_PER_READ])


def test_what_is_written_after_the_list_read_keeps_the_admin_comment_it_read():
    slurm = FakeSlurm()
    slurm.admin["15"] = "checked by admin; mapa:topology=ring sensitive=yes # dgx2=0,1 policy=preserve"
    run = reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["15", "16"])
    assert _record_with(run, "15")
    recorded = parse_decisions(slurm.admin["15"])
    assert set(recorded) == {"dgx1", "dgx2"} and slurm.admin["15"].startswith("checked by admin")


def _record_with(run, job: str) -> bool:
    ctx = PrologContext(job_id=job, node="dgx1", slurm_gpus=(), env_comment="", nodes_in_job=1)
    return record_decision(ctx, parse_directive("topology=ring sensitive=yes"), Decision("dgx1", (2, 3), "preserve"), HookConfig(),
                           run, [].append, sleep=lambda seconds: None)


def test_a_gone_job_is_read_alone_and_the_others_from_the_list():
    slurm = FakeSlurm()
    slurm.gone.add("22")
    run = reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["21", "22"])
    assert _record_with(run, "21") and slurm.calls[-1][1] == "update"  # 21 came from the list
    assert _record_with(run, "22")  # gone: read alone, slurmctld says so, and the record is dropped
    assert slurm.calls[-1] == show_job_argv(SCONTROL, "22") and "22" not in slurm.admin
    slurm.gone.add("21")
    assert reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["21", "22"]) is slurm  # none known: each alone


class Failing(FakeSlurm):
    def __init__(self, answer) -> None:
        super().__init__()
        self.answer = answer

    def __call__(self, argv, *args, **kwargs):
        if argv[0] == SQUEUE:
            self.calls.append(list(argv))
            if isinstance(self.answer, CommandFailed):
                raise self.answer
            return self.answer
        return super().__call__(argv, *args, **kwargs)


def test_an_unanswered_list_fails_each_read_without_asking_again():
    slurm = Failing(CommandFailed("squeue: error: Unable to contact slurm controller (connect failure)"))
    run = reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["31", "32"])
    assert not _record_with(run, "31") and not _record_with(run, "32")  # both wait in the journal
    assert len(slurm.calls) == 1


@pytest.mark.parametrize("answer", ["not json", '{"jobs": 3}', '{"jobs": [], "errors": [{"error": "x"}]}', "[" * 100_000,
                                    '{"jobs": [{"job_id": 41, "gres_detail": []}]}',  # no AdminComment
                                    '{"jobs": [{"job_id": 41, "admin_comment": ""}]}'])  # no gres_detail
def test_an_answer_that_cannot_be_read_leaves_each_job_to_its_own_read(answer):
    slurm = Failing(answer)
    run = reading_jobs_at_once(slurm, SQUEUE, SCONTROL, ["41", "42"])
    assert _record_with(run, "41") and _record_with(run, "42")
    assert [call for call in slurm.calls if call[0] == SCONTROL and call[1] == "--json"] == [
        show_job_argv(SCONTROL, "41"), show_job_argv(SCONTROL, "42")]
