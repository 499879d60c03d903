"""Issue 51: clusters with NVLink domains in the replay: racks, Slurm block files, the domain
replay and its report (headline first, ``one_domain_sensitive`` in the JSON)."""

from __future__ import annotations

import json

import pytest

from slurm_mapa.errors import InputError
from slurm_mapa.replay.cli import main
from slurm_mapa.replay.domains import (
    DomainCluster, file_cluster, is_domain_cluster, multinode_jobs, rack_cluster, simulate_domains,
)
from slurm_mapa.replay.jobs import Job


def test_racks_are_domains_of_trays():
    nvl72 = rack_cluster("4xgb200-nvl72")
    assert len(nvl72.nodes) == 72 and [len(d) for d in nvl72.domains] == [18] * 4
    assert nvl72.nodes[18].name == "nvl2-01" and nvl72.capacity == 4 and nvl72.nodes[0].graph.name == "gb200-nvl72-tray"
    nvl36 = rack_cluster("1xgb200-nvl36x2")
    assert [len(d) for d in nvl36.domains] == [9, 9] and nvl36.names == ["nvl1a", "nvl1b"]
    assert is_domain_cluster("4xgb200-nvl72") and is_domain_cluster("1xgb200-nvl72,1xgb200-nvl36x2")
    assert not is_domain_cluster("2xdgx1-v100") and not is_domain_cluster(None)
    with pytest.raises(InputError, match="accepted: COUNTxRACK"):
        rack_cluster("0xgb200-nvl72")


def test_a_cluster_from_slurms_topology_conf(tmp_path):
    path = tmp_path / "topology.conf"
    path.write_text("BlockName=b1 Nodes=gb[01-03]\nBlockName=b2 Nodes=gb[04-05]\nBlockSizes=2,4\n")
    cluster = file_cluster(str(path))
    assert [len(d) for d in cluster.domains] == [3, 2] and cluster.names == ["b1", "b2"]
    assert cluster.nodes[3].name == "gb04" and cluster.block_sizes == (2, 4)
    assert is_domain_cluster(str(path))


def _two_blocks() -> DomainCluster:
    from slurm_mapa.replay.config import graph_of
    from slurm_mapa.replay.options import Node

    graph = graph_of("gb200-nvl72-tray")
    return DomainCluster([Node(f"n{i}", graph) for i in range(5)], [[0, 1, 2], [3, 4]], ["b1", "b2"])


def test_mapa_keeps_the_whole_domain_for_the_job_that_needs_it():
    """An insensitive 2-node job first, then a sensitive 3-node job that needs a domain: MAPA put
    the first into the smaller domain and the second starts at once; Slurm's block placement put the
    first into the lowest-numbered block that fits and the second waits for it to end."""
    jobs = [Job("0", 0.0, 100.0, 4, nodes=2), Job("1", 1.0, 10.0, 4, sensitive=True, nodes=3)]
    mapa = simulate_domains(jobs, _two_blocks(), "mapa").summary()
    block = simulate_domains(jobs, _two_blocks(), "block").summary()
    assert mapa["one_domain_sensitive"] == {"fit": 1, "kept": 1, "share": 1.0} and mapa["wait_max"] == 0
    assert block["one_domain_sensitive"]["kept"] == 1 and block["wait_max"] == 99.0
    assert block["stranded_gpus_mean"] > mapa["stranded_gpus_mean"] == 0
    # first-fit does not see domains: the 3-node job starts at once over both
    first = simulate_domains(jobs, _two_blocks(), "first-fit").summary()
    assert first["one_domain_sensitive"] == {"fit": 1, "kept": 0, "share": 0.0} and first["multi_node_spread"] == 1


def test_a_stated_need_wins_over_the_default():
    jobs = [Job("0", 0.0, 100.0, 4, nodes=2), Job("1", 1.0, 10.0, 4, sensitive=True, nodes=3, domain="any")]
    block = simulate_domains(jobs, _two_blocks(), "block").summary()
    assert block["wait_max"] == 0 and block["one_domain_sensitive"]["kept"] == 0


def test_the_generated_multinode_workload_is_seeded():
    jobs = list(multinode_jobs(200, seed=4))
    assert jobs == list(multinode_jobs(200, seed=4))
    assert {j.nodes for j in jobs} <= {1, 2, 4, 8, 16, 18} and any(j.nodes > 1 and j.sensitive for j in jobs)
    assert all(j.gpus == 4 for j in jobs if j.nodes > 1)


def test_the_cli_reports_domains_headline_first(capsys):
    assert main(["run", "--generate", "multinode:60", "--cluster", "2xgb200-nvl72"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("multi-node sensitive jobs kept inside one NVLink domain: MAPA ")
    assert "Slurm topology/block" in out and "first-fit" in out and "assumed:" in out
    assert main(["run", "--generate", "multinode:60", "--cluster", "2xgb200-nvl72", "--json", "--policies", "mapa,block"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["mapa", "block"]
    one = doc["policies"][0]["one_domain_sensitive"]
    assert set(one) == {"fit", "kept", "share"} and one["fit"] >= one["kept"] > 0
    assert doc["headline"][0].startswith("multi-node sensitive jobs kept inside one NVLink domain")
    assert len(doc["cluster"]["domains"]) == 2
    assert main(["run", "--generate", "multinode:5", "--cluster", "1xgb200-nvl72", "--policies", "preserve"]) != 0
    assert "the policies are mapa, block, first-fit, random" in capsys.readouterr().err
