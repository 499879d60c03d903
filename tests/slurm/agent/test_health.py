"""mapa-agent's GPU health passes (issue 50): what a source's findings do to the held GPUs (a pure
merge on literals), the passes on a fake pynvml and a fake AMD SMI source, Slurm told at once,
the mapa_gpu_healthy gauge, held GPUs left out of the free-ring gauges, and `mapa doctor`'s line."""

from __future__ import annotations

import types

import pytest
from fake_nvml import from_graph
from fake_slurmctld import FakeSlurmctld

from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.policies import all_policies
from slurm_mapa.hardware.gpu_faults import Finding, GpuReading
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.admin.doctor.held_check import check_health
from slurm_mapa.slurm.admin.doctor.records import OK, WARN, Inputs
from slurm_mapa.slurm.agent.background import Background
from slurm_mapa.slurm.agent.health import HealthMonitor
from slurm_mapa.slurm.agent.health_holds import merge_source
from slurm_mapa.slurm.agent.metrics import AgentMetrics, node_gauges
from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.node_state import GpuHold, NodeState

XID79 = Finding("XID 79 (GPU fell off the bus)", sticky=True)
REMAP = Finding("row remapping pending (reset the GPU)")
ALL = frozenset(range(8))


# --- the merge ----------------------------------------------------------------------------------


def test_a_finding_holds_the_gpu_with_the_sources_name_and_a_healthy_pass_releases_it():
    merged = merge_source({}, "nvml", {3: (REMAP,)}, ALL, 100.0)
    assert merged.holds == {3: GpuHold("row remapping pending (reset the GPU)", 100.0, "nvml")}
    assert merged.lines == ("GPU 3 held out of new jobs (nvml): row remapping pending (reset the GPU)",)
    assert not merge_source(merged.holds, "nvml", {3: (REMAP,)}, ALL, 200.0).changed  # seen again: unchanged
    released = merge_source(merged.holds, "nvml", {}, ALL, 300.0)
    assert released.holds == {} and released.lines == (
        "GPU 3 released (nvml): healthy again (was: row remapping pending (reset the GPU))",)


def test_a_changed_finding_keeps_since():
    holds = {3: GpuHold("row remapping pending (reset the GPU)", 100.0, "nvml")}
    merged = merge_source(holds, "nvml", {3: (Finding("row remapping failed"),)}, ALL, 200.0)
    assert merged.holds == {3: GpuHold("row remapping failed", 100.0, "nvml")}


def test_an_admins_hold_and_another_sources_are_never_overwritten_nor_released():
    holds = {1: GpuHold("bad fan", 5.0, "admin"), 2: GpuHold("2 uncorrectable ECC errors", 6.0, "amdsmi")}
    for found in ({1: (XID79,), 2: (REMAP,)}, {}):
        merged = merge_source(holds, "nvml", found, ALL, 100.0)
        assert merged.holds == holds and not merged.changed


def test_an_xid_hold_is_not_released_by_its_source_only_its_clearing_parts():
    merged = merge_source({}, "nvml", {3: (XID79, REMAP)}, ALL, 100.0)
    assert merged.holds[3].reason == "XID 79 (GPU fell off the bus); row remapping pending (reset the GPU)"
    later = merge_source(merged.holds, "nvml", {}, ALL, 200.0)
    assert later.holds == {3: GpuHold("XID 79 (GPU fell off the bus)", 100.0, "nvml")}
    assert "an XID is released by an admin (mapa gpu release 3)" in later.lines[0]
    assert not merge_source(later.holds, "nvml", {}, ALL, 300.0).changed
    again = merge_source(later.holds, "nvml", {3: (REMAP,)}, ALL, 400.0)  # a new finding keeps the XID
    assert again.holds[3].reason == "XID 79 (GPU fell off the bus); row remapping pending (reset the GPU)"


def test_a_gpu_the_source_could_not_read_keeps_what_it_has():
    holds = {3: GpuHold("row remapping pending (reset the GPU)", 100.0, "nvml")}
    assert not merge_source(holds, "nvml", {}, ALL - {3}, 200.0).changed


# --- the passes -----------------------------------------------------------------------------------


def config_in(tmp_path, health: str = "auto") -> HookConfig:
    return HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                      nodes=(("dgx*", "dgx1-v100"),), health=health, scontrol="scontrol")


def machine():
    return from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6)


def monitor(fake, tmp_path, clock=lambda: 1_700_000_000.0) -> HealthMonitor:
    return HealthMonitor(load_nvml=lambda: fake, kfd=tmp_path / "no-kfd", clock=clock)


def test_a_pass_holds_a_faulted_gpu_and_releases_it_when_the_fault_clears(tmp_path):
    fake, state = machine(), NodeState.of(config_in(tmp_path))
    health = monitor(fake, tmp_path)
    assert health.health_pass(state, 8) == [] and health.healthy == dict.fromkeys(range(8), True)
    assert health.summary() == "nvml read (8 GPUs), dcgm not installed, amd-smi not used (no /dev/kfd)"
    fake._gpus[2].remapped_rows = (0, 1, 1, 0)
    fake.raise_xid(5, 79)
    state.set_hold(6, GpuHold("fan", 1.0, "admin"))
    fake._gpus[6].retirement_pending = True
    lines = health.health_pass(state, 8)
    assert lines == ["GPU 2 held out of new jobs (nvml): row remapping pending (reset the GPU)",
                     "GPU 5 held out of new jobs (nvml): XID 79 (GPU fell off the bus)"]
    assert state.held_gpus() == {2: GpuHold("row remapping pending (reset the GPU)", 1_700_000_000.0, "nvml"),
                                 5: GpuHold("XID 79 (GPU fell off the bus)", 1_700_000_000.0, "nvml"),
                                 6: GpuHold("fan", 1.0, "admin")}
    assert {gpu for gpu, ok in health.healthy.items() if not ok} == {2, 5, 6}
    fake._gpus[2].remapped_rows = (0, 1, 0, 0)  # the GPU was reset
    fake._gpus[6].retirement_pending = False
    assert health.health_pass(state, 8) == [
        "GPU 2 released (nvml): healthy again (was: row remapping pending (reset the GPU))"]
    assert sorted(state.held_gpus()) == [5, 6]  # the XID and the admin's hold stay
    assert {gpu for gpu, ok in health.healthy.items() if not ok} == set()  # healthy now, held still


def test_gpus_beyond_the_topology_are_not_held(tmp_path):
    fake, state = machine(), NodeState.of(config_in(tmp_path))
    fake._gpus[7].remapped_rows = (0, 0, 0, 1)
    health = monitor(fake, tmp_path)
    assert health.health_pass(state, 4) == [] and state.held_gpus() == {} and sorted(health.healthy) == [0, 1, 2, 3]


def test_off_reads_nothing_and_nvml_missing_or_failing_holds_and_releases_nothing(tmp_path):
    state = NodeState.of(config_in(tmp_path))
    state.set_hold(1, GpuHold("row remapping failed", 1.0, "nvml"))
    health = monitor(machine(), tmp_path)
    assert health.health_pass(state, 8, off=True) == [] and health.healthy == {}
    assert health.summary() == 'nvml off (health = "off"), dcgm off (health = "off"), amd-smi off (health = "off")'

    def missing():
        raise ImportError("No module named 'pynvml'")

    gone = HealthMonitor(load_nvml=missing, kfd=tmp_path / "no-kfd")
    assert gone.health_pass(state, 8) == [] and gone.summary().startswith("nvml not installed")
    broken = machine()
    broken.__dict__["nvmlInit"] = lambda: (_ for _ in ()).throw(broken.NVMLError(12, "NVML Shared Library Not Found"))
    failing = monitor(broken, tmp_path)
    assert failing.health_pass(state, 8) == [] and "nvml cannot be read (NVML Shared Library Not Found)" in failing.summary()
    assert state.held_gpus() == {1: GpuHold("row remapping failed", 1.0, "nvml")}


def test_an_amd_node_reads_amd_smi(tmp_path):
    kfd = tmp_path / "kfd"
    kfd.touch()
    readings = [(GpuReading(0), GpuReading(1, other=("3 uncorrectable ECC errors",)), GpuReading(2, error="AMD SMI error: x")),
                (GpuReading(0), GpuReading(1), GpuReading(2))]
    state = NodeState.of(config_in(tmp_path))
    health = HealthMonitor(load_nvml=lambda: None, kfd=kfd, read_amd=lambda: readings.pop(0))
    assert health.health_pass(state, 8) == ["GPU 1 held out of new jobs (amdsmi): 3 uncorrectable ECC errors"]
    assert health.healthy == {0: True, 1: False} and health.summary().startswith("nvml not used (an AMD node)")
    assert health.health_pass(state, 8) == ["GPU 1 released (amdsmi): healthy again (was: 3 uncorrectable ECC errors)"]


def test_the_agent_tells_slurm_at_once_when_a_pass_holds_or_releases(tmp_path):
    slurm, fake, config = FakeSlurmctld(), machine(), config_in(tmp_path)
    errors: list[str] = []
    background = Background(types.SimpleNamespace(make_runner=lambda timeout: slurm, metrics=None, log_errors=errors.append), "dgx1")
    background.health = monitor(fake, tmp_path)
    assert background.health_pass(config) == [] and slurm.calls == []
    fake._gpus[3].lost = True
    assert background.health_pass(config) == ["GPU 3 held out of new jobs (nvml): GPU lost (NVML: GPU is lost)"]
    assert slurm.reservations == {"mapa_held_dgx1": 1} and "GPU 3 (GPU lost (NVML: GPU is lost))" in slurm.comment
    fake._gpus[3].lost = False
    assert background.health_pass(config)[0].startswith("GPU 3 released (nvml)")
    assert slurm.reservations == {} and errors == []
    log = (tmp_path / "log").read_text()
    assert "mapa-agent: GPU health: nvml read (8 GPUs)" in log and "mapa-agent: GPU 3 held out of new jobs (nvml)" in log


# --- metrics and doctor -----------------------------------------------------------------------------


def samples(metrics: AgentMetrics) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for family in metrics.registry.collect() for s in family.samples}


def test_the_healthy_gauge_sits_beside_the_held_one():
    metrics = AgentMetrics("dgx1", health=lambda: {0: True, 3: False})
    found = samples(metrics)
    assert found[("mapa_gpu_healthy", frozenset({("node", "dgx1"), ("gpu", "3")}))] == 0.0
    assert found[("mapa_gpu_healthy", frozenset({("node", "dgx1"), ("gpu", "0")}))] == 1.0
    assert not any(name == "mapa_gpu_healthy" for name, _ in samples(AgentMetrics("dgx1")))  # no source read: no series


def test_held_gpus_are_not_free_in_the_free_ring_and_preserved_gauges():
    graph, model = preset("dgx1-v100"), paper_model()
    every = node_gauges(graph, {}, model, all_policies())
    held = node_gauges(graph, {}, model, all_policies(), held_out=frozenset(range(1, 8)))
    assert every.free_ring[2] > 0 and held.free_ring[2] == 0.0 and held.free_preserved == 0.0
    assert held.idle_ring == every.idle_ring


def test_doctor_says_per_source_whether_it_is_read():
    read = check_health(Inputs(node="n", health_sources="nvml read (8 GPUs), dcgm not installed, amd-smi not used (no /dev/kfd)"))
    assert read.status == OK and read.found == "health: nvml read (8 GPUs), dcgm not installed, amd-smi not used (no /dev/kfd)"
    none = check_health(Inputs(node="n", health_sources="nvml not installed, dcgm not installed, amd-smi not used (no /dev/kfd)"))
    assert none.status == WARN and "no GPU fault holds a GPU out automatically" in none.found
    assert check_health(Inputs(node="n", health_sources='off (health = "off" in mapa.toml): no source is read')).status == OK


def test_off_in_the_agent_reads_and_logs_nothing(tmp_path):
    config = config_in(tmp_path, health="off")
    background = Background(types.SimpleNamespace(make_runner=lambda timeout: None, metrics=None, log_errors=[].append), "dgx1")
    background.health = monitor(machine(), tmp_path)
    assert background.health_pass(config) == [] and not (tmp_path / "log").exists() and background.health.healthy == {}
