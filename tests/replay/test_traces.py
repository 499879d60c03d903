"""Readers of public GPU-cluster traces (--format philly|helios|acme|pai|openb), on small files
written here from each trace's documented column layout (no trace data is bundled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_mapa.errors import InputError
from slurm_mapa.replay.cli import main
from slurm_mapa.replay.jobs import ReadStats
from slurm_mapa.replay.sources import _detect
from slurm_mapa.replay.traces import FRACTIONAL, read_helios, read_openb, read_pai, read_philly

KW = dict(rules=[], default_shape="ring", default_sensitive=False)

PHILLY = [
    {"status": "Pass", "vc": "ee9e8c", "jobid": "application_1_1", "submitted_time": "2017-10-07 01:11:39", "user": "ce2f4c",
     "attempts": [
         {"start_time": "2017-10-07 01:12:09", "end_time": "2017-10-07 01:13:23",
          "detail": [{"ip": "m47", "gpus": ["gpu0", "gpu1"]}]},
         {"start_time": "2017-10-07 01:13:30", "end_time": "2017-10-07 03:13:30",
          "detail": [{"ip": "m412", "gpus": [f"gpu{i}" for i in range(8)]}, {"ip": "m413", "gpus": [f"gpu{i}" for i in range(8)]}]},
     ]},
    {"status": "Killed", "vc": "ee9e8c", "jobid": "application_1_2", "submitted_time": "2017-10-07 02:00:00", "user": "x",
     "attempts": [{"start_time": "2017-10-07 02:00:05", "end_time": "2017-10-07 02:30:05",
                   "detail": [{"ip": "m47", "gpus": ["gpu0", "gpu1", "gpu2", "gpu3"]}]}]},
    {"status": "Failed", "vc": "a", "jobid": "application_1_3", "submitted_time": "2017-10-07 02:00:00", "user": "x", "attempts": []},
    {"status": "Pass", "vc": "a", "jobid": "application_1_4", "submitted_time": "2017-10-07 02:00:00", "user": "x",
     "attempts": [{"start_time": "2017-10-07 02:00:05", "end_time": None, "detail": [{"ip": "m1", "gpus": ["gpu0"]}]}]},
]

HELIOS = """job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue
1425511,uXBbc,vcJkd,1,1,1,COMPLETED,2020-06-09 18:41:01,2020-06-09 18:41:01,2020-06-10 04:55:09,36848,0
1425512,uVMrF,vchbv,4,16,1,FAILED,2020-06-09 18:41:27,2020-06-09 18:41:27,2020-06-09 18:45:36,249,0
1425513,uzqls,vcpDC,16,64,2,COMPLETED,2020-06-09 18:41:28,2020-06-09 18:50:28,2020-06-09 20:15:21,5093,540
1425514,uzqls,vcpDC,0,8,1,COMPLETED,2020-06-09 18:41:28,2020-06-09 18:41:28,2020-06-09 18:42:21,53,0
"""

ACME = """job_id,user,node_num,gpu_num,cpu_num,type,state,submit_time,start_time,end_time,duration,queue,gpu_time
5778432,u5907,1,8,128,Other,FAILED,2023-03-01 00:18:22+08:00,2023-03-01 00:18:54+08:00,2023-03-01 00:20:51+08:00,117,32,936.0
5778469,u5907,2,16,128,Pretrain,COMPLETED,2023-03-01 00:23:58+08:00,2023-03-01 00:24:11+08:00,2023-03-01 01:09:04+08:00,2693,13,43088.0
"""

PAI = """job_name,task_name,inst_num,status,start_time,end_time,plan_cpu,plan_mem,plan_gpu,gpu_type
4b3f04b66a525d2df903eb16,tensorflow,1.0,Terminated,5339000.0,5339300.0,600.0,29.296875,50.0,MISC
9e2b8f1c0a7d3b5e6f4a1c2d,worker,4.0,Terminated,5340000.0,5343600.0,800.0,100.0,800.0,V100
9e2b8f1c0a7d3b5e6f4a1c2d,ps,2.0,Terminated,5340000.0,5343600.0,400.0,50.0,,
1a2b3c,worker,1.0,Running,5350000.0,,600.0,29.0,100.0,T4
"""

OPENB = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0017,88000,327680,8,1000,,Burstable,Succeeded,9437497,10769854,9437497
openb-pod-0022,4000,15258,1,220,,BE,Running,9679175,9973826,9679175
openb-pod-0035,16000,32768,2,1000,V100M16|V100M32,LS,Running,9967058,9968575,9967063
openb-pod-0040,8000,30517,0,0,,BE,Succeeded,9967058,9968575,9967063
openb-pod-0041,8000,30517,4,1000,,LS,Pending,9967058,,
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_philly_job_log():
    stats = ReadStats()
    jobs = list(read_philly(json.dumps(PHILLY), stats, **KW))
    assert [j.id for j in jobs] == ["application_1_1", "application_1_2"]
    wide, four = jobs
    assert (wide.nodes, wide.gpus, wide.node) == (2, 8, "m412")
    assert wide.runtime == pytest.approx(2 * 3600 + 81)  # first attempt's start to the last attempt's end
    assert wide.start - wide.submit == pytest.approx(30)
    assert (four.nodes, four.gpus) == (1, 4)
    assert stats.skipped["never started"] == 1 and stats.skipped["still running (no End)"] == 1
    with pytest.raises(InputError, match="JSON list of jobs"):
        list(read_philly('{"jobs": []}', ReadStats(), **KW))


def test_helios_and_acme_logs():
    stats = ReadStats()
    jobs = list(read_helios(HELIOS.splitlines(True), stats, **KW))
    assert [(j.id, j.gpus, j.nodes) for j in jobs] == [("1425511", 1, 1), ("1425512", 4, 1), ("1425513", 8, 2)]
    assert jobs[2].start - jobs[2].submit == 540 and stats.skipped["no GPUs"] == 1
    jobs = list(read_helios(ACME.splitlines(True), ReadStats(), fmt="acme", **KW))
    assert [(j.gpus, j.nodes) for j in jobs] == [(8, 1), (8, 2)]
    assert jobs[0].start - jobs[0].submit == 32 and jobs[1].runtime == 2693  # time zones read
    with pytest.raises(InputError, match="needs the columns job_id, gpu_num, submit_time, start_time, end_time"):
        list(read_helios(["job_id,user,gpus\n", "1,u,2\n"], ReadStats(), **KW))


def test_pai_task_table_with_and_without_header():
    for text in (PAI, PAI.split("\n", 1)[1]):
        stats = ReadStats()
        jobs = list(read_pai(text.splitlines(True), stats, **KW))
        assert [(j.id, j.gpus, j.nodes) for j in jobs] == [
            ("4b3f04b66a525d2df903eb16/tensorflow", 1, 1),
            ("9e2b8f1c0a7d3b5e6f4a1c2d/worker", 8, 4),
        ]
        assert stats.notes[FRACTIONAL] == 1 and stats.skipped["no GPUs"] == 1
        assert stats.skipped["still running (no End)"] == 1
    stats = ReadStats()
    assert list(read_pai(["a,b,c\n"], stats, **KW)) == [] and stats.malformed_total == 1


def test_openb_pod_list():
    stats = ReadStats()
    jobs = list(read_openb(OPENB.splitlines(True), stats, **KW))
    assert [(j.id, j.gpus) for j in jobs] == [("openb-pod-0017", 8), ("openb-pod-0022", 1), ("openb-pod-0035", 2)]
    assert jobs[2].start - jobs[2].submit == 5
    assert stats.notes[FRACTIONAL] == 1 and stats.skipped["no GPUs"] == 1 and stats.skipped["never started"] == 1
    with pytest.raises(InputError, match="missing: creation_time, scheduled_time, deletion_time"):
        list(read_openb(["name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "p,1,1,1,1000\n"], ReadStats(), **KW))


def test_formats_are_detected():
    assert _detect(json.dumps(PHILLY)) == "philly"
    assert _detect(HELIOS) == "helios" and _detect(ACME) == "acme" and _detect(OPENB) == "openb" and _detect(PAI) == "pai"


@pytest.mark.parametrize("name, text, fmt, argv", [
    ("philly.json", json.dumps(PHILLY), "philly", ["--topology", "dgx1-v100"]),
    ("cluster_log.csv", HELIOS, "helios", ["--nodes", "auto"]),
    ("trace_seren.csv", ACME, "acme", ["--nodes", "2", "--topology", "dgx-a100"]),
    ("pai_task_table.csv", PAI.split("\n", 1)[1], "pai", ["--nodes", "auto"]),
    ("openb_pod_list_default.csv", OPENB, "openb", ["--nodes", "auto"]),
])
def test_replay_each_trace_end_to_end(capsys, tmp_path, name, text, fmt, argv):
    path = _write(tmp_path, name, text)
    assert main(["run", str(path), "--format", fmt, "--policies", "baseline,preserve", "--json", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["read"]["jobs"] >= 2 and data["policies"][0]["jobs"] >= 1
    if fmt != "philly":  # auto-detected too
        assert main(["run", str(path), "--policies", "baseline", "--json", *argv]) == 0
        assert json.loads(capsys.readouterr().out)["read"]["jobs"] == data["read"]["jobs"]


def test_trace_without_node_names_needs_a_cluster(capsys, tmp_path):
    path = _write(tmp_path, "cluster_log.csv", HELIOS)
    assert main(["run", str(path), "--policies", "baseline"]) == 2
    assert "names no nodes" in capsys.readouterr().err
