"""gres.conf lines, CPU lists, Slurm core ids, and the GPU numbering helpers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.core.hardware import build_graph
from slurm_mapa.errors import InputError
from slurm_mapa.cli import main as commands_main
from slurm_mapa.hardware.gres import (
    LINKS_NOTE,
    CpuLayout,
    binding_environment,
    format_cpu_list,
    gpu_of_device_file,
    gres_conf_lines,
    gres_conf_text,
    links_value,
    parse_cpu_list,
    parse_gres_conf_files,
    slurm_cores,
)
from slurm_mapa.hardware.presets import PRESETS, preset
from slurm_mapa.hardware.topofile import Topology

ROOT = REPO
GRES_CONF = ROOT / "slurm_mapa" / "data" / "gres_conf"  # the gres.conf and topology file of every preset


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list([]) == ""
    for bad in ("", "a", "3-1", "1,,2"):
        with pytest.raises(InputError):
            parse_cpu_list(bad)


def test_slurm_cores_from_affinity():
    dgx1 = CpuLayout(cores=40, threads_per_core=2, numbering="split", sockets=2)
    assert slurm_cores("0-19,40-59", dgx1) == "0-19"
    assert slurm_cores("20-39,60-79", dgx1) == "20-39"
    # Summit binds GPUs to 21 of a socket's 22 cores; slurmd rejects Cores= that do not cover
    # whole sockets ("doesn't match socket boundaries"), so each socket is taken whole.
    summit = CpuLayout(cores=44, threads_per_core=4, numbering="packed", sockets=2)
    assert slurm_cores("0-83", summit) == "0-21"
    assert slurm_cores("88-171", summit) == "22-43"
    assert slurm_cores("0-3", CpuLayout(cores=8)) == "0-7"  # one socket: the whole node
    with pytest.raises(InputError, match="socket count must divide"):
        CpuLayout(cores=10, sockets=3)
    with pytest.raises(InputError, match="beyond the node's 40 cores"):
        slurm_cores("0-19,40-59", CpuLayout(cores=40))
    with pytest.raises(InputError):
        CpuLayout(cores=4, numbering="zigzag")


def test_links_value():
    graph = preset("dgx1-v100")
    assert links_value(graph, 0) == "-1,1,1,2,2,0,0,0"
    assert links_value(preset("dgx-a100"), 7) == "12,12,12,12,12,12,12,-1"
    assert links_value(preset("pcie-8"), 0) == "-1,0,0,0,0,0,0,0"


def test_lines_for_dgx1():
    lines = gres_conf_lines(preset("dgx1-v100"), layout=CpuLayout(40, 2, sockets=2), gres_type="v100", node_name="dgx1")
    assert lines[0] == "NodeName=dgx1 Name=gpu Type=v100 File=/dev/nvidia0 Cores=0-19 Links=-1,1,1,2,2,0,0,0"
    assert lines[7].endswith("File=/dev/nvidia7 Cores=20-39 Links=0,0,0,1,2,1,2,-1")
    plain = gres_conf_lines(preset("dgx1-v100"), links=False)
    assert plain[3] == "Name=gpu File=/dev/nvidia3"


def test_minor_numbers_give_the_device_files_in_index_order():
    graph = build_graph("box", 3, {(0, 1): "NV1"})
    topology = Topology(graph, minor_numbers=(2, 0, 1))
    lines = gres_conf_lines(topology)
    assert [re.search(r"File=(\S+)", line).group(1) for line in lines] == ["/dev/nvidia2", "/dev/nvidia0", "/dev/nvidia1"]
    assert gpu_of_device_file(topology, "/dev/nvidia0") == 1
    with pytest.raises(InputError, match="no GPU of box has minor number 7"):
        gpu_of_device_file(topology, "/dev/nvidia7")
    with pytest.raises(InputError):
        gpu_of_device_file(topology, "/dev/tty0")
    assert parse_gres_conf_files(gres_conf_text(topology)) == ["/dev/nvidia2", "/dev/nvidia0", "/dev/nvidia1"]


def test_text_notes_links_need_type_or_cores():
    text = gres_conf_text(preset("torus2d-16"))
    assert LINKS_NOTE in text and "neither Type= nor Cores=" in text
    assert "AutoDetect=off" in text
    typed = gres_conf_text(preset("torus2d-16"), gres_type="v100")
    assert "neither Type= nor Cores=" not in typed
    assert "Cores= left out" in gres_conf_text(preset("dgx1-v100"))


def test_binding_environment():
    assert binding_environment([0, 3]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,3"}
    env = binding_environment([1], uuids=("GPU-a", "GPU-b"))
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b"


@pytest.mark.parametrize("name", ["dgx1-v100", "torus2d-16", "summit"])
def test_mini_cluster_files_keep_their_gpu_lines(name):
    """The mini cluster makes /dev/nvidia0..N-1 from the File= entries of these files."""
    text = (GRES_CONF / f"{name}.gres.conf").read_text()
    files = parse_gres_conf_files(text)
    assert files == [f"/dev/nvidia{n}" for n in range(preset(name).size)]
    for n, line in enumerate(l for l in text.splitlines() if l.startswith("Name=gpu")):
        assert line.startswith(f"Name=gpu File=/dev/nvidia{n}")


def test_mini_cluster_cores_fit_slurm_conf():
    """The mini cluster's nodes have their presets' sockets with one core each; entrypoint.sh
    (socket_gres) renames each preset gres.conf's Cores= ranges to those sockets' cores. Cores=
    must stay inside the node's cores, or slurmd stops (fatal), and GPUs of one socket share one."""
    conf = ROOT / "containers" / "config" / "slurm.conf"
    entrypoint = ROOT / "containers" / "entrypoint.sh"
    nodes = {"dgx1": "dgx1-v100", "torus1": "torus2d-16", "summit1": "summit", "mi250x1": "mi250x", "dgx2": "dgx1-v100"}
    seen = set()
    for line in conf.read_text().splitlines():
        match = re.match(r"NodeName=(\S+) .*SocketsPerBoard=(\d+) CoresPerSocket=(\d+)", line)
        if not match or match.group(1) not in nodes:
            continue
        node, sockets, per_socket = match.group(1), int(match.group(2)), int(match.group(3))
        seen.add(node)
        preset_text = (GRES_CONF / f"{nodes[node]}.gres.conf").read_text()
        script = f'log() {{ echo "$*" >&2; }}; source <(sed -n "/^socket_gres()/,/^}}/p" {entrypoint}); socket_gres "$1" "$2" "$3"'
        done = subprocess.run(["bash", "-c", script, "bash", str(GRES_CONF / f"{nodes[node]}.gres.conf"), str(conf), node],
                              capture_output=True, text=True, check=True)
        before = re.findall(r"(?m)^Name=gpu (File=\S+) .*?Cores=(\S+)", preset_text)
        after = re.findall(r"(?m)^Name=gpu (File=\S+) .*?Cores=(\S+)", done.stdout)
        assert [f for f, _ in before] == [f for f, _ in after]
        for (_, old), (_, new) in zip(before, after):
            assert max(parse_cpu_list(new)) < sockets * per_socket
            # GPUs that shared a socket in the preset share one here, and only they do.
            assert [c == old for _, c in before] == [c == new for _, c in after]
        assert done.stdout.replace("\n", "").count("Links=") == preset_text.replace("\n", "").count("Links=")
    assert seen == set(nodes)


def test_gres_conf_command(capsys):
    assert commands_main(["gres-conf", "--topology", "summit", "--node", "summit1", "--type", "v100"]) == 0
    out = capsys.readouterr().out
    assert "NodeName=summit1 Name=gpu Type=v100 File=/dev/nvidia0 Cores=0-21 Links=-1,2,2,0,0,0" in out
    assert commands_main(["gres-conf", "--topology", "dgx1-v100", "--cores", "20", "--threads-per-core", "4"]) == 0
    assert "Cores=0-19 " in capsys.readouterr().out
    assert commands_main(["gres-conf", "--topology", "dgx1-v100", "--no-cores", "--no-links"]) == 0
    assert "Name=gpu File=/dev/nvidia0\n" in capsys.readouterr().out
    assert commands_main(["gres-conf", "--topology", "nowhere"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_topo_show(capsys, tmp_path):
    assert commands_main(["topo", "show", "dgx1-v100"]) == 0
    out = capsys.readouterr().out
    assert "NVLink generation 2" in out and "NV2 50" in out
    path = tmp_path / "t.toml"
    path.write_text((GRES_CONF / "summit.toml").read_text())
    assert commands_main(["topo", "show", "--topology", str(path), "--json"]) == 0
    assert '"gpus": 6' in capsys.readouterr().out
    assert commands_main(["topo", "show", "pcie-8", "--nvidia-smi-format"]) == 0
    assert "GPU0\t X \tPIX" in capsys.readouterr().out


def test_write_presets(tmp_path, capsys):
    assert commands_main(["gres-conf", "--write-presets", str(tmp_path)]) == 0
    assert len(list(tmp_path.iterdir())) == 2 * len(PRESETS)


@pytest.mark.parametrize("argv, offered", [
    (["gres-conf", "--nvidia-smi", "/nonexistent/nvidia-smi"], "--topology"),
    (["gres-conf", "--source", "rocm-smi", "--rocm-smi", "/nonexistent/rocm-smi"], "--topology"),
    (["topo", "discover", "--nvidia-smi", "/nonexistent/nvidia-smi"], "--source file --file"),
])
def test_without_the_gpu_tool_the_error_offers_an_option_the_command_has(argv, offered, capsys):
    assert commands_main(argv) == 2
    error = capsys.readouterr().err
    assert "/nonexistent/" in error and offered in error, error
    command = argv[:2] if argv[0] == "topo" else argv[:1]
    with pytest.raises(SystemExit):
        commands_main([*command, "--help"])
    usage = capsys.readouterr().out
    for option in re.findall(r"--[a-z-]+", error.split("not found;")[1]):
        assert option in usage, (option, error)
