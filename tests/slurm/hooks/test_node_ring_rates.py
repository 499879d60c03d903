"""Issue 49: the hooks keep the ring-rate table of a node whose topology file matches no preset
beside the ledger (node_graph.load_graph installs the store), so a Prolog in a fresh process (the
agent down) decides with the stored table: no numpy, no linear programme."""

from __future__ import annotations

import subprocess
import sys

from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.ring_rate_tables import fingerprint
from slurm_mapa.hardware.presets import preset
from slurm_mapa.hardware.topofile import graph_to_toml

PROLOG_DECISION = """
import sys
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.slurm.config import load_hook_config
from slurm_mapa.slurm.hooks.node_graph import load_graph

config, problem = load_hook_config({{"MAPA_CONFIG": {config!r}}})
assert not problem, problem
graph = load_graph(config, "gpu7")
chosen = select("preserve", graph, tuple(range(8)), Request(make_pattern("ring", 4), True))
print(chosen.objective, chosen.placement.ring_rate, "numpy" in sys.modules)
"""


def test_a_prolog_in_a_fresh_process_reads_the_nodes_table_from_beside_the_ledger(tmp_path):
    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"  # no preset's links
    graph = build_graph("gpu-node", 8, links)
    topology = tmp_path / "gpu-node.toml"
    topology.write_text(graph_to_toml(graph))
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      f'health = "off"\n[nodes]\n"gpu[0-9]*" = "{topology}"\n')
    code = PROLOG_DECISION.format(config=str(config))

    def decide() -> list[str]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.split()

    first = decide()  # the first use computes the table and stores it
    assert first[0] == "effective-rings" and first[2] == "True"
    table = tmp_path / "state" / "ring-rates" / f"{fingerprint(graph)}.json"
    assert table.is_file()
    assert decide() == [*first[:2], "False"]
    assert not (tmp_path / "log").exists() or "ring rates" not in (tmp_path / "log").read_text()
