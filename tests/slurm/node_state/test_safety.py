"""No GPU in two jobs, whatever fails: the Prolog's provisional record, its budget, the marks,
reconciliation with the jobs directory, corrupt ledgers, stuck locks, killed Epilogs, root-side
paths. The randomised end-to-end check is tests/core/test_invariant.py."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.slurm.node_state import job_files as jobfiles
from slurm_mapa.slurm.text.commands import Runner
from slurm_mapa.slurm.config import config_from_text
from slurm_mapa.slurm.hooks.epilog import run_epilog
from slurm_mapa.slurm.hooks.budget import Budget
from slurm_mapa.slurm.hooks.prolog import fallback_gpus, prolog_failing_open, run_prolog
from slurm_mapa.slurm.hooks.reconcile import reconcile_node
from slurm_mapa.slurm.node_state.job_files import JobRecords, Mark, mark_for, mark_path, write_job_file, write_mark
from slurm_mapa.slurm.node_state.ledger import Holding, Ledger, LedgerCorrupt, LedgerFile, ledger_from_json, ledger_to_json, reconcile
from slurm_mapa.slurm.trusted_files import UnsafePath

from fake_slurm import FakeSlurm, env_for


def make_config(tmp_path: Path, **extra: object):
    lines = [f'ledger = "{tmp_path}/state/ledger.json"', f'jobs_dir = "{tmp_path}/jobs"', f'log = "{tmp_path}/log"', 'health = "off"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    return config_from_text("\n".join(lines) + '\n[nodes]\n"dgx*" = "dgx1-v100"\n', "test")


def job_gpus(config, job: str) -> tuple[int, ...]:
    return jobfiles.parse_job_file((config.jobs_dir / job).read_bytes())


def usage(config, slurm_gpus: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """What each live job uses: its job file, else Slurm's indices (the invariant's definition)."""
    return {job: job_gpus(config, job) if (config.jobs_dir / job).exists() else gpus for job, gpus in slurm_gpus.items()}


def assert_disjoint(uses: dict[str, tuple[int, ...]]) -> None:
    seen: dict[int, str] = {}
    for job, gpus in sorted(uses.items()):
        for gpu in gpus:
            assert gpu not in seen, f"GPU {gpu} used by jobs {seen[gpu]} and {job}: {uses}"
            seen[gpu] = job


def fake_command(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# --- the provisional record ---------------------------------------------------------------------


def test_a_safe_choice_is_recorded_before_the_prolog_asks_slurm_anything(tmp_path):
    config = make_config(tmp_path)
    seen_at_first_call: list[tuple[str, Ledger]] = []

    class Watching(FakeSlurm):
        def __call__(self, argv):
            if not seen_at_first_call:
                seen_at_first_call.append(((config.jobs_dir / "12").read_text(), LedgerFile(config.ledger, 8).read()))
            return super().__call__(argv)

    slurm, logs = Watching(), []
    slurm.running = {"11", "12"}
    write_job_file_trusted(config, "11", (0, 1))  # job 11 was moved by MAPA onto Slurm's idea of job 12's GPUs
    slurm.admin["12"] = "mapa:topology=ring sensitive=yes"
    decision = run_prolog(env_for("12", "0,1"), config, slurm, logs.append)
    job_file, ledger = seen_at_first_call[0]
    assert job_file == "MAPA_GPUS=2,3\nSLURM_GPUS=0,1\nPAIRED_GPUS=2,3\n" and ledger.holdings["12"].policy == "provisional"
    assert ledger.holdings["11"].gpus == (0, 1)
    assert not {0, 1} & set(decision.gpus) and job_gpus(config, "12") == decision.gpus


def write_job_file_trusted(config, job: str, gpus: tuple[int, ...]) -> None:
    config.jobs_dir.mkdir(mode=0o755, exist_ok=True)
    write_job_file(config.jobs_dir, job, gpus)


def test_fallback_gpus_share_as_little_as_possible():
    assert fallback_gpus((0, 1), (0, 1, 2)) == (0, 1)
    assert fallback_gpus((0, 1), (1, 2, 5)) == (1, 2)
    # Only one free: it, then the Slurm GPU held by fewest jobs.
    assert fallback_gpus((0, 1), (5,), held=[0, 0, 1, 2]) == (5, 1)
    assert fallback_gpus((3,), (), held=[3, 3, 4]) == (3,)


# --- the budget ---------------------------------------------------------------------------------


def test_hanging_slurm_commands_cannot_hold_the_prolog_past_its_budget(tmp_path):
    hang = fake_command(tmp_path, "hang", "exec sleep 60\n")
    config = make_config(tmp_path, scontrol=hang, squeue=hang, command_timeout=30, prolog_budget=3)
    logs: list[str] = []
    started = time.monotonic()
    decision = run_prolog(env_for("5", "0,1"), config, Runner(timeout=30), logs.append)
    took = time.monotonic() - started
    assert took < 3 + 1.5, f"the Prolog took {took:.1f} s with a 3 s budget"
    assert decision is not None and job_gpus(config, "5") == decision.gpus and len(decision.gpus) == 2
    assert any("budget is spent" in line or "timed out" in line for line in logs)


def test_many_unknown_jobs_and_a_slow_slurm_stay_within_the_reconcile_budget(tmp_path):
    # 40 jobs run here that no Prolog marked (they started before MAPA was enabled); Slurm answers in 2 s.
    ids = " ".join(str(100 + i) for i in range(40))
    squeue = fake_command(tmp_path, "squeue", f"for j in {ids} 7; do echo $j; done\n")
    # `scontrol --json show job ID`: the record of job ID ($4), as Slurm prints it.
    scontrol = fake_command(tmp_path, "scontrol", "sleep 2\necho '{\"jobs\": [{\"job_id\": '\"$4\"', \"gres_detail\": [], \"job_state\": [\"RUNNING\"]}]}'\n")
    config = make_config(tmp_path, scontrol=scontrol, squeue=squeue, command_timeout=5, prolog_budget=8, job_submit_lua=True)
    logs: list[str] = []
    started = time.monotonic()
    run_prolog(env_for("7", "0"), config, Runner(timeout=5), logs.append, defer=lambda action: None)  # as in mapa-agent
    assert time.monotonic() - started < 1.5  # the start path asked Slurm nothing
    started = time.monotonic()
    reconcile_node(config, "dgx1", Runner(timeout=5), logs.append, Budget(8))
    assert time.monotonic() - started < 8 + 1.5
    marked = [p for p in config.jobs_dir.iterdir() if p.name.startswith(".prolog-1")]
    assert 0 < len(marked) < 40  # some were asked about (and are known from now on), the rest left to later passes


def test_budget_cuts_each_step():
    now = [0.0]
    budget = Budget(10, clock=lambda: now[0])
    assert budget.for_step(5) == 5
    now[0] = 7.5
    assert budget.for_step(5) == pytest.approx(1.5)
    now[0] = 9.5
    assert budget.for_step(5) < 0


# --- non-UTF-8 text from Slurm ------------------------------------------------------------------


def test_a_latin1_batch_script_and_job_name_still_get_a_safe_decision(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "script").write_bytes(b"#!/bin/bash\n# Auteur: J\xe9r\xf4me\n#SBATCH --gres=gpu:2\nsrun ./a.out\n")
    (bindir / "job.json").write_bytes(b'{"jobs": [{"job_id": 9, "name": "r\xe9sum\xe9", "admin_comment": "", "batch_flag": true}]}')
    scontrol = fake_command(tmp_path, "scontrol", f'case "$1" in write) cat {bindir}/script ;; --json) cat {bindir}/job.json ;; esac\n')
    squeue = fake_command(tmp_path, "squeue", "echo 9; echo 3\n")
    config = make_config(tmp_path, scontrol=scontrol, squeue=squeue)
    write_job_file_trusted(config, "3", (0,))  # job 3 holds GPU 0, which Slurm gives job 9 as well
    logs: list[str] = []
    decision = run_prolog(env_for("9", "0,1"), config, Runner(timeout=5), logs.append)
    assert decision.policy == "preserve" and 0 not in decision.gpus
    assert usage(config, {"9": (0, 1), "3": (0,)})["9"] == decision.gpus
    assert not any("Traceback" in line for line in logs)


def test_an_unexpected_error_still_leaves_a_safe_job_file(tmp_path, monkeypatch):
    config_path = tmp_path / "mapa.toml"
    config_path.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                           'health = "off"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    config = make_config(tmp_path)
    write_job_file_trusted(config, "3", (4, 5))  # so GPUs 0-5 exist, though the topology cannot be read

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("slurm_mapa.slurm.hooks.prolog.load_graph", broken)
    prolog_failing_open(env_for("9", "4,5"), {"MAPA_CONFIG": str(config_path)}, make_runner=lambda timeout: FakeSlurm())
    log = (tmp_path / "log").read_text()
    assert "internal error" in log and "RuntimeError: a bug" in log
    assert job_gpus(config, "9") == (0, 1)


# --- killed Prologs: marks, shared GPUs, reused pids --------------------------------------------


def test_a_gpu_shared_after_a_killed_prolog_stays_held_until_both_jobs_end(tmp_path):
    config = make_config(tmp_path)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"1", "2", "3"}
    write_job_file_trusted(config, "1", (3, 4))  # MAPA put job 1 on 3,4
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_mark(config.jobs_dir, "2", mark_for(dead.pid, (4, 5)))  # job 2's Prolog was killed: it runs on Slurm's 4,5
    decision = run_prolog(env_for("3", "0,1"), config, slurm, logs.append)
    ledger = LedgerFile(config.ledger, 8).read()
    assert ledger.shared() == {4: ["1", "2"]} and not {3, 4, 5} & set(decision.gpus)
    from slurm_mapa.slurm.admin.status import node_status

    status = node_status(config, "dgx1")
    assert status["shared"] == {"4": ["1", "2"]} and not {3, 4, 5} & set(status["free"])
    run_epilog({"SLURM_JOB_ID": "1"}, config, logs.append)  # job 1 ends; job 2 still uses GPU 4
    slurm.running = {"2", "3", "4"}
    decision = run_prolog(env_for("4", "2,3,6,7"), config, slurm, logs.append)  # Slurm: 4,5 are job 2's, 0,1 job 3's
    assert 4 not in decision.gpus and 5 not in decision.gpus
    assert_disjoint(usage(config, {"2": (4, 5), "3": (0, 1), "4": (2, 3, 6, 7)}))


def test_a_job_whose_slurm_gpus_slurm_gave_again_has_ended_even_when_squeue_fails(tmp_path):
    config = make_config(tmp_path)
    slurm, logs = FakeSlurm(), []
    slurm.broken = {"squeue"}
    write_job_file_trusted(config, "1", (0, 1, 2, 3))  # ended; its Epilog was killed before removing anything
    write_mark(config.jobs_dir, "1", Mark(0, 0, (4, 5, 6, 7)))
    write_job_file_trusted(config, "2", (4, 5))
    write_mark(config.jobs_dir, "2", Mark(0, 0, (0, 1)))  # still runs: Slurm's 0,1 are not given to job 3
    decision = run_prolog(env_for("3", "6,7"), config, slurm, logs.append)  # Slurm gives job 1's 6,7 again
    assert set(decision.gpus) <= {0, 1, 2, 3, 6, 7} and not (config.jobs_dir / "1").exists()
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"2", "3"}


def test_a_since_in_the_future_is_taken_as_now_so_the_entry_can_be_reaped(tmp_path):
    config = make_config(tmp_path)
    config.ledger.parent.mkdir(parents=True)
    LedgerFile(config.ledger, 8).write(Ledger({"5": Holding((0, 1), "preserve", time.time() + 10 ** 6)}))
    write_job_file_trusted(config, "5", (0, 1))
    old = time.time() - 3600
    os.utime(config.jobs_dir / "5", (old, old))
    slurm, logs = FakeSlurm(), []
    slurm.running = {"6"}
    run_prolog(env_for("6", "2"), config, slurm, logs.append)  # clamped when first read
    assert reconcile_node(config, "dgx1", slurm, logs.append)  # so the listing after it reaps it
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"6"}
    assert ledger_from_json(ledger_to_json(Ledger({"5": Holding((0,), "p", 10.0 ** 11)})), 8).holdings["5"].since == 10.0 ** 11
    clamped, _ = reconcile(Ledger({"5": Holding((0,), "p", 10.0 ** 11)}), {"5": JobRecords(gpus=(0,), newest=1.0)}, 8, now=100.0)
    assert clamped.holdings["5"].since == 100.0


def test_a_prolog_run_that_was_taken_over_writes_nothing_more(tmp_path):
    config = make_config(tmp_path)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"5"}

    class TakenOver(FakeSlurm):
        def __call__(self, argv):  # while this run reads the directive, a newer run marks the job
            write_mark(config.jobs_dir, "5", Mark(os.getpid(), 1, (0, 1)))
            return super().__call__(argv)

    slow = TakenOver()
    slow.running = {"5"}
    assert run_prolog(env_for("5", "0,1"), config, slow, logs.append) is None
    assert any("took the job over" in line for line in logs)
    assert LedgerFile(config.ledger, 8).read().holdings["5"].policy == "provisional"


def test_the_in_process_budget_counts_from_the_wrappers_start(tmp_path):
    from slurm_mapa.slurm.hooks.prolog import seconds_since_wrapper_start

    uptime = tmp_path / "uptime"
    uptime.write_text("1000.50 2000.00\n")
    assert seconds_since_wrapper_start({"MAPA_WRAPPER_STARTED": "975.25"}, uptime) == pytest.approx(25.25)
    for bad in ("", "x", "2000", "-3", "1e9", "9" * 40):
        assert seconds_since_wrapper_start({"MAPA_WRAPPER_STARTED": bad}, uptime) == 0.0


def test_process_start_time_tells_a_reused_pid_from_the_prolog():
    me = os.getpid()
    assert jobfiles.mark_is_live(mark_for(me, ()))
    assert not jobfiles.mark_is_live(Mark(me, jobfiles.process_start_time(me) + 1, ()))
    assert not jobfiles.mark_is_live(Mark(0, 0, (1,)))
    assert jobfiles.process_start_time(0) is None


@pytest.mark.parametrize(
    "text",
    [b"", b"pid=1 start=2 slurm=0,1\n", b"pid=1 start=2 slurm=0,1", b"pid=1 start=2 slurm=0-999999999999\n", b"pid=x start=2 slurm=\n",
     b"pid=1 start=2 slurm=\n\n", b"pid=1 start=2 slurm=\xff\n"],
)
def test_marks_parse_strictly(text):
    if text == b"pid=1 start=2 slurm=0,1\n":
        assert jobfiles.parse_mark(text) == Mark(1, 2, (0, 1))
    else:
        with pytest.raises(ValueError):
            jobfiles.parse_mark(text)


# --- reconciliation -----------------------------------------------------------------------------

gpu_sets = st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True).map(lambda g: tuple(sorted(g)))


@settings(max_examples=300, deadline=None)
@given(
    entries=st.dictionaries(
        st.integers(1, 30).map(str),
        st.tuples(st.none() | gpu_sets, st.none() | st.tuples(st.booleans(), st.tuples() | gpu_sets), st.none() | gpu_sets,
                  st.floats(0, 100)),
        max_size=10,
    ),
    running=st.none() | st.sets(st.integers(1, 30).map(str)),
)
def test_reconcile_holds_what_every_job_uses(entries, running):
    """Every job not listed as ended holds at least what it uses (job file, else Slurm's GPUs once
    its Prolog is gone); ended are exactly the jobs without any file and the unlisted jobs with
    records older than the listing."""
    records, holdings, live = {}, {}, set()
    for job, (file_gpus, mark, ledger_gpus, age) in entries.items():
        if file_gpus is not None or mark is not None:
            records[job] = JobRecords(file_gpus, Mark(2 if mark[0] else 0, 1, mark[1]) if mark else None, age)
            if mark and mark[0]:
                live.add(job)
        if ledger_gpus is not None:
            holdings[job] = Holding(ledger_gpus, "preserve", age)
    ledger, ended = reconcile(Ledger(holdings), records, 8, running, 50.0 if running is not None else None,
                              is_live=lambda mark: mark.pid == 2)
    for job in set(records) | set(holdings):
        newest = max(records[job].newest if job in records else 0, holdings[job].since if job in holdings else 0)
        # A ledger entry whose job left no file at all has ended (every job is marked first).
        gone = job not in records or (running is not None and job not in running and newest < 50.0)
        assert (job in ended) == gone
        if gone:
            assert job not in ledger.holdings
            continue
        record = records.get(job)
        if record is not None and record.gpus is not None:
            assert ledger.holdings[job].gpus == record.gpus
        elif record is not None and record.mark is not None and job not in live:
            assert ledger.holdings.get(job, Holding((), "", 0)).gpus == record.mark.slurm_gpus
        elif job in holdings:
            assert ledger.holdings[job] == holdings[job]


BAD_LEDGERS = [
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": null, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": "1", "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1.0], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [true], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [-1], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [99999999999999999999], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1, 1], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": 5, "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": "x", "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": NaN, "note": ""}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": 1, "note": []}}}',
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": 1}}}',
    '{"version": 1, "jobs": {"7\\n": {"gpus": [1], "policy": "p", "since": 1, "note": ""}}}',
    '{"version": 1, "jobs": {"7": []}}',
    '{"version": 1, "jobs": []}',
    '{"version": 2, "jobs": {}}',
    '{"version": 1, "jobs": {}, "extra": 1}',
    "[" * 100000,
    '{"version": 1, "jobs": {"7": {"gpus": [1], "policy": "p", "since": 1, "note": "' + "[" * 50 + '"}}}x',
    "{ torn",
    "",
]


@pytest.mark.parametrize("text", BAD_LEDGERS)
def test_a_ledger_wrong_in_any_field_is_corrupt_and_rebuilt_from_the_jobs_directory(tmp_path, text):
    with pytest.raises(LedgerCorrupt):
        ledger_from_json(text, 8)
    config = make_config(tmp_path)
    write_job_file_trusted(config, "7", (0, 1))
    config.ledger.parent.mkdir(parents=True)
    config.ledger.write_text(text)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"7", "8"}
    decision = run_prolog(env_for("8", "0,1"), config, slurm, logs.append)
    assert not {0, 1} & set(decision.gpus) and any("corrupt" in line for line in logs)
    assert LedgerFile(config.ledger, 8).read().holdings["7"].gpus == (0, 1)


def test_a_deep_but_valid_note_is_not_mistaken_for_nesting():
    ledger = Ledger({"7": Holding((1,), "p", 1.0, "[[[[[[[[[[[[{{{{{{ \"quoted\" \\ "  )})
    assert ledger_from_json(ledger_to_json(ledger), 8) == ledger


def test_a_symlink_in_place_of_the_ledger_is_replaced_never_followed(tmp_path):
    config = make_config(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    config.ledger.parent.mkdir(parents=True)
    config.ledger.symlink_to(victim)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"8"}
    run_prolog(env_for("8", "0,1"), config, slurm, logs.append)
    assert victim.read_text() == "precious\n" and not config.ledger.is_symlink()
    assert "8" in LedgerFile(config.ledger, 8).read().holdings


# --- killed Epilogs and stuck locks -------------------------------------------------------------


def test_files_left_by_killed_epilogs_are_removed_once_slurm_no_longer_lists_the_job(tmp_path):
    config = make_config(tmp_path)
    write_job_file_trusted(config, "5", (0, 1))
    write_mark(config.jobs_dir, "5", Mark(0, 0, (0, 1)))
    write_mark(config.jobs_dir, "6", Mark(0, 0, ()))  # a CPU-only job whose Epilog was killed
    (config.jobs_dir / ".5.abc.tmp").write_text("half")
    old = time.time() - 3600
    for name in ("5", ".prolog-5", ".prolog-6", ".5.abc.tmp"):
        os.utime(config.jobs_dir / name, (old, old))
    slurm, logs = FakeSlurm(), []
    slurm.running = {"8"}
    decision = run_prolog(env_for("8", "0,1"), config, slurm, logs.append)
    assert decision.gpus == (0, 1) or set(decision.gpus) <= set(range(8))
    names = sorted(p.name for p in config.jobs_dir.iterdir())
    assert [n for n in names if not n.startswith(".claim-")] == [".prolog-8", "8"]
    assert [n for n in names if n.startswith(".claim-")] == [f".claim-{g}" for g in sorted(decision.gpus)]  # job 8's own
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"8"}


def hold_lock(config):
    config.ledger.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(config.ledger) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_an_epilog_that_cannot_lock_still_removes_the_job_files(tmp_path, monkeypatch):
    monkeypatch.setattr("slurm_mapa.slurm.hooks.epilog.LOCK_WAIT_S", 0.3)
    config = make_config(tmp_path)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"5"}
    run_prolog(env_for("5", "0,1"), config, slurm, logs.append)
    fd = hold_lock(config)
    try:
        run_epilog({"SLURM_JOB_ID": "5"}, config, logs.append)
    finally:
        os.close(fd)
    assert not (config.jobs_dir / "5").exists() and not mark_path(config.jobs_dir, "5").exists()
    assert "5" in LedgerFile(config.ledger, 8).read().holdings  # kept (safe) until Slurm no longer lists it
    slurm.running = {"6"}
    time.sleep(0.05)
    run_prolog(env_for("6", "2"), config, slurm, logs.append)
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"6"}


def test_an_epilog_that_cannot_lock_leaves_word_that_the_job_ended_even_when_squeue_fails(tmp_path, monkeypatch):
    """Stale entries of ended jobs used to fill the ledger while squeue failed, forcing sharing."""
    monkeypatch.setattr("slurm_mapa.slurm.hooks.epilog.LOCK_WAIT_S", 0.3)
    config = make_config(tmp_path)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"5"}
    run_prolog(env_for("5", "0-7"), config, slurm, logs.append)  # the whole node
    fd = hold_lock(config)
    try:
        run_epilog({"SLURM_JOB_ID": "5"}, config, logs.append)
    finally:
        os.close(fd)
    assert sorted(p.name for p in config.jobs_dir.iterdir()) == [".ended-5"]
    slurm.broken = {"squeue", "scontrol"}
    decision = run_prolog(env_for("6", "0-7"), config, slurm, logs.append)
    assert sorted(decision.gpus) == list(range(8)) and not any("SHARES" in line for line in logs)
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"6"}
    assert not (config.jobs_dir / ".ended-5").exists()


def test_a_requeued_job_clears_the_word_that_its_earlier_run_ended(tmp_path):
    config = make_config(tmp_path)
    config.jobs_dir.mkdir(mode=0o755)
    jobfiles.write_ended(config.jobs_dir, "5")  # its first run's Epilog could not finish
    slurm, logs = FakeSlurm(), []
    slurm.running = {"5"}
    run_prolog(env_for("5", "0,1"), config, slurm, logs.append)
    assert not (config.jobs_dir / ".ended-5").exists() and job_gpus(config, "5")
    run_prolog(env_for("6", "2"), config, slurm, logs.append)
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"5", "6"}


def test_a_commit_never_takes_a_gpu_claimed_after_the_ledger_was_read(tmp_path):
    """A Prolog without the lock claims GPU 0 between a lock holder's read and its write: the
    holder must not write GPU 0 (the claim file decides who has it)."""
    from slurm_mapa.slurm.node_state import ClaimTaken, NodeState

    config = make_config(tmp_path)
    config.jobs_dir.mkdir(mode=0o755)
    config.ledger.parent.mkdir()
    ledger_file = LedgerFile(config.ledger, 8)
    snapshot = Ledger()  # read before the claim
    assert jobfiles.claim(config.jobs_dir, "2", (0,), 1) == (0,)
    with pytest.raises(ClaimTaken):
        NodeState.of(config).commit(ledger_file, snapshot, "1", Holding((0, 1), "preserve", time.time(), ""), [].append)
    assert sorted(p.name for p in config.jobs_dir.iterdir()) == [".claim-0"]  # nothing of job 1's, GPU 1 not kept
    NodeState.of(config).commit(ledger_file, snapshot, "1", Holding((1, 2), "preserve", time.time(), ""), [].append)
    assert {p.name: p.read_text() for p in config.jobs_dir.iterdir() if p.name.startswith(".claim-")} == {
        ".claim-0": "2\n", ".claim-1": "1\n", ".claim-2": "1\n"}


def test_a_prolog_chooses_again_when_a_gpu_is_claimed_between_its_read_and_its_write(tmp_path, monkeypatch):
    from slurm_mapa.slurm.node_state import NodeState

    config = make_config(tmp_path)
    real = NodeState.current
    raced: list[str] = []

    def read_then_lose_the_race(*args, **kwargs):
        result = real(*args, **kwargs)
        if not raced:  # job 2, without the lock, claims Slurm's GPUs of job 1 right after job 1 read the files
            write_mark(config.jobs_dir, "2", mark_for(os.getpid(), (0, 1)))
            raced.extend(jobfiles.claim(config.jobs_dir, "2", (0, 1), 2))
            write_job_file(config.jobs_dir, "2", (0, 1))
        return result

    monkeypatch.setattr(NodeState, "current", read_then_lose_the_race)
    slurm, logs = FakeSlurm(), []
    slurm.running = {"1", "2"}
    # Its client goes away after the provisional record: that record is what the job runs on.
    assert run_prolog(env_for("1", "0,1"), config, slurm, logs.append, still_wanted=lambda: False) is None
    assert raced == [0, 1]
    assert_disjoint({"1": job_gpus(config, "1"), "2": (0, 1)})


def test_a_stuck_lock_still_gives_the_job_gpus_no_job_file_names(tmp_path):
    config = make_config(tmp_path, prolog_budget=2)
    write_job_file_trusted(config, "3", (0, 1))
    fd = hold_lock(config)
    logs: list[str] = []
    try:
        slurm = FakeSlurm()
        slurm.running = {"3", "4"}
        started = time.monotonic()
        run_prolog(env_for("4", "0,1"), config, slurm, logs.append)
        assert time.monotonic() - started < 2 + 1.5
    finally:
        os.close(fd)
    assert not {0, 1} & set(job_gpus(config, "4"))
    assert any("LEDGER LOCK TIMEOUT" in line for line in logs)


def test_without_the_lock_a_prolog_waits_for_a_lock_holder_to_let_its_provisional_gpus_go(tmp_path, monkeypatch):
    """The interleaving CI found: job 2 (Slurm gave it 2,7) was provisionally on 5,7 and its lock
    holder had claimed its final 5,6 and not yet let 7 go when job 3 (Slurm gave it 5), without
    the lock, read the files: nothing free. Job 3 once shared GPU 5 with job 2 at once; it must wait
    until the holder is done, then take 7."""
    config = make_config(tmp_path, prolog_budget=2)
    write_job_file_trusted(config, "1", (0, 1, 2, 3, 4))
    jobfiles.claim(config.jobs_dir, "1", (0, 1, 2, 3, 4), 5)
    write_mark(config.jobs_dir, "2", mark_for(os.getpid(), (2, 7)))
    write_job_file(config.jobs_dir, "2", (5, 7))
    assert jobfiles.claim(config.jobs_dir, "2", (5, 6, 7), 3) == (5, 6, 7)  # provisional 5,7 and final 5,6

    def holder_finishes_the_commit() -> None:
        time.sleep(0.2)
        write_job_file(config.jobs_dir, "2", (5, 6))
        jobfiles.release_claims(config.jobs_dir, "2", keep=(5, 6))

    holder = threading.Thread(target=holder_finishes_the_commit)
    real_locked = LedgerFile.locked

    @contextlib.contextmanager
    def locked(self, timeout=10.0):
        try:
            with real_locked(self, timeout=timeout):
                yield
        except TimeoutError:
            if not holder.is_alive() and holder.ident is None:
                holder.start()  # job 3 is on its own from here: the holder finishes 0.2 s later
            raise

    monkeypatch.setattr(LedgerFile, "locked", locked)
    fd = hold_lock(config)
    logs: list[str] = []
    try:
        slurm = FakeSlurm()
        slurm.running = {"1", "2", "3"}
        run_prolog(env_for("3", "5"), config, slurm, logs.append)
    finally:
        os.close(fd)
        if holder.ident is not None:
            holder.join()
    assert holder.ident is not None, "the Prolog must have gone without the lock"
    assert job_gpus(config, "3") == (7,), logs
    assert_disjoint({job: job_gpus(config, job) for job in ("1", "2", "3")})
    assert not any("SHARES" in line for line in logs), logs


# --- root-side paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["world-writable", "other-owner", "symlink"])
def test_an_untrusted_jobs_directory_is_refused(tmp_path, how):
    config = make_config(tmp_path)
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        config.jobs_dir.symlink_to(tmp_path / "elsewhere")
    else:
        config.jobs_dir.mkdir()
        if how == "world-writable":
            config.jobs_dir.chmod(0o777)
        else:
            os.chown(config.jobs_dir, 12345, 12345)
    with pytest.raises(UnsafePath, match="accepted"):
        run_prolog(env_for("4", "0,1"), config, FakeSlurm(), [].append)
    assert list((tmp_path / "elsewhere").iterdir() if how == "symlink" else config.jobs_dir.iterdir()) == []


def test_an_untrusted_ledger_directory_is_refused(tmp_path):
    config = make_config(tmp_path)
    config.ledger.parent.mkdir(parents=True)
    config.ledger.parent.chmod(0o777)
    with pytest.raises(UnsafePath, match="writable by group or others"):
        with LedgerFile(config.ledger, 8).locked():
            pass


def test_with_a_shared_gpu_the_policy_still_decides_and_never_uses_it(tmp_path):
    """The shared GPU is left out of preserve-ahead's running groups: select() gets disjoint
    groups, so the next job gets a real MAPA choice, not a fallback."""
    config = make_config(tmp_path, policy="preserve-ahead")
    slurm, logs = FakeSlurm(), []
    slurm.running = {"1", "2", "3"}
    write_job_file_trusted(config, "1", (0, 1))
    write_mark(config.jobs_dir, "2", Mark(0, 0, (1, 2)))
    assert Ledger({"1": Holding((0, 1), "p", 0), "2": Holding((1, 2), "slurm", 0)}).running_groups() == ((0,), (2,))
    decision = run_prolog(env_for("3", "3,4"), config, slurm, logs.append)
    assert decision.policy == "preserve-ahead" and not {0, 1, 2} & set(decision.gpus)
    assert any("job 2's Prolog died before choosing" in line and "SHARED with job(s) 1" in line for line in logs)


def test_the_prolog_wrapper_marks_the_job_before_any_python_starts(tmp_path):
    """The shell's mark names the wrapper (live while it runs, dead after) and Slurm's GPUs;
    strange job ids or GPU lists, or a jobs directory that is a symlink, get no mark."""
    from slurm_mapa.slurm.admin.install import _MARK_JOB

    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o755)
    check = ("import sys; from slurm_mapa.slurm.node_state.job_files import parse_mark, mark_is_live; "
             "m = parse_mark(open(sys.argv[1], 'rb').read()); print(m.pid, m.slurm_gpus, mark_is_live(m))")
    script = f"JOBS_DIR={jobs}\n{_MARK_JOB}\n{sys.executable} -c \"{check}\" {jobs}/.prolog-42\necho wrapper $$\n"
    done = subprocess.run(["sh", "-c", script], env={"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,3", "PATH": os.defpath},
                          capture_output=True, text=True, check=True)
    pid, gpus, live = done.stdout.splitlines()[0].split(" ", 1)[0], done.stdout.splitlines()[0], done.stdout.splitlines()[0].endswith("True")
    assert live and "(0, 3)" in gpus and done.stdout.splitlines()[1] == f"wrapper {pid}"
    assert not jobfiles.mark_is_live(jobfiles.parse_mark((jobs / ".prolog-42").read_bytes()))  # the wrapper is gone
    for env in ({"SLURM_JOB_ID": "4x", "SLURM_JOB_GPUS": "0"}, {"SLURM_JOB_ID": "43", "SLURM_JOB_GPUS": "0;rm"}):
        subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_MARK_JOB}"], env=env, check=True)
    (tmp_path / "link").symlink_to(jobs)
    subprocess.run(["sh", "-c", f"JOBS_DIR={tmp_path / 'link'}\n{_MARK_JOB}"], env={"SLURM_JOB_ID": "44", "SLURM_JOB_GPUS": "1"}, check=True)
    assert sorted(p.name for p in jobs.iterdir()) == [".prolog-42"]


def test_the_epilog_wrapper_says_the_job_ended_before_any_python_starts(tmp_path):
    """Even when every Python run of the Epilog is killed, the next Prolog learns the job ended;
    the Prolog wrapper of a requeued job clears it; strange ids or a symlinked directory: nothing."""
    from slurm_mapa.slurm.admin.install import _END_JOB, _MARK_JOB

    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o755)
    for _ in range(2):  # twice: the second finds it there and is quiet
        done = subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_END_JOB}"], env={"SLURM_JOB_ID": "42"}, capture_output=True, check=True)
        assert done.stderr == b""
    assert jobfiles.scan(jobs)[0]["42"].ended
    subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_END_JOB}"], env={"SLURM_JOB_ID": "4;x"}, check=True)
    (tmp_path / "link").symlink_to(jobs)
    subprocess.run(["sh", "-c", f"JOBS_DIR={tmp_path / 'link'}\n{_END_JOB}"], env={"SLURM_JOB_ID": "44"}, check=True)
    assert sorted(p.name for p in jobs.iterdir()) == [".ended-42"]
    subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_MARK_JOB}"], env={"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "1"}, check=True)
    assert sorted(p.name for p in jobs.iterdir()) == [".prolog-42"]
    (jobs / ".ended-43").symlink_to(tmp_path / "nowhere")  # not made by the wrapper, but gone all the same
    subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_MARK_JOB}"], env={"SLURM_JOB_ID": "43", "SLURM_JOB_GPUS": "1"}, check=True)
    assert sorted(p.name for p in jobs.iterdir()) == [".prolog-42", ".prolog-43"]


def test_prologs_without_the_lock_claim_gpus_and_never_take_the_same(tmp_path):
    """The lock is stuck; MAPA jobs hold every job's Slurm GPUs, so each Prolog must take free
    GPUs of its own choosing: the claims keep them apart, and the ledger later takes them in."""
    config = make_config(tmp_path, prolog_budget=2)
    write_job_file_trusted(config, "1", (0, 1, 2, 3))  # MAPA moved job 1 onto Slurm's idea of the new jobs' GPUs
    fd = hold_lock(config)
    results: dict[str, tuple[int, ...]] = {}

    def one(job: str, slurm_gpus: str) -> None:
        slurm = FakeSlurm()
        slurm.running = {"1", "5", "6", "7"}
        run_prolog(env_for(job, slurm_gpus), config, slurm, [].append)
        results[job] = job_gpus(config, job)

    # Slurm: job 1 has 4-7, jobs 5-7 get 0-2, job 9 (later) 3.
    threads = [threading.Thread(target=one, args=(job, gpus)) for job, gpus in (("5", "0"), ("6", "1"), ("7", "2"))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        os.close(fd)
    uses = {"1": (0, 1, 2, 3), **results}
    assert_disjoint(uses)
    claims = sorted(p.name for p in config.jobs_dir.iterdir() if p.name.startswith(".claim-"))
    assert len(claims) == 3 and set(results.values()) <= {(4,), (5,), (6,), (7,)}
    slurm = FakeSlurm()
    slurm.running = {"1", "5", "6", "7", "9"}
    decision = run_prolog(env_for("9", "3"), config, slurm, [].append)  # the lock is free again
    assert_disjoint({**uses, "9": decision.gpus})
    assert decision.policy == "preserve"
    assert {job: h.gpus for job, h in LedgerFile(config.ledger, 8).read().holdings.items() if job != "9"} == uses
    for job in ("5", "6", "7"):
        run_epilog({"SLURM_JOB_ID": job}, config, [].append)
    left = {p.name: p.read_text() for p in config.jobs_dir.iterdir() if p.name.startswith(".claim-")}
    assert left == {f".claim-{g}": "9\n" for g in decision.gpus}  # only the live job 9's


def test_temporary_files_of_killed_writers_go_even_while_squeue_fails(tmp_path):
    config = make_config(tmp_path)
    config.jobs_dir.mkdir(mode=0o755)
    for name in ("..prolog-7.x1.tmp", ".7.y2.tmp", ".claim-3.z3.tmp"):
        (config.jobs_dir / name).write_text("half")
    old = time.time() - 3600
    os.utime(config.jobs_dir / "..prolog-7.x1.tmp", (old, old))
    os.utime(config.jobs_dir / ".7.y2.tmp", (old, old))  # ".claim-3.z3.tmp" is recent: its writer may still run
    slurm, logs = FakeSlurm(), []
    slurm.broken = {"squeue"}
    run_prolog(env_for("8", "0"), config, slurm, logs.append)
    assert sorted(p.name for p in config.jobs_dir.iterdir() if p.name.endswith(".tmp")) == [".claim-3.z3.tmp"]


def test_a_prolog_run_again_without_the_lock_takes_back_its_own_claims(tmp_path):
    """The first run committed GPUs 0,4 (claimed) and was killed; the wrapper's retry cannot get
    the lock. It must take 0,4 back, not share other jobs' GPUs because 0 and 4 look claimed."""
    config = make_config(tmp_path, prolog_budget=2)
    write_job_file_trusted(config, "1", (1, 2, 3, 5, 6, 7))  # another job holds the rest of the node
    for gpu in (1, 2, 3, 5, 6, 7):
        assert jobfiles.claim(config.jobs_dir, "1", (gpu,), 1) == (gpu,)
    assert jobfiles.claim(config.jobs_dir, "9", (0, 4), 2) == (0, 4)  # the first run's claims
    write_job_file(config.jobs_dir, "9", (0, 4))
    fd = hold_lock(config)
    logs: list[str] = []
    try:
        slurm = FakeSlurm()
        slurm.running = {"1", "9"}
        run_prolog(env_for("9", "4,5"), config, slurm, logs.append)
    finally:
        os.close(fd)
    assert job_gpus(config, "9") == (0, 4) and not any("SHARES" in line for line in logs)


def test_searches_left_behind_cannot_pile_up():
    """At most N searches run at once; a Prolog that gets no slot within its budget gives up at
    once with a TimeoutError (and keeps its provisional choice), and a finished search frees its slot."""
    from slurm_mapa.slurm.hooks.budget import search_within

    slots = threading.BoundedSemaphore(2)
    release = threading.Event()
    for _ in range(2):  # two searches outlive their Prologs' budgets
        with pytest.raises(TimeoutError, match="did not finish"):
            search_within(0.05, release.wait, slots)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="earlier jobs still run"):
        search_within(0.2, lambda: 42, slots)
    assert 0.15 < time.monotonic() - started < 3.0
    release.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert search_within(0.5, lambda: 42, slots) == 42
            break
        except TimeoutError:
            time.sleep(0.01)
    with pytest.raises(ZeroDivisionError):
        search_within(0.5, lambda: 1 / 0, slots)  # an error in the search reaches the Prolog, and frees the slot
    assert search_within(0.5, lambda: 7, slots) == 7 and search_within(0.5, lambda: 8, slots) == 8


def test_the_prolog_wrappers_shell_mark_keeps_a_sluid_and_only_a_sluid(tmp_path):
    """Slurm 25.11+ hands the Prolog SLURM_JOB_SLUID; 26.05 names the job's cgroup v2 directory by
    it. The first mark keeps it (mapa-agent finds the job of a task by it); anything else is left out."""
    from slurm_mapa.slurm.admin.install import _MARK_JOB

    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o755)
    for job, sluid, kept in (("51", "sEKNKTV3WPV500", "sEKNKTV3WPV500"), ("52", "sEKNKTV3WPV5I0", ""), ("53", "s$(id)", "")):
        subprocess.run(["sh", "-c", f"JOBS_DIR={jobs}\n{_MARK_JOB}"], env={"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "1",
                                                                         "SLURM_JOB_SLUID": sluid}, check=True)
        assert jobfiles.parse_mark((jobs / f".prolog-{job}").read_bytes()).sluid == kept
