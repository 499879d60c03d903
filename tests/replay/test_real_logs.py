"""Replaying real logs honestly (issue 17): assumptions, cluster size, multi-node jobs, model range,
one bandwidth per GPU set, per-size results, the time-model note and a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.core.model_files import bundled_model, paper_model
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.cli import main
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.sacct import read_sacct_text
from slurm_mapa.replay.simulate import Node, Options, simulate

HEADER = "JobID|JobName|User|Account|Partition|Submit|Start|End|State|AllocTRES\n"


def _line(job_id: int, gpus: int, start: int, length: int, nodes: int = 1) -> str:
    stamp = lambda t: f"2026-01-01T{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"  # noqa: E731
    tres = f"billing=1,cpu=4,gres/gpu={gpus},mem=1G,node={nodes}"
    return f"{job_id}|job{job_id}|u|acct|gpu|{stamp(start)}|{stamp(start)}|{stamp(start + length)}|COMPLETED|{tres}\n"


@pytest.fixture()
def nodeless_log(tmp_path: Path) -> Path:
    """A log as a real export without NodeList, NNodes or directives: whole-node, half-node, small jobs."""
    lines = [HEADER]
    job = 1
    for block in range(6):
        t = block * 600
        for gpus in (8, 4, 2, 2, 1):
            lines.append(_line(job, gpus, t + job % 5, 500))
            job += 1
    lines.append(_line(job, 16, 4000, 300, nodes=2))  # two whole nodes, named only by node=2 in AllocTRES
    lines.append(_line(job + 1, 12, 4100, 300))  # no node count anywhere: too wide for one node
    path = tmp_path / "real.txt"
    path.write_text("".join(lines))
    return path


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


# --- item 1: --sensitive-share ------------------------------------------------------------------


def test_sensitive_share_is_deterministic_and_counted(capsys, nodeless_log):
    argv = ["run", str(nodeless_log), "--nodes", "4", "--topology", "dgx1-v100", "--policies", "baseline,preserve"]
    assert main([*argv, "--sensitive-share", "0.5", "--json"]) == 0
    first = _json(capsys)
    read = first["read"]
    assert read["directive_sources"] == {"default": read["jobs"]}
    multi = sum(1 for line in nodeless_log.read_text().splitlines()[1:] if "gres/gpu=1," not in line)
    assert 0 < read["assumed_sensitive"] < multi
    assert read["share_candidates"] == multi  # issue 39: the denominator is said too
    assert main([*argv, "--sensitive-share", "0.5", "--json"]) == 0
    assert _json(capsys)["read"]["assumed_sensitive"] == read["assumed_sensitive"]  # the same jobs every run
    sensitive = first["policies"][0]["effective_bw_sensitive"]["n"]
    assert sensitive == read["assumed_sensitive"] - 1  # the 12-GPU job is not replayed
    assert main([*argv, "--sensitive-share", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "assumption (--sensitive-share 0.5)" in out and f"{read['jobs']} site default" in out
    assert f"{read['assumed_sensitive']} of the {multi} jobs with 2+" in " ".join(out.split())
    assert main([*argv, "--sensitive-share", "1.5"]) == 2
    assert "--sensitive-share must be a fraction from 0 to 1" in capsys.readouterr().err


# --- item 2: a log without node names -----------------------------------------------------------


def test_nodeless_log_is_refused_naming_the_options(capsys, nodeless_log):
    assert main(["run", str(nodeless_log), "--policies", "baseline"]) == 2
    err = capsys.readouterr().err
    assert "names no nodes" in err and "--nodes N" in err and "--cluster" in err and "--config" in err and "--nodes auto" in err


def test_nodes_auto_sizes_from_the_logs_peak_and_says_so(capsys, nodeless_log):
    from slurm_mapa.replay.cluster_spec import log_peak

    peak = log_peak(read_sacct_text(nodeless_log.read_text().splitlines()))
    assert peak["peak_gpus"] == 16 + 12 and peak["widest_job_nodes"] == 2
    assert main(["run", str(nodeless_log), "--nodes", "auto", "--policies", "baseline,preserve", "--json"]) == 0
    data = _json(capsys)
    assert len(data["nodes"]) == 4 and data["warnings"] == []
    assert "at most 28 GPUs were in use at once" in data["cluster"]["notes"][0]
    waits = data["policies"][0]["wait"]
    assert waits["max"] < 3600  # no absurd queue on a sized cluster


def test_a_cluster_smaller_than_the_log_is_warned_about(capsys, nodeless_log):
    assert main(["run", str(nodeless_log), "--nodes", "1", "--topology", "dgx1-v100", "--policies", "baseline"]) == 0
    out = capsys.readouterr().out
    assert "warning: the replayed cluster has 8 GPUs but the log had 28 in use at once" in out


# --- item 3: multi-node jobs and dropped jobs -------------------------------------------------------


def test_node_count_from_alloctres_and_dropped_jobs_in_the_table(capsys, nodeless_log):
    jobs = {job.id: job for job in read_sacct_text(nodeless_log.read_text().splitlines())}
    wide = jobs["31"]
    assert (wide.nodes, wide.gpus) == (2, 8)
    assert main(["run", str(nodeless_log), "--nodes", "4", "--topology", "dgx1-v100", "--policies", "baseline,greedy"]) == 0
    out = capsys.readouterr().out
    assert "not replayed: 1 larger than every node" in out and "node=N in AllocTRES" in out


def test_the_sacct_command_in_the_docs_asks_for_every_field_the_reader_uses():
    from slurm_mapa.replay.sacct import SACCT_FIELDS

    docs = (REPO / "docs" / "replay.md").read_text()
    assert SACCT_FIELDS in docs
    for field in ("NNodes", "NodeList", "AllocTRES", "AdminComment", "Comment", "Start", "End", "Submit"):
        assert field in SACCT_FIELDS.split(",")


# --- item 4: the model and its fitted range -------------------------------------------------------------


def test_out_of_range_predictions_come_from_the_link_bound_model_and_are_marked(capsys, nodeless_log):
    """A judge fitted on 2-5 GPUs (derived-dgx1-v100, named with --judge) scores 8-GPU jobs by the link-bound model, marked."""
    argv = ["run", str(nodeless_log), "--nodes", "4", "--topology", "dgx1-v100", "--policies", "preserve", "--sensitive-share", "1",
            "--judge", "derived-dgx1-v100"]
    assert main([*argv, "--json"]) == 0
    data = _json(capsys)
    eight = data["policies"][0]["by_gpus"]["8"]
    assert eight["grounded_predictions"] == eight["jobs"] > 0
    assert eight["effective_bw_sensitive"]["max"] == pytest.approx(120.0)  # 0.8 x 150 GB/s of NVLink per DGX-1 GPU
    assert data["policies"][0]["by_gpus"]["4"]["grounded_predictions"] == 0
    assert main([*argv, "--json", "--extrapolate"]) == 0
    eight = _json(capsys)["policies"][0]["by_gpus"]["8"]
    assert eight["extrapolated_predictions"] == eight["jobs"]
    assert eight["effective_bw_sensitive"]["max"] == pytest.approx(111.564)  # derived-dgx1-v100's, flat past its 5 edges
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fitted on 2-5 GPU patterns" in out and "  8* preserve" in out


def test_model_option_and_config_model_are_honoured(capsys, nodeless_log, tmp_path):
    argv = ["run", str(nodeless_log), "--nodes", "4", "--topology", "dgx1-v100", "--policies", "preserve", "--json"]
    assert main([*argv, "--model", "bottleneck-generic"]) == 0
    assert _json(capsys)["model"]["name"] == "bottleneck-generic"
    cfg = tmp_path / "mapa.toml"
    model = tmp_path / "m.toml"
    model.write_text((REPO / "slurm_mapa" / "data" / "models" / "bottleneck-generic.toml").read_text().replace(
        'name = "bottleneck-generic"', 'name = "site-model"'))
    cfg.write_text('policy = "preserve"\nmodel = "m.toml"\n')
    assert main([*argv, "--config", str(cfg)]) == 0
    assert _json(capsys)["model"]["name"] == "site-model"
    assert main([*argv, "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no model file or bundled model 'no-such-model'" in err and "mapa-paper-dgx1" in err


def test_fitted_range_in_model_files():
    from slurm_mapa.core.model_files import load_model

    assert paper_model().fitted_gpus == (2, 5) and not paper_model().fitted_for(8) and paper_model().fitted_for(3)
    assert load_model("bottleneck-generic").fitted_gpus is None
    with pytest.raises(InputError, match="link-bound reporting model"):
        load_model("link-bound")
    from slurm_mapa.core.model_files import load_model_text

    with pytest.raises(InputError, match=r"fitted_gpus must be \[LOW, HIGH\]"):
        load_model_text('fitted_gpus = [5, 2]\n[classes]\nx1 = ["PCIE"]\n[terms]\n"x1" = 1.0\n', source="t")


def test_link_bound_model_on_known_servers():
    from slurm_mapa.core.model_files import grounded_model
    from slurm_mapa.core.patterns import make_pattern

    model = grounded_model()
    ring = lambda k: make_pattern("ring", k)  # noqa: E731
    assert model.predict(preset("dgx1-v100"), tuple(range(8)), ring(8)) == pytest.approx(120.0)
    assert model.predict(preset("dgx-a100"), tuple(range(8)), ring(8)) == pytest.approx(240.0)
    # a chain is a rank-order pattern: its slowest edge bounds it, in the order given
    chain = make_pattern("chain", 3)
    dgx = preset("dgx1-v100")
    assert model.predict(dgx, (0, 3, 2), chain) == pytest.approx(40.0)  # two double links
    assert model.predict(dgx, (0, 5, 2), chain) < 12


# --- item 5: one bandwidth per GPU set --------------------------------------------------------------------


def test_every_policy_reports_the_same_bandwidth_for_the_same_set():
    dgx = [Node("n1", preset("dgx1-v100"))]
    jobs = lambda: [Job("a", 0, 10, 8, sensitive=True), Job("b", 20, 10, 4, sensitive=False)]  # noqa: E731
    policies = ("baseline", "greedy", "preserve", "slurm-native")
    derived = bundled_model("derived-dgx1-v100")
    for settings in ({}, {"judge": derived}, {"judge": derived, "extrapolate": True}):
        values = {}
        for policy in policies:
            result = simulate(jobs(), dgx, policy, Options(**settings))
            values[policy] = round(result.eff_sensitive.quantile(0.5), 6)
        assert len(set(values.values())) == 1, values  # the 8 GPUs are one set: one number
    assert values["greedy"] == pytest.approx(111.564)  # the judge's own (extrapolated) best ring: all double NVLinks


def test_rank_order_patterns_keep_the_policys_order():
    from slurm_mapa.core.explain import reported_placement
    from slurm_mapa.core.patterns import make_pattern
    from slurm_mapa.core.search import score_placement

    dgx = preset("dgx1-v100")
    chain = make_pattern("chain", 4)
    placed = score_placement(dgx, range(8), chain, (0, 1, 2, 3), paper_model())
    assert reported_placement(dgx, chain, placed, paper_model()) is placed
    ring = make_pattern("ring", 4)
    placed = score_placement(dgx, range(8), ring, (0, 2, 1, 3), paper_model())
    shown = reported_placement(dgx, ring, placed, paper_model())
    assert set(shown.gpus) == {0, 1, 2, 3} and shown.effective_bandwidth > placed.effective_bandwidth
    assert shown.preserved_bandwidth == placed.preserved_bandwidth


# --- item 6: per-size results, p10 and p90 everywhere ------------------------------------------------------


def test_by_gpus_in_json_and_table_with_p10_and_p90(capsys, nodeless_log):
    argv = ["run", str(nodeless_log), "--nodes", "auto", "--sensitive-share", "0.5",
            "--policies", "baseline,greedy,preserve,slurm-native"]
    assert main([*argv, "--json"]) == 0
    data = _json(capsys)
    eights = set()
    for summary in data["policies"]:
        assert set(summary["by_gpus"]) == {"1", "2", "4", "8"}
        for name in ("effective_bw_sensitive", "effective_bw_insensitive", "wait", "runtime", "preserved_bw_after_decision"):
            assert "p10" in summary[name] and "p90" in summary[name]
        eight = summary["by_gpus"]["8"]["effective_bw_sensitive"]
        assert "p10" in eight and "p90" in eight
        eights.add((eight["n"], eight["min"], eight["max"]))
    assert len(eights) == 1  # whole-node jobs: the same set, the same number under every policy
    assert main(argv) == 0
    assert "by GPUs per node" in capsys.readouterr().out


# --- item 7: the note on waits without a time model ------------------------------------------------------


def test_note_that_waits_do_not_depend_on_the_policy_without_a_time_model(capsys, nodeless_log):
    argv = ["run", str(nodeless_log), "--nodes", "4", "--topology", "dgx1-v100", "--policies", "baseline,preserve"]
    assert main(argv) == 0
    assert "note: without --time-model" in capsys.readouterr().out
    assert main([*argv, "--time-model"]) == 0
    assert "note: without --time-model" not in capsys.readouterr().out


# --- item 8: a closed pipe ----------------------------------------------------------------------------


def test_a_closed_pipe_ends_quietly():
    code = "import sys; from slurm_mapa.replay.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code, "policies"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before anything is written, as with `| head` on a long output
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "" and proc.returncode == 141
