"""What the TaskProlog trusts when it decides that the SPANK plugin had the task isolated: only the
agent's root-owned record of the task process (isolation/task_records.py), never the variables a
user can set in their own environment (srun and sbatch pass it on), MAPA_SPANK_ISOLATION and
MAPA_SPANK_GPUS included."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from fake_node import USER, node  # noqa: F401 - node: the fixture
from test_isolation import TASK_START, CannedAgent, _as_spank_then_taskprolog, run_taskprolog, task_record

from slurm_mapa.slurm import trusted_files
from slurm_mapa.slurm.agent import client as agent_client
from slurm_mapa.slurm.agent.server import LOG_BURST
from slurm_mapa.slurm.isolation import task_records
from slurm_mapa.slurm.isolation.task_records import TaskRecord, TaskRecords, parse_record, start_time_of, tasks_dir_of

CLAIM_LINE = "claimed SPANK isolation that the agent did not record"
# What a user can put in their own environment before srun or sbatch.
USER_SET = {"MAPA_SPANK_ISOLATION": "cgroup-v1", "MAPA_SPANK_GPUS": "0"}


class RecordingAgent(CannedAgent):
    """Answers ``answer`` and keeps each request's variables."""

    def __init__(self, answer):
        super().__init__(answer)
        self.requests = []

    def isolate(self, pid, uid, env, public=False):
        self.requests.append(dict(env))
        return super().isolate(pid, uid, env, public)


def write_stat(proc: Path, pid: int, start: str, name: str = "slurmstepd") -> None:
    """/proc/PID/stat of a process named ``name`` that started at ``start`` (field 22)."""
    fields = ["S", "1", *["0"] * 17, start, "0"]
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")


def log_lines(tmp_path: Path) -> list[str]:
    log = tmp_path / "log"
    return log.read_text().splitlines() if log.exists() else []


# --- (a) the user's own variables ------------------------------------------------------------------
def test_user_set_spank_variables_do_not_let_a_task_run_in_fail_closed_mode(tmp_path):
    closed = run_taskprolog(tmp_path, "fail-closed", None, socket_there=False, **USER_SET)
    assert closed.returncode == 1, closed.stdout
    assert "export MAPA_ISOLATION=cgroup-v1" not in closed.stdout.splitlines()
    assert "no mapa-agent answered" in closed.stdout


def test_user_set_spank_variables_leave_a_fail_open_task_said_unisolated(tmp_path):
    opened = run_taskprolog(tmp_path, "fail-open", None, socket_there=False, **USER_SET)
    lines = opened.stdout.splitlines()
    assert opened.returncode == 0 and "export MAPA_ISOLATION=failed-open" in lines, opened.stdout
    assert not [line for line in lines if line.startswith(("export MAPA_ISOLATION=cgroup", "export MAPA_ISOLATED_GPUS"))]
    # Numbered as the node's indices (nothing is isolated), and the variables go all the same.
    assert {"export CUDA_VISIBLE_DEVICES=6,2,3", "unset MAPA_SPANK_ISOLATION", "unset MAPA_SPANK_GPUS"} <= set(lines)


def test_user_set_spank_variables_make_the_taskprolog_ask_and_say_so(tmp_path):
    agent = RecordingAgent("done cgroup-v1 gpus=2,3,6 job 55 step batch task pid 1: GPUs 2,3,6 in /x")
    done = run_taskprolog(tmp_path, "fail-closed", None, agent=agent, **USER_SET)
    assert done.returncode == 0 and agent.requests == [{"SLURM_JOB_ID": "55", "MAPA_SPANK_CLAIM": "1"}], done.stdout
    # A user's own MAPA_SPANK_CLAIM, with nothing claimed: not sent.
    run_taskprolog(tmp_path, "fail-closed", None, agent=agent, MAPA_SPANK_CLAIM="1")
    # The plugin's "off" claims no isolation.
    run_taskprolog(tmp_path, "fail-closed", None, agent=agent, MAPA_SPANK_ISOLATION="off")
    assert agent.requests[1:] == [{"SLURM_JOB_ID": "55"}, {"SLURM_JOB_ID": "55"}]


# --- (b) the agent's record of the task ----------------------------------------------------------------
def test_a_record_of_the_task_skips_the_request_and_its_state_is_exported(tmp_path):
    agent = RecordingAgent("error should not be asked")
    done = run_taskprolog(tmp_path, "fail-closed", None, agent=agent, record=task_record(state="cgroup-v2"),
                          MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and agent.requests == [], done.stdout
    # The record's state, not the variable's.
    assert "export MAPA_ISOLATION=cgroup-v2" in lines and "export MAPA_ISOLATION=cgroup-v1" not in lines
    assert {"export MAPA_ISOLATED_GPUS=2,3,6", "export CUDA_VISIBLE_DEVICES=2,0,1"} <= set(lines)


def test_a_record_without_the_variables_is_enough(tmp_path):
    """The record decides; the variables may be missing (a job that unset them for its steps)."""
    done = run_taskprolog(tmp_path, "fail-closed", None, socket_there=False, record=task_record(gpus="none"))
    assert done.returncode == 0 and "export MAPA_ISOLATED_GPUS=" in done.stdout.splitlines(), done.stdout


def test_a_record_with_task_scope_still_asks_without_a_claim(tmp_path):
    agent = RecordingAgent("done cgroup-v1 gpus=6 job 55 step batch ...")
    done = run_taskprolog(tmp_path, "fail-closed", None, agent=agent, scope="task", record=task_record(),
                          MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    assert done.returncode == 0 and agent.requests == [{"SLURM_JOB_ID": "55"}], done.stdout


# --- (c) a record that is not this task's ---------------------------------------------------------------
@pytest.mark.parametrize("record", [
    task_record(job="56"),  # another job's
    task_record(job="5"),
    task_record(job="555"),
    task_record(step="0"),  # another step's (this task is in step_batch)
    task_record(start=str(int(TASK_START) + 1)),  # another process that had this pid
    task_record(start=TASK_START + "0"),
    task_record(state="off"),
    task_record(state="failed-open"),
    task_record(gpus=""),
    task_record(gpus=",2"),
    task_record(gpus="2,,3"),
    task_record(gpus="2 3"),
    task_record().replace("\n", " extra\n"),
    "x" + task_record(),
    task_record().replace("MAPA1 ", ""),
    task_record().replace(" step=", "  step="),
    "",
])
def test_a_record_naming_another_job_step_or_start_time_is_ignored(tmp_path, record):
    done = run_taskprolog(tmp_path, "fail-closed", None, socket_there=False, record=record,
                          MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    assert done.returncode == 1, done.stdout
    assert "export MAPA_ISOLATION=cgroup" not in done.stdout and "MAPA_ISOLATED_GPUS" not in done.stdout


def test_the_same_record_for_this_task_is_trusted(tmp_path):
    """The control of the test above: what it changes is what makes those records fail."""
    done = run_taskprolog(tmp_path, "fail-closed", None, socket_there=False, record=task_record(),
                          MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    assert done.returncode == 0 and "export MAPA_ISOLATION=cgroup-v1" in done.stdout.splitlines(), done.stdout


def test_a_record_that_names_another_job_is_answered_by_the_agent_with_a_claim(tmp_path):
    agent = RecordingAgent("done cgroup-v1 gpus=6 job 55 step batch ...")
    done = run_taskprolog(tmp_path, "fail-closed", None, agent=agent, record=task_record(job="56"),
                          MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="2,3,6")
    assert done.returncode == 0 and agent.requests == [{"SLURM_JOB_ID": "55", "MAPA_SPANK_CLAIM": "1"}], done.stdout
    assert "export MAPA_ISOLATED_GPUS=6" in done.stdout.splitlines()


# --- (d) the agent writes the record and removes it ---------------------------------------------------
def spank_request(agent, proc, step="0"):
    """The test process as the task itself, asking as root with the step's GPUs (the SPANK plugin)."""
    as_spank, _ = _as_spank_then_taskprolog(proc, step, "0")
    as_spank()
    write_stat(proc.root, os.getpid(), TASK_START)
    return agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": "0,1"})


def test_the_agent_records_the_plugins_task_and_the_taskprolog_trusts_it(node):
    agent, proc, _, _, _, tmp_path = node
    records = tmp_path / "iso" / "tasks"
    agent.task_records = TaskRecords(records, proc=proc.root)
    answer = spank_request(agent, proc)
    assert answer.startswith("done cgroup-v1 gpus=4,5 job 12 step 0"), answer
    record = records / str(os.getpid())
    assert record.read_text() == f"MAPA1 job=12 step=0 start={TASK_START} state=cgroup-v1 gpus=4,5\n"
    assert (stat.S_IMODE(records.stat().st_mode), stat.S_IMODE(record.stat().st_mode)) == (0o755, 0o644)
    assert records.stat().st_uid == record.stat().st_uid == os.geteuid()
    # That record, read by the task's TaskProlog: no request, the record's GPUs.
    agent_there = RecordingAgent("error should not be asked")
    (tmp_path / "run").mkdir()
    done = run_taskprolog(tmp_path / "run", "fail-closed", None, agent=agent_there, record=record.read_text(), job_file=None,
                          SLURM_JOB_ID="12", SLURM_STEP_ID="0", MAPA_SPANK_ISOLATION="cgroup-v1", MAPA_SPANK_GPUS="4,5")
    assert done.returncode == 0 and agent_there.requests == [], done.stdout
    assert {"export MAPA_ISOLATION=cgroup-v1", "export MAPA_ISOLATED_GPUS=4,5"} <= set(done.stdout.splitlines())


def test_no_record_for_a_taskprolog_or_an_earlier_plugin_or_without_isolation(node):
    agent, proc, _, _, configure, tmp_path = node
    records = tmp_path / "iso" / "tasks"
    agent.task_records = TaskRecords(records, proc=proc.root)
    write_stat(proc.root, os.getpid(), TASK_START)
    assert agent.isolate(os.getpid(), USER, {}).startswith("done cgroup-v1")  # a TaskProlog's request
    as_spank, _ = _as_spank_then_taskprolog(proc, "0", "0")
    as_spank()
    assert agent.isolate(os.getpid(), 0, {}).startswith("done cgroup-v1")  # a plugin without MAPA_STEP_ENV
    configure("off")
    assert agent.isolate(os.getpid(), 0, {"MAPA_STEP_ENV": "1", "SLURM_STEP_GPUS": "0,1"}) == "done off"
    assert not records.exists() or not list(records.iterdir())


def test_the_jobs_end_removes_its_records_and_no_others(node, monkeypatch):
    agent, proc, _, _, _, tmp_path = node
    monkeypatch.setattr("slurm_mapa.slurm.isolation.cgroups.release_job", lambda job_id, *args: [])  # no host cgroups
    records = tmp_path / "iso" / "tasks"
    agent.task_records = TaskRecords(records, proc=proc.root)
    assert spank_request(agent, proc).startswith("done cgroup-v1")
    (records / "7777").write_text(task_record(job="13", step="0"))
    agent.run_hook("epilog", {"SLURM_JOB_ID": "12"}, lambda: True)
    assert sorted(path.name for path in records.iterdir()) == ["7777"]


def test_the_periodic_pass_removes_the_records_of_gone_processes(node):
    agent, proc, _, _, _, tmp_path = node
    records = tmp_path / "iso" / "tasks"
    agent.task_records = TaskRecords(records, proc=proc.root, clock=lambda: 1e10)
    assert spank_request(agent, proc).startswith("done cgroup-v1")
    write_stat(proc.root, 7001, "100")
    write_stat(proc.root, 7002, "200")
    (records / "7001").write_text(task_record(job="12", step="0", start="100"))  # alive
    (records / "7002").write_text(task_record(job="12", step="0", start="150"))  # its pid is another process now
    (records / "7003").write_text(task_record(job="12", step="0", start="300"))  # gone
    (records / "7004").write_text("garbage\n")
    (records / ".7005.abc.tmp").write_text("")  # an interrupted write, long ago by the clock
    assert agent.sweep_task_records() == 4
    assert sorted(path.name for path in records.iterdir()) == sorted([str(os.getpid()), "7001"])
    # A fresh temporary file stays (a write may be under way).
    fresh = TaskRecords(records, proc=proc.root)
    (records / ".7006.abc.tmp").write_text("")
    assert fresh.remove_gone() == 0


def test_a_pass_reads_a_bounded_number_of_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(task_records, "MAX_SCANNED", 3)
    records = tmp_path / "tasks"
    records.mkdir()
    for pid in range(9001, 9011):
        (records / str(pid)).write_text(task_record(start="1"))
    assert TaskRecords(records, proc=tmp_path / "no-proc").remove_gone() == 3
    assert len(list(records.iterdir())) == 7


def test_a_directory_root_does_not_own_gets_no_record_and_is_not_cleaned(node):
    agent, proc, _, _, _, tmp_path = node
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    records = tmp_path / "iso" / "tasks"
    records.mkdir(parents=True)
    os.chown(records, 1000, 1000)
    agent.task_records = TaskRecords(records, proc=proc.root)
    assert spank_request(agent, proc).startswith("done cgroup-v1")  # the task is isolated all the same
    assert list(records.iterdir()) == []
    assert any("could not record task" in line for line in log_lines(tmp_path))
    (records / "7003").write_text(task_record())
    assert agent.task_records.remove_gone() == 0 and agent.task_records.remove_job("55") == 0


def test_a_group_writable_directory_or_a_symlink_is_refused(tmp_path):
    proc = tmp_path / "proc"
    write_stat(proc, 4242, "77")
    loose = tmp_path / "loose" / "tasks"
    loose.mkdir(parents=True)
    os.chmod(loose, 0o775)
    with pytest.raises(trusted_files.UnsafePath):
        TaskRecords(loose, proc=proc).write(4242, "12", "0", "cgroup-v1", (4,))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "tasks").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(trusted_files.UnsafePath):
        TaskRecords(tmp_path / "linked" / "tasks", proc=proc).write(4242, "12", "0", "cgroup-v1", (4,))
    assert list((tmp_path / "elsewhere").iterdir()) == []


# --- (e) the claim is logged ------------------------------------------------------------------------------
def test_a_claim_without_a_record_is_logged_at_a_bounded_rate(node):
    agent, _, _, _, _, tmp_path = node
    plain = agent.isolate(os.getpid(), USER, {}, public=True)
    assert not [line for line in log_lines(tmp_path) if CLAIM_LINE in line]
    claimed = agent.isolate(os.getpid(), USER, {"MAPA_SPANK_CLAIM": "1"}, public=True)
    assert claimed == plain  # it decides nothing
    for _ in range(50):
        agent.isolate(os.getpid(), USER, {"MAPA_SPANK_CLAIM": "1"}, public=True)
    claims = [line for line in log_lines(tmp_path) if CLAIM_LINE in line]
    assert 1 <= len(claims) <= LOG_BURST, claims
    assert f"task of process {os.getpid()} (uid {USER}) {CLAIM_LINE}" in claims[0]


def test_root_never_claims(node):
    agent, proc, _, _, _, tmp_path = node
    as_spank, _ = _as_spank_then_taskprolog(proc, "0", "0")
    as_spank()
    agent.isolate(os.getpid(), 0, {"MAPA_SPANK_CLAIM": "1"})
    assert not [line for line in log_lines(tmp_path) if CLAIM_LINE in line]


def test_the_claim_is_a_key_the_isolate_request_may_carry():
    request = agent_client.request_bytes(agent_client.ISOLATE, {"SLURM_JOB_ID": "55", "MAPA_SPANK_CLAIM": "1", "PATH": "/bin"})
    assert request.endswith(b"SLURM_JOB_ID=55\0MAPA_SPANK_CLAIM=1")


# --- the record's format ------------------------------------------------------------------------------------
def test_the_start_time_is_read_after_the_last_parenthesis(tmp_path):
    write_stat(tmp_path, 4242, "123456", name="a) b (c) 9 9")
    assert start_time_of(tmp_path, 4242) == "123456"
    (tmp_path / "4243").mkdir()
    (tmp_path / "4243" / "stat").write_text("4243 (x) S 1 2\n")
    with pytest.raises(ValueError):
        start_time_of(tmp_path, 4243)
    with pytest.raises(OSError):
        start_time_of(tmp_path, 4244)
    me = start_time_of(Path("/proc"), os.getpid())  # the kernel's own format
    assert me.isdigit() and me == Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(") ", 1)[1].split()[19]


def test_records_are_read_back_exactly_or_not_at_all():
    record = TaskRecord("12", "0+1", "99", "cgroup-v2", (4, 5))
    assert record.line() == "MAPA1 job=12 step=0+1 start=99 state=cgroup-v2 gpus=4,5\n"
    assert parse_record(record.line()) == record
    assert parse_record(TaskRecord("12", "batch", "99", "cgroup-v1", ()).line()).gpus == ()
    for bad in (record.line().rstrip("\n"), record.line() + "\n", record.line().replace("step=0+1", "step=x"),
                record.line().replace("gpus=4,5", "gpus=4,5,"), record.line().upper()):
        assert parse_record(bad) is None, bad
    with pytest.raises(ValueError):
        TaskRecord("12", "0 start=1", "99", "cgroup-v1", ()).line()


def test_the_records_live_beside_the_public_socket():
    assert tasks_dir_of(agent_client.ISOLATE_SOCKET) == Path("/run/slurm-mapa-isolate/tasks")
