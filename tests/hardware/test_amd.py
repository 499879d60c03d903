"""AMD Instinct nodes: xGMI link classes, the mi250x / mi300x presets, saved rocm-smi and amd-smi
text, gres.conf lines with render nodes, the binding variables, and `mapa select` on MI250X."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import REPO, TEST_DATA

from slurm_mapa.cli import main as cli_main
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.links import Bandwidths, Link, parse_link, xgmi_link
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.gres import (
    binding_environment,
    gpu_of_device_file,
    gres_conf_lines,
    parse_gres_conf_files,
)
from slurm_mapa.hardware.load import load_topology_file
from slurm_mapa.hardware.presets import preset
from slurm_mapa.hardware.rocm_smi import detect_amd_tool, format_showtopo, parse_amd_topology
from slurm_mapa.hardware.topofile import Topology, graph_from_toml_text, topology_from_toml_text, topology_to_toml

from line_mutations import mutations

DATA = TEST_DATA / "rocm-smi"
IN_PACKAGE = {(0, 1), (2, 3), (4, 5), (6, 7)}


def matrix_of(graph) -> list[list[str]]:
    return [["X" if a == b else graph.link(a, b).token for b in graph.gpus] for a in graph.gpus]


# --- link classes -------------------------------------------------------------------------------


def test_xgmi_tokens_and_bandwidths():
    assert parse_link("XGMI4") == Link(kind="nvlink", links=4, fabric="xgmi") == xgmi_link(4)
    assert parse_link("xgmi1").token == "XGMI1"
    relayed = parse_link("XGMI0")
    assert relayed.token == "XGMI0" and not relayed.is_nvlink and relayed.is_xgmi
    assert relayed != parse_link("SYS") and parse_link("NV4") != parse_link("XGMI4")
    bandwidths = Bandwidths(xgmi_per_link=50.0)
    assert [bandwidths.of(parse_link(f"XGMI{n}")) for n in (4, 2, 1, 0)] == [200.0, 100.0, 50.0, 25.0]
    assert Bandwidths(xgmi_per_link=64.0, xgmi_relayed=40.0).of(relayed) == 40.0
    with pytest.raises(InputError, match="XGMI<n>"):
        parse_link("XGMI-2")
    with pytest.raises(InputError, match="positive"):
        Bandwidths(xgmi_per_link=0)


def test_the_paper_model_counts_xgmi_bonds_like_nvlink_bonds():
    from slurm_mapa.core.model_files import paper_model

    model = paper_model()
    # x1: double (or wider) links, x2: single links, x3: no direct link.
    assert [model.classify(parse_link(t)) for t in ("XGMI4", "XGMI2", "XGMI1", "XGMI0")] == [0, 0, 1, 2]


# --- presets ------------------------------------------------------------------------------------


def test_mi250x_preset_is_the_driver_matrix_of_an_ex235a_node():
    graph = preset("mi250x")
    # amdgpu's xgmi_num_links on a Frontier-class node (ROCm/rocm-systems#5763).
    counts = [
        [0, 4, 1, 0, 0, 0, 2, 0],
        [4, 0, 0, 1, 0, 1, 0, 0],
        [1, 0, 0, 4, 2, 0, 0, 0],
        [0, 1, 4, 0, 0, 0, 0, 1],
        [0, 0, 2, 0, 0, 4, 1, 0],
        [0, 1, 0, 0, 4, 0, 0, 1],
        [2, 0, 0, 0, 1, 0, 0, 4],
        [0, 0, 0, 1, 0, 1, 4, 0],
    ]
    assert [[0 if a == b else graph.link(a, b).links for b in graph.gpus] for a in graph.gpus] == counts
    fastest = max(graph.bandwidth(a, b) for a, b in graph.pairs())
    assert {(a, b) for a, b in graph.pairs() if graph.bandwidth(a, b) == fastest} == IN_PACKAGE
    assert fastest == 200.0 and list(graph.domains) == [3, 3, 1, 1, 0, 0, 2, 2]


def test_mi300x_is_all_to_all():
    graph = preset("mi300x")
    assert {graph.link(a, b).token for a, b in graph.pairs()} == {"XGMI1"}
    assert graph.bandwidth(0, 7) == 64.0


def test_topo_show_mi250x_puts_the_package_pairs_on_the_fastest_class(capsys):
    assert cli_main(["topo", "show", "mi250x"]) == 0
    out = capsys.readouterr().out
    assert "xGMI 50 GB/s per link" in out
    assert "bandwidth (GB/s): XGMI4 200, XGMI2 100, XGMI1 50, XGMI0 25" in out
    rows = {line.split()[0]: line.split()[1:9] for line in out.splitlines() if line.startswith("GPU") and " X " in f" {line} "}
    for a, b in IN_PACKAGE:
        assert rows[f"GPU{a}"][b] == "XGMI4" and rows[f"GPU{b}"][a] == "XGMI4"
    assert cli_main(["topo", "show", "mi250x", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vendor"] == "amd" and data["links"]["0-1"] == "XGMI4" and data["bandwidth_gbps"][0][1] == 200.0


@pytest.mark.parametrize("free, pair", [(None, {0, 1}), ("0,2,3,4,5,6,7", {2, 3}), ("1,2,4,5,6", {4, 5}), ("0,3,6,7", {6, 7})])
def test_select_on_mi250x_picks_an_in_package_pair(free, pair, capsys):
    args = ["select", "--topology", "mi250x", "--gpus", "2", "--directive", "topology=ring sensitive=yes", "--json"]
    assert cli_main(args + (["--free", free] if free else [])) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert set(chosen["gpus"]) == pair


def test_topology_file_round_trip_keeps_vendor_and_xgmi_speed():
    topology = Topology(graph=preset("mi300x"))
    text = topology_to_toml(topology)
    assert 'vendor = "amd"' in text and "xgmi_per_link = 64.0" in text
    again = topology_from_toml_text(text)
    assert again.graph.bandwidths == preset("mi300x").bandwidths
    assert again.graph.bandwidth(0, 1) == 64.0 and again.gpu_vendor == "amd"
    mi250x = graph_from_toml_text(topology_to_toml(Topology(graph=preset("mi250x"))))
    assert matrix_of(mi250x) == matrix_of(preset("mi250x"))
    with pytest.raises(InputError, match="vendor"):
        topology_from_toml_text('vendor = "intel"\ngpus = 2\n')
    with pytest.raises(InputError, match='expected vendor = "amd"'):
        topology_from_toml_text('vendor = "nvidia"\ngpus = 2\n[links]\n"0-1" = "XGMI2"\n')


# --- rocm-smi / amd-smi text ----------------------------------------------------------------------


def test_rocm_smi_showtopo_with_nodesbw_gives_the_mi250x():
    result = parse_amd_topology((DATA / "mi250x-showtopo-nodesbw.txt").read_text())
    assert result.tool == "rocm-smi" and result.notes == ()
    assert matrix_of(result.graph) == matrix_of(preset("mi250x"))
    assert result.graph.bandwidths.xgmi_per_link == 50.0
    assert list(result.graph.domains) == [3, 3, 1, 1, 0, 0, 2, 2]


def test_amd_smi_topology_gives_the_mi250x_and_its_bus_ids():
    result = parse_amd_topology((DATA / "mi250x-amd-smi-topology.txt").read_text())
    assert result.tool == "amd-smi"
    assert matrix_of(result.graph) == matrix_of(preset("mi250x"))
    assert result.pci_bus_ids[0] == "0000:c1:00.0" and result.pci_bus_ids[7] == "0000:de:00.0"


def test_mi300_showtopo_alone_is_one_xgmi_class_with_a_note():
    result = parse_amd_topology((DATA / "mi300x-showtopo.txt").read_text())
    graph = result.graph
    assert graph.size == 8 and {graph.link(a, b).token for a, b in graph.pairs()} == {"XGMI1"}
    assert graph.bandwidth(0, 1) == 64.0 and list(graph.domains) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(result.notes) == 1 and "--shownodesbw" in result.notes[0]


def test_mi250x_showtopo_alone_is_refused_never_guessed():
    with pytest.raises(InputError, match="link widths are unknown.*--shownodesbw"):
        parse_amd_topology((DATA / "mi250x-showtopo-only.txt").read_text())
    # Even with uniform weights, a text that names an MI250X product is refused.
    text = (DATA / "mi300x-showtopo.txt").read_text().replace(
        "End of ROCm SMI Log", "Product Info"
    ) + "GPU[0]\t\t: Card Series: \t\tAMD INSTINCT MI250X (MCM) OAM LC HPE\n"
    with pytest.raises(InputError, match="link widths are unknown"):
        parse_amd_topology(text)


def test_pcie_only_amd_gpus():
    result = parse_amd_topology((DATA / "pcie-4gpu-showtopo.txt").read_text())
    assert {result.graph.link(a, b).token for a, b in result.graph.pairs()} == {"SYS"}
    assert list(result.graph.domains) == [0, 0, 1, 1]


@pytest.mark.parametrize("name", ["mi250x", "mi300x"])
def test_formatter_round_trips_the_amd_presets(name):
    graph = preset(name)
    result = parse_amd_topology(format_showtopo(graph))
    assert matrix_of(result.graph) == matrix_of(graph)
    assert result.graph.bandwidths == graph.bandwidths and result.graph.domains == graph.domains


def test_format_is_detected_by_topo_show(capsys):
    for name in ("mi250x-showtopo-nodesbw.txt", "mi250x-amd-smi-topology.txt"):
        assert cli_main(["topo", "show", str(DATA / name)]) == 0
        assert "XGMI4 200" in capsys.readouterr().out
    assert cli_main(["topo", "show", str(DATA / "mi300x-showtopo.txt")]) == 0
    out = capsys.readouterr().out
    assert "note: rocm-smi gives no xGMI link widths" in out and "nothing to choose" in out
    nvidia = TEST_DATA / "nvidia-smi" / "dgx1-v100.txt"
    assert detect_amd_tool(nvidia.read_text()) is None
    assert load_topology_file(str(nvidia)).gpu_vendor == "nvidia"
    assert cli_main(["topo", "show", str(DATA / "mi250x-showtopo-only.txt")]) == 2
    assert "--shownodesbw" in capsys.readouterr().err


def test_discover_from_a_saved_rocm_smi_file(capsys):
    assert cli_main(["topo", "discover", "--source", "file", "--file", str(DATA / "mi250x-amd-smi-topology.txt"),
                     "--name", "nid005000"]) == 0
    captured = capsys.readouterr()
    topology = topology_from_toml_text(captured.out)
    assert topology.gpu_vendor == "amd" and topology.pci_bus_ids[1] == "0000:c6:00.0"
    assert matrix_of(topology.graph) == matrix_of(preset("mi250x"))


GOOD_AMD = "LINK TYPE TABLE:\n       GPU0 GPU1\nGPU0   SELF XGMI\nGPU1   XGMI SELF\n\nNUMA BW TABLE:\n       GPU0 GPU1\nGPU0   N/A 50000-100000\nGPU1   50000-100000 N/A\n"


@pytest.mark.parametrize(
    "text, quoted, expected",
    [
        (GOOD_AMD.replace("GPU1   XGMI SELF", "GPU1   PCIE SELF"), "GPU1   PCIE SELF", "symmetric"),
        (GOOD_AMD.replace("GPU0   SELF XGMI", "GPU0   SELF NVLINK").replace("GPU1   XGMI", "GPU1   NVLINK"), "NVLINK", "expected XGMI or PCIE"),
        (GOOD_AMD.replace("50000-100000", "50000-75000"), "50000-75000", "whole number of links"),
        (GOOD_AMD.replace("50000-100000", "fast"), "fast", "expected min-max"),
        (GOOD_AMD.replace("GPU1   50000", "GPU2   50000"), "GPU2", "expected the row of GPU1"),
        (GOOD_AMD.replace("GPU0   SELF", "GPU0   XGMI"), "GPU0   XGMI", "with itself"),
        (GOOD_AMD + "hello\n", "hello", "3 rows for 2 columns"),
        ("hello\n" + GOOD_AMD, "hello", "before the first table"),
        (GOOD_AMD.replace("       GPU0 GPU1\nGPU0   N/A", "       GPU0 GPX\nGPU0   N/A"), "GPX", "not a GPU column"),
    ],
)
def test_amd_errors_quote_the_line(text, quoted, expected):
    with pytest.raises(InputError) as caught:
        parse_amd_topology(text)
    assert expected in str(caught.value) and quoted in str(caught.value)


def _reading(text: str):
    result = parse_amd_topology(text)
    return result.graph, result.notes, result.pci_bus_ids


@pytest.mark.parametrize("name", sorted(path.name for path in DATA.glob("*.txt") if "only" not in path.name))
def test_a_corrupted_amd_line_gives_an_error_never_a_wrong_graph(name):
    text = (DATA / name).read_text()
    expected = _reading(text)
    lines = text.splitlines()
    caught = 0
    for label, mutated in mutations(lines, ("XGMI", "PCIE"), "   ", extra_cells=("30",)):
        try:
            got = _reading("\n".join(mutated))
        except InputError:
            caught += 1
            continue
        assert got == expected, f"{name}: {label} gave a different reading without an error"
    assert caught > 0


# --- gres.conf and binding ------------------------------------------------------------------------


def test_gres_lines_name_render_nodes_as_autodetect_rsmi_does():
    topology = Topology(graph=preset("mi250x"))
    lines = gres_conf_lines(topology, links=True)
    assert lines[0] == "Name=gpu File=/dev/dri/renderD128 Flags=amd_gpu_env Links=-1,4,1,0,0,0,2,0"
    assert parse_gres_conf_files("\n".join(lines))[7] == "/dev/dri/renderD135"
    odd = Topology(graph=preset("mi250x"), minor_numbers=(136, 137, 128, 129, 130, 131, 132, 133))
    assert gres_conf_lines(odd, links=False)[0] == "Name=gpu File=/dev/dri/renderD136 Flags=amd_gpu_env"
    assert gpu_of_device_file(odd, "/dev/dri/renderD128") == 2
    with pytest.raises(InputError, match="expected /dev/dri/renderD<N>"):
        gpu_of_device_file(odd, "/dev/nvidia0")
    shipped = (REPO / "slurm_mapa" / "data" / "gres_conf" / "mi250x.gres.conf").read_text()
    assert "Flags=amd_gpu_env" in shipped and "AutoDetect=off" in shipped


def test_binding_variables_on_amd():
    assert binding_environment([6, 7, 0], vendor="amd") == {
        "ROCR_VISIBLE_DEVICES": "6,7,0",
        "HIP_VISIBLE_DEVICES": "0,1,2",
        "CUDA_VISIBLE_DEVICES": "0,1,2",
        "GPU_DEVICE_ORDINAL": "0,1,2",
    }
    assert binding_environment([1], uuids=("GPU-a", "GPU-b"), vendor="amd")["ROCR_VISIBLE_DEVICES"] == "GPU-b"
    with pytest.raises(InputError, match="nvidia or amd"):
        binding_environment([0], vendor="intel")


def test_a_graph_with_xgmi_and_pcie_classes():
    graph = build_graph("mixed", 4, {(0, 1): "XGMI2", (2, 3): "XGMI2"}, default_link="SYS")
    assert Topology(graph=graph).gpu_vendor == "amd"
    assert graph.bandwidth(0, 1) == 100.0 and graph.bandwidth(0, 2) == 12.0


# --- the TaskProlog on an AMD node ------------------------------------------------------------------

TASKPROLOG = REPO / "slurm_mapa" / "data" / "hooks" / "mapa-taskprolog"


def _taskprolog(tmp_path, content, *, kfd="/nonexistent/kfd", vendor="auto", step_gpus=None):
    import subprocess

    from slurm_mapa.slurm.admin.install import taskprolog_text

    script = taskprolog_text(str(tmp_path), vendor).replace("KFD=/dev/kfd\n", f"KFD={kfd}\n")
    path = tmp_path / "taskprolog"
    path.write_text(script)
    (tmp_path / "77").write_text(content)
    env = {"SLURM_JOB_ID": "77", "PATH": "/usr/bin:/bin"} | ({"SLURM_STEP_GPUS": step_gpus} if step_gpus else {})
    return subprocess.run(["/bin/sh", str(path)], env=env, capture_output=True, text=True, check=True).stdout.splitlines()


def test_taskprolog_exports_rocr_and_relative_hip_lists_where_kfd_exists(tmp_path):
    # /dev/null stands for /dev/kfd: any character device tells an AMD node.
    out = _taskprolog(tmp_path, "MAPA_GPUS=6,7,0\n", kfd="/dev/null")
    assert out == ["export ROCR_VISIBLE_DEVICES=6,7,0", "export HIP_VISIBLE_DEVICES=0,1,2",
                   "export CUDA_VISIBLE_DEVICES=0,1,2", "export GPU_DEVICE_ORDINAL=0,1,2", "export MAPA_GPUS=6,7,0",
                   "export MAPA_SLURM_JOB_GPUS=", "export MAPA_SLURM_STEP_GPUS=", "export SLURM_JOB_GPUS=0,6,7",
                   "export SLURM_STEP_GPUS=0,6,7"]
    assert out[:4] == [f"export {key}={value}" for key, value in binding_environment([6, 7, 0], vendor="amd").items()]
    single = _taskprolog(tmp_path, "MAPA_GPUS=5\n", vendor="amd")
    assert single[:2] == ["export ROCR_VISIBLE_DEVICES=5", "export HIP_VISIBLE_DEVICES=0"]
    # A step Slurm gave its GPUs 1 and 2: MAPA's paired with them (the job file's pairing).
    step = _taskprolog(tmp_path, "MAPA_GPUS=4,5,2,3\nSLURM_GPUS=0,1,2,3\nPAIRED_GPUS=2,3,4,5\n", kfd="/dev/null", step_gpus="1,2")
    assert step[:2] == ["export ROCR_VISIBLE_DEVICES=3,4", "export HIP_VISIBLE_DEVICES=0,1"]


def test_taskprolog_stays_nvidia_without_kfd_or_when_told(tmp_path):
    out = _taskprolog(tmp_path, "MAPA_GPUS=0,3\n")
    assert out[0] == "export CUDA_VISIBLE_DEVICES=0,3" and not any("ROCR" in line for line in out)
    assert _taskprolog(tmp_path, "MAPA_GPUS=0,3\n", kfd="/dev/null", vendor="nvidia")[0] == "export CUDA_VISIBLE_DEVICES=0,3"
    assert _taskprolog(tmp_path, "MAPA_GPUS=1;reboot\n", kfd="/dev/null") == []
    from slurm_mapa.slurm.admin.install import taskprolog_text

    with pytest.raises(InputError, match="GPU vendor"):
        taskprolog_text("/run/x", "intel")


def test_show_in_the_tools_own_formats(capsys):
    assert cli_main(["topo", "show", "mi250x", "--rocm-smi-format"]) == 0
    assert matrix_of(parse_amd_topology(capsys.readouterr().out).graph) == matrix_of(preset("mi250x"))
    assert cli_main(["topo", "show", "mi250x", "--nvidia-smi-format"]) == 2
    assert "use --rocm-smi-format" in capsys.readouterr().err
    assert cli_main(["topo", "show", "dgx1-v100", "--rocm-smi-format"]) == 2
    capsys.readouterr()


def test_mock_rocm_smi_prints_a_preset(tmp_path):
    import os
    import subprocess
    import sys

    mock = REPO / "scripts" / "mock-rocm-smi"
    env = {**os.environ, "MAPA_PRESET": "mi250x"}
    env.pop("MAPA_MOCK_TOPOLOGY", None)
    done = subprocess.run([sys.executable, str(mock), "--showtopo", "--shownodesbw"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert matrix_of(parse_amd_topology(done.stdout).graph) == matrix_of(preset("mi250x"))
    bad = subprocess.run([sys.executable, str(mock), "--showbus"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "only `--showtopo" in bad.stderr
