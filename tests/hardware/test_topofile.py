"""The TOML topology file: reading, writing, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.errors import InputError
from slurm_mapa.hardware.gres import PRESET_CPU_LAYOUTS, gres_conf_text
from slurm_mapa.hardware.presets import PRESETS, preset
from slurm_mapa.hardware.topofile import (
    Topology,
    graph_from_toml_text,
    graph_to_toml,
    topology_from_toml_text,
    topology_to_dict,
    topology_to_toml,
)

ROOT = REPO
GRES_CONF = ROOT / "slurm_mapa" / "data" / "gres_conf"  # the gres.conf and topology file of every preset

SMALL = """
name = "box"
gpus = 4
nvlink_generation = 2
default_link = "PHB"
domains = [0, 0, 1, 1]
cpu_affinity = ["0-7", "0-7", "8-15", "8-15"]

[links]
"0-1" = "NV2"
"2-3" = "NV1"
"1-2" = "SYS"
"""


def test_read_small_file():
    graph = graph_from_toml_text(SMALL)
    assert graph.name == "box" and graph.size == 4
    assert graph.link(1, 0).token == "NV2"
    assert graph.link(0, 3).token == "PHB"  # missing pairs take default_link
    assert graph.link(2, 1).token == "SYS"
    assert graph.bandwidth(0, 1) == 50.0
    assert graph.domains == (0, 0, 1, 1)


def test_missing_pairs_default_to_sys():
    graph = graph_from_toml_text('gpus = 3\n[links]\n"0-1" = "NV1"\n', source="x.toml")
    assert graph.link(1, 2).token == "SYS" and graph.name == "x.toml"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_every_preset(name):
    graph = preset(name)
    assert graph_from_toml_text(graph_to_toml(graph)) == graph


def test_round_trip_device_facts_and_bandwidth_overrides():
    graph = graph_from_toml_text(SMALL + "\n[bandwidth]\nnvlink_per_link = 30.0\nSYS = 10\n")
    assert graph.bandwidth(0, 1) == 60.0 and graph.bandwidth(1, 2) == 10.0
    topology = Topology(graph, minor_numbers=(3, 2, 1, 0), uuids=("GPU-a", "GPU-b", "GPU-c", "GPU-d"),
                        pci_bus_ids=("00000000:07:00.0",) * 4)
    again = topology_from_toml_text(topology_to_toml(topology, comment="two\nlines"))
    assert again == topology
    assert again.minor(0) == 3
    assert topology_to_dict(again)["links"]["0-1"] == "NV2"


@pytest.mark.parametrize(
    "text, expected",
    [
        ('gpus = 2\n[links]\n"0-2" = "NV1"\n', "unknown GPU 2"),
        ('gpus = 2\n[links]\n"1-1" = "NV1"\n', "links GPU 1 to itself"),
        ('gpus = 2\n[links]\n"0-1" = "NV1"\n"1-0" = "NV2"\n', "conflicting entries for GPUs 0-1"),
        ('gpus = 2\n[links]\n"0-1" = "NV9Q"\n', "unknown link class"),
        ('gpus = 2\n[links]\n"zero-one" = "NV1"\n', "GPU pair"),
        ('gpus = 2\n[links]\n"0-1" = 1\n', "link class string"),
        ('gpus = 2\ncolour = "red"\n', "unknown key 'colour' (line 'colour = \"red\"')"),
        ('name = "x"\n', "missing 'gpus"),
        ("gpus = 0\n", "positive integer"),
        ('gpus = 2\ndomains = [0]\n', "list of 2 integers"),
        ('gpus = 2\ndefault_link = "NV1"\n', "must be a PCIe level"),
        ('gpus = 2\nnvlink_generation = 9\n', "NVLink generation 9"),
        ('gpus = 2\n[bandwidth]\nPIX = -1\n', "positive number"),
        ('gpus = 2\n[bandwidth]\nwarp = 1\n', "unknown bandwidth key"),
        ('gpus = 2\nminor_numbers = [1, 1]\n', "repeats"),
        ("gpus = [\n", "not valid TOML"),
    ],
)
def test_validation_errors(text, expected):
    with pytest.raises(InputError, match="topology file") as caught:
        topology_from_toml_text(text)
    assert expected in str(caught.value)


def test_same_entry_twice_in_both_orders_is_fine():
    graph = graph_from_toml_text('gpus = 2\n[links]\n"0-1" = "NV1"\n"1-0" = "nv1"\n')
    assert graph.link(0, 1).token == "NV1"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_gres_conf_directory_is_up_to_date(name):
    """slurm_mapa/data/gres_conf/ holds the generated files of every preset
    (mapa gres-conf --write-presets slurm_mapa/data/gres_conf)."""
    toml_file = GRES_CONF / f"{name}.toml"
    assert graph_from_toml_text(toml_file.read_text()) == preset(name)
    gres_file = GRES_CONF / f"{name}.gres.conf"
    expected = gres_conf_text(Topology(preset(name)), layout=PRESET_CPU_LAYOUTS.get(name),
                              generated_by=f"mapa gres-conf --topology {name}")
    assert gres_file.read_text() == expected
