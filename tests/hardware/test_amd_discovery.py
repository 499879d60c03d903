"""AMD discovery and health through a strict fake of AMD SMI's Python package."""

from __future__ import annotations

import pytest

from fake_amdsmi import FakeAmdGpu, FakeAmdSmi, from_graph
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.amd import amdsmi_session, discover, health
from slurm_mapa.hardware.presets import preset


def matrix_of(graph) -> list[list[str]]:
    return [["X" if a == b else graph.link(a, b).token for b in graph.gpus] for a in graph.gpus]


@pytest.mark.parametrize("name, per_link", [("mi250x", 50000), ("mi300x", 64000)])
def test_discovery_reproduces_the_presets(name, per_link):
    graph = preset(name)
    fake = from_graph(graph, per_link_mbs=per_link)
    with amdsmi_session(fake) as amdsmi:
        found = discover(amdsmi, name=name)
    assert matrix_of(found.topology.graph) == matrix_of(graph)
    assert found.topology.graph.bandwidths == graph.bandwidths
    assert found.topology.graph.domains == graph.domains
    assert found.topology.minor_numbers == tuple(range(128, 136))
    assert found.topology.gpu_vendor == "amd" and found.warnings == ()
    assert fake.calls[0] == "amdsmi_init" and fake.calls[-1] == "amdsmi_shut_down"


def test_gpus_are_numbered_as_hip_numbers_them():
    graph = preset("mi250x")
    shuffle = [3, 1, 7, 0, 2, 6, 5, 4]  # the library's handle order
    with amdsmi_session(from_graph(graph, shuffle=shuffle)) as amdsmi:
        found = discover(amdsmi)
    assert matrix_of(found.topology.graph) == matrix_of(graph)
    assert [device.hip_id for device in found.devices] == list(range(8))
    assert found.topology.pci_bus_ids[0] == "0000:c1:00.0"


def test_without_enumeration_info_the_library_order_is_kept_and_said():
    gpus = [FakeAmdGpu(bdf="0000:C1:00.0", uuid="GPU-a", render=None, hip_id=None),
            FakeAmdGpu(bdf="0000:c6:00.0", uuid="GPU-b", render=None, hip_id=None)]
    with amdsmi_session(FakeAmdSmi(gpus, {(0, 1): 4})) as amdsmi:
        found = discover(amdsmi)
    assert found.topology.graph.link(0, 1).token == "XGMI4"
    assert found.topology.pci_bus_ids == ("0000:c1:00.0", "0000:c6:00.0")
    assert found.topology.minor_numbers == (128, 129)
    assert any("no HIP ids" in warning for warning in found.warnings)
    assert any("renderD128" in warning for warning in found.warnings)


def test_pcie_pairs_take_their_level_from_the_hops():
    gpus = [FakeAmdGpu(bdf=f"0000:{0x10 * (i + 1):02x}:00.0", uuid=f"GPU-{i}", render=128 + i, hip_id=i, numa=i // 2)
            for i in range(4)]
    links = {(0, 1): "pcie:1", (2, 3): "pcie:2", (0, 2): "pcie:3", (0, 3): "pcie:3", (1, 2): "pcie:3", (1, 3): "pcie:3"}
    with amdsmi_session(FakeAmdSmi(gpus, links)) as amdsmi:
        graph = discover(amdsmi).topology.graph
    assert [graph.link(0, 1).token, graph.link(2, 3).token, graph.link(0, 3).token] == ["PXB", "NODE", "SYS"]
    assert list(graph.domains) == [0, 0, 1, 1]


def test_cpu_affinity_comes_from_the_given_reader():
    with amdsmi_session(from_graph(preset("mi250x"))) as amdsmi:
        found = discover(amdsmi, cpulist_of=lambda bdf: "0-15" if bdf.endswith("c1:00.0") else "16-31")
    assert found.topology.graph.cpu_affinity[:2] == ("0-15", "16-31")


def test_calls_before_init_and_unknown_calls_fail_loudly():
    fake = from_graph(preset("mi300x"))
    with pytest.raises(Exception, match="before amdsmi_init"):
        discover(fake)
    with pytest.raises(AssertionError, match="not implemented"):
        fake.amdsmi_get_gpu_metrics_info  # noqa: B018


def test_health_reports_ecc_pages_and_foreign_processes():
    graph = preset("mi250x")
    fake = from_graph(graph, shuffle=[1, 0, 2, 3, 4, 5, 6, 7])
    gpus = fake._gpus
    gpus[0].ecc_uncorrectable = 3  # handle 0 is topology GPU 1
    gpus[2].bad_pages = [0, 1]  # GPU 2: one retired, one pending
    gpus[3].bad_pages = [2]  # GPU 3: could not be retired
    gpus[4].processes = [4242, 777]  # GPU 4: 777 belongs to no job
    gpus[5].ecc_uncorrectable = None  # GPU 5: not supported -> healthy
    gpus[6].lost = True  # GPU 6: cannot be queried
    with amdsmi_session(fake) as amdsmi:
        report = health(amdsmi, job_pids={4242})
    assert report.excluded == [1, 2, 3, 4, 6]
    assert report.problems[1] == ("3 uncorrectable ECC errors",)
    assert report.problems[2] == ("bad page retirement pending (reset the GPU)",)
    assert report.problems[3] == ("a bad page could not be retired",)
    assert report.problems[4] == ("compute process 777 belongs to no job",)
    assert report.problems[6][0].startswith("AMD SMI error")
    with amdsmi_session(from_graph(graph)) as amdsmi:
        assert health(amdsmi).healthy


def test_init_failure_is_an_input_error():
    class Broken(FakeAmdSmi):
        def amdsmi_init(self, flag=None):
            raise self.AmdSmiLibraryException(4, "libamd_smi.so could not be loaded")

    with pytest.raises(InputError, match="AMD SMI could not start"):
        with amdsmi_session(Broken([], {})):
            pass


def test_the_fake_has_the_real_signatures():
    """When AMD SMI's Python package is installed, the fake's calls must take the same arguments."""
    import ast
    import importlib.util
    import inspect
    from pathlib import Path

    spec = importlib.util.find_spec("amdsmi")  # found without importing: the import needs libamd_smi
    assert spec is not None and spec.submodule_search_locations, "install the test extras: pip install -e '.[test]' (they hold amdsmi)"
    source = Path(list(spec.submodule_search_locations)[0]) / "amdsmi_interface.py"
    tree = ast.parse(source.read_text())
    real = {node.name: [arg.arg for arg in node.args.args] for node in tree.body if isinstance(node, ast.FunctionDef)}
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for name, member in vars(FakeAmdSmi).items():
        if name.startswith("amdsmi_"):
            assert name in real, name
            fake_args = [p for p in inspect.signature(member).parameters if p != "self"]
            assert len(fake_args) == len(real[name]), (name, fake_args, real[name])
    assert {"AmdSmiInitFlags", "AmdSmiLinkType", "AmdSmiMemoryPageStatus"} <= classes


def test_health_probe_is_none_without_the_package(monkeypatch):
    import importlib.util

    from slurm_mapa.hardware import amd

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert amd.health_probe(lambda pid: True) is None


def test_the_prolog_asks_amd_smi_on_nodes_with_the_amdgpu_driver(tmp_path, monkeypatch):
    import importlib.util

    from slurm_mapa.slurm.config import HookConfig
    from slurm_mapa.slurm.hooks.prolog import gpu_health_probe

    kfd = tmp_path / "kfd"
    kfd.write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no amdsmi package
    assert gpu_health_probe(HookConfig(), kfd) is None  # not NVML's probe, which would fail here
    assert gpu_health_probe(HookConfig(health="off"), kfd) is None


def test_the_gpu_count_of_an_amd_node_comes_from_its_render_nodes(tmp_path):
    from slurm_mapa.slurm.node_state.job_files import device_count

    (tmp_path / "dri").mkdir()
    for name in ("renderD128", "renderD129", "card0", "card1"):
        (tmp_path / "dri" / name).write_text("")
    assert device_count(tmp_path) == 0  # without /dev/kfd these are not compute GPUs
    (tmp_path / "kfd").write_text("")
    assert device_count(tmp_path) == 2
