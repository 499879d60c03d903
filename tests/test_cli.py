"""The `mapa` command, run in-process."""

from __future__ import annotations

import json

from slurm_mapa.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_select_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "select", "--topology", "dgx1-v100", "--free", "0-3,5,6", "--gpus", "4",
                       "--directive", "topology=ring sensitive=yes", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["gpus"] == [0, 1, 2, 3]
    assert data["policy"] == "preserve"
    for field in ("aggregated_bandwidth", "effective_bandwidth", "preserved_bandwidth"):
        assert isinstance(data[field], float)
    assert data["effective_bandwidth"] == 38.056  # derived-dgx1-v100: a 4-GPU ring whose slowest hop is a single NVLink


def test_ring_order_is_returned_as_neighbours(capsys):
    code, out, _ = run(capsys, "select", "--topology", "dgx1-v100", "--gpus", "4", "--directive", "sensitive=yes", "--json")
    gpus = json.loads(out)["gpus"]
    from slurm_mapa.hardware.presets import preset

    dgx = preset("dgx1-v100")
    ring_links = [dgx.link(gpus[i], gpus[(i + 1) % 4]).token for i in range(4)]
    assert ring_links.count("NV2") == 3 and ring_links.count("NV1") == 1


def test_explain_lists_alternatives_with_reasons(capsys):
    code, out, _ = run(capsys, "select", "--topology", "summit", "--gpus", "2", "--directive", "sensitive=yes", "--explain", "--json")
    alternatives = json.loads(out)["alternatives"]
    assert alternatives and all(alt["why_not"] for alt in alternatives)


def test_no_fit_exits_1(capsys):
    code, out, _ = run(capsys, "select", "--topology", "summit", "--free", "0", "--gpus", "2")
    assert code == 1 and "does not fit" in out


def test_more_gpus_than_the_server_has_is_bad_input_and_a_misspelled_preset_gets_a_suggestion(capsys):
    """Issue 39: --gpus 9 on an 8-GPU server exited 1 ("does not fit") and --gpus 99 exited 2."""
    for count in ("9", "99"):
        code, out, err = run(capsys, "select", "--topology", "dgx1-v100", "--gpus", count, "--directive", "topology=ring")
        assert code == 2 and out == "" and err.startswith("mapa: error: "), (count, err)
    assert "asked of dgx1-v100, which has 8; accepted: 1 to 8" in run(capsys, "select", "--topology", "dgx1-v100", "--gpus", "9")[2]
    code, _, err = run(capsys, "select", "--topology", "dgx1-v10", "--gpus", "2")
    assert code == 2 and "(did you mean 'dgx1-v100'?)" in err


def test_bad_input_goes_through_one_handler(capsys):
    code, _, err = run(capsys, "select", "--topology", "dgx9", "--gpus", "2")
    assert code == 2 and err.startswith("mapa: error: topology 'dgx9' is neither a preset")
    code, _, err = run(capsys, "select", "--topology", "summit", "--free", "0,x", "--gpus", "1")
    assert code == 2 and "--free: not a GPU index list: '0,x', bad part 'x' (accepted: indices 0 to 1023" in err
    code, _, err = run(capsys, "select", "--topology", "summit", "--free", "3-1", "--gpus", "1")
    assert code == 2 and "--free: GPU list '3-1': range '3-1' runs backwards (accepted:" in err
    code, _, err = run(capsys, "select", "--topology", "summit", "--gpus", "2", "--directive", "topology=rnig")
    assert code == 2 and "unknown topology 'rnig'" in err


def test_topo_show(capsys):
    code, out, _ = run(capsys, "topo", "show", "dgx1-v100")
    assert code == 0 and out.splitlines()[4].split()[:5] == ["GPU0", "X", "NV1", "NV1", "NV2"]
    code, out, _ = run(capsys, "topo", "show", "dgx1-v100", "--nvidia-smi-format")
    assert code == 0 and out.splitlines()[1].split("\t")[:5] == ["GPU0", " X ", "NV1", "NV1", "NV2"]
    code, out, _ = run(capsys, "topo", "show", "hgx-h100", "--json")
    data = json.loads(out)
    assert data["links"]["0-7"] == "NVS18" and data["bandwidth_gbps"][0][7] == 450


def test_model_takes_a_bundled_name(capsys):
    code, out, _ = run(capsys, "select", "--topology", "mi250x", "--gpus", "2", "--directive", "sensitive=yes", "--json")
    own = json.loads(out)
    assert code == 0 and own["model"] == "derived-mi250x" and own["effective_bandwidth"] > 200
    code, out, _ = run(capsys, "select", "--topology", "mi250x", "--gpus", "2", "--directive", "sensitive=yes",
                       "--model", "mapa-paper-dgx1", "--json")
    paper = json.loads(out)
    assert code == 0 and paper["model"] == "mapa-paper-dgx1" and abs(paper["effective_bandwidth"] - 58.925036) < 1e-6
    assert paper["gpus"] == own["gpus"] == [0, 1] and paper["extrapolated"] is True  # xGMI: not the paper's links


def test_hooks_refuse_a_node_whose_topology_file_does_not_exist(tmp_path, capsys):
    """Issue 52: the node's [nodes] entry names a file that is not there (or a misspelled preset):
    every job on it would get Slurm's GPUs, so nothing is written, one line says why, exit 2."""
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.hardware.topofile import graph_to_toml

    topology = tmp_path / "topo" / "gpu-node.toml"
    config = tmp_path / "mapa.toml"
    config.write_text(f'jobs_dir = "{tmp_path}/jobs"\n[nodes]\n"gpu[0-9]*" = "{topology}"\n"dgx*" = "dgx1-v10"\n')
    code, out, err = run(capsys, "hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "gpu7", "--cc", "none")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f'mapa: error: --config {config}: [nodes] entry "gpu[0-9]*" = "{topology}" (node gpu7): topology '
                          f"file {topology} does not exist; every job on gpu7 would get Slurm's GPUs (its record says "
                          "no-topology); accepted: a preset (dgx1-v100, "), err
    assert err.rstrip().endswith(f"or a topology file on this node, e.g. from `mapa topo discover -o {topology}`")
    assert not (tmp_path / "sbin").exists()
    code, _, err = run(capsys, "hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "dgx3", "--cc", "none")
    assert code == 2 and err.count("\n") == 1 and "topology 'dgx1-v10' (did you mean 'dgx1-v100'?)" in err
    assert not (tmp_path / "sbin").exists()
    topology.parent.mkdir()
    topology.write_text(graph_to_toml(preset("dgx1-v100")))
    code, _, err = run(capsys, "hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "gpu7", "--cc", "none")
    assert code == 0 and (tmp_path / "sbin" / "mapa-prolog-wrapper").exists() and "error" not in err
    assert "ring rates" not in err  # a DGX-1's links: its table ships


def test_hooks_store_the_ring_rate_table_of_a_topology_file_that_matches_no_preset(tmp_path, capsys):
    """Issue 49: `mapa hooks` computes the node's table beside the ledger, so no Prolog solves it."""
    from slurm_mapa.core.hardware import build_graph
    from slurm_mapa.core.ring_rate_tables import fingerprint
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.hardware.topofile import graph_to_toml

    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"
    graph = build_graph("gpu-node", 8, links)
    (tmp_path / "gpu-node.toml").write_text(graph_to_toml(graph))
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\n'
                      f'[nodes]\n"gpu*" = "{tmp_path}/gpu-node.toml"\n')
    table = tmp_path / "state" / "ring-rates" / f"{fingerprint(graph)}.json"
    code, _, err = run(capsys, "hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "gpu7", "--cc", "none")
    assert code == 0 and table.is_file()
    assert f"ring rates: computed the table of gpu-node (links match no preset) into {table}\n" in err
    code, _, err = run(capsys, "hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "gpu7", "--cc", "none")
    assert code == 0 and "ring rates" not in err


def test_select_names_each_bandwidth_as_the_replay_does(capsys):
    """Issue 52: one set showed 38.056, 100 and 80 on different screens under three names; select
    now shows all three, each named as in mapa-replay's legend, and names what x1, x2, x3 count."""
    assert main(["select", "--topology", "dgx1-v100", "--gpus", "4", "--directive", "topology=ring sensitive=yes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  predicted            38.056 GB/s (effective bandwidth by the ranking model")
    assert lines[3].startswith("  ring rate            100.000 GB/s (the bus bandwidth rings can carry")
    assert lines[4].startswith("  judged               80.000 GB/s (link-bound, 0.8 x the ring rate: what mapa-replay")
    assert "x1=3 (NV2), x2=1 (NV1), x3=0 (SYS): the pattern's edges per link class (model derived-dgx1-v100" in lines[7]
    assert main(["select", "--topology", "dgx1-v100", "--gpus", "4", "--directive", "topology=ring sensitive=yes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["judged_bandwidth"] == 80.0 and out["judge"] == "link-bound" and out["link_classes"]["x1"] == ["NV2"]
