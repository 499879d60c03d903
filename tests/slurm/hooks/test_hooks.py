"""The Prolog / Epilog logic and the ledger, with a strict fake of scontrol and squeue."""

from __future__ import annotations

import json
import os
import time
import subprocess
import threading
from pathlib import Path

import pytest
from repo_paths import REPO
from fake_slurm import FakeSlurm, env_for

from slurm_mapa.core.order import prefix_order
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.text.commands import CommandFailed, parse_gpu_indices, parse_job_ids
from slurm_mapa.slurm.config import HookConfig, config_from_text
from slurm_mapa.slurm.text.decision import Decision, parse_decisions, with_decision
from slurm_mapa.slurm.hooks.epilog import run_epilog
from slurm_mapa.slurm.hooks.prolog import run_prolog
from slurm_mapa.slurm.hooks.reconcile import reconcile_node
from slurm_mapa.slurm.node_state import NodeState
from slurm_mapa.slurm.text.directive import parse_directive
from slurm_mapa.slurm.node_state.job_files import Mark, mark_for, mark_is_live, mark_path, process_start_time, write_job_file, write_mark
from slurm_mapa.slurm.node_state.ledger import Holding, Ledger, LedgerCorrupt, LedgerFile, ledger_from_json, ledger_to_json
from slurm_mapa.errors import InputError

TASKPROLOG = REPO / "slurm_mapa" / "data" / "hooks" / "mapa-taskprolog"


@pytest.fixture
def setup(tmp_path):
    config = HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log", nodes=(("dgx*", "dgx1-v100"),))
    return config, FakeSlurm(), []


def test_prolog_chooses_like_mapa_select_and_records_everywhere(setup):
    config, slurm, logs = setup
    slurm.running = {"11"}
    # What job_submit.lua leaves: the user's comment, then the checked directive.
    decision = run_prolog(env_for("11", "0,1,2,3", "nightly [mapa:topology=ring sensitive=yes]"), config, slurm, logs.append)
    expected = select("preserve", preset("dgx1-v100"), range(8), Request(make_pattern("ring", 4), True))
    assert decision.gpus == expected.gpus and decision.policy == "preserve"
    # MAPA's GPUs, then Slurm's (0-3, ascending) and MAPA's in the order they pair with them: a best
    # pair first, each next GPU closing the best ring of those before it (core/order.py).
    paired = prefix_order(preset("dgx1-v100"), expected.gpus)
    assert (config.jobs_dir / "11").read_text() == (f"MAPA_GPUS={','.join(map(str, expected.gpus))}\nSLURM_GPUS=0,1,2,3\n"
                                                    f"PAIRED_GPUS={','.join(map(str, paired))}\n")
    assert LedgerFile(config.ledger, 8).read().holdings["11"].gpus == expected.gpus
    recorded = slurm.admin["11"]
    assert recorded.startswith("mapa:topology=ring sensitive=yes # dgx1=")
    assert parse_decisions(recorded)["dgx1"].gpus == expected.gpus


def test_second_job_gets_the_best_of_what_is_left_and_epilog_frees(setup):
    config, slurm, logs = setup
    slurm.running = {"11", "12"}
    first = run_prolog(env_for("11", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append)
    second = run_prolog(env_for("12", "2,3", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not set(first.gpus) & set(second.gpus)
    free = [g for g in range(8) if g not in first.gpus]
    assert second.gpus == select("preserve", preset("dgx1-v100"), free, Request(make_pattern("ring", 2), True)).gpus
    run_epilog({"SLURM_JOB_ID": "11"}, config, logs.append)
    run_epilog({"SLURM_JOB_ID": "11"}, config, logs.append)  # idempotent
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"12"}
    assert not (config.jobs_dir / "11").exists()


def test_finished_jobs_are_reaped_by_the_reconcile_pass_not_the_prolog(setup):
    config, slurm, logs = setup
    config.jobs_dir.mkdir(mode=0o755)
    write_mark(config.jobs_dir, "5", Mark(0, 0, (0, 3)))  # its Prolog died; its Epilog never ran
    old = time.time() - 3600
    os.utime(mark_path(config.jobs_dir, "5"), (old, old))
    slurm.running = {"12"}
    NodeState.of(config).touch_reconciled()  # mapa-agent's passes keep this fresh: no Prolog lists jobs itself
    decision = run_prolog(env_for("12", "1,2", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not {0, 3} & set(decision.gpus) and not [c for c in slurm.calls if "squeue" in c[0]]
    assert reconcile_node(config, "dgx1", slurm, logs.append)
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"12"}
    assert any("reaped" in line for line in logs)


def test_directive_from_the_batch_script_when_admin_comment_is_empty(setup):
    config, slurm, logs = setup
    slurm.running = {"13"}
    slurm.scripts["13"] = "#!/bin/bash\n#SBATCH --gres=gpu:2\n#MAPA topology=ring sensitive=yes\nsrun hostname\n"
    decision = run_prolog(env_for("13", "4,5"), config, slurm, logs.append)
    assert set(decision.gpus) in ({0, 3}, {0, 4}, {1, 2}, {1, 5}, {2, 3}, {4, 7}, {5, 6}, {6, 7})


def test_missing_topology_falls_back_to_slurms_indices(setup):
    config, slurm, logs = setup
    config = HookConfig(ledger=config.ledger, jobs_dir=config.jobs_dir, log=config.log, nodes=())
    slurm.running = {"14"}
    decision = run_prolog(env_for("14", "5,6"), config, slurm, logs.append)
    assert decision.gpus == (5, 6) and decision.policy == "fallback" and decision.fallback == "no-topology"
    assert "fallback=no-topology" in slurm.admin["14"]


def test_corrupt_ledger_is_rebuilt_from_job_files(setup):
    config, slurm, logs = setup
    slurm.running = {"20", "21"}
    run_prolog(env_for("20", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append)
    held = LedgerFile(config.ledger, 8).read().holdings["20"].gpus
    config.ledger.write_text("{ torn")
    second = run_prolog(env_for("21", "2,3", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not set(held) & set(second.gpus)
    assert any("corrupt" in line for line in logs)


def test_squeue_failure_keeps_entries_and_never_double_assigns(setup):
    config, slurm, logs = setup
    slurm.running = {"30"}
    first = run_prolog(env_for("30", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append)
    slurm.broken = {"squeue"}
    second = run_prolog(env_for("31", "2,3", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not set(first.gpus) & set(second.gpus)


def test_bad_directive_in_a_comment_falls_back_loudly(setup):
    config, slurm, logs = setup
    slurm.running = {"40"}
    decision = run_prolog(env_for("40", "2,3", "mapa:topology=rnig"), config, slurm, logs.append)
    assert decision.policy == "fallback" and decision.gpus == (2, 3)


def test_jobs_without_gpus_are_left_alone(setup):
    config, slurm, logs = setup
    assert run_prolog(env_for("41", ""), config, slurm, logs.append) is None
    assert slurm.calls == []


def test_concurrent_prologs_never_share_a_gpu(tmp_path):
    config = HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log", nodes=(("dgx*", "dgx1-v100"),))
    jobs = [str(100 + i) for i in range(8)]
    results = {}

    def one(job):
        slurm = FakeSlurm()
        slurm.running = set(jobs)
        results[job] = run_prolog(env_for(job, str(int(job) - 100)), config, slurm, lambda _: None)  # Slurm: one GPU each

    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chosen = [results[job].gpus[0] for job in jobs]
    assert sorted(chosen) == list(range(8))


def test_ledger_round_trip_and_strictness():
    ledger = Ledger({"7": Holding((1, 2), "preserve", 1.5, "x")})
    assert ledger_from_json(ledger_to_json(ledger), 8) == ledger
    for bad in ['{"version": 1, "jobs": {"7": {"gpus": [9]}}}', '{"version": 1, "jobs": {"a": {"gpus": [1]}}}',
                '{"version": 1, "jobs": {"7": {"gpus": [1]}, "8": {"gpus": [1]}}}', "[]", "{"]:
        with pytest.raises(LedgerCorrupt):
            ledger_from_json(bad, 8)
    with pytest.raises(ValueError, match="already held"):
        ledger.with_job("8", Holding((2,), "preserve", 0.0))


def test_decision_text_round_trips_and_keeps_other_nodes():
    directive = parse_directive("topology=ring sensitive=yes")
    first = with_decision("mapa:topology=ring sensitive=yes", directive, Decision("n1", (0, 3), "preserve", 58.9, 100.0, 216.0))
    both = with_decision(first, directive, Decision("n2", (4, 7), "preserve", 58.9, 100.0, 216.0))
    decisions = parse_decisions(both)
    assert set(decisions) == {"n1", "n2"} and decisions["n2"].gpus == (4, 7) and decisions["n1"].effective == pytest.approx(58.9)
    busy = Decision("n1", (0, 3), "preserve-ahead", 58.9, free=(0, 2, 3), running=((1, 4), (5, 6, 7)))
    text = with_decision("mapa:topology=ring sensitive=yes", directive, busy)
    assert text.endswith("# n1=0,3 policy=preserve-ahead free=0,2,3 running=1,4/5,6,7 eff=58.900")
    assert parse_decisions(text)["n1"] == busy
    for bad in ("running=1,x/5", "running=3-1"):  # an unreadable list is dropped, the decision kept
        parsed = parse_decisions(text.replace("running=1,4/5,6,7", bad))["n1"]
        assert parsed.running == () and parsed.gpus == (0, 3)


def test_command_output_parsers():
    assert parse_gpu_indices("0-2,5") == (0, 1, 2, 5)
    assert parse_job_ids("12\n 13\n\n") == {"12", "13"}
    with pytest.raises(CommandFailed):
        parse_job_ids("12\nerror: x\n")
    with pytest.raises(ValueError):
        parse_gpu_indices("0;rm")


def test_config_validation():
    config = config_from_text('policy = "greedy"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    assert config.policy == "greedy" and config.topology_for("dgx7") == "dgx1-v100" and config.topology_for("x") is None
    with pytest.raises(InputError, match="unknown policy 'best'"):
        config_from_text('policy = "best"\n')
    with pytest.raises(InputError, match="absolute path"):
        config_from_text('ledger = "ledger.json"\n')
    with pytest.raises(InputError, match="unknown key"):
        config_from_text('polcy = "preserve"\n')


def run_taskprolog(tmp_path, job, content, extra_env=None):
    script = TASKPROLOG.read_text().replace("JOBS_DIR=/run/slurm-mapa/jobs", f"JOBS_DIR={tmp_path}")
    path = tmp_path / "taskprolog"
    path.write_text(script)
    if content is not None:
        (tmp_path / job).write_text(content)
    env = {"SLURM_JOB_ID": job, "PATH": "/usr/bin:/bin"} | (extra_env or {})
    return subprocess.run(["/bin/sh", str(path)], env=env, capture_output=True, text=True, check=True).stdout


def test_taskprolog_exports_only_strict_gpu_lists(tmp_path):
    out = run_taskprolog(tmp_path, "55", "MAPA_GPUS=0,3,2,1\n", {"SLURM_JOB_GPUS": "4,5,6,7"})
    # Slurm's own variables name MAPA's GPUs too, ascending as Slurm writes them; Slurm's are kept.
    assert out.splitlines() == ["export CUDA_VISIBLE_DEVICES=0,3,2,1", "export GPU_DEVICE_ORDINAL=0,3,2,1",
                                "export CUDA_DEVICE_ORDER=PCI_BUS_ID", "export MAPA_GPUS=0,3,2,1",
                                "export MAPA_SLURM_JOB_GPUS=4,5,6,7", "export MAPA_SLURM_STEP_GPUS=",
                                "export SLURM_JOB_GPUS=0,1,2,3", "export SLURM_STEP_GPUS=0,1,2,3"]
    paired = "MAPA_GPUS=7,3,12,1\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=3,7,1,12\n"
    step = run_taskprolog(tmp_path, "55", paired, {"SLURM_JOB_GPUS": "0-3", "SLURM_STEP_GPUS": "0,1", "SLURM_STEP_ID": "0"})
    # Slurm's job GPUs here come from the Prolog (the job file): an srun step's SLURM_JOB_GPUS is the batch node's.
    assert step.splitlines()[-4:] == ["export MAPA_SLURM_JOB_GPUS=0,1,2,3", "export MAPA_SLURM_STEP_GPUS=0,1",
                                      "export SLURM_JOB_GPUS=1,3,7,12", "export SLURM_STEP_GPUS=3,7"]
    for evil in ["MAPA_GPUS=0;reboot\n", "MAPA_GPUS=$(id)\n", "CUDA=1\n", "MAPA_GPUS=\n", "MAPA_GPUS=1,,2\n"]:
        assert run_taskprolog(tmp_path, "56", evil) == ""
    assert run_taskprolog(tmp_path, "57", None) == ""


PAIRED_JOB = "MAPA_GPUS=4,7,6,5\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=7,6,5,4\n"  # Slurm's 0 is MAPA's 7, 1 is 6, ...


@pytest.mark.parametrize("env, cuda", [
    # Two concurrent steps Slurm keeps apart (srun --exact --gres=gpu:2): MAPA's keep apart too.
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "0,1"}, "7,6"),
    ({"SLURM_STEP_ID": "1", "SLURM_STEP_GPUS": "2,3"}, "5,4"),
    # srun -n4 --gpus-per-task=1 (and --gpu-bind=single:1, map_gpu, --ntasks-per-gpu): Slurm narrows
    # SLURM_STEP_GPUS to each task's own; local rank r gets the r-th paired GPU.
    ({"SLURM_STEP_ID": "2", "SLURM_STEP_GPUS": "0", "SLURM_LOCALID": "0"}, "7"),
    ({"SLURM_STEP_ID": "2", "SLURM_STEP_GPUS": "3", "SLURM_LOCALID": "3"}, "4"),
    ({"SLURM_STEP_ID": "3", "SLURM_STEP_GPUS": "1-3"}, "6,5,4"),  # Slurm's range form
    # A step of no GPUs (--gres=gpu:0, --gres=none): Slurm unset SLURM_STEP_GPUS; it sees none.
    ({"SLURM_STEP_ID": "4"}, ""),
    # The batch step (no step number in its environment): the whole job.
    ({}, "4,7,6,5"),
    # Not Slurm's list, or GPUs Slurm did not give the job here: the job's, never a crash.
    ({"SLURM_STEP_ID": "5", "SLURM_STEP_GPUS": "08"}, "4,7,6,5"),
    ({"SLURM_STEP_ID": "5", "SLURM_STEP_GPUS": "0-99999"}, "4,7,6,5"),
    ({"SLURM_STEP_ID": "5", "SLURM_STEP_GPUS": "0,9"}, "4,7,6,5"),
    ({"SLURM_STEP_ID": "5", "SLURM_STEP_GPUS": "$(id)"}, "4,7,6,5"),
])
def test_taskprolog_gives_each_step_and_task_the_mapa_gpus_paired_with_slurms(tmp_path, env, cuda):
    """Issue 24: one fixed pairing per job and node between Slurm's indices and MAPA's GPUs, so
    Slurm's own split of a job into steps and tasks carries over unchanged."""
    out = run_taskprolog(tmp_path, "58", PAIRED_JOB, env).splitlines()
    assert f"export CUDA_VISIBLE_DEVICES={cuda}" in out and "export MAPA_GPUS=4,7,6,5" in out
    assert f"export SLURM_STEP_GPUS={','.join(sorted(cuda.split(','), key=int)) if cuda else ''}" in out


def test_taskprolog_of_an_earlier_releases_job_file_gives_steps_the_jobs_gpus(tmp_path):
    out = run_taskprolog(tmp_path, "59", "MAPA_GPUS=4,7,6,5\n", {"SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "4,5"})
    assert "export CUDA_VISIBLE_DEVICES=4,7,6,5" in out.splitlines()


def test_taskprolog_without_a_job_file_drops_what_the_batch_node_exported(tmp_path):
    """A node where the job has no choice of MAPA's (its other node's batch step exported MAPA_GPUS
    into srun's environment): that value is not this node's."""
    assert run_taskprolog(tmp_path, "60", None, {"MAPA_GPUS": "0,3"}).splitlines() == ["unset MAPA_GPUS"]


def test_status_and_explain_read_what_the_prolog_recorded(setup, capsys, monkeypatch):
    from slurm_mapa.slurm.admin.status import explain_job, node_status

    config, slurm, logs = setup
    slurm.running = {"60", "61"}
    slurm.admin["60"] = "mapa:topology=ring sensitive=yes"
    first = run_prolog(env_for("60", "0,1,2,3"), config, slurm, logs.append)
    run_prolog(env_for("61", "4"), config, slurm, logs.append)
    status = node_status(config, "dgx1")
    assert [job["job"] for job in status["jobs"]] == ["60", "61"]
    assert status["jobs"][0]["gpus"] == list(first.gpus)
    # Slurm's GPUs for each job (scontrol -d show job's IDX), beside MAPA's.
    assert [job["slurm_gpus"] for job in status["jobs"]] == [[0, 1, 2, 3], [4]]
    assert len(status["free"]) == 3
    report = explain_job(config, slurm.admin["60"])
    assert report[0]["gpus"] == list(first.gpus) and report[0]["free"] == list(range(8))
    assert report[0]["alternatives"] and all(alt["why_not"] for alt in report[0]["alternatives"])
    assert (report[0]["slurm_gpus"], report[0]["affinity"], report[0]["isolation"]) == ([0, 1, 2, 3], "prefer:0.1", "")
    # The text form says under which rule the choice was made, and an isolation note when there is one.
    from slurm_mapa.slurm.admin import status as admin

    noted = slurm.admin["60"] + " isolation=failed-open why=cannot_set_up_the_devices_cgroup"
    slurm.admin["60"] = noted
    monkeypatch.setattr(admin, "Runner", lambda timeout: slurm)
    toml = config.ledger.parent / "mapa.toml"
    toml.write_text(f'ledger = "{config.ledger}"\njobs_dir = "{config.jobs_dir}"\nlog = "{config.log}"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    assert admin.cmd_explain(type("Args", (), {"job": "60", "config": str(toml), "json": False})()) == 0
    out = capsys.readouterr().out
    assert "    Slurm's GPUs: 0,1,2,3\n" in out
    assert "    CPU affinity rule: prefer:0.1, with the CPUs of Slurm's GPUs; alternatives below are ranked without it" in out
    assert "    GPU isolation: failed-open (cannot_set_up_the_devices_cgroup)" in out
    # --json: one document, the same decision
    assert admin.cmd_explain(type("Args", (), {"job": "60", "config": str(toml), "json": True})()) == 0
    assert json.loads(capsys.readouterr().out)["nodes"][0]["gpus"] == list(first.gpus)


def test_unhealthy_gpus_are_left_out_and_logged(setup):
    config, slurm, logs = setup
    slurm.running = {"70"}
    decision = run_prolog(env_for("70", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append,
                          unhealthy_gpus=lambda: {0: ("2 uncorrectable ECC errors",), 3: ("pending page retirement",)})
    assert not {0, 3} & set(decision.gpus) and decision.policy == "preserve"
    assert any("leaving out GPU 0: 2 uncorrectable ECC errors" in line for line in logs)


def test_a_failing_health_probe_never_stops_the_job(setup):
    config, slurm, logs = setup
    slurm.running = {"71"}

    def broken():
        raise RuntimeError("NVML exploded")

    decision = run_prolog(env_for("71", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append, unhealthy_gpus=broken)
    assert decision.policy == "preserve" and any("health check failed" in line for line in logs)


def test_a_lost_admin_comment_write_is_repeated(setup):
    """Two Prologs of one job rewrite the AdminComment at once; the one that lost rewrites it merged."""
    config, _, logs = setup
    dropped = []

    class Racing(FakeSlurm):
        def __call__(self, argv):
            if argv[1] == "update" and not dropped:
                dropped.append(argv)
                self.admin["80"] = "mapa:topology=ring sensitive=no # other=5 policy=preserve"  # the other node won
                return ""
            return super().__call__(argv)

    racing = Racing()
    racing.running = {"80"}
    decision = run_prolog(env_for("80", "0", "mapa:") | {"SLURM_JOB_NUM_NODES": "2"}, config, racing, logs.append)
    recorded = parse_decisions(racing.admin["80"])
    assert set(recorded) == {"other", "dgx1"} and recorded["dgx1"].gpus == decision.gpus


def test_a_killed_writer_never_leaves_a_torn_ledger(tmp_path):
    """SIGKILL a process that rewrites the ledger in a loop, many times: the file always parses."""
    import signal
    import sys
    import time

    path = tmp_path / "ledger.json"
    writer = (
        "import sys, itertools\n"
        "from slurm_mapa.slurm.node_state.ledger import Ledger, LedgerFile, Holding\n"
        "f = LedgerFile(sys.argv[1], 8)\n"
        "for i in itertools.count():\n"
        "    f.write(Ledger({str(j): Holding((j,), 'preserve', float(i), 'x' * 5000) for j in range(i % 8)}))\n"
    )
    for round_ in range(15):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(path)])
        time.sleep(0.15 + 0.02 * round_)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if path.exists():
            LedgerFile(path, 8).read()  # raises LedgerCorrupt on a torn file
    assert path.exists()


def test_jobs_running_without_a_ledger_entry_are_adopted_with_slurms_gpus(setup):
    """A job whose Prolog was killed runs on Slurm's indices; the next Prolog must not hand them out."""
    config, slurm, logs = setup
    slurm.running = {"90", "91", "92"}
    slurm.gres = {"90": ["gpu:2(IDX:0,3)"], "91": []}  # 90: a killed Prolog; 91: a CPU-only job
    assert reconcile_node(config, "dgx1", slurm, logs.append)  # mapa-agent's pass, off the start path
    reads = [call[1:] for call in slurm.calls if call[1] == "--json"]
    assert reads == [["--json", "--states=all", "--jobs=90,91,92"]]  # the unmarked jobs read in one call
    decision = run_prolog(env_for("92", "1,2", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not {0, 3} & set(decision.gpus)
    holdings = LedgerFile(config.ledger, 8).read().holdings
    assert holdings["90"].gpus == (0, 3) and holdings["90"].policy == "slurm" and "91" not in holdings
    assert mark_path(config.jobs_dir, "91").read_text() == "pid=0 start=0 slurm=\n"  # known: never asked again
    assert any("adopted job 90 with Slurm's GPUs 0,3" in line for line in logs)
    slurm.calls.clear()
    slurm.running.add("93")
    run_prolog(env_for("93", "4", "mapa:"), config, slurm, logs.append)
    assert reconcile_node(config, "dgx1", slurm, logs.append)
    asked_about = {call[4] for call in slurm.calls if call[1:4] == ["--json", "show", "job"]}
    assert asked_about == {"93"}  # only to write 93's record: adopted jobs, the CPU-only one included, are known


def test_gres_detail_parsing():
    from slurm_mapa.slurm.text.commands import slurm_gpus_on_only_node

    assert slurm_gpus_on_only_node({"gres_detail": ["gpu:2(IDX:0-1)"]}) == (0, 1)
    assert slurm_gpus_on_only_node({"gres_detail": ["gpu:a100:3(IDX:0-1,3)"]}) == (0, 1, 3)
    assert slurm_gpus_on_only_node({"gres_detail": ["gpu:islA:2(IDX:0-1),gpu:islB:0(IDX:)"]}) == (0, 1)
    assert slurm_gpus_on_only_node({"gres_detail": []}) == ()
    assert slurm_gpus_on_only_node({"gres_detail": ["gpu:1(IDX:0)", "gpu:1(IDX:2)"]}) is None
    assert slurm_gpus_on_only_node({"gres_detail": ["gpu(CNT:2)"]}) is None


def test_an_unreadable_config_makes_the_hooks_fall_back_not_fail(tmp_path):
    from slurm_mapa.slurm.config import load_hook_config

    bad = tmp_path / "mapa.toml"
    bad.write_bytes(b"policy = \xff\n")
    config, problem = load_hook_config({"MAPA_CONFIG": str(bad)})
    assert config == HookConfig() and problem.startswith("bad-config:")
    config, problem = load_hook_config({"MAPA_CONFIG": str(tmp_path / "missing.toml")})
    assert problem.startswith("bad-config:")
    good = tmp_path / "good.toml"
    good.write_text('policy = "best"\nlog = "/tmp/x.log"\n')
    assert load_hook_config({"MAPA_CONFIG": str(good)})[1].startswith("bad-config:")  # validated for the Prolog
    assert load_hook_config({"MAPA_CONFIG": str(good)}, validate=False)[0].log == Path("/tmp/x.log")  # the Epilog's paths


def test_reaping_keeps_entries_written_after_the_job_list_was_asked_for():
    ledger = Ledger({"1": Holding((0,), "preserve", 100.0), "2": Holding((1,), "preserve", 200.0)})
    kept, dead = ledger.reaped(set(), listed_at=150.0)
    assert dead == ["1"] and set(kept.holdings) == {"2"}  # job 2's Prolog wrote after squeue started
    assert ledger.reaped(set())[1] == ["1", "2"]


def test_a_job_that_ended_after_squeue_listed_it_is_not_adopted(setup):
    from slurm_mapa.slurm.hooks.reconcile import still_running

    assert still_running({"job_state": ["RUNNING"]}) and still_running({"job_state": "SUSPENDED"}) and still_running({})
    assert not still_running({"job_state": ["COMPLETED", "COMPLETING"]}) and not still_running({"job_state": ["RUNNING", "COMPLETING"]})
    assert not still_running({"job_state": ["CANCELLED"]})
    config, slurm, logs = setup
    slurm.running = {"5", "6"}  # squeue still lists 5, whose Epilog has already emptied its entry
    slurm.gres["5"] = ["gpu:2(IDX:0-1)"]
    real_call = slurm.__call__

    def with_state(argv):
        out = real_call(argv)
        if argv[1:4] == ["--json", "show", "job"] and argv[4] == "5":
            record = json.loads(out)
            record["jobs"][0]["job_state"] = ["COMPLETED", "COMPLETING"]
            return json.dumps(record)
        return out

    decision = run_prolog(env_for("6", "0"), config, with_state, logs.append)
    assert "5" not in LedgerFile(config.ledger, 8).read().holdings
    assert decision.policy == "preserve" and not any("adopted job 5" in line for line in logs)


def test_the_prolog_uses_preserve_aheads_configured_sizes(tmp_path):
    from slurm_mapa.core.ahead import make_preserve_ahead
    from slurm_mapa.hardware.load import model_for_topology

    config = HookConfig(ledger=tmp_path / "l.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log", nodes=(("dgx*", "dgx1-v100"),),
                        policy="preserve-ahead", ahead_sizes=((4, 1.0),))
    slurm, logs = FakeSlurm(), []
    slurm.running = {"1", "2"}
    LedgerFile(config.ledger, 8).write(Ledger({"1": Holding((0, 1), "preserve-ahead", 1.0)}))  # free: 2-7
    config.jobs_dir.mkdir(mode=0o755)
    write_job_file(config.jobs_dir, "1", (0, 1))
    decision = run_prolog(env_for("2", "2,3,4", "mapa:topology=ring sensitive=no"), config, slurm, logs.append)
    graph = preset("dgx1-v100")
    model = model_for_topology(graph)  # the node's default, as the Prolog's
    policy = make_preserve_ahead({4: 1.0})
    free = (2, 3, 4, 5, 6, 7)
    want = policy(graph, free, Request(make_pattern("ring", 3), False), model, running=((0, 1),))
    assert decision.policy == "preserve-ahead" and sorted(decision.gpus) == sorted(want.gpus) == [2, 3, 6]
    assert decision.running == ((0, 1),) and "running=0,1" in slurm.admin["2"]
    # Without job 1's GPUs in the outlook the choice would differ: the Prolog hands them over.
    alone = policy(graph, free, Request(make_pattern("ring", 3), False), model)
    assert sorted(alone.gpus) == [2, 3, 4]


def test_a_job_whose_prolog_is_running_is_not_adopted_but_one_whose_prolog_died_is(setup):
    config, slurm, logs = setup
    slurm.running = {"20", "21", "22", "23"}
    slurm.gres = {"20": ["gpu:2(IDX:0-1)"], "21": ["gpu:2(IDX:2-3)"], "23": ["gpu:1(IDX:6)"]}
    config.jobs_dir.mkdir(mode=0o755)
    write_mark(config.jobs_dir, "20", mark_for(os.getpid(), (0, 1)))  # job 20's Prolog runs right now (this process)
    child = subprocess.Popen(["true"])  # a process that has exited: job 21's Prolog was killed
    child.wait()
    write_mark(config.jobs_dir, "21", mark_for(child.pid, (2, 3)))
    # Job 23's Prolog died too, and its pid now belongs to a live process started later (pid reuse).
    write_mark(config.jobs_dir, "23", Mark(os.getpid(), process_start_time(os.getpid()) - 1, (6,)))
    assert mark_is_live(mark_for(os.getpid(), ())) and not mark_is_live(mark_for(child.pid, ()))
    assert not mark_is_live(Mark(os.getpid(), process_start_time(os.getpid()) - 1, ()))
    decision = run_prolog(env_for("22", "4,5"), config, slurm, logs.append)
    holdings = LedgerFile(config.ledger, 8).read().holdings
    assert "20" not in holdings and holdings["21"].gpus == (2, 3) and holdings["23"].gpus == (6,)
    assert not {2, 3, 6} & set(decision.gpus)
    assert not any(c[1:4] == ["--json", "show", "job"] and c[4] in {"20", "21", "23"} for c in slurm.calls)  # marks say it all
    assert mark_path(config.jobs_dir, "22").exists()  # its own mark stays until the Epilog
    run_epilog({"SLURM_JOB_ID": "21"}, config, logs.append)
    assert not mark_path(config.jobs_dir, "21").exists()  # the Epilog clears a killed Prolog's mark
    assert "21" not in LedgerFile(config.ledger, 8).read().holdings


def test_affinity_keeps_the_job_on_the_socket_of_slurms_gpus(setup):
    """CPU affinity in the Prolog (prefer unless [affinity] says otherwise): the job's CPUs are
    those of the GPUs Slurm picked (exact with --gres-flags=enforce-binding); mode = "ignore" is
    the policy alone. The record says which rule the choice was made under."""
    import dataclasses

    from slurm_mapa.core.affinity import select_with_affinity
    from slurm_mapa.core.affinity import cpus_of_slurms_gpus

    config, slurm, logs = setup
    assert config.affinity_mode == "prefer"  # the default
    graph, request = preset("dgx1-v100"), Request(make_pattern("ring", 2), True)
    slurm.running = {"80", "81", "82", "83", "84"}
    # Job 80 takes a pair; the best free pair is then on socket 0, while Slurm puts job 81 on socket 1.
    ignore = dataclasses.replace(config, affinity_mode="ignore")
    first = run_prolog(env_for("80", "4,7", "mapa:sensitive=yes"), ignore, slurm, logs.append)
    assert "slurm=4,7" in slurm.admin["80"] and "affinity=" not in slurm.admin["80"]
    free = tuple(g for g in range(8) if g not in first.gpus)
    best = select("preserve", graph, free, request)
    assert max(best.gpus) <= 3 and {5, 6} <= set(free), (first.gpus, best.gpus)  # what the test needs
    blind = run_prolog(env_for("81", "5,6", "mapa:sensitive=yes"), ignore, slurm, logs.append)
    assert sorted(blind.gpus) == sorted(best.gpus)  # "ignore": the policy alone
    run_epilog({"SLURM_JOB_ID": "81"}, config, logs.append)
    strict = dataclasses.replace(config, affinity_mode="strict")
    local = run_prolog(env_for("82", "5,6", "mapa:sensitive=yes"), strict, slurm, logs.append)
    assert set(local.gpus) <= {4, 5, 6, 7}  # on the socket of Slurm's GPUs 5 and 6
    expected, why = select_with_affinity("preserve", graph, free, request, cpus_of_slurms_gpus(graph, (5, 6)), "strict")
    assert local.gpus == expected.gpus and why.local
    assert parse_decisions(slurm.admin["82"])["dgx1"].affinity == "strict"
    run_epilog({"SLURM_JOB_ID": "82"}, config, logs.append)
    # prefer (the default): local unless that gives up more than max_loss of the best predicted bandwidth.
    chosen = run_prolog(env_for("83", "5,6", "mapa:sensitive=yes"), config, slurm, logs.append)
    expected, why = select_with_affinity("preserve", graph, free, request, cpus_of_slurms_gpus(graph, (5, 6)), "prefer",
                                         max_loss=0.1)
    assert chosen.gpus == expected.gpus
    recorded = parse_decisions(slurm.admin["83"])["dgx1"]
    assert (recorded.slurm_gpus, recorded.affinity) == ((5, 6), "prefer:0.1")
    assert cpus_of_slurms_gpus(graph, (5, 6)) == frozenset(range(20, 40)) | frozenset(range(60, 80))
    assert cpus_of_slurms_gpus(preset("pcie-8"), (5, 6)) is None  # no CPU affinity in the topology: all local
    assert cpus_of_slurms_gpus(graph, (9,)) is None


def test_the_jobs_own_cpus_from_its_cgroup_win_over_slurms_gpus(setup):
    """With PrologFlags=RunInJob the Prolog reads the job's CPUs from its cpuset (slurm/jobcpus.py);
    those decide, and the record names them (cpus=), so a replay can make the same choice."""
    import dataclasses

    from slurm_mapa.slurm.text.directive import parse_directive
    from slurm_mapa.slurm.hooks.prolog import PrologContext, choose

    config, _, _ = setup
    strict = dataclasses.replace(config, affinity_mode="strict")
    graph, directive = preset("dgx1-v100"), parse_directive("topology=ring sensitive=yes")
    # Slurm's GPUs are on socket 0 (CPUs 0-19,40-59), the job's cores on socket 1.
    ctx = PrologContext("90", "dgx1", (0, 1), "", job_cpus=frozenset({25, 65}))
    decision = choose(ctx, strict, graph, directive, Ledger(), 8, "")
    assert set(decision.gpus) <= {4, 5, 6, 7} and (decision.job_cpus, decision.affinity) == ("25,65", "strict")
    assert " cpus=25,65 affinity=strict" in decision.text()
    ctx.job_cpus = None  # not in the job's cgroup (PrologFlags=Alloc): Slurm's GPUs' CPUs stand in
    decision = choose(ctx, strict, graph, directive, Ledger(), 8, "")
    assert set(decision.gpus) <= {0, 1, 2, 3} and decision.job_cpus == "" and "cpus=" not in decision.text()


def test_the_prolog_asks_for_the_jobs_cpus_with_the_pid_that_asked(setup, monkeypatch):
    from slurm_mapa.slurm.hooks import job_cpus as jobcpus

    config, slurm, logs = setup
    slurm.running = {"91"}
    asked = []
    monkeypatch.setattr(jobcpus, "read_job_cpus", lambda pid, job, sluid="": asked.append((pid, job)) or frozenset({25}))
    decision = run_prolog(env_for("91", "0,1", "mapa:topology=ring sensitive=yes"), config, slurm, logs.append, requester_pid=4242)
    assert asked == [(4242, "91")]
    assert decision.job_cpus == "25" and "cpus=25 affinity=prefer:0.1" in slurm.admin["91"]


@pytest.mark.parametrize("old_mark", [b"812\n", b"812", b"pid=812\n", b"\xff\xfe garbage\n"])
def test_a_job_with_a_mark_of_an_earlier_release_is_adopted_and_held(setup, old_mark):
    """Security round 3: a Prolog of an earlier release marked its job with a bare pid. Such a mark
    (or a damaged one) once hid the running job: scanned as "no mark", never adopted, so the next
    job got its GPUs. The reconcile pass asks Slurm and replaces the mark with one this release
    reads; the job then holds Slurm's GPUs."""
    config, slurm, logs = setup
    config.jobs_dir.mkdir(mode=0o755)
    mark_path(config.jobs_dir, "40").write_bytes(old_mark)  # job 40 runs on GPUs 1,2; no ledger entry
    slurm.running = {"40", "41"}
    slurm.gres = {"40": ["gpu:2(IDX:1-2)"]}
    assert reconcile_node(config, "dgx1", slurm, logs.append)
    assert mark_path(config.jobs_dir, "40").read_text() == "pid=0 start=0 slurm=1,2\n"
    decision = run_prolog(env_for("41", "0,3,4,5", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not {1, 2} & set(decision.gpus)
    assert LedgerFile(config.ledger, 8).read().holdings["40"].gpus == (1, 2)


def test_a_readable_mark_is_never_replaced_by_adoption(setup):
    from slurm_mapa.slurm.node_state.job_files import write_mark_if_none

    config, _, _ = setup
    config.jobs_dir.mkdir(mode=0o755)
    write_mark(config.jobs_dir, "7", Mark(812, 99, (3,)))
    assert not write_mark_if_none(config.jobs_dir, "7", Mark(0, 0, (1,)))
    assert mark_path(config.jobs_dir, "7").read_text() == "pid=812 start=99 slurm=3\n"
    mark_path(config.jobs_dir, "8").write_bytes(b"812\n")
    assert write_mark_if_none(config.jobs_dir, "8", Mark(0, 0, (1,)))
    assert mark_path(config.jobs_dir, "8").read_text() == "pid=0 start=0 slurm=1\n"


def test_a_symlink_in_the_ledger_locks_place_is_replaced_not_followed(setup, tmp_path):
    """Security round 3 (low): a dangling ledger.json.lock symlink made every Prolog raise (ELOOP)
    and fall back to Slurm's GPUs."""
    config, slurm, logs = setup
    target = tmp_path / "elsewhere"
    os.symlink(target, str(config.ledger) + ".lock")
    slurm.running = {"3"}
    decision = run_prolog(env_for("3", "0"), config, slurm, logs.append)
    assert decision.policy == "preserve" and not target.exists()
    lock = Path(str(config.ledger) + ".lock")
    assert lock.is_file() and not lock.is_symlink()


def test_a_held_directory_lock_cannot_block_the_symlink_repair_past_the_deadline(tmp_path):
    """Issue 36 (low): the repair's lock on the ledger's directory (mode 755: any user may open it
    and flock it) was a blocking flock: one user holding it blocked every Prolog past its budget."""
    import fcntl
    import time as time_module

    directory = tmp_path / "state"
    directory.mkdir(mode=0o755)
    os.symlink(tmp_path / "elsewhere", directory / "ledger.json.lock")
    holder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        started = time_module.monotonic()
        with pytest.raises(TimeoutError, match="could not lock"):
            with LedgerFile(directory / "ledger.json", 8).locked(timeout=0.3):
                pass
        assert time_module.monotonic() - started < 5
    finally:
        os.close(holder)
    with LedgerFile(directory / "ledger.json", 8).locked(timeout=1):  # released: repaired and locked
        assert not (directory / "ledger.json.lock").is_symlink()


def test_threads_of_one_process_queue_for_the_ledger_lock_and_still_exclude_each_other(tmp_path):
    """Issue 41: mapa-agent's handler threads wait for the ledger on a thread lock (no polling)
    before the flock. They still hold it one at a time; one that cannot have it in time gets the
    same TimeoutError as before; and the flock still keeps another process out meanwhile."""
    import fcntl
    import threading
    import time as time_module

    directory = tmp_path / "state"
    directory.mkdir(mode=0o755)
    ledger = LedgerFile(directory / "ledger.json", 8)
    inside, overlaps = [], []

    def hold(seconds):
        with ledger.locked(timeout=10):
            if inside:
                overlaps.append(threading.get_ident())
            inside.append(1)
            time_module.sleep(seconds)
            inside.pop()

    threads = [threading.Thread(target=hold, args=(0.02,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == []
    # Another thread holds it past the waiter's timeout: TimeoutError, and the lock works after.
    holding, release = threading.Event(), threading.Event()

    def keep():
        with ledger.locked(timeout=1):
            holding.set()
            release.wait(10)

    keeper = threading.Thread(target=keep)
    keeper.start()
    holding.wait(5)
    # The flock is held meanwhile: another process's non-blocking try fails.
    probe = os.open(directory / "ledger.json.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
    started = time_module.monotonic()
    with pytest.raises(TimeoutError, match="could not lock"):
        with ledger.locked(timeout=0.2):
            pass
    assert time_module.monotonic() - started < 5
    release.set()
    keeper.join()
    with ledger.locked(timeout=1):
        pass


def test_a_root_request_with_a_path_for_a_job_id_is_refused_in_one_line(tmp_path):
    """Security round 3 (low): a root request naming job ../../etc/passwd logged a traceback."""
    import socket as socket_module

    from slurm_mapa.slurm.agent.service import Agent
    from slurm_mapa.slurm.agent.server import serve

    errors = []
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/l.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    server = serve(str(tmp_path / "agent" / "agent.sock"), Agent(str(config), errors.append, node="dgx1"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        payload = b"SLURM_JOB_ID=../../etc/passwd\0SLURMD_NODENAME=dgx1"
        with socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM) as conn:
            conn.connect(str(tmp_path / "agent" / "agent.sock"))
            conn.sendall(b"MAPA1 prolog %d\n" % len(payload) + payload)
            answer = conn.makefile("rb").readline()
    finally:
        server.shutdown()
        server.server_close()
    assert answer.startswith(b"error SLURM_JOB_ID '../../etc/passwd' is not a job id")
    assert errors == ["mapa-agent: refused a request: SLURM_JOB_ID '../../etc/passwd' is not a job id (accepted: digits)"]
    assert not (tmp_path / "log").exists() or "Traceback" not in (tmp_path / "log").read_text()


def test_a_prolog_asks_about_a_job_with_an_unreadable_mark_before_choosing(setup):
    """Right after an upgrade no reconcile pass may have run yet: the Prolog itself, finding a job
    whose mark it cannot read and that nothing else accounts for, asks Slurm before it chooses."""
    config, slurm, logs = setup
    config.jobs_dir.mkdir(mode=0o755)
    for job, gpus in (("40", "1-2"), ("42", "5")):
        mark_path(config.jobs_dir, job).write_bytes(f"{8000 + int(job)}\n".encode())  # earlier release: a bare pid
        slurm.gres[job] = [f"gpu:{len(parse_gpu_indices(gpus))}(IDX:{gpus})"]
    slurm.running = {"40", "41", "42"}
    decision = run_prolog(env_for("41", "0,3,4,6", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not {1, 2, 5} & set(decision.gpus)
    holdings = LedgerFile(config.ledger, 8).read().holdings
    assert holdings["40"].gpus == (1, 2) and holdings["42"].gpus == (5,)
    lists = [call[3] for call in slurm.calls if call[1:3] == ["--json", "--states=all"]]
    assert len(lists) == 1 and {"40", "42"} <= set(lists[0][len("--jobs="):].split(","))  # in one call (squeue takes a list)
    slurm.calls.clear()
    run_prolog(env_for("43", "7", "mapa:"), config, slurm, logs.append)  # converted: never asked again
    asked = {job for call in slurm.calls if call[1] == "--json" for job in call[-1].removeprefix("--jobs=").split(",")}
    assert not asked & {"40", "42"}


def test_a_prolog_asks_about_a_job_the_kernel_shows_but_no_file_names_before_choosing(setup, monkeypatch):
    """Issue 36: a job whose Prolog died before its first write has no mark; until the next
    reconcile pass another job's Prolog could be given its GPUs. The node knows the job runs (its
    Slurm job cgroup): the Prolog treats it as unknown and asks Slurm before it chooses."""
    from slurm_mapa.slurm.hooks import prolog as prolog_module

    config, slurm, logs = setup
    slurm.gres["50"] = ["gpu:2(IDX:0-1)"]
    slurm.running = {"50", "51"}
    monkeypatch.setattr(prolog_module, "jobs_with_cgroups", lambda: {"50", "51"})
    decision = run_prolog(env_for("51", "2,3", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert not {0, 1} & set(decision.gpus), decision
    assert LedgerFile(config.ledger, 8).read().holdings["50"].gpus == (0, 1)
    assert "50" in [call[4] for call in slurm.calls if call[1:4] == ["--json", "show", "job"]]


def test_jobs_with_cgroups_reads_slurms_job_directories_of_both_versions(tmp_path):
    from slurm_mapa.slurm.isolation.cgroups import jobs_with_cgroups

    freezer, unified = tmp_path / "freezer", tmp_path / "unified"
    (freezer / "slurm" / "uid_1000" / "job_7" / "step_0").mkdir(parents=True)
    (freezer / "slurm" / "uid_1000" / "job_x").mkdir(parents=True)
    (unified / "system.slice" / "slurmstepd.scope" / "job_9").mkdir(parents=True)
    (unified / "system.slice" / "slurmstepd.scope" / "s0123456789ABC").mkdir(parents=True)  # a SLUID: no id
    (unified / "user.slice" / "job_11").mkdir(parents=True)  # not Slurm's
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"36 31 0:33 / {freezer} rw - cgroup cgroup rw,freezer\n41 31 0:38 / {unified} rw - cgroup2 cgroup2 rw\n")
    assert jobs_with_cgroups(mountinfo, older_than_s=0, now=time.time() + 1) == {"7", "9"}
    assert jobs_with_cgroups(mountinfo, older_than_s=60) == set()  # too young: their Prologs may be marking them
    assert jobs_with_cgroups(tmp_path / "missing") == set()


def test_taskprolog_reads_slurms_indices_even_when_slurm_writes_uuids(tmp_path):
    """Slurm 26.05's gres.conf Flags=env_uuid puts GPU UUIDs in CUDA_VISIBLE_DEVICES; its
    SLURM_STEP_GPUS stays node indices (src/plugins/gres/common/gres_common.c), which is what the
    TaskProlog reads."""
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "1", "CUDA_VISIBLE_DEVICES": "GPU-6f5a7e2b-0c1d-4e3f-9a8b-7c6d5e4f3a2b"}
    out = run_taskprolog(tmp_path, "61", PAIRED_JOB, env).splitlines()
    assert "export CUDA_VISIBLE_DEVICES=6" in out and "export SLURM_STEP_GPUS=6" in out


def test_taskprolog_of_a_het_component_reads_its_own_job_file(tmp_path):
    """A het job's tasks get the leader's id in SLURM_JOB_ID. Where the cgroup path names no job_J
    (here, and Slurm 26.05's SLUID directories), the one component with a job file on this node is
    the task's; the mini cluster's het test covers the cgroup path."""
    (tmp_path / "71").write_text(PAIRED_JOB)
    env = {"SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "70", "SLURM_JOB_ID_HET_GROUP_1": "71"}
    out = run_taskprolog(tmp_path, "70", None, env).splitlines()
    assert "export MAPA_GPUS=4,7,6,5" in out
    (tmp_path / "70").write_text("MAPA_GPUS=1\n")  # both components on this node: the leader's id stays
    assert "export MAPA_GPUS=1" in run_taskprolog(tmp_path, "70", None, env).splitlines()


def test_the_prologs_search_is_bounded_and_a_gap_reaches_the_record(setup, monkeypatch):
    """Each search of a decision gets a SearchLimit of DECISION_SEARCH_S at most (less when the
    budget is nearly spent); a search that runs out records how far from the optimum it can be."""
    import dataclasses

    from slurm_mapa.core import policies
    from slurm_mapa.core.search import SearchLimit
    from slurm_mapa.slurm.hooks.budget import Budget
    from slurm_mapa.slurm.text.directive import parse_directive
    from slurm_mapa.slurm.hooks.prolog import DECISION_SEARCH_S, PrologContext, choose, search_seconds

    config, slurm, logs = setup
    config = dataclasses.replace(config, affinity_mode="ignore")
    limits: list = []
    real_select = policies.select

    def spy(*args, **kwargs):
        limits.append(args[7] if len(args) > 7 else kwargs.get("limit"))
        return real_select(*args, **kwargs)

    monkeypatch.setattr(policies, "select", spy)
    slurm.running = {"95"}
    run_prolog(env_for("95", "0,1", "mapa:topology=ring sensitive=yes"), config, slurm, logs.append)
    assert limits and all(isinstance(limit, SearchLimit) and 0 < limit.seconds <= DECISION_SEARCH_S for limit in limits)
    assert search_seconds(Budget(15.0)) == DECISION_SEARCH_S and search_seconds(Budget(1.2)) < DECISION_SEARCH_S
    assert search_seconds(Budget(0.5)) > 0  # a spent budget still searches a little (then takes the best found)
    # A 16-GPU mesh, 13 GPUs insensitive: the exact search needs far more than a microsecond.
    monkeypatch.setattr(policies, "select", real_select)
    graph = preset("torus2d-16")
    ctx = PrologContext("96", "torus1", tuple(range(13)), "")
    decision = choose(ctx, config, graph, parse_directive("topology=ring sensitive=no"), Ledger(), 16, "", search_seconds=1e-6)
    assert len(decision.gpus) == 13 and decision.policy == "preserve" and decision.gap is not None and decision.gap >= 0
    assert f" gap={decision.gap:.3f}" in decision.text()


def test_a_multi_node_jobs_record_survives_a_stale_write_made_after_this_node_saw_its_own(setup):
    """Seen in CI: summit1 wrote its decision and read it back in place; dgx1's write, made from a
    read of the AdminComment before summit1's, then replaced it, and the job's record named dgx1
    only. A node of a multi-node job reads back until every node's decision is there, and merges
    its own in again when a stale write dropped it."""
    from slurm_mapa.slurm.hooks.admin_comment import MULTI_NODE_READS, record_decision
    from slurm_mapa.slurm.hooks.job_context import PrologContext
    from slurm_mapa.slurm.text.decision import Decision, parse_decisions, with_decision
    from slurm_mapa.slurm.text.directive import parse_directive

    config, slurm, logs = setup
    directive = parse_directive("topology=ring sensitive=yes")
    ours = Decision(node="summit1", gpus=(0, 1), policy="preserve")
    theirs = Decision(node="dgx1", gpus=(0, 3), policy="preserve")
    stale = with_decision("", directive, theirs)  # dgx1's write, from a read before summit1's record
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:  # after summit1 has read its record back once
            slurm.admin["60"] = stale

    ctx = PrologContext(job_id="60", node="summit1", slurm_gpus=(0, 1), env_comment="", nodes_in_job=2)
    assert record_decision(ctx, directive, ours, config, slurm, logs.append, sleep=sleep) is True
    assert set(parse_decisions(slurm.admin["60"])) == {"dgx1", "summit1"}
    # Alone (the other node never writes): it stops after MULTI_NODE_READS reads, its record in place.
    slurm.admin.clear()
    slurm.calls.clear()
    assert record_decision(ctx, directive, ours, config, slurm, logs.append, sleep=lambda s: None) is True
    reads = [c for c in slurm.calls if c[1:4] == ["--json", "show", "job"]]
    assert len(reads) == MULTI_NODE_READS and set(parse_decisions(slurm.admin["60"])) == {"summit1"}
