"""`mapa release`: parsing squeue/sinfo output and deciding which placement=require jobs start now."""

from __future__ import annotations

import pytest

from slurm_mapa.cli import main
from slurm_mapa.slurm import commands
from slurm_mapa.slurm.release import (
    NodeLine,
    WaitingJob,
    jobs_to_release,
    parse_nodes,
    parse_waiting,
    release_argv,
    release_once,
    sinfo_argv,
    squeue_argv,
    wanted_features,
)

R, F = "\x1e", "\x1f"
# What squeue_argv printed in the mini cluster (Slurm 24.11.5), fields joined by \x1f.
SQUEUE_TEXT = (
    f"{R}41{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}mapa:topology=ring sensitive=yes placement=require wait=10\n"
    f"{R}42{F}BeginTime{F}dgx,gpu{F}bigmem&ib{F}gres/gpu:v100:4{F}my run [mapa:topology=ring sensitive=yes placement=require wait=5]\n"
    f"{R}43{F}Resources{F}dgx{F}(null){F}gres/gpu:3{F}mapa:topology=ring sensitive=yes placement=require wait=10\n"
    f"{R}44{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}(null)\n"
    f"{R}45{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}mapa:topology=ring sensitive=yes\n"
    f"{R}46{F}BeginTime{F}dgx{F}a|b{F}gres/gpu:3{F}mapa:topology=ring sensitive=yes placement=require wait=10\n"
    f"{R}47{F}BeginTime{F}dgx{F}(null){F}(null){F}mapa:topology=ring sensitive=yes placement=require wait=10\n"
    f"{R}48{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}mapa:topology=rnig sensitive=yes placement=require\n"
)
SINFO_TEXT = (
    f"dgx1{F}gpu*{F}mix{F}mapa_ring2,mapa_noring3,mapa_noring4\n"
    f"dgx1{F}dgx{F}mix{F}mapa_ring2,mapa_noring3,mapa_noring4\n"
    f"dgx2{F}gpu*{F}mix{F}mapa_ring2,mapa_ring3,mapa_noring4\n"
    f"dgx2{F}dgx{F}mix{F}mapa_ring2,mapa_ring3,mapa_noring4\n"
    f"torus1{F}gpu*{F}idle{F}bigmem,ib,mapa_ring2,mapa_noring3,mapa_ring4\n"
    f"summit1{F}gpu*{F}drain{F}bigmem,ib,mapa_ring4\n"
    f"down1{F}gpu*{F}idle*{F}(null)\n"
)


def test_argv_are_fixed_and_shell_free() -> None:
    assert squeue_argv("squeue") == ["squeue", "--noheader", "--states=PENDING", f"--format={R}%A{F}%r{F}%P{F}%f{F}%b{F}%k"]
    assert sinfo_argv("/usr/bin/sinfo") == ["/usr/bin/sinfo", "--noheader", "--Node", f"--format=%N{F}%P{F}%t{F}%b"]
    assert release_argv("scontrol", "41") == ["scontrol", "update", "JobId=41", "StartTime=now"]


def test_parse_waiting_reads_every_record() -> None:
    jobs = parse_waiting(SQUEUE_TEXT)
    assert [job.job_id for job in jobs] == [str(n) for n in range(41, 49)]
    assert jobs[1] == WaitingJob("42", "BeginTime", ("dgx", "gpu"), "bigmem&ib", "gres/gpu:v100:4",
                                 "my run [mapa:topology=ring sensitive=yes placement=require wait=5]")
    assert jobs[3].comment == "" and jobs[0].constraint == ""


def test_records_that_cannot_be_read_are_skipped_not_guessed() -> None:
    text = (f"{R}51{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}a comment with a {R} inside [mapa:sensitive=yes placement=require]\n"
            f"{R}x52{F}BeginTime{F}dgx{F}(null){F}gres/gpu:3{F}mapa:sensitive=yes placement=require\n"
            f"{R}53{F}BeginTime{F}dgx{F}gres/gpu:3\n"
            f"{R}54{F}BeginTime{F}dgx{F}(null){F}gres/gpu:2{F}multi\nline {F} comment\n")
    jobs = parse_waiting(text)
    # 51's comment is cut at the separator (its directive lost), the others are dropped.
    assert [job.job_id for job in jobs] == ["51"] and jobs[0].comment == "a comment with a "
    assert [wanted_features(job) for job in jobs] == [None]
    assert parse_waiting("") == []


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
    jobs = {job.job_id: job for job in parse_waiting(SQUEUE_TEXT)}
    assert wanted_features(jobs["41"]) == {"mapa_ring3"}
    assert wanted_features(jobs["42"]) == {"bigmem", "ib", "mapa_ring4"}
    assert [wanted_features(jobs[j]) for j in ("43", "44", "45", "46", "47", "48")] == [None] * 6


def test_jobs_start_where_a_node_in_service_of_their_partition_has_every_feature() -> None:
    released = jobs_to_release(parse_waiting(SQUEUE_TEXT), parse_nodes(SINFO_TEXT))
    # 41: dgx2 has mapa_ring3. 42 needs bigmem&ib&mapa_ring4: torus1 (partition gpu) has them;
    # summit1 is drained and does not count.
    assert released == [("41", "dgx2"), ("42", "torus1")]
    drained = SINFO_TEXT.replace(f"torus1{F}gpu*{F}idle", f"torus1{F}gpu*{F}drain")
    assert jobs_to_release(parse_waiting(SQUEUE_TEXT), parse_nodes(drained)) == [("41", "dgx2")]
    no_ring = SINFO_TEXT.replace("mapa_ring3", "mapa_noring3")
    assert jobs_to_release(parse_waiting(SQUEUE_TEXT), parse_nodes(no_ring)) == [("42", "torus1")]


def test_release_once_updates_the_jobs_and_goes_on_after_a_failed_update() -> None:
    calls: list[list[str]] = []
    logged: list[str] = []

    def run(argv: list[str]) -> str:
        calls.append(argv)
        if argv[0] == "squeue":
            return SQUEUE_TEXT
        if argv[0] == "sinfo":
            return SINFO_TEXT
        if argv[2] == "JobId=41":
            raise commands.CommandFailed("scontrol update exited 1: Job has already started")
        return ""

    assert release_once(run, log=logged.append) == 1
    assert calls[2:] == [release_argv("scontrol", "41"), release_argv("scontrol", "42")]
    assert "job 41" in logged[0] and "already started" in logged[0]
    assert "job 42" in logged[1] and "torus1" in logged[1]


def test_release_once_asks_sinfo_nothing_when_no_job_waits_for_its_begin_time() -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> str:
        calls.append(argv)
        return f"{R}60{F}Resources{F}dgx{F}(null){F}gres/gpu:3{F}(null)\n"

    assert release_once(run) == 0
    assert [argv[0] for argv in calls] == ["squeue"]


def test_the_command_checks_its_interval(capsys) -> None:
    assert main(["release", "--every", "0"]) != 0
    assert "--every must be 1 to 3600 seconds" in capsys.readouterr().err
