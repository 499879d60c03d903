"""The `nvidia-smi topo -m` / `-L` parser and formatter, on real pasted outputs."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO, TEST_DATA

from slurm_mapa.core.hardware import HardwareGraph
from slurm_mapa.errors import InputError
from slurm_mapa.cli import main as commands_main
from slurm_mapa.hardware.nvidia_smi import parse_discovery, parse_gpu_list, parse_topo_matrix
from slurm_mapa.hardware.nvidia_smi_format import format_gpu_list, format_topo_matrix
from slurm_mapa.hardware.nvlink import nvlink_generation_of
from slurm_mapa.hardware.presets import PRESETS, preset
from slurm_mapa.hardware.topofile import graph_vendor

from line_mutations import mutations

DATA = TEST_DATA / "nvidia-smi"
# nvidia-smi can only print NVIDIA servers: the AMD presets (xGMI) have their own tests.
NVIDIA_PRESETS = sorted(name for name in PRESETS if graph_vendor(preset(name)) == "nvidia")
FIXTURES = sorted(path.stem for path in DATA.glob("*.txt"))
ROOT = REPO
GRES_CONF = ROOT / "slurm_mapa" / "data" / "gres_conf"  # the gres.conf and topology file of every preset
MOCK = ROOT / "scripts" / "mock-nvidia-smi"


def read_expected(name: str) -> dict:
    matrix, fields = [], {}
    for line in (DATA / f"{name}.expected").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if " = " in line:
            key, value = line.split(" = ", 1)
            fields[key] = [] if value == "-" else value.split()
        else:
            matrix.append(line.split())
    return {"matrix": matrix, **fields}


def matrix_of(graph: HardwareGraph) -> list[list[str]]:
    return [["X" if a == b else graph.link(a, b).token for b in graph.gpus] for a in graph.gpus]


def same_hardware(a: HardwareGraph, b: HardwareGraph) -> bool:
    """Equal except for the name and description, which no nvidia-smi text carries."""
    return dataclasses.replace(a, name="", description="") == dataclasses.replace(b, name="", description="")


def test_every_fixture_has_its_expected_matrix_and_matches_the_shared_copy_where_there_is_one():
    """Each saved `nvidia-smi topo -m` text has its expected matrix; in a checkout next to the
    team's shared fixtures (not in every clone), each of those is copied here unchanged."""
    copies = sorted(DATA.glob("*.txt"))
    assert copies
    for path in copies:
        assert (DATA / f"{path.stem}.expected").exists(), path.name
    shared = REPO.parent / "shared" / "fixtures" / "nvidia-smi"
    for path in sorted(shared.glob("*.txt")) if shared.is_dir() else []:
        assert (DATA / path.name).read_text() == path.read_text(), path.name


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_parses_to_expected_matrix(name):
    result = parse_topo_matrix((DATA / f"{name}.txt").read_text(), name=name)
    expected = read_expected(name)
    assert matrix_of(result.graph) == expected["matrix"]
    assert [str(d) for d in result.graph.domains] == expected["domains"]
    assert list(result.graph.cpu_affinity) == expected["cpu_affinity"]
    assert list(result.nics) == expected["nics"]


@pytest.mark.parametrize(
    "fixture, name",
    [
        ("dgx1-v100", "dgx1-v100"),
        ("dgx-a100", "dgx-a100"),
        ("hgx-h100", "hgx-h100"),
        ("ibm-ac922-summit-6gpu", "summit"),
        ("pcie-8gpu-pix-phb-sys", "pcie-8"),
        ("dgx1-p100", "dgx1-p100"),
    ],
)
def test_fixtures_match_presets(fixture, name):
    """An independent check of the expected matrices: the presets were built from the papers."""
    result = parse_topo_matrix((DATA / f"{fixture}.txt").read_text())
    assert matrix_of(result.graph) == matrix_of(preset(name))


def test_facts_are_kept():
    result = parse_topo_matrix((DATA / "pcie-8x-rtx4090-sys.txt").read_text())
    assert result.nics == ("NIC0", "NIC1")
    assert result.nic_links[("GPU6", "NIC0")] == "PHB"
    assert result.nic_links[("NIC0", "NIC1")] == "PIX"
    assert result.numa_affinity == ("0",) * 4 + ("1",) * 4
    assert result.gpu_numa_id == ("N/A",) * 8
    dgx = parse_topo_matrix((DATA / "dgx-a100.txt").read_text())
    assert len(dgx.nics) == 12 and dgx.nic_links[("GPU0", "mlx5_0")] == "PXB"
    assert dgx.cpu_affinity[0] == "48-63,176-191"


def test_old_legend_soc_is_sys():
    result = parse_topo_matrix((DATA / "dgx1-p100.txt").read_text())
    assert result.graph.link(0, 5).token == "SYS"
    assert result.nic_links[("GPU0", "mlx5_2")] == "SYS"


@pytest.mark.parametrize("name", FIXTURES)
def test_layout_does_not_matter(name):
    """Tabs to spaces, spaces to tabs, an indented paste, a prompt line and Windows line ends."""
    text = (DATA / f"{name}.txt").read_text()
    reference = parse_topo_matrix(text)
    variants = [
        text.expandtabs(8),
        text.replace("\t", "   "),
        "\n".join("    " + line for line in text.splitlines()),
        "user@node:~$ nvidia-smi topo -m\n" + text,
        text.replace("\n", "\r\n"),
        "\n\n" + text + "\n\n",
    ]
    for variant in variants:
        assert parse_topo_matrix(variant) == reference


def test_legend_or_none():
    text = (DATA / "dgx1-v100.txt").read_text()
    without = text.split("Legend:")[0]
    assert parse_topo_matrix(without) == parse_topo_matrix(text)


def test_bonded_counts_beyond_nv18():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV24\nGPU1\tNV24\t X \n"
    assert parse_topo_matrix(text).graph.link(0, 1).token == "NV24"


def test_nvswitch_recognised_by_port_count():
    # Two GPUs with NV12: a bridge (direct). Eight GPUs all NV12: more links than an A100 has.
    pair = parse_topo_matrix("\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n", nvlink_generation=3)
    assert pair.graph.link(0, 1).kind == "nvlink"
    dgx = parse_topo_matrix((DATA / "dgx-a100.txt").read_text(), nvlink_generation=3)
    assert {dgx.graph.link(a, b).token for a, b in dgx.graph.pairs()} == {"NVS12"}


def test_nic_legend():
    text = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV4\tPIX\t0-7\t0\n"
        "GPU1\tNV4\t X \tSYS\t8-15\t1\n"
        "NIC0\tPIX\tSYS\t X \n\nLegend:\n\n  X    = Self\n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    )
    result = parse_topo_matrix(text)
    assert result.nic_names == {"NIC0": "mlx5_0"}
    with pytest.raises(InputError, match="NIC Legend"):
        parse_topo_matrix(text + "  NIC1: mlx5_1\n")


# --- errors ------------------------------------------------------------------------------------

GOOD = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-7\nGPU1\tNV2\t X \t0-7\n"


@pytest.mark.parametrize(
    "text, quoted, expected",
    [
        (GOOD.replace("NV2\t0-7\nGPU1", "NV7X\t0-7\nGPU1"), "GPU0", "unknown link class"),
        (GOOD.replace("GPU1\tNV2", "GPU1\tNV1"), "GPU1\\tNV1", "symmetric"),
        (GOOD.replace("GPU0\t X ", "GPU0\tPIX"), "GPU0\\tPIX", "expected X"),
        (GOOD.replace("\t0-7\nGPU1", "\nGPU1"), "GPU0", "found 2 cells"),
        (GOOD.replace("GPU1\tNV2", "GPU2\tNV2"), "GPU2", "no such column"),
        (GOOD.replace("\tGPU0\tGPU1\tCPU", "\tGPU1\tGPU0\tCPU"), "GPU1\\tGPU0", "header does not name"),
        (GOOD + "hello world\n", "hello world", "header has no such column"),
        (GOOD + "\nLegend:\n  what is this\n", "what is this", "unexpected text after the matrix"),
        (GOOD.replace("CPU Affinity", "CPU Afinity"), "CPU Afinity", "expected only CPU Affinity"),
        (GOOD.replace("0-7\nGPU1", "zero\nGPU1"), "zero", "not a CPU list"),
        ("hello\n" + GOOD, "hello", "expected the header"),
        ("", "", "no header line"),
    ],
)
def test_errors_quote_the_line_and_say_what_is_expected(text, quoted, expected):
    with pytest.raises(InputError) as caught:
        parse_topo_matrix(text)
    message = str(caught.value)
    assert expected in message
    assert quoted in message


def _reading(text: str):
    result = parse_topo_matrix(text)
    return (result.graph, result.nics, result.nic_links, result.cpu_affinity, result.numa_affinity,
            result.gpu_numa_id, result.nic_names)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_corrupted_line_gives_an_error_never_a_wrong_graph(name):
    text = (DATA / f"{name}.txt").read_text()
    expected = _reading(text)
    lines = text.splitlines()
    caught = 0
    matrix_lines = {i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")
                    and "Legend" not in line and "=" not in line and "nvidia-smi" not in line}
    for label, mutated in mutations(lines, ("PIX", "SYS"), "\t"):
        try:
            got = _reading("\n".join(mutated))
        except InputError:
            caught += 1
            continue
        assert got == expected, f"{name}: {label} gave a different reading without an error"
    assert caught > 0
    # Every deletion of a matrix line (header or row) is caught.
    for i in matrix_lines:
        with pytest.raises(InputError):
            parse_topo_matrix("\n".join(lines[:i] + lines[i + 1 :]))


# --- -L, generations, formatter round trip ----------------------------------------------------


def test_gpu_list():
    text = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0a1b2c3d-0000-1111-2222-333344445555)\n"
        "  MIG 1g.10gb     Device  0: (UUID: MIG-0a1b2c3d-0000-1111-2222-333344445555)\n"
        "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-1a1b2c3d-0000-1111-2222-333344445555)\n"
    )
    entries = parse_gpu_list(text)
    assert [e.index for e in entries] == [0, 1]
    assert entries[1].uuid.startswith("GPU-1a1b")
    with pytest.raises(InputError, match="expected 'GPU <n>"):
        parse_gpu_list("GPU zero: X\n")
    with pytest.raises(InputError, match="expected GPU 1 next"):
        parse_gpu_list(text.replace("GPU 1:", "GPU 2:"))


@pytest.mark.parametrize(
    "model, generation",
    [
        ("Tesla P100-SXM2-16GB", 1),
        ("Tesla V100-SXM2-32GB", 2),
        ("NVIDIA A100-SXM4-80GB", 3),
        ("NVIDIA H100 80GB HBM3", 4),
        ("NVIDIA B200", 5),
        ("NVIDIA H20", 4),
        ("NVIDIA H200", 4),
        ("NVIDIA H800", 4),
        ("NVIDIA GH200 480GB", 4),
        ("NVIDIA A800-SXM4-80GB", 3),
        ("NVIDIA B300 SXM6 AC", 5),
        ("NVIDIA GB200", 5),
        ("NVIDIA GB300", 5),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA RTX A6000", None),
    ],
)
def test_generation_from_model(model, generation):
    assert nvlink_generation_of(model) == generation


@pytest.mark.parametrize("name", NVIDIA_PRESETS)
def test_formatter_round_trips_every_preset(name):
    graph = preset(name)
    result = parse_discovery(format_topo_matrix(graph), format_gpu_list(graph), name=name)
    assert same_hardware(result.graph, graph)


def test_gpu_count_mismatch_between_topo_and_list():
    graph = preset("summit")
    with pytest.raises(InputError, match="lists 8 GPUs"):
        parse_discovery(format_topo_matrix(graph), format_gpu_list(preset("dgx1-v100")))


# --- the mock nvidia-smi and `mapa topo discover` ---------------------------------------------


def _wrapper(tmp_path: Path, env: dict[str, str]) -> Path:
    script = tmp_path / "nvidia-smi"
    exports = "".join(f"export {key}='{value}'\n" for key, value in env.items())
    script.write_text(f"#!/bin/sh\n{exports}exec '{sys.executable}' '{MOCK}' \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("name", NVIDIA_PRESETS)
def test_discover_through_mock_nvidia_smi_reproduces_every_preset(name, tmp_path, capsys):
    fake = _wrapper(tmp_path, {"MAPA_PRESET": name})
    assert commands_main(["topo", "discover", "--source", "nvidia-smi", "--nvidia-smi", str(fake), "--name", name]) == 0
    out = capsys.readouterr().out
    from slurm_mapa.hardware.topofile import graph_from_toml_text

    discovered = graph_from_toml_text(out)
    assert discovered.name == name
    assert same_hardware(discovered, preset(name))


def test_mock_reads_a_topology_file(tmp_path):
    topo = GRES_CONF / "summit.toml"
    env = {**os.environ, "MAPA_MOCK_TOPOLOGY": str(topo)}
    env.pop("MAPA_PRESET", None)
    done = subprocess.run([sys.executable, str(MOCK), "topo", "-m"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert same_hardware(parse_topo_matrix(done.stdout).graph, preset("summit"))
    listed = subprocess.run([sys.executable, str(MOCK), "-L"], env=env, capture_output=True, text=True)
    assert len(parse_gpu_list(listed.stdout)) == 6
    bad = subprocess.run([sys.executable, str(MOCK), "nvlink", "-s"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "only `topo -m` and `-L`" in bad.stderr


def test_discover_from_saved_file_as_json(capsys):
    assert commands_main(["topo", "discover", "--source", "file", "--file", str(DATA / "dgx1-v100.txt"),
                          "--name", "x", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["links"]["0-3"] == "NV2" and data["gpus"] == 8


def test_discover_reports_bad_text(tmp_path, capsys):
    bad = tmp_path / "topo.txt"
    bad.write_text((DATA / "dgx1-v100.txt").read_text().replace("GPU3\tNV2", "GPU3\tNV3"))
    assert commands_main(["topo", "discover", "--source", "file", "--file", str(bad)]) == 2
    assert "symmetric" in capsys.readouterr().err


def test_terminal_styling_is_dropped_and_other_control_sequences_refused():
    real = (DATA / "h100-1gpu-lent.txt").read_text()
    assert "\x1b[4m" in real  # as the lent H100 printed it
    result = parse_topo_matrix(real)
    assert result.graph.size == 1 and result.numa_affinity == ("0",) and result.gpu_numa_id == ("N/A",)
    with pytest.raises(InputError, match="line 1: a terminal control sequence other than text styling"):
        parse_topo_matrix(real.replace("\x1b[4m", "\x1b]0;title\x07"))


# --- issue 16: prompts, sockets without CPU columns, current NVLink generations ------------------


@pytest.mark.parametrize(
    "prompt",
    [
        "nvidia-smi topo -m",
        "$ nvidia-smi topo -m",
        "[user@login01 ~]$ nvidia-smi topo -m",
        "(base) user@gpu-box:~$ nvidia-smi topo -m",
        "(pytorch) [user@node ~]$ nvidia-smi topo --matrix",
        "PS C:\\Users\\admin> nvidia-smi topo -m",
        "C:\\> nvidia-smi.exe topo -m",
        "root@dgx:/# nvidia-smi topo -m",
        "user@node:~$ sudo nvidia-smi topo -m | cat",
    ],
)
def test_any_command_line_naming_nvidia_smi_may_come_first(prompt):
    text = (DATA / "dgx1-v100.txt").read_text()
    assert parse_topo_matrix(prompt + "\n" + text) == parse_topo_matrix(text)


def test_a_line_that_is_no_command_is_still_refused():
    text = (DATA / "dgx1-v100.txt").read_text()
    for stray in ("user@node:~$ topo -m", "nvidia-smi-topo output below", "see nvidia-smi.log"):
        with pytest.raises(InputError, match="expected the header"):
            parse_topo_matrix(stray + "\n" + text)


def test_sockets_from_sys_boundaries_when_no_cpu_columns():
    # DGX-1 V100: NVLinks cross the sockets (0-4, 1-5, 2-6, 3-7); SYS pairs say where they are.
    result = parse_topo_matrix((DATA / "dgx1-v100-no-cpu-columns.txt").read_text())
    assert list(result.graph.domains) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert result.cpu_affinity is None
    # PCIe short of SYS joins, SYS separates, NVLink joins only where no SYS pair would be inside.
    text = "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV4\tSYS\tSYS\nGPU1\tNV4\t X \tSYS\tSYS\nGPU2\tSYS\tSYS\t X \tPHB\nGPU3\tSYS\tSYS\tPHB\t X \n"
    assert list(parse_topo_matrix(text).graph.domains) == [0, 0, 1, 1]
    bridged = "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV4\tSYS\tNV4\nGPU1\tNV4\t X \tNV4\tSYS\nGPU2\tSYS\tNV4\t X \tNV4\nGPU3\tNV4\tSYS\tNV4\t X \n"
    # A ring of NVLinks with SYS across: 0-1 joins first, then 2 cannot join {0,1} (0-2 SYS) ...
    domains = parse_topo_matrix(bridged).graph.domains
    for a, b in ((0, 2), (1, 3)):
        assert domains[a] != domains[b]
    all_nvlink = "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n"
    assert list(parse_topo_matrix(all_nvlink).graph.domains) == [0, 0]


def test_b200_nv18_reads_900_from_the_gpu_list_in_the_paste():
    result = parse_topo_matrix((DATA / "hgx-b200-with-gpu-list.txt").read_text())
    graph = result.graph
    assert graph.bandwidths.nvlink_generation == 5
    assert {graph.link(a, b).token for a, b in graph.pairs()} == {"NVS18"}
    assert graph.bandwidth(0, 7) == 900.0
    assert result.notes == () and result.gpu_models == ("NVIDIA B200",) * 8


def test_unknown_generation_is_a_noted_guess():
    result = parse_topo_matrix((DATA / "gb200-tray-4gpu.txt").read_text())
    assert result.graph.bandwidth(0, 1) == 450.0  # 18 x 25: the guess
    assert len(result.notes) == 1 and "NVLink generation unknown" in result.notes[0]
    assert "B200" in result.notes[0] and "50" in result.notes[0]
    listed = "".join(f"GPU {i}: NVIDIA GB200 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)\n" for i in range(4))
    known = parse_discovery((DATA / "gb200-tray-4gpu.txt").read_text(), listed)
    assert known.graph.bandwidth(0, 1) == 900.0 and known.notes == ()
    # A model outside the table: the note names it.
    rtx = "".join(f"GPU {i}: NVIDIA RTX A6000 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)\n" for i in range(2))
    pair = parse_discovery("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n", rtx)
    assert "NVIDIA RTX A6000 is not in the model table" in pair.notes[0]
    # PCIe-only servers have no NVLink to guess about.
    assert parse_topo_matrix((DATA / "pcie-8x-rtx4090-sys.txt").read_text()).notes == ()


def test_gpu_list_lines_in_the_paste_must_match_the_matrix():
    text = (DATA / "hgx-b200-with-gpu-list.txt").read_text()
    lines = text.splitlines()
    seventh = next(i for i, line in enumerate(lines) if line.startswith("GPU 7:"))
    with pytest.raises(InputError, match="list 7 GPUs but the matrix has 8"):
        parse_topo_matrix("\n".join(lines[:seventh] + lines[seventh + 1 :]))
    with pytest.raises(InputError, match="expected GPU 1 next, found GPU 2"):
        parse_topo_matrix(text.replace("GPU 1: NVIDIA", "GPU 2: NVIDIA", 1))


def test_topo_show_prints_the_generation_note(capsys):
    assert commands_main(["topo", "show", str(DATA / "gb200-tray-4gpu.txt")]) == 0
    out = capsys.readouterr().out
    assert "NVLink generation 2 (a guess, see the note)" in out
    assert "note: NVLink generation unknown" in out
    assert "nothing to choose" in out
