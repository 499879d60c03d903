"""The job-start path asks slurmctld nothing (issue: keep slurmctld off the start path).

With job_submit.lua installed the directive reaches the Prolog in SLURM_JOB_COMMENT; which jobs
still run is learnt by mapa-agent's reconcile pass; the AdminComment record goes through an
on-disk journal that the agent writes later, retrying until slurmctld answers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from slurm_mapa.slurm.node_state import journal
from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.agent.background import Background
from slurm_mapa.slurm.text.commands import CommandFailed
from slurm_mapa.slurm.text.decision import parse_decisions
from slurm_mapa.slurm.hooks.epilog import run_epilog
from slurm_mapa.slurm.hooks.prolog import run_prolog
from slurm_mapa.slurm.node_state import NodeState

from fake_slurm import FakeSlurm, env_for


class NoSlurm:
    """A Slurm that fails the test when anything calls it."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        raise AssertionError(f"the start path called {argv}")


def write_config(tmp_path: Path, **extra) -> Path:
    lines = [f'ledger = "{tmp_path}/state/ledger.json"', f'jobs_dir = "{tmp_path}/jobs"', f'log = "{tmp_path}/log"', 'health = "off"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    path = tmp_path / "mapa.toml"
    path.write_text("\n".join(lines) + '\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    return path


def load(path: Path):
    from slurm_mapa.slurm.config import config_from_text

    return config_from_text(path.read_text(), str(path))


@pytest.mark.parametrize("comment", ["mapa:topology=ring sensitive=yes", "sweep 4 [mapa:topology=ring sensitive=yes]", "", "just notes"])
def test_with_job_submit_lua_the_prolog_and_epilog_call_no_slurm_command(tmp_path, comment):
    config = load(write_config(tmp_path, job_submit_lua=True))
    slurm, logs = NoSlurm(), []
    deferred: list = []
    decision = run_prolog(env_for("11", "0,1,2,3", comment), config, slurm, logs.append, defer=deferred.append)
    run_epilog({"SLURM_JOB_ID": "11"}, config, logs.append)
    assert slurm.calls == [] and not [line for line in logs if "error" in line.lower()]
    entry = journal.parse_entry((config.journal / "11").read_bytes())
    assert entry.node == "dgx1" and parse_decisions(entry.record)["dgx1"].gpus == decision.gpus
    sensitive = "mapa" in comment
    assert entry.record.startswith(f"mapa:topology=ring sensitive={'yes' if sensitive else 'no'} # dgx1=")


def test_without_the_plugin_at_most_one_call_remains_the_batch_script(tmp_path):
    config = load(write_config(tmp_path))
    slurm, logs = FakeSlurm(), []
    slurm.scripts["12"] = "#!/bin/bash\n#MAPA topology=ring sensitive=yes\nsrun ./app\n"
    run_prolog(env_for("12", "0,1"), config, slurm, logs.append, defer=lambda action: None)
    assert slurm.calls == [["/usr/bin/scontrol", "write", "batch_script", "12", "-"]]
    assert "sensitive=yes" in (config.journal / "12").read_text()


def test_records_wait_in_the_journal_through_an_outage_and_an_agent_restart(tmp_path):
    path = write_config(tmp_path, job_submit_lua=True)
    config = load(path)
    run_prolog(env_for("21", "0,1", "mapa:sensitive=yes"), config, NoSlurm(), [].append, defer=lambda action: None)
    run_prolog(env_for("22", "2", "notes"), config, NoSlurm(), [].append, defer=lambda action: None)

    class Down(FakeSlurm):
        def __call__(self, argv):
            self.calls.append(list(argv))
            raise CommandFailed("scontrol: error: Unable to contact slurm controller (connect failure)")

    down = Down()
    first = Background(Agent(str(path), [].append, run=lambda timeout: down), "dgx1")
    assert first.flush_records() == 0 and len(down.calls) == 1  # both jobs in one read, unanswered
    assert sorted(p.name for p in config.journal.iterdir()) == ["21", "22"]
    assert first.flush_records() == 0 and len(down.calls) == 1  # backing off: not asked again at once
    up = FakeSlurm()
    restarted = Background(Agent(str(path), [].append, run=lambda timeout: up), "dgx1")  # the agent restarted
    assert restarted.flush_records() == 2
    assert list(config.journal.iterdir()) == []
    assert parse_decisions(up.admin["21"])["dgx1"].policy == "preserve" and up.admin["21"].startswith("mapa:topology=ring sensitive=yes #")
    assert up.admin["22"].startswith("mapa:topology=ring sensitive=no # dgx1=")


def test_the_agent_writes_records_at_a_bounded_rate(tmp_path):
    path = write_config(tmp_path, job_submit_lua=True, admin_comment_rate=20)
    config = load(path)
    for job in range(30, 36):
        run_prolog(env_for(str(job), str(job - 30), "mapa:"), config, NoSlurm(), [].append, defer=lambda action: None)
    up = FakeSlurm()
    background = Background(Agent(str(path), [].append, run=lambda timeout: up), "dgx1")
    started = time.monotonic()
    assert background.flush_records() == 6
    assert time.monotonic() - started >= 5 / 20  # six writes at 20 per second


def test_a_newer_record_written_while_the_older_is_sent_is_kept(tmp_path):
    config = load(write_config(tmp_path, job_submit_lua=True))
    config.journal.mkdir(parents=True, mode=0o700)
    older = journal.Entry("dgx1", 1, "mapa:topology=ring sensitive=no # dgx1=0 policy=preserve")
    newer = journal.Entry("dgx1", 1, "mapa:topology=ring sensitive=no # dgx1=1 policy=preserve")
    journal.write(config.journal, "5", older)
    assert journal.take(config.journal, "5") == older
    journal.write(config.journal, "5", newer)  # the job's Prolog ran again meanwhile
    journal.finish(config.journal, "5", done=False)  # the older failed: it must not replace the newer
    assert journal.parse_entry((config.journal / "5").read_bytes()) == newer
    assert [p.name for p in config.journal.iterdir()] == ["5"]
    journal.write(config.journal, "6", older)
    assert journal.take(config.journal, "6") == older  # then the agent stops mid-write
    journal.recover(config.journal)
    assert sorted(p.name for p in config.journal.iterdir()) == ["5", "6"]


@pytest.mark.parametrize("data", [b"", b"node=dgx1 nodes=1\n", b"node=dgx1 nodes=x\nmapa:\n", b"node=a b nodes=1\nmapa:\n",
                                  b"node=dgx1 nodes=1\nmapa:\nextra\n", b"\xff\xfe\n\n", b"node=dgx1 nodes=1\n" + b"x" * 20000 + b"\n"])
def test_journal_entries_are_parsed_strictly(data):
    with pytest.raises(ValueError):
        journal.parse_entry(data)


def test_an_unreadable_journal_entry_is_dropped_not_retried_for_ever(tmp_path):
    path = write_config(tmp_path, job_submit_lua=True)
    config = load(path)
    config.journal.mkdir(parents=True, mode=0o700)
    (config.journal / "7").write_bytes(b"\xff garbage")
    up = FakeSlurm()
    assert Background(Agent(str(path), [].append, run=lambda timeout: up), "dgx1").flush_records() == 0
    assert list(config.journal.iterdir()) == [] and up.calls == []


def test_the_in_process_prolog_without_an_agent_still_records_and_reconciles_when_due(tmp_path):
    config = load(write_config(tmp_path, job_submit_lua=True, reconcile_interval=5))
    slurm, logs = FakeSlurm(), []
    slurm.running = {"41"}
    run_prolog(env_for("41", "0", "mapa:"), config, slurm, logs.append)  # no agent: no defer
    assert "dgx1=" in slurm.admin["41"] and list(config.journal.iterdir()) == []
    assert [c for c in slurm.calls if "squeue" in c[0]]  # no pass had run: this Prolog ran one
    slurm.calls.clear()
    NodeState.of(config).touch_reconciled()
    slurm.running.add("42")
    run_prolog(env_for("42", "1", "mapa:"), config, slurm, logs.append)
    assert not [c for c in slurm.calls if "squeue" in c[0]]  # a pass ran less than reconcile_interval ago


def test_a_record_for_a_job_that_already_finished_is_dropped_not_retried(tmp_path):
    """slurmctld refuses AdminComment updates of finished jobs; a job of a few milliseconds ends
    before the agent writes its record: the record stays in the node's log, the journal forgets it."""
    path = write_config(tmp_path, job_submit_lua=True)
    config = load(path)
    run_prolog(env_for("61", "0", "mapa:"), config, NoSlurm(), [].append, defer=lambda action: None)

    class Finished(FakeSlurm):
        def __call__(self, argv):
            if argv[1] == "update":
                self.calls.append(list(argv))
                raise CommandFailed("/usr/bin/scontrol update job=61 exited 1: Job has already finished for job 61")
            return super().__call__(argv)

    slurm = Finished()
    background = Background(Agent(str(path), [].append, run=lambda timeout: slurm), "dgx1")
    assert background.flush_records() == 1 and list(config.journal.iterdir()) == []
    assert "job 61: the AdminComment can no longer be written" in (tmp_path / "log").read_text()


def test_the_agent_writes_dcgm_job_mapping_with_mapas_gpus(tmp_path):
    mapping = tmp_path / "dcgm"
    path = write_config(tmp_path, job_submit_lua=True, dcgm_job_mapping_dir=str(mapping))
    config = load(path)
    background = Background(Agent(str(path), [].append, run=lambda timeout: NoSlurm()), "dgx1")
    assert background.write_dcgm_mapping() == [str(gpu) for gpu in range(8)]  # every GPU, no job yet: empty files
    first = run_prolog(env_for("41", "0,1", "mapa:sensitive=yes"), config, NoSlurm(), [].append, defer=lambda action: None)
    second = run_prolog(env_for("42", "2,3,4,5", "mapa:sensitive=yes"), config, NoSlurm(), [].append, defer=lambda action: None)
    background.write_dcgm_mapping()
    files = {p.name: p.read_text() for p in mapping.iterdir()}
    assert files == {str(gpu): "".join(f"{job}\n" for job, gpus in (("41", first.gpus), ("42", second.gpus)) if gpu in gpus)
                     for gpu in range(8)}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in mapping.iterdir())
    run_epilog({"SLURM_JOB_ID": "41"}, config, [].append)
    assert sorted(background.write_dcgm_mapping(), key=int) == sorted(map(str, first.gpus), key=int)
    assert all((mapping / str(gpu)).read_text() == "" for gpu in first.gpus)


def test_a_dcgm_mapping_directory_problem_is_logged_once_not_every_second(tmp_path):
    """Security round 3 (low): a mapping directory others may write is refused, but said once."""
    import os

    mapping = tmp_path / "dcgm"
    mapping.mkdir()
    os.chmod(mapping, 0o777)
    path = write_config(tmp_path, job_submit_lua=True, dcgm_job_mapping_dir=str(mapping))
    errors: list[str] = []
    background = Background(Agent(str(path), errors.append, run=lambda timeout: NoSlurm()), "dgx1")
    for _ in range(30):  # the records loop's turns: one a second
        assert background.write_dcgm_mapping() == []
    assert len(errors) == 1 and "writable by group or others" in errors[0], errors
    assert list(mapping.iterdir()) == []
    os.chmod(mapping, 0o755)
    assert len(background.write_dcgm_mapping()) == 8
    assert len(errors) == 2 and "solved" in errors[1], errors


def test_a_record_of_a_job_whose_epilog_the_agent_ran_is_not_sent(tmp_path):
    """slurmctld refuses an AdminComment update once the job has finished ("Job has already
    finished"): a record still waiting when the agent ran the job's Epilog costs no RPC; a requeued
    job (its Prolog again) is sent as any other."""
    path = write_config(tmp_path, job_submit_lua=True)
    config = load(path)
    up = FakeSlurm()
    agent = Agent(str(path), [].append, run=lambda timeout: up)
    run_prolog(env_for("41", "0", "mapa:"), config, NoSlurm(), [].append, defer=lambda action: None)
    agent.run_hook("epilog", {"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "dgx1"}, still_wanted=lambda: True)
    assert agent.has_ended("41") and not agent.has_ended("42")
    background = Background(agent, "dgx1")
    assert background.flush_records() == 1 and up.calls == [] and list(config.journal.iterdir()) == []
    assert "job 41: ended before its AdminComment record was written; the decision stays in this node's log only" in (
        Path(config.log).read_text())
    agent.run_hook("prolog", env_for("41", "0", "mapa:"), still_wanted=lambda: True, defer=lambda action: None)
    assert not agent.has_ended("41")


def test_the_agent_reuses_a_config_load_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """load_hook_config keeps a load CONFIG_REUSE_S at most, and not past an edit, a chmod or a
    rename over the file; an unusable config is read afresh every time."""
    from slurm_mapa.slurm import config as config_module
    from slurm_mapa.slurm.config import load_hook_config

    path = write_config(tmp_path)
    env = {"MAPA_CONFIG": str(path)}
    first = load_hook_config(env)
    assert first[1] == "" and load_hook_config(env) is first
    path.write_text(path.read_text() + "\n")  # an edit (size and mtime change)
    second = load_hook_config(env)
    assert second is not first and load_hook_config(env) is second
    os.chmod(path, 0o664)
    refused = load_hook_config(env)
    assert refused[1].startswith("bad-config: refused the config") and load_hook_config(env) is not refused
    os.chmod(path, 0o644)
    third = load_hook_config(env)
    assert third[1] == "" and third is not second
    monkeypatch.setattr(config_module, "CONFIG_REUSE_S", 0.0)
    assert load_hook_config(env) is not third  # past the reuse time: read again


def test_a_multi_node_jobs_prolog_writes_its_record_before_the_job_starts_agent_or_not(tmp_path):
    """Written after the start, a short multi-node job could end before a node put back the record
    another node's write had dropped (slurmctld takes no update of a finished job): each node's
    Prolog settles the AdminComment itself, even with mapa-agent's journal at hand."""
    config = load(write_config(tmp_path, job_submit_lua=True))
    slurm, deferred = FakeSlurm(), []
    slurm.admin["31"] = "mapa:topology=ring sensitive=yes # summit1=0,1 policy=preserve"  # the other node's, written first
    env = {**env_for("31", "0,1", "mapa:topology=ring sensitive=yes"), "SLURM_JOB_NUM_NODES": "2"}
    decision = run_prolog(env, config, slurm, [].append, defer=deferred.append)
    assert deferred == [] and list(config.journal.iterdir()) == []
    recorded = parse_decisions(slurm.admin["31"])
    assert set(recorded) == {"dgx1", "summit1"} and recorded["dgx1"].gpus == decision.gpus
    # A one-node job's record still waits for the agent, off the start path.
    run_prolog(env_for("32", "2,3", "mapa:topology=ring sensitive=yes"), config, NoSlurm(), [].append, defer=deferred.append)
    assert len(deferred) == 1 and [path.name for path in config.journal.iterdir()] == ["32"]


def test_after_starts_and_ends_the_features_are_published_at_most_once_a_second(tmp_path):
    """Issue 41: under a burst the node's feature updates (slurmctld's node write lock) delayed
    every start; after starts and ends the agent asks slurmctld at most once per
    FEATURES_MIN_GAP_S, and a later turn of the records loop publishes what changed meanwhile.
    The reconcile pass's publication is not held back."""
    from slurm_mapa.slurm.agent.background import FEATURES_MIN_GAP_S

    path = write_config(tmp_path, job_submit_lua=True)
    path.write_text(path.read_text() + "[features]\nsizes = [2, 4]\n")
    now = [1000.0]
    asked: list[tuple] = []
    background = Background(Agent(str(path), [].append, run=lambda timeout: NoSlurm()), "dgx1", clock=lambda: now[0])

    def publish(config, run, log, force=False):  # Publisher.publish: True when slurmctld was asked
        asked.append((now[0], force))
        return True

    background.features.publish = publish
    assert background.publish_features() is True and asked == [(1000.0, False)]
    now[0] += FEATURES_MIN_GAP_S / 2
    assert background.publish_features() is False and len(asked) == 1  # held back: a later turn publishes
    now[0] += FEATURES_MIN_GAP_S / 2
    assert background.publish_features() is True and asked[-1] == (1000.0 + FEATURES_MIN_GAP_S, False)
    background.features.publish = lambda config, run, log, force=False: False  # nothing changed: slurmctld not asked
    now[0] += FEATURES_MIN_GAP_S
    assert background.publish_features() is False
    background.features.publish = publish
    assert background.publish_features() is True  # not held back by a turn that asked nothing
