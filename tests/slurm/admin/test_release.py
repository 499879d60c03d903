"""`mapa release`: parsing squeue/sinfo output and deciding which placement=require jobs start now."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.cli import main
from slurm_mapa.slurm.text import commands
from slurm_mapa.slurm.admin.release import (
    JSON_BATCH,
    NodeLine,
    NodeOutlook,
    WaitingJob,
    holding_out_costs_more,
    jobs_to_release,
    nodes_argv,
    parse_node_outlooks,
    parse_nodes,
    parse_pending,
    parse_waiting_json,
    release_argv,
    release_once,
    sinfo_argv,
    squeue_argv,
    squeue_json_argv,
    wanted_features,
)
from slurm_mapa.slurm.text.outlook import RingOutlook
from slurm_mapa.replay.timemodel import TimeModel

R, F = "\x1e", "\x1f"
REQUIRE = "mapa:topology=ring sensitive=yes placement=require wait=10"
# What squeue_argv prints (Slurm 24.11): the job id, a space, the reason (which may hold spaces).
SQUEUE_TEXT = (
    "41 BeginTime\n"
    "42 BeginTime\n"
    "43 Resources\n"
    "44 BeginTime\n"
    "50 ReqNodeNotAvail, UnavailableNodes:dgx1\n"
)
# `squeue --json --states=PENDING --jobs=41,42,44` as Slurm 24.11 (data_parser v0.0.42) prints it,
# each record abridged to the fields around the ones read.
SQUEUE_JSON = """{
  "jobs": [
    {
      "account": "",
      "admin_comment": "mapa:topology=ring sensitive=yes placement=require wait=10",
      "batch_flag": true,
      "comment": "mapa:topology=ring sensitive=yes placement=require wait=10",
      "features": "",
      "gres_detail": [],
      "job_id": 41,
      "job_state": [
        "PENDING"
      ],
      "name": "ring3",
      "partition": "dgx",
      "prefer": "mapa_ring3",
      "state_description": "",
      "state_reason": "BeginTime",
      "tres_per_node": "gres/gpu:3",
      "user_name": "alice"
    },
    {
      "admin_comment": "mapa:topology=ring sensitive=yes placement=require wait=5",
      "comment": "my run [mapa:topology=ring sensitive=yes placement=require wait=5]",
      "features": "bigmem&ib",
      "job_id": 42,
      "job_state": [
        "PENDING"
      ],
      "partition": "dgx,gpu",
      "state_reason": "BeginTime",
      "tres_per_node": "gres/gpu:v100:4",
      "user_name": "bob"
    },
    {
      "admin_comment": "",
      "comment": "",
      "features": "",
      "job_id": 44,
      "job_state": [
        "PENDING"
      ],
      "partition": "dgx",
      "state_reason": "BeginTime",
      "tres_per_node": "gres/gpu:3",
      "user_name": "carol"
    }
  ],
  "last_backfill": {
    "set": true,
    "infinite": false,
    "number": 1733400000
  },
  "last_update": {
    "set": true,
    "infinite": false,
    "number": 1733400012
  },
  "meta": {
    "plugin": {
      "type": "openapi/slurmctld",
      "name": "Slurm OpenAPI slurmctld",
      "data_parser": "data_parser/v0.0.42",
      "accounting_storage": "accounting_storage/slurmdbd"
    },
    "client": {
      "source": "/dev/pts/0",
      "user": "root",
      "group": "root"
    },
    "command": [
      "squeue",
      "--json",
      "--states=PENDING",
      "--jobs=41,42,44"
    ],
    "slurm": {
      "version": {
        "major": "24",
        "micro": "5",
        "minor": "11"
      },
      "release": "24.11.5",
      "cluster": "mapa"
    }
  },
  "errors": [],
  "warnings": []
}
"""
SINFO_TEXT = (
    f"dgx1{F}gpu*{F}mix{F}mapa_ring2,mapa_noring3,mapa_noring4\n"
    f"dgx1{F}dgx{F}mix{F}mapa_ring2,mapa_noring3,mapa_noring4\n"
    f"dgx2{F}gpu*{F}mix{F}mapa_ring2,mapa_ring3,mapa_noring4\n"
    f"dgx2{F}dgx{F}mix{F}mapa_ring2,mapa_ring3,mapa_noring4\n"
    f"torus1{F}gpu*{F}idle{F}bigmem,ib,mapa_ring2,mapa_noring3,mapa_ring4\n"
    f"summit1{F}gpu*{F}drain{F}bigmem,ib,mapa_ring4\n"
    f"down1{F}gpu*{F}idle*{F}(null)\n"
)


def job(job_id: int, comment: str = REQUIRE, reason: str = "BeginTime", partition: str = "dgx", features: str = "",
        gres: str = "gres/gpu:3", state: object = ("PENDING",)) -> dict:
    """One `.jobs[]` record, with the fields `mapa release` reads, as 24.11 prints them."""
    return {"comment": comment, "features": features, "job_id": job_id,
            "job_state": list(state) if isinstance(state, tuple) else state, "partition": partition,
            "state_reason": reason, "tres_per_node": gres, "user_name": "u"}


def squeue_json(*records: dict) -> str:
    return json.dumps({"jobs": list(records), "meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}},
                       "errors": [], "warnings": []}, indent=2)


class FakeSlurm:
    """squeue, sinfo and scontrol over one table of pending jobs. squeue prints any ``--format``
    as the real one does, each field's text as it is (a comment may hold the separators or a
    newline), and ``--json`` through json.dumps; so the same table feeds the old one-call format
    and the new two calls."""

    def __init__(self, jobs: list[dict], sinfo: str = SINFO_TEXT, honour_filters: bool = True) -> None:
        self.jobs, self.sinfo, self.honour_filters = jobs, sinfo, honour_filters
        self.nodes = ""  # `scontrol --oneliner show nodes`
        self.calls: list[list[str]] = []

    def released(self) -> list[str]:
        return [argv[2].removeprefix("JobId=") for argv in self.calls if argv[:2] == ["scontrol", "update"]]

    def __call__(self, argv: list[str]) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sinfo":
            return self.sinfo
        if argv[:3] == ["scontrol", "--oneliner", "show"]:
            return self.nodes
        if argv[:2] == ["scontrol", "update"]:
            return ""
        assert argv[0] == "squeue", argv
        pending = [j for j in self.jobs if "PENDING" in j["job_state"]]
        if "--json" in argv:
            asked = next(a for a in argv if a.startswith("--jobs=")).removeprefix("--jobs=").split(",")
            shown = [j for j in pending if str(j["job_id"]) in asked] if self.honour_filters else self.jobs
            return squeue_json(*shown)
        fmt = next(a for a in argv if a.startswith("--format=")).removeprefix("--format=")
        fields = {"A": "job_id", "r": "state_reason", "P": "partition", "f": "features", "b": "tres_per_node", "k": "comment"}
        return "".join(re.sub(r"%([ArPfbk])", lambda m: str(j[fields[m.group(1)]]) or "(null)", fmt) + "\n" for j in pending)


def test_argv_are_fixed_and_shell_free() -> None:
    assert squeue_argv("squeue") == ["squeue", "--noheader", "--states=PENDING", "--format=%A %r"]
    assert squeue_json_argv("/usr/bin/squeue", ["41", "42"]) == ["/usr/bin/squeue", "--json", "--states=PENDING", "--jobs=41,42"]
    for bad in ([], ["41,42"], ["--all"], ["41", "x"]):
        with pytest.raises(ValueError, match="accepted: one or more ids"):
            squeue_json_argv("squeue", bad)
    assert sinfo_argv("/usr/bin/sinfo") == ["/usr/bin/sinfo", "--noheader", "--Node", f"--format=%N{F}%P{F}%t{F}%b"]
    assert release_argv("scontrol", "41") == ["scontrol", "update", "JobId=41", "StartTime=now"]


def test_parse_pending_reads_ids_and_whole_reasons() -> None:
    assert parse_pending(SQUEUE_TEXT) == [("41", "BeginTime"), ("42", "BeginTime"), ("43", "Resources"), ("44", "BeginTime"),
                                          ("50", "ReqNodeNotAvail, UnavailableNodes:dgx1")]
    assert parse_pending("") == [] and parse_pending("\n") == []
    assert parse_pending("7 BeginTime\r\n7 BeginTime\n") == [("7", "BeginTime")]  # each id once


@pytest.mark.parametrize("line", ["x41 BeginTime", "41", "41\tBeginTime", " 41 BeginTime", "-41 BeginTime",
                                  f"41{F}BeginTime", "1234567890123 BeginTime"])
def test_parse_pending_refuses_a_line_that_is_not_an_id_and_a_reason(line) -> None:
    with pytest.raises(commands.CommandFailed, match="expected a job id, a space and the reason") as caught:
        parse_pending(f"41 BeginTime\n{line}\n")
    assert repr(line)[:40] in str(caught.value)
    with pytest.raises(commands.CommandFailed, match="printed"):
        parse_pending("1 BeginTime\n" * (commands.MAX_OUTPUT_BYTES // 12 + 1))


def test_parse_waiting_json_reads_every_record() -> None:
    jobs = parse_waiting_json(SQUEUE_JSON, ["41", "42", "44"])
    assert [job.job_id for job in jobs] == ["41", "42", "44"]
    assert jobs[0] == WaitingJob("41", "BeginTime", ("dgx",), "", "gres/gpu:3", REQUIRE)
    assert jobs[1] == WaitingJob("42", "BeginTime", ("dgx", "gpu"), "bigmem&ib", "gres/gpu:v100:4",
                                 "my run [mapa:topology=ring sensitive=yes placement=require wait=5]")
    assert jobs[2].comment == "" and jobs[2].constraint == ""
    assert parse_waiting_json(SQUEUE_JSON, ["42"]) == [jobs[1]]  # only the jobs asked for
    assert parse_waiting_json(squeue_json(), ["41"]) == []


def test_only_pending_begin_time_records_of_the_jobs_asked_for_are_read() -> None:
    """Whatever squeue answers (it may ignore --jobs or --states, a job may start meanwhile)."""
    text = squeue_json(job(60), job(61, reason="Resources"), job(62, state=("RUNNING",)), job(63, state="PENDING"),
                       job(64, state=("PENDING", "REQUEUED")), job(65), job(60, comment=""))
    assert [j.job_id for j in parse_waiting_json(text, ["60", "61", "62", "63", "64"])] == ["60", "63", "64"]
    assert parse_waiting_json(text, ["60"])[0].comment == REQUIRE  # the first record of a job, once


@pytest.mark.parametrize("change", [
    {"job_id": "70"}, {"job_id": True}, {"job_id": 70.0}, {"job_id": 0}, {"job_id": 10**12}, {"comment": None},
    {"comment": ["mapa:sensitive=yes"]}, {"partition": 3}, {"features": None}, {"tres_per_node": {"gpu": 4}},
    {"job_state": None}, {"job_state": {"current": ["PENDING"]}}, {"state_reason": None},
])
def test_a_record_with_a_missing_or_ill_typed_field_is_skipped(change) -> None:
    good, bad = job(71), {**job(70), **change}
    assert [j.job_id for j in parse_waiting_json(squeue_json(bad, good), ["70", "71"])] == ["71"]
    for key in ("job_id", "comment", "partition", "features", "tres_per_node", "job_state", "state_reason"):
        missing = {k: v for k, v in job(70).items() if k != key}
        assert [j.job_id for j in parse_waiting_json(squeue_json(missing, good), ["70", "71"])] == ["71"]
    assert parse_waiting_json('{"jobs": [1, "x", null, []]}', ["1"]) == []


@pytest.mark.parametrize("text,message", [
    ("", "not JSON"), ("41 BeginTime\n", "not JSON"), ('{"jobs": [', "not JSON"), ("[]", "no jobs list"),
    ('"jobs"', "no jobs list"), ("{}", "no jobs list"), ('{"jobs": {"41": {}}}', "no jobs list"),
    ('{"jobs": [], "errors": [{"description": "Invalid job id specified", "error_number": 2017}]}', "reported errors"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply|not JSON"),
    ("1" * (commands.MAX_OUTPUT_BYTES + 1), "accepted: at most"),
])
def test_output_that_is_not_squeues_json_fails_the_call(text, message) -> None:
    with pytest.raises(commands.CommandFailed, match=message):
        parse_waiting_json(text, ["41"])


def test_parse_nodes_drops_the_default_marker_and_checks_names() -> None:
    nodes = parse_nodes(SINFO_TEXT)
    assert nodes[0] == NodeLine("dgx1", "gpu", "mix", frozenset({"mapa_ring2", "mapa_noring3", "mapa_noring4"}))
    assert nodes[-1].features == frozenset()
    with pytest.raises(commands.CommandFailed, match="not feature names"):
        parse_nodes(f"n1{F}gpu{F}idle{F}good,bad name\n")
    with pytest.raises(commands.CommandFailed, match="expected node, partition, state, features"):
        parse_nodes("n1 gpu idle mapa_ring2\n")
    with pytest.raises(commands.CommandFailed, match="printed"):
        parse_nodes("x" * (commands.MAX_OUTPUT_BYTES + 1))


def test_wanted_features_only_for_waiting_require_jobs_with_a_per_node_gpu_count() -> None:
    jobs = {j.job_id: j for j in parse_waiting_json(SQUEUE_JSON, ["41", "42", "44"])}
    assert wanted_features(jobs["41"]) == {"mapa_ring3"}
    assert wanted_features(jobs["42"]) == {"bigmem", "ib", "mapa_ring4"}
    assert wanted_features(WaitingJob("43", "Resources", ("dgx",), "", "gres/gpu:3", REQUIRE)) is None
    others = [job(44, comment=""), job(45, comment="mapa:topology=ring sensitive=yes"), job(46, features="a|b"),
              job(47, gres=""), job(48, comment="mapa:topology=rnig sensitive=yes placement=require")]
    parsed = parse_waiting_json(squeue_json(*others), [str(n) for n in range(44, 49)])
    assert len(parsed) == 5 and [wanted_features(j) for j in parsed] == [None] * 5
    assert wanted_features(parse_waiting_json(squeue_json(job(49, gres="gres:gpu:4")), ["49"])[0]) == {"mapa_ring4"}


def test_jobs_start_where_a_node_in_service_of_their_partition_has_every_feature() -> None:
    jobs = parse_waiting_json(SQUEUE_JSON, ["41", "42", "44"])
    released = jobs_to_release(jobs, parse_nodes(SINFO_TEXT))
    # 41: dgx2 has mapa_ring3. 42 needs bigmem&ib&mapa_ring4: torus1 (partition gpu) has them;
    # summit1 is drained and does not count.
    assert released == [("41", "dgx2"), ("42", "torus1")]
    drained = SINFO_TEXT.replace(f"torus1{F}gpu*{F}idle", f"torus1{F}gpu*{F}drain")
    assert jobs_to_release(jobs, parse_nodes(drained)) == [("41", "dgx2")]
    no_ring = SINFO_TEXT.replace("mapa_ring3", "mapa_noring3")
    assert jobs_to_release(jobs, parse_nodes(no_ring)) == [("42", "torus1")]


def test_release_once_updates_the_jobs_and_goes_on_after_a_failed_update() -> None:
    calls: list[list[str]] = []
    logged: list[str] = []

    def run(argv: list[str]) -> str:
        calls.append(argv)
        if argv[:2] == ["squeue", "--json"]:
            return SQUEUE_JSON
        if argv[0] == "squeue":
            return SQUEUE_TEXT
        if argv[0] == "sinfo":
            return SINFO_TEXT
        if argv[2] == "JobId=41":
            raise commands.CommandFailed("scontrol update exited 1: Job has already started")
        return ""

    assert release_once(run, log=logged.append) == 1
    assert calls[1] == squeue_json_argv("squeue", ["41", "42", "44"])  # only the jobs waiting for their begin time
    assert calls[3:] == [release_argv("scontrol", "41"), release_argv("scontrol", "42")]
    assert "job 41" in logged[0] and "already started" in logged[0]
    assert "job 42" in logged[1] and "torus1" in logged[1]


def test_release_once_asks_sinfo_nothing_when_no_job_waits_for_its_begin_time() -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> str:
        calls.append(argv)
        return "60 Resources\n61 Priority\n"

    assert release_once(run) == 0
    assert [argv[0] for argv in calls] == ["squeue"]
    slurm = FakeSlurm([job(62, comment="")])  # waits for its begin time, but is no placement=require job
    assert release_once(slurm) == 0 and [argv[0] for argv in slurm.calls] == ["squeue", "squeue"]


@pytest.mark.parametrize("victim_reason", ["BeginTime", "Priority"])
def test_a_comment_cannot_forge_a_record_that_releases_another_users_job(victim_reason) -> None:
    """Issue #31: job 89's user writes, in its comment, a record for job 90 (someone else's job,
    waiting for its begin time or its priority) claiming placement=require. Read from a separator
    format (the old single squeue call), that record made `mapa release` start job 90 now."""
    forged = f"{R}90{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}{REQUIRE}"
    for comment in (f"my run{forged}", f"my run{forged}\n", f"{forged}{R}", f"x\n{forged}", f"x{F}{F}{F}{F}{forged}"):
        slurm = FakeSlurm([job(89, comment=comment), job(90, comment="", reason=victim_reason)])
        release_once(slurm, log=[].append)
        assert "90" not in slurm.released(), comment
        assert not any(argv[0] == "scontrol" and "JobId=90" in argv for argv in slurm.calls)
    # The same job 90, with the directive in its own comment, is released: the test's scene works.
    slurm = FakeSlurm([job(89, comment="x"), job(90, comment=REQUIRE)])
    assert release_once(slurm, log=[].append) == 1 and slurm.released() == ["90"]


def test_a_squeue_that_ignores_jobs_and_states_releases_only_the_jobs_asked_for() -> None:
    slurm = FakeSlurm([job(91, comment=""), job(92, reason="Resources"), job(93, state=("RUNNING",))], honour_filters=False)
    assert release_once(slurm, log=[].append) == 0 and slurm.released() == []
    assert [argv[-1] for argv in slurm.calls if "--json" in argv] == ["--jobs=91"]


def test_many_waiting_jobs_are_asked_for_in_batches_and_a_failed_batch_spoils_only_itself() -> None:
    count = 2 * JSON_BATCH + 7
    assert JSON_BATCH <= 500
    slurm = FakeSlurm([job(1000 + n) for n in range(count)])
    assert release_once(slurm, log=[].append) == count
    asked = [argv[-1].removeprefix("--jobs=").split(",") for argv in slurm.calls if "--json" in argv]
    assert [len(batch) for batch in asked] == [JSON_BATCH, JSON_BATCH, 7]
    assert sum(asked, []) == [str(1000 + n) for n in range(count)]

    def run(argv: list[str]) -> str:
        if "--json" in argv and "--jobs=1000," in argv[-1] + ",":
            return "slurm_load_jobs error: Unable to contact slurm controller"
        return slurm(argv)

    slurm.calls.clear()
    with pytest.raises(commands.CommandFailed, match="1 batch.*not JSON"):
        release_once(run, log=[].append)
    assert len(slurm.released()) == count - JSON_BATCH and "1000" not in slurm.released()


_TRICKY = st.sampled_from([R, F, "\n", "\r", '"', "\\", "\\u001e", '"}, {"job_id": 90, "', "}]}", "\x00", "\u2028",
                           "90", "BeginTime", "dgx", "gres/gpu:3", "(null)", "mapa:", REQUIRE, f" [{REQUIRE[:-1]}]",
                           f"{R}90{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}{REQUIRE}\n"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(comment=st.lists(_TRICKY | st.text(max_size=8), max_size=12).map("".join),
       victim_reason=st.sampled_from(["BeginTime", "Priority", "Resources"]))
def test_no_comment_releases_any_job_but_its_own(comment, victim_reason) -> None:
    """Any comment, carried through squeue as squeue carries it, is read back as exactly that
    comment of exactly its job; at most its own job is released, never the victim."""
    attacker, victim = job(89, comment=comment), job(90, comment="my own, later", reason=victim_reason)
    assert parse_waiting_json(squeue_json(attacker, victim), ["89", "90"])[0] == WaitingJob(
        "89", "BeginTime", ("dgx",), "", "gres/gpu:3", comment)
    slurm = FakeSlurm([attacker, victim])
    release_once(slurm, log=[].append)
    assert set(slurm.released()) <= {"89"}


def test_the_command_checks_its_interval(capsys) -> None:
    assert main(["release", "--every", "0"]) != 0
    assert "--every must be 1 to 3600 seconds" in capsys.readouterr().err


def test_the_cost_rules_curve_is_checked_before_any_pass(capsys) -> None:
    assert main(["release", "--wait-rule", "cost", "--time-curve", "12:3,oops"]) != 0
    assert "time curve point 'oops'" in capsys.readouterr().err
    assert main(["release", "--wait-rule", "cost", "--time-curve", "50:1,12:3"]) != 0
    assert "must increase" in capsys.readouterr().err
    assert main(["release", "--wait-rule", "sometimes"]) == 2  # one line (issue 52), not argparse's usage block
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
    assert main(["release", "--time-curve", "12:3,50:1"]) != 0  # a curve the fixed rule would ignore
    assert "give --wait-rule cost too" in capsys.readouterr().err


def test_a_missing_slurm_command_is_an_error_line_naming_the_option(tmp_path, capsys) -> None:
    """Issue 39: without squeue on PATH, one pass said `mapa release: cannot run squeue: ...` with no
    `error:` and no hint; it exits 1 with both."""
    from slurm_mapa.cli import main as mapa_main

    missing = str(tmp_path / "no-such-squeue")
    assert mapa_main(["release", "--squeue", missing]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mapa release: error: cannot run {missing}") and "give --squeue" in err, err


def test_a_missing_compiler_is_named_with_what_to_install(tmp_path, capsys) -> None:
    import os

    from slurm_mapa.cli import main as mapa_main

    target = tmp_path / "lib"
    target.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(target, 0o755)
    assert mapa_main(["spank-plugin", str(target / "spank_mapa_isolate.so"), "--cc", "no-such-cc"]) == 2
    err = capsys.readouterr().err
    assert "cannot run the compiler 'no-such-cc': it is not on this node's PATH" in err and "libslurm-dev" in err, err
    assert "Errno" not in err


# `scontrol --oneliner show nodes` (Slurm 24.11, abridged): a DGX-1 whose 4-rings are all held until
# Unix time 1_000_600, a PCIe node with a 4-GPU set free now, a node without MAPA's outlook, and
# one whose Extra is a site's own text.
NODES_TEXT = (
    "NodeName=dgx1 Arch=x86_64 ActiveFeatures=mapa_ring2,mapa_noring4 Gres=gpu:8(S:0-1) State=MIXED Partitions=gpu,dgx "
    "Extra=mapa_ring2=48.1/58.93@0,mapa_ring4=-/53.6@1000600\n"
    "NodeName=pcie1 Arch=x86_64 ActiveFeatures=mapa_noring2,mapa_noring4 Gres=gpu:pcie:8 State=IDLE Partitions=gpu "
    "Extra=mapa_ring2=12.3/58.93@-,mapa_ring4=12.3/53.6@-\n"
    "NodeName=torus1 Arch=x86_64 ActiveFeatures=(null) Gres=gpu:16 State=IDLE Partitions=gpu\n"
    "NodeName=site1 Arch=x86_64 ActiveFeatures=(null) Gres=gpu:a100:2,gpu:h100:2 State=IDLE Partitions=gpu Extra={\"rack\":1}\n"
)
COST_SINFO = (f"dgx1{F}gpu*{F}mix{F}mapa_ring2,mapa_noring4\npcie1{F}gpu*{F}idle{F}mapa_noring2,mapa_noring4\n"
              f"torus1{F}gpu*{F}idle{F}(null)\n")
PAPER = TimeModel()


def waiting(job_id: str, gpus: int = 4, limit_s: float | None = 3600.0) -> WaitingJob:
    return WaitingJob(job_id, "BeginTime", ("gpu",), "", f"gres/gpu:{gpus}", REQUIRE, limit_s)


def test_node_outlooks_are_read_from_scontrol_show_nodes() -> None:
    found = parse_node_outlooks(NODES_TEXT)
    assert found["dgx1"] == NodeOutlook(8, {"mapa_ring2": RingOutlook(48.1, 58.93, 0.0), "mapa_ring4": RingOutlook(None, 53.6, 1000600.0)})
    assert found["pcie1"].gpus == 8 and found["pcie1"].rings["mapa_ring4"] == RingOutlook(12.3, 53.6, None)
    assert found["torus1"] == NodeOutlook(16, {}) and found["site1"] == NodeOutlook(4, {})  # not MAPA's: none
    assert nodes_argv("/usr/bin/scontrol") == ["/usr/bin/scontrol", "--oneliner", "show", "nodes"]
    with pytest.raises(commands.CommandFailed, match="NodeName= first"):
        parse_node_outlooks("Arch=x86_64 Gres=gpu:8\n")
    # An admin's reason naming another node or an Extra forges nothing: the line's node keeps none.
    forged = parse_node_outlooks("NodeName=n1 Gres=gpu:8 Reason=see_NodeName=dgx1 Extra=mapa_ring4=9/9@0 Extra=x\n")
    assert forged == {"n1": NodeOutlook(8, {})}


def test_a_job_holds_out_while_the_expected_wait_is_shorter_than_what_starting_now_loses() -> None:
    nodes, outlooks = parse_nodes(COST_SINFO), parse_node_outlooks(NODES_TEXT)
    # Now on pcie1's 12.3 GB/s ring against the best 53.6: the curve at 60 x 12.3/53.6 = 13.8 GB/s,
    # 2.861x; 3600 s x (2.861 - 1) lost, x (1 + 3 queued x 4 / 32 GPUs).
    loss = 3600 * (PAPER.slowdown_against(12.3, 53.6) - 1.0) * (1 + 3 * 4 / 32)
    assert loss == pytest.approx(9213.1, abs=0.1)
    assert holding_out_costs_more([waiting("41")], nodes, outlooks, 3, now=1_000_000, curve=PAPER) == []  # 600 s < loss
    late = 1_000_600 - loss - 1  # the wait is now just longer than the loss: start now
    released = holding_out_costs_more([waiting("41")], nodes, outlooks, 3, now=late, curve=PAPER)
    assert released == [("41", "a good 4-GPU ring is expected in 9214 s; starting now (a ring of 12.3 GB/s or better) loses 9213 s")]
    # A short job loses less than it would wait (200 s x 1.861 x 1.375 = 512 s < 600 s); a job with no time limit holds out.
    assert [j for j, _ in holding_out_costs_more([waiting("41", limit_s=200.0), waiting("42", limit_s=None)], nodes, outlooks, 3,
                                                  now=1_000_000, curve=PAPER)] == ["41"]


def test_the_second_job_holding_out_for_the_same_ring_expects_the_next_one() -> None:
    """dgx1 expects a good 4-ring in 600 s, dgx2 in 20000 s: the first job holds out for dgx1's; the
    second expects dgx2's, longer than it would lose (8711 s), and starts now. A 2-GPU job whose
    good ring is free now is left to the good-node rule (jobs_to_release)."""
    nodes = parse_nodes(COST_SINFO + f"dgx2{F}gpu*{F}mix{F}mapa_ring2,mapa_noring4\n")
    outlooks = parse_node_outlooks(NODES_TEXT + "NodeName=dgx2 Gres=gpu:8 State=MIXED Extra=mapa_ring4=-/53.6@1020000\n")
    two = holding_out_costs_more([waiting("41"), waiting("42"), waiting("43", gpus=2)], nodes, outlooks, 3, now=1_000_000, curve=PAPER)
    assert two == [("42", "a good 4-GPU ring is expected in 20000 s; starting now (a ring of 12.3 GB/s or better) loses 8711 s")]
    # With dgx2 out of service, the second job expects the last ring expected (dgx1's), as the replay does.
    nodes = parse_nodes(COST_SINFO + f"dgx2{F}gpu*{F}drain{F}mapa_ring2,mapa_noring4\n")
    assert holding_out_costs_more([waiting("41"), waiting("42")], nodes, outlooks, 3, now=1_000_000, curve=PAPER) == []


def test_a_job_no_node_can_run_now_holds_out() -> None:
    nodes = parse_nodes(COST_SINFO.replace("pcie1", "pcieX"))  # pcie1 is not in the job's partition's service list
    assert holding_out_costs_more([waiting("41")], nodes, parse_node_outlooks(NODES_TEXT), 3, now=1e9, curve=PAPER) == []
    other = WaitingJob("44", "BeginTime", ("dgx",), "", "gres/gpu:4", REQUIRE, 3600.0)  # pcie1 is not in partition dgx
    assert holding_out_costs_more([other], parse_nodes(COST_SINFO), parse_node_outlooks(NODES_TEXT), 3, now=1e9, curve=PAPER) == []


def test_release_once_with_the_cost_rule_asks_the_outlooks_only_for_jobs_still_holding_out() -> None:
    record = dict(job(41, gres="gres/gpu:4", partition="gpu"), time_limit={"set": True, "infinite": False, "number": 10})
    slurm = FakeSlurm([record, job(45, comment="", partition="gpu")], sinfo=COST_SINFO)
    slurm.nodes = NODES_TEXT
    logged: list[str] = []
    # 10 minutes on pcie1 lose 600 x 1.968 x (1 + 1 queued x 4 / 32) = 1328 s, less than dgx1's expected wait
    # from 999000 (1600 s): it starts now; from 1000500 (100 s) it holds out.
    assert release_once(slurm, log=logged.append, curve=PAPER, clock=lambda: 999_000.0) == 1
    assert slurm.calls[-2] == nodes_argv("scontrol") and slurm.released() == ["41"]
    assert "expected in 1600 s" in logged[0]
    slurm.calls.clear()
    assert release_once(slurm, log=logged.append, curve=PAPER, clock=lambda: 1_000_500.0) == 0  # 100 s: it holds out
    slurm.calls.clear()
    assert release_once(slurm, log=logged.append) == 0 and nodes_argv("scontrol") not in slurm.calls  # the fixed rule
