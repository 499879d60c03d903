"""Readers of sacct text and JSON, the MAPA job file, directives, site rules and generators."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import TEST_DATA

from slurm_mapa.errors import InputError
from slurm_mapa.replay.directives import make_rules, read_intent
from slurm_mapa.replay.generate import SENSITIVE, generate
from slurm_mapa.replay.jobfile import read_jobfile, write_jobfile
from slurm_mapa.replay.jobs import ReadStats
from slurm_mapa.replay.sacct import first_node, gpus_in_tres, parse_elapsed, read_sacct_json, read_sacct_text

DATA = TEST_DATA / "sacct"

FACTS = """JobID|JobName|User|Account|Partition|Submit|Start|End|Elapsed|ElapsedRaw|State|ExitCode|NodeList|AllocTRES|Comment|AdminComment|SystemComment
33|replay1|alice|research|gpu|2026-11-22T05:38:04|2026-11-22T05:38:56|2026-11-22T05:38:59|00:00:03|3|COMPLETED|0:0|n1|billing=1,cpu=1,gres/gpu=1,node=1|mapa-user-visible|mapa:topology=ring sensitive=yes|
37|live|alice|research|gpu|2026-11-22T05:39:07|2026-11-22T05:39:07|2026-11-22T05:39:18|00:00:11|11|CANCELLED by 0|0:0|n1|billing=1,cpu=1,gres/gpu=2,node=1|mapa-user-visible|mapa:topology=ring sensitive=yes|
"""


def test_parsable2_literal_from_the_facts():
    stats = ReadStats()
    jobs = list(read_sacct_text(FACTS.splitlines(), stats))
    assert [j.id for j in jobs] == ["33", "37"]
    assert jobs[0].gpus == 1 and jobs[1].gpus == 2
    assert jobs[1].runtime == 11 and jobs[1].sensitive and jobs[1].shape == "ring"
    assert jobs[0].submit + 52 == jobs[0].start
    assert jobs[0].node == "n1" and jobs[0].source == "directive"
    assert stats.jobs == 2 and not stats.malformed


def test_parsable2_file_with_trailing_delimiter_lines():
    stats = ReadStats()
    jobs = list(read_sacct_text((DATA / "facts-5.3-P.txt").read_text().splitlines(), stats))
    assert len(jobs) == 5
    plain = next(j for j in jobs if j.id == "36")
    assert plain.runtime == 0 and plain.sensitive is False and plain.source == "default"


def test_dash_p_any_order_steps_arrays_het_typed_gres_and_bad_lines():
    stats = ReadStats()
    jobs = {j.id: j for j in read_sacct_text((DATA / "mixed-p.txt").read_text().splitlines(), stats)}
    assert set(jobs) == {"200", "201_3", "202+0", "207"}
    assert jobs["207"].source == "default"  # a bad directive is counted and the job replays with the default
    assert jobs["200"].gpus == 2 and jobs["200"].recorded == (0, 3) and jobs["200"].node == "g1"
    assert jobs["202+0"].shape == "tree" and jobs["202+0"].sensitive
    assert jobs["201_3"].runtime == 60
    assert stats.skipped["step lines"] == 2
    assert stats.skipped["never started"] == 1
    assert stats.skipped["still running (no End)"] == 1
    assert stats.skipped["no GPUs"] == 1  # 202+1
    reasons = " ".join(stats.malformed)
    assert "unreadable" in reasons and "fields for" in reasons and "bad directive" in reasons
    assert stats.malformed_total == 3
    assert "malformed" in stats.summary()


def test_missing_header_is_an_error_naming_the_fields():
    with pytest.raises(InputError, match="JobID, Submit, Start"):
        list(read_sacct_text(["33|replay1|alice"]))
    with pytest.raises(InputError, match="empty"):
        list(read_sacct_text([]))


def test_comment_with_a_pipe_is_counted_not_fatal():
    text = FACTS.splitlines()[:1] + ["38|x|a|r|gpu|2026-11-22T05:39:07|2026-11-22T05:39:07|2026-11-22T05:39:18|00:00:11|11|COMPLETED|0:0|n1|gres/gpu=1|a|x|b|mapa:topology=ring|"]
    stats = ReadStats()
    assert list(read_sacct_text(text, stats)) == []
    assert "use --json" in next(iter(stats.malformed))


def test_sacct_json():
    stats = ReadStats()
    jobs = {j.id: j for j in read_sacct_json((DATA / "sample.json").read_text(), stats)}
    assert set(jobs) == {"33", "40_2"}
    assert jobs["33"].gpus == 2 and jobs["33"].recorded == (0, 3) and jobs["33"].sensitive
    assert jobs["40_2"].gpus == 1 and jobs["40_2"].node == "n1" and jobs["40_2"].runtime == 50
    assert stats.skipped["never started"] == 1 and stats.malformed_total == 1
    with pytest.raises(InputError, match="not JSON"):
        list(read_sacct_json("{nope"))
    with pytest.raises(InputError, match='"jobs" list'):
        list(read_sacct_json("[]"))


def test_small_field_helpers():
    assert gpus_in_tres("billing=1,cpu=1,gres/gpu=4,node=1") == 4
    assert gpus_in_tres("cpu=1,gres/gpu:a100=2,gres/gpu:v100=1") == 3
    assert gpus_in_tres("cpu=1,gres/gpu=2,gres/gpu:a100=2") == 2
    assert gpus_in_tres("cpu=1,gres/gpumem=10") is None
    assert parse_elapsed("1-02:03:04") == 93784 and parse_elapsed("03:04") == 184
    assert first_node("gpu[01-04,7]") == "gpu01" and first_node("None assigned") is None


def test_directive_forms_and_recorded_decisions():
    assert read_intent("mapa:topology=ring sensitive=yes").sensitive is True
    assert read_intent("mapa:topology=ring sensitive=no").sensitive is False
    intent = read_intent("mapa: # n1=0,1 policy=preserve")
    assert intent.recorded == (0, 1) and intent.node == "n1"
    intent = read_intent("mapa:topology=tree sensitive=yes # n2=4-6 policy=preserve")
    assert intent.shape == "tree" and intent.recorded == (4, 5, 6) and intent.node == "n2"
    assert read_intent("mapa:topology=ring gpus=4").recorded is None  # the grammar's GPU count, not a decision
    assert read_intent("mapa-user-visible") is None
    with pytest.raises(InputError):
        read_intent("mapa:topology=blob")


def test_site_rules_apply_to_jobs_without_a_directive():
    rules = make_rules([{"name": "^replay", "directive": "topology=ring sensitive=yes"}])
    text = FACTS.splitlines()[:1] + [FACTS.splitlines()[1].replace("mapa:topology=ring sensitive=yes", "")]
    (job,) = read_sacct_text(text, rules=rules)
    assert job.sensitive and job.source == "rule"
    with pytest.raises(InputError, match="exactly one of"):
        make_rules([{"directive": "topology=ring"}])


def test_mapa_job_file_round_trip_and_bad_lines():
    text = "3,ring,17,11,1,inception-v3.sh\n2,clique,29,23,0,googlenet.sh\n\nx,ring,1,1,1\n2,ring,1,1,7,a.sh\n2,ring,1\n"
    stats = ReadStats()
    jobs = list(read_jobfile(text.splitlines(), stats))
    assert [(j.id, j.gpus, j.shape, j.submit, j.runtime, j.sensitive) for j in jobs] == [
        ("0", 3, "ring", 17, 11, True), ("1", 2, "all", 29, 23, False)]
    assert stats.malformed_total == 3
    again = list(read_jobfile(list(write_jobfile(jobs))))
    assert [(j.gpus, j.submit, j.runtime, j.sensitive) for j in again] == [(j.gpus, j.submit, j.runtime, j.sensitive) for j in jobs]


def test_generators_are_seeded_and_follow_the_paper():
    a = list(generate("paper", 600, seed=3))
    assert [(j.gpus, j.submit, j.task) for j in a] == [(j.gpus, j.submit, j.task) for j in generate("paper", 600, seed=3)]
    assert {j.gpus for j in a} == {1, 2, 3, 4, 5}
    assert all(j.sensitive == SENSITIVE[j.task[:-3]] for j in a)
    assert 0.55 < sum(j.sensitive for j in a) / len(a) < 0.78
    assert [j.submit for j in a] == sorted(j.submit for j in a)
    mixed = list(generate("paper", 200, seed=1, patterns=("ring", "tree")))
    assert {j.shape for j in mixed} == {"ring", "tree"}
    amaral = list(generate("amaral", 500, seed=2))
    gaps = [b.submit - a.submit for a, b in zip(amaral, amaral[1:])]
    assert 7 < sum(gaps) / len(gaps) < 13 and {j.gpus for j in amaral} <= {1, 2, 3}
    with pytest.raises(InputError, match="accepted: paper, amaral"):
        list(generate("nope", 1))


def test_recorded_decision_brings_its_free_set_and_policy():
    header = FACTS.splitlines()[0]
    line = ("41|ring|alice|research|gpu|2026-11-22T05:40:00|2026-11-22T05:40:01|2026-11-22T05:40:09|00:00:08|8|COMPLETED|0:0|dgx1|"
            "billing=2,cpu=2,gres/gpu=2,node=1||mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve free=0-3,6 "
            "eff=68.707 agg=175.000 pres=216.000|")
    (job,) = read_sacct_text([header, line])
    assert (job.node, job.recorded, job.recorded_free, job.recorded_policy) == ("dgx1", (0, 3), (0, 1, 2, 3, 6), "preserve")
    # A free set that does not contain the chosen GPUs is not trusted; the decision still is.
    (job,) = read_sacct_text([header, line.replace("free=0-3,6", "free=1,2")])
    assert job.recorded == (0, 3) and job.recorded_free is None
    (job,) = read_sacct_text([header, line.replace("free=0-3,6", "free=0-3,6 running=4,5/7")])
    assert job.recorded_running == ((4, 5), (7,))
    # Running jobs that overlap the free set (or each other) are not trusted.
    for bad in ("running=4,5/5,7", "running=3/7"):
        (job,) = read_sacct_text([header, line.replace("free=0-3,6", "free=0-3,6 " + bad)])
        assert job.recorded_running == () and job.recorded_free == (0, 1, 2, 3, 6)
    (job,) = read_sacct_text([header, line.replace("policy=preserve free=0-3,6", "policy=fallback fallback=no-topology")])
    assert job.recorded_policy == "fallback" and job.recorded_free is None
