"""NVML discovery and health, against the strict fake NVML of tests/fake_nvml.py."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from fake_nvml import IMPLEMENTED_CALLS, FakeGpu, FakeLink, FakeNvml, NVMLError, bus_id, from_graph
from slurm_mapa.core.hardware import HardwareGraph
from slurm_mapa.errors import InputError
from slurm_mapa.hardware import nvml as nvml_module
from slurm_mapa.cli import main as commands_main
from slurm_mapa.hardware.gres import gres_conf_lines
from slurm_mapa.hardware.nvml import discover, health, normalize_bus_id, nvml_session
from slurm_mapa.hardware.presets import preset
from slurm_mapa.hardware.topofile import topology_from_toml_text


def same_hardware(a: HardwareGraph, b: HardwareGraph) -> bool:
    return dataclasses.replace(a, name="", description="") == dataclasses.replace(b, name="", description="")


def run_discovery(fake, **kwargs):
    with nvml_session(fake) as nvml:
        return discover(nvml, **kwargs)


# --- the fake itself is strict -----------------------------------------------------------------


def test_fake_rejects_calls_it_does_not_implement():
    fake = from_graph(preset("pcie-8"), model="NVIDIA L40S", ports=0)
    with pytest.raises(AssertionError, match="nvmlDeviceGetPowerUsage is not implemented"):
        fake.nvmlDeviceGetPowerUsage(None)
    with pytest.raises(AssertionError, match="NVML_SOMETHING is not implemented"):
        fake.NVML_SOMETHING
    with pytest.raises(NVMLError):
        fake.nvmlDeviceGetCount()  # before nvmlInit


def test_fake_calls_have_pynvml_signatures():
    pynvml = pytest.importorskip("pynvml")
    for name in IMPLEMENTED_CALLS:
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        ours = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]
        assert len(real) == len(ours), (name, real, ours)
    for name in ("NVML_NVLINK_DEVICE_TYPE_SWITCH", "NVML_TOPOLOGY_HOSTBRIDGE", "NVML_ERROR_NOT_SUPPORTED",
                 "NVML_VOLATILE_ECC", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_FEATURE_ENABLED"):
        assert getattr(pynvml, name) == getattr(from_graph(preset("pcie-8"), model="x", ports=0), name)


# --- discovery ---------------------------------------------------------------------------------


def test_dgx1_v100():
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6)
    found = run_discovery(fake, name="dgx1-v100")
    graph = found.topology.graph
    assert same_hardware(graph, preset("dgx1-v100"))
    assert graph.name == "dgx1-v100"
    assert found.warnings == ()
    assert found.devices[0].nvlinks[0].remote_kind == "gpu"
    assert found.topology.uuids[3].startswith("GPU-00000003")
    assert found.topology.pci_bus_ids[1] == bus_id(1)
    assert "nvmlShutdown" in fake.calls


def test_dgx_a100_nvswitch():
    fake = from_graph(preset("dgx-a100"), model="NVIDIA A100-SXM4-80GB", ports=12, switches=6)
    graph = run_discovery(fake).topology.graph
    assert same_hardware(graph, preset("dgx-a100"))
    assert {graph.link(a, b).token for a, b in graph.pairs()} == {"NVS12"}
    assert graph.bandwidths.nvlink_generation == 3


def test_nvswitch_counts_the_smaller_switch_link_count():
    fake = from_graph(preset("dgx-a100"), model="NVIDIA A100-SXM4-80GB", ports=12)
    gpu = fake._gpus[5]
    for link in gpu.links[8:]:
        link.enabled = False  # GPU 5 has 8 of its 12 links up
    graph = run_discovery(fake).topology.graph
    assert graph.link(5, 0).token == "NVS8" and graph.link(0, 1).token == "NVS12"


def test_pcie_only_server():
    fake = from_graph(preset("pcie-8"), model="NVIDIA GeForce RTX 4090", ports=0)
    graph = run_discovery(fake).topology.graph
    assert same_hardware(graph, preset("pcie-8"))
    assert "nvmlDeviceGetTopologyCommonAncestor" in fake.calls


def test_without_remote_device_type_switches_are_found_by_sharing():
    fake = from_graph(preset("dgx-a100"), model="NVIDIA A100-SXM4-80GB", ports=12, remote_type_supported=False)
    assert same_hardware(run_discovery(fake).topology.graph, preset("dgx-a100"))
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6, remote_type_supported=False)
    assert same_hardware(run_discovery(fake).topology.graph, preset("dgx1-v100"))


def test_summit_links_to_the_cpu_are_not_gpu_pairs():
    fake = from_graph(preset("summit"), model="Tesla V100-SXM2-16GB", ports=6)
    for index, gpu in enumerate(fake._gpus):
        gpu.links += [FakeLink(f"00000000:{0x80 + index:02X}:00.{n}", 2, 1) for n in range(2)]
    found = run_discovery(fake)
    assert same_hardware(found.topology.graph, preset("summit"))
    assert found.devices[0].nvlinks[-1].remote_kind == "npu"


def test_numa_unknown_falls_back_to_cpu_affinity_groups():
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6, numa_supported=False)
    assert run_discovery(fake).topology.graph.domains == (0, 0, 0, 0, 1, 1, 1, 1)


def test_minor_numbers_are_kept_and_used_for_device_files():
    fake = from_graph(preset("pcie-8"), model="NVIDIA L4", ports=0, minors=[7, 6, 5, 4, 3, 2, 1, 0])
    topology = run_discovery(fake).topology
    assert topology.minor_numbers == (7, 6, 5, 4, 3, 2, 1, 0)
    assert gres_conf_lines(topology, links=False)[0] == "Name=gpu File=/dev/nvidia7"


def test_asymmetric_link_counts_are_warned_about():
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6)
    first_to_3 = next(link for link in fake._gpus[0].links if link.remote_bus_id == bus_id(3))
    first_to_3.enabled = False
    found = run_discovery(fake)
    assert found.topology.graph.link(0, 3).token == "NV1"
    assert any("GPUs 0-3" in warning for warning in found.warnings)


def test_bus_ids():
    assert normalize_bus_id(b"0000:3b:00.0") == "00000000:3B:00.0"
    with pytest.raises(InputError):
        normalize_bus_id("garbage")


def test_init_failure_is_an_input_error():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise NVMLError(9, "Driver Not Loaded")

    with pytest.raises(InputError, match="NVIDIA driver"):
        with nvml_session(Broken([])):
            pass


def test_discover_command_with_nvml(monkeypatch, capsys):
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6)
    monkeypatch.setattr(nvml_module, "load_pynvml", lambda: fake)
    assert commands_main(["topo", "discover", "--source", "nvml", "--name", "n1"]) == 0
    topology = topology_from_toml_text(capsys.readouterr().out)
    assert same_hardware(topology.graph, preset("dgx1-v100"))
    assert topology.minor_numbers == tuple(range(8)) and len(topology.uuids) == 8


# --- health ------------------------------------------------------------------------------------


def test_health_reports_what_to_leave_out():
    fake = from_graph(preset("pcie-8"), model="NVIDIA A100-PCIE-40GB", ports=0)
    gpus = fake._gpus
    gpus[1].retirement_pending = True
    gpus[2].retirement_pending, gpus[2].remapped_rows = None, (0, 1, 1, 0)
    gpus[3].ecc_uncorrected = 4
    gpus[4].processes = [4242]
    gpus[5].processes = [1000]  # a job's
    gpus[6].lost = True
    gpus[7].ecc_uncorrected, gpus[7].retirement_pending = None, None  # not supported: healthy
    with nvml_session(fake) as nvml:
        report = health(nvml, job_pids={1000})
    assert report.excluded == [1, 2, 3, 4, 6]
    assert "page retirement pending" in report.problems[1][0]
    assert "row remapping pending" in report.problems[2][0]
    assert "4 uncorrectable ECC errors" in report.problems[3][0]
    assert "compute process 4242 belongs to no job" in report.problems[4][0]
    assert "GPU is lost" in report.problems[6][0]
    assert report.to_dict()["excluded"] == [1, 2, 3, 4, 6]


def test_health_with_a_pid_predicate_and_a_healthy_machine():
    fake = from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6)
    fake._gpus[0].processes = [10, 11]
    with nvml_session(fake) as nvml:
        assert health(nvml, job_pids=lambda pid: pid >= 10).healthy
        assert health(nvml).excluded == [0]


def test_health_row_remapping_failure():
    fake = FakeNvml([FakeGpu(bus_id(0), "GPU-x", 0, "NVIDIA H100", retirement_pending=None,
                             remapped_rows=(0, 0, 0, 1))])
    with nvml_session(fake) as nvml:
        assert health(nvml).problems == {0: ("row remapping failed",)}
