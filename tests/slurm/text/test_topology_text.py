"""Issue 51: Slurm's block topology read from literal topology.conf and topology.yaml text."""

import pytest

from slurm_mapa.errors import InputError
from slurm_mapa.slurm.text.topology import parse_block_topology, parse_topology_conf, parse_topology_yaml

CONF = """\
# two GB200 NVL72 racks, one block each (topology.conf(5), topology/block)
BlockName=b1 Nodes=nvl1-[01-18]
blockname=b2 nodes=nvl2-[01-18]   # keys are case-insensitive
BlockSizes=18,36
"""

YAML = """\
- topology: topo-tree
  tree:
    switches:
      - switch: s1
        children: n[1-4]
- topology: racks
  cluster_default: true
  block:
    block_sizes:
      - 9
      - 18
    blocks:
      - block: r1a
        nodes: nvl1-[01-09]
      - block: r1b
        nodes: nvl1-[10-18]
"""


def test_topology_conf_blocks():
    topo = parse_topology_conf(CONF)
    assert [name for name, _ in topo.blocks] == ["b1", "b2"]
    assert topo.blocks[0][1][0] == "nvl1-01" and len(topo.blocks[1][1]) == 18
    assert topo.block_sizes == (18, 36)
    assert topo.domain_of()["nvl2-05"] == 1


def test_topology_yaml_blocks():
    topo = parse_topology_yaml(YAML)
    assert [name for name, _ in topo.blocks] == ["r1a", "r1b"] and topo.block_sizes == (9, 18)
    assert topo.blocks[1][1] == tuple(f"nvl1-{i:02d}" for i in range(10, 19))
    flow = "- topology: b\n  block:\n    block_sizes: [4, 8]\n    blocks:\n      - block: x\n        nodes: n[1-4]\n"
    assert parse_block_topology(flow, "t.yaml").block_sizes == (4, 8)
    assert parse_block_topology(CONF, "topology.conf").block_sizes == (18, 36)


@pytest.mark.parametrize("text, message", [
    ("SwitchName=s1 Nodes=n[1-4]\n", "topology/tree"),
    ("BlockName=b1\n", "has no Nodes="),
    ("BlockName=b1 Nodes=n1\nBlockSizes=4,12\n", "power of two"),
    ("BlockName=b1 Nodes=n[1-2]\nBlockName=b2 Nodes=n2\n", "node n2 is in blocks b1 and b2"),
    ("# nothing\n", "no blocks"),
    ("BlockName b1\n", "not KEY=VALUE"),
])
def test_topology_conf_errors(text, message):
    with pytest.raises(InputError, match=message):
        parse_topology_conf(text)


def test_topology_yaml_errors():
    with pytest.raises(InputError, match="no block topology"):
        parse_topology_yaml("- topology: flat1\n  flat: true\n")
    with pytest.raises(InputError, match="no block topology named 'x'"):
        parse_topology_yaml(YAML, name="x")


def test_hostlists():
    from slurm_mapa.slurm.text.topology import expand_hostlist

    assert expand_hostlist("nvl1-[01-03],gb7,n[1-2,5]") == ["nvl1-01", "nvl1-02", "nvl1-03", "gb7", "n1", "n2", "n5"]
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
