"""A GPU's health decided from plain readings (issue 50): literal values in, findings out."""

from __future__ import annotations

from slurm_mapa.hardware.gpu_faults import HOLDING_XIDS, Finding, GpuReading, findings, is_sticky, join_reasons


def reasons(reading: GpuReading) -> list[str]:
    return [f.reason for f in findings(reading)]


def test_a_healthy_reading_has_no_findings():
    assert findings(GpuReading(0)) == ()
    assert findings(GpuReading(1, retirement_pending=False, remap_pending=False, remap_failed=False,
                               links_expected=frozenset({0, 1}), links_active=frozenset({0, 1}))) == ()


def test_each_condition_is_named():
    assert reasons(GpuReading(3, lost=True)) == ["GPU lost (NVML: GPU is lost)"]
    assert reasons(GpuReading(3, xids=(79,))) == ["XID 79 (GPU fell off the bus)"]
    assert reasons(GpuReading(3, remap_failed=True)) == ["row remapping failed"]
    assert reasons(GpuReading(3, remap_pending=True)) == ["row remapping pending (reset the GPU)"]
    assert reasons(GpuReading(3, retirement_pending=True)) == ["page retirement pending (reset the GPU)"]
    assert reasons(GpuReading(3, links_expected=frozenset({0, 1, 5}), links_active=frozenset({1}))) == ["NVLink 0,5 down"]
    assert reasons(GpuReading(3, other=("2 uncorrectable ECC errors",))) == ["2 uncorrectable ECC errors"]


def test_only_the_xids_that_need_a_reset_or_lose_the_gpu_hold_it():
    assert sorted(HOLDING_XIDS) == [48, 64, 74, 79, 95]
    for xid in (13, 31, 43, 63, 92, 94):  # application faults, a row marked for remapping, corrected or contained ECC
        assert findings(GpuReading(0, xids=(xid,))) == ()
    found = findings(GpuReading(0, xids=(95, 48, 95, 13)))
    assert found == (Finding("XID 48 (double-bit ECC error)", sticky=True), Finding("XID 95 (uncontained ECC error)", sticky=True))


def test_a_gpu_not_read_concludes_nothing_but_a_lost_one_is_read():
    assert not GpuReading(0, error="NVML: Unknown Error").read
    assert GpuReading(0, lost=True).read and GpuReading(0).read


def test_only_xid_parts_are_sticky_and_reasons_are_joined_once_and_bounded():
    assert is_sticky("XID 79 (GPU fell off the bus)") and not is_sticky("row remapping failed")
    assert join_reasons(["a", "b", "a"], 200) == "a; b"
    text = join_reasons(["x" * 150, "y" * 150], 200)
    assert len(text) == 200 and text.endswith("...")
