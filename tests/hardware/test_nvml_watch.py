"""NVML health readings at the edge (issue 50), on the strict fake pynvml: XID events between
passes, row remapping, pending retirement, a lost GPU, an NVLink going down."""

from __future__ import annotations

import inspect

import pytest
from fake_nvml import CONSTANTS, FakeNvml, from_graph

from slurm_mapa.hardware.gpu_faults import findings
from slurm_mapa.hardware.nvml_watch import NvmlWatcher
from slurm_mapa.hardware.presets import preset


def machine(**options) -> FakeNvml:
    return from_graph(preset("dgx1-v100"), model="Tesla V100-SXM2-32GB", ports=6, **options)


def reasons(readings) -> dict[int, list[str]]:
    return {r.gpu: [f.reason for f in findings(r)] for r in readings if findings(r)}


def test_the_new_calls_and_constants_are_pynvmls():
    pynvml = pytest.importorskip("pynvml")
    for name in ("nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait", "nvmlEventSetFree", "nvmlDeviceGetIndex"):
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        assert len(real) == len(inspect.signature(getattr(FakeNvml, name)).parameters) - 1, name
    for name in ("NVML_ERROR_TIMEOUT", "NVML_ERROR_GPU_IS_LOST", "nvmlEventTypeXidCriticalError", "NVML_FEATURE_ENABLED"):
        assert getattr(pynvml, name) == CONSTANTS[name], name
    assert {"device", "eventType", "eventData"} <= {field for field, _ in pynvml.c_nvmlEventData_t._fields_}


def test_a_healthy_machine_reads_healthy_every_pass():
    fake = machine()
    watcher = NvmlWatcher(fake)
    for _ in range(2):
        readings = watcher.read()
        assert [r.gpu for r in readings] == list(range(8)) and all(r.read for r in readings)
        assert reasons(readings) == {}
    assert readings[0].links_active and readings[0].links_expected == readings[0].links_active
    watcher.close()
    assert fake.calls[-1] == "nvmlShutdown" and "nvmlEventSetFree" in fake.calls


def test_an_xid_between_passes_is_read_once_at_the_next_pass():
    fake = machine()
    watcher = NvmlWatcher(fake)
    watcher.read()
    fake.raise_xid(3, 79)
    fake.raise_xid(3, 13)  # an application fault: read, not a finding
    fake.raise_xid(5, 48)
    first = watcher.read()
    assert first[3].xids == (79, 13) and first[5].xids == (48,)
    assert reasons(first) == {3: ["XID 79 (GPU fell off the bus)"], 5: ["XID 48 (double-bit ECC error)"]}
    assert reasons(watcher.read()) == {}  # the event is gone: the hold's stickiness is the merge's (agent/health_holds.py)


def test_remapping_retirement_and_a_lost_gpu():
    fake = machine()
    fake._gpus[1].remapped_rows = (0, 2, 0, 1)
    fake._gpus[2].remapped_rows = (0, 1, 1, 0)
    fake._gpus[4].retirement_pending = True
    watcher = NvmlWatcher(fake)
    watcher.read()
    fake._gpus[6].lost = True  # after the start: every query on it answers GPU_IS_LOST
    readings = watcher.read()
    assert reasons(readings) == {1: ["row remapping failed"], 2: ["row remapping pending (reset the GPU)"],
                                 4: ["page retirement pending (reset the GPU)"], 6: ["GPU lost (NVML: GPU is lost)"]}
    fake._gpus[6].lost = False
    fake._gpus[2].remapped_rows = (0, 1, 0, 0)  # reset: the remapping is done
    assert reasons(watcher.read()) == {1: ["row remapping failed"], 4: ["page retirement pending (reset the GPU)"]}


def test_a_gpu_lost_at_the_start_is_lost_and_read_again_when_back():
    fake = machine()
    fake._gpus[0].lost = True
    watcher = NvmlWatcher(fake)
    readings = watcher.read()
    assert readings[0].lost and reasons(readings) == {0: ["GPU lost (NVML: GPU is lost)"]}
    fake._gpus[0].lost = False
    readings = watcher.read()
    assert reasons(readings) == {}
    fake.raise_xid(0, 95)  # registered once it came back
    assert reasons(watcher.read()) == {0: ["XID 95 (uncontained ECC error)"]}


def test_an_nvlink_that_goes_down_is_named_and_clears_when_it_is_back():
    fake = machine()
    watcher = NvmlWatcher(fake)
    watcher.read()
    fake._gpus[2].links[1].enabled = False
    assert reasons(watcher.read()) == {2: ["NVLink 1 down"]}
    fake._gpus[2].links[1].enabled = True
    assert reasons(watcher.read()) == {}


def test_without_event_support_the_states_are_still_read():
    fake = machine()
    fake.set_events_supported(False)
    fake._gpus[7].remapped_rows = (0, 0, 0, 1)
    assert reasons(NvmlWatcher(fake).read()) == {7: ["row remapping failed"]}


def test_gpus_without_nvlink_or_remapping_report_nothing_missing():
    fake = from_graph(preset("pcie-8"), model="Tesla T4", ports=0)
    readings = NvmlWatcher(fake).read()
    assert reasons(readings) == {} and all(r.links_expected == frozenset() for r in readings)
    assert all(r.remap_pending is None and r.retirement_pending is False for r in readings)


def test_nvml_that_cannot_start_raises_and_starts_at_a_later_pass():
    fake = machine()
    calls = {"n": 0}

    class Broken:
        def __getattr__(self, name):
            if name == "nvmlInit" and calls["n"] == 0:
                calls["n"] += 1

                def fail():
                    raise fake.NVMLError(12, "NVML Shared Library Not Found")
                return fail
            return getattr(fake, name)

    watcher = NvmlWatcher(Broken())
    with pytest.raises(fake.NVMLError):
        watcher.read()
    assert not watcher.started and len(watcher.read()) == 8
