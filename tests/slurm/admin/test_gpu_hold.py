"""`mapa gpu hold|release|list`, and held GPUs in mapa status, mapa doctor and the metrics (issue 50)."""

from __future__ import annotations

import dataclasses
import json

from fake_slurm import FakeSlurm, env_for

from slurm_mapa.cli import main
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.policies import all_policies
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.admin.doctor import OK, WARN, FAIL
from slurm_mapa.slurm.admin.doctor.held_check import check_held
from slurm_mapa.slurm.admin.doctor.records import Inputs
from slurm_mapa.slurm.config import load_admin_config
from slurm_mapa.slurm.hooks.prolog import run_prolog


def node_config(tmp_path) -> str:
    (tmp_path / "state").mkdir(mode=0o755)
    (tmp_path / "jobs").mkdir(mode=0o755)
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      '[nodes]\n"*" = "dgx1-v100"\n')
    config.chmod(0o644)
    return str(config)


def mapa(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_hold_list_release_and_what_is_refused(tmp_path, capsys):
    config = node_config(tmp_path)
    code, out, _ = mapa(capsys, "gpu", "hold", "3", "--reason", "XID 79 twice", "--config", config, "--node", "dgx1")
    assert code == 0 and "GPU 3 of node dgx1 is held out of every new job: XID 79 twice" in out
    code, out, _ = mapa(capsys, "gpu", "list", "--json", "--config", config, "--node", "dgx1")
    held = json.loads(out)["held"]
    assert code == 0 and [(h["gpu"], h["reason"], h["source"]) for h in held] == [(3, "XID 79 twice", "admin")]
    for argv, expected in [
        (["gpu", "hold", "8"], "GPU 8 is not on node dgx1, which has 8 GPUs; accepted: a GPU index of node dgx1 (dgx1-v100), 0 to 7"),
        (["gpu", "hold", "-1"], "is not a GPU index; accepted"),
        (["gpu", "hold", "2", "--reason", "a\nb"], "--reason: it has a control character or a line break; accepted"),
        (["gpu", "hold", "2", "--reason", "x" * 201], "--reason: 201 characters; accepted: at most 200"),
        (["gpu", "release", "4"], "GPU 4 of node dgx1 is not held; held now: 3"),
    ]:
        code, _, err = mapa(capsys, *argv, "--config", config, "--node", "dgx1")
        assert code == 2 and err.startswith("mapa: error: ") and expected in err, err
    code, out, _ = mapa(capsys, "gpu", "release", "3", "--config", config, "--node", "dgx1")
    assert code == 0 and "released" in out
    assert mapa(capsys, "gpu", "list", "--config", config, "--node", "dgx1")[1] == "no GPU is held\n"


def test_a_corrupt_record_is_named_with_the_fix(tmp_path, capsys):
    config = node_config(tmp_path)
    (tmp_path / "state" / "held-gpus.json").write_bytes(b"\x00\xff")
    code, _, err = mapa(capsys, "gpu", "hold", "1", "--config", config, "--node", "dgx1")
    assert code == 2 and "cannot be read" in err and "remove it as root" in err


def test_a_running_job_on_a_newly_held_gpu_is_named_and_keeps_it(tmp_path, capsys):
    config_path = node_config(tmp_path)
    config = load_admin_config(config_path)
    slurm = FakeSlurm()
    slurm.running = {"20"}
    first = run_prolog(env_for("20", "0,1"), config, slurm, lambda line: None)
    gpu = first.gpus[0]
    code, out, _ = mapa(capsys, "gpu", "hold", str(gpu), "--config", config_path, "--node", "dgx1")
    assert code == 0 and f"running job 20 uses it: the job keeps it until it ends" in out
    assert f"running job 20 uses it" in (tmp_path / "log").read_text()
    assert (tmp_path / "jobs" / "20").exists()  # left alone
    code, out, _ = mapa(capsys, "status", "dgx1", "--config", config_path)
    assert f"HELD: GPU {gpu}: held since" in out and "still used by running job(s) 20" in out
    status = json.loads(mapa(capsys, "status", "dgx1", "--config", config_path, "--json")[1])
    assert [h["gpu"] for h in status["held"]] == [gpu]
    slurm.running = {"20", "21"}
    second = run_prolog(env_for("21", "2,3"), config, slurm, lambda line: None)
    assert gpu not in second.gpus


def test_doctor_warns_about_a_held_gpu_and_fails_on_an_unreadable_record():
    assert check_held(Inputs(node="n")).status == OK
    held = ({"gpu": 3, "reason": "XID 79", "since": 1.0, "since_text": "1970", "source": "admin", "jobs": ["7"]},)
    check = check_held(Inputs(node="n", held_gpus=held))
    assert check.status == WARN and "GPU 3 held out of new jobs" in check.found and "running job(s) 7" in check.found
    assert "mapa gpu release" in check.fix
    assert check_held(Inputs(node="n", held_error="not JSON")).status == FAIL


def test_metrics_serve_one_held_gauge_per_gpu():
    from prometheus_client import generate_latest

    from slurm_mapa.slurm.agent.metrics import AgentMetrics, node_gauges

    gauges = node_gauges(preset("dgx1-v100"), {}, paper_model(), all_policies(), frozenset({3}))
    text = generate_latest(AgentMetrics("n1", state=lambda: gauges).registry).decode()
    assert 'mapa_gpu_held{gpu="3",node="n1"} 1.0' in text and 'mapa_gpu_held{gpu="0",node="n1"} 0.0' in text
    assert dataclasses.replace(gauges, held_out=frozenset()).held_out == frozenset()
