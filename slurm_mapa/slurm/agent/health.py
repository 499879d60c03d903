"""mapa-agent's GPU health passes (issue 50): read each source, hold out what it finds unhealthy.

Every HEALTH_INTERVAL_S the agent reads the node's GPUs through the sources present:

* ``nvml`` (nvidia-ml-py's ``pynvml``): XID events, row remapping, pending page retirement, GPU
  lost, NVLink state (hardware/nvml_watch.py, decided in hardware/gpu_faults.py);
* ``amdsmi`` (AMD SMI's Python package, on nodes with the amdgpu driver's /dev/kfd): uncorrectable
  ECC errors and bad pages, as the Prolog's probe reads them (hardware/amd.py);
* ``dcgm``: not read by this version; ``mapa doctor`` says whether its bindings are installed.

What a pass found goes into the held-GPUs file with the source's name (health_holds.py: an
admin's hold is never touched); the background then tells slurmctld at once. ``healthy`` (GPU ->
bool, the GPUs read at the last pass) feeds the ``mapa_gpu_healthy`` gauge, ``sources`` (source ->
what it is doing) ``mapa doctor`` and the log.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Callable

from ...hardware.gpu_faults import GpuReading, findings
from .health_holds import merge_source

HEALTH_INTERVAL_S = 10.0
SOURCE_NAMES = {"nvml": "nvml", "amdsmi": "amd-smi", "dcgm": "dcgm"}


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dcgm_state() -> str:
    """What the agent does with DCGM: its bindings are never read by this version."""
    if has_module("pydcgm") or has_module("dcgm_structs"):
        return "installed, not read (this version reads NVML itself)"
    return "not installed"


def amd_readings(job_pid: Callable[[int], bool] = lambda pid: True) -> tuple[GpuReading, ...]:
    """One AMD SMI pass as readings (the Prolog probe's checks, without the stray-process one)."""
    from ...hardware.amd import _ordered_handles, amdsmi_session, health, load_amdsmi

    with amdsmi_session(load_amdsmi()) as amdsmi:
        report = health(amdsmi, job_pids=job_pid)
        count = len(_ordered_handles(amdsmi, tolerant=True)[0])  # the GPUs health() enumerated
    readings = []
    for gpu in range(count):
        reasons = report.problems.get(gpu, ())
        errors = [r for r in reasons if r.startswith("AMD SMI error")]
        readings.append(GpuReading(gpu, error="; ".join(errors), other=tuple(r for r in reasons if r not in errors)))
    return tuple(readings)


class HealthMonitor:
    """The health sources of one agent, kept between passes (NVML's XID event set lives here)."""

    def __init__(self, load_nvml: Callable[[], Any] | None = None, kfd: Path = Path("/dev/kfd"),
                 read_amd: Callable[[], tuple[GpuReading, ...]] = amd_readings,
                 clock: Callable[[], float] = time.time) -> None:
        self.load_nvml = load_nvml
        self.kfd = kfd
        self.read_amd = read_amd
        self.clock = clock
        self.watcher: Any = None
        self.healthy: dict[int, bool] = {}
        self.sources: dict[str, str] = {}

    def _nvml(self) -> Any:
        if self.load_nvml is not None:
            return self.load_nvml()
        import pynvml  # type: ignore[import-not-found]

        return pynvml

    def close(self) -> None:
        if self.watcher is not None:
            try:
                self.watcher.close()
            except Exception:  # noqa: BLE001 - NVML may already be gone
                pass
            self.watcher = None

    def read_sources(self) -> dict[str, tuple[GpuReading, ...]]:
        """Each source's readings this pass; ``sources`` says what each did."""
        from ...hardware.nvml_watch import NvmlWatcher

        got: dict[str, tuple[GpuReading, ...]] = {}
        self.sources = {"dcgm": dcgm_state()}
        if self.kfd.exists():
            self.sources["nvml"] = "not used (an AMD node)"
            if self.load_nvml is None and not has_module("amdsmi"):
                self.sources["amdsmi"] = "not installed"
            else:
                try:
                    got["amdsmi"] = self.read_amd()
                    self.sources["amdsmi"] = f"read ({len(got['amdsmi'])} GPUs)"
                except Exception as error:  # noqa: BLE001 - a source that fails holds nothing and releases nothing
                    self.sources["amdsmi"] = f"cannot be read ({str(error)[:120]})"
            return got
        self.sources["amdsmi"] = "not used (no /dev/kfd)"
        try:
            nvml = self._nvml()
        except ImportError:
            self.sources["nvml"] = "not installed"
            return got
        if self.watcher is None:
            self.watcher = NvmlWatcher(nvml)
        try:
            got["nvml"] = self.watcher.read()
            self.sources["nvml"] = f"read ({len(got['nvml'])} GPUs)"
        except Exception as error:  # noqa: BLE001 - NVML may start at the next pass (driver reloaded)
            self.sources["nvml"] = f"cannot be read ({str(error)[:120]})"
            self.close()
        return got

    def health_pass(self, state: Any, gpu_count: int, off: bool = False) -> list[str]:
        """Read the sources and hold or release GPUs in ``state`` (a NodeState); what changed."""
        if off:
            self.close()
            self.sources = {name: "off (health = \"off\")" for name in ("nvml", "amdsmi", "dcgm")}
            self.healthy = {}
            return []
        lines: list[str] = []
        healthy: dict[int, bool] = {}
        for source, readings in self.read_sources().items():
            read = frozenset(r.gpu for r in readings if r.read and 0 <= r.gpu < gpu_count)
            found = {r.gpu: findings(r) for r in readings if r.gpu in read and findings(r)}
            for gpu in read:
                healthy[gpu] = healthy.get(gpu, True) and gpu not in found
            now = self.clock()

            def change(holds, source=source, found=found, read=read, now=now):
                merged = merge_source(holds, source, found, read, now)
                lines.extend(merged.lines)
                return merged.holds if merged.changed else None

            state.update_holds(change)
        self.healthy = healthy
        return lines

    def summary(self) -> str:
        """``nvml read (8 GPUs), dcgm not installed, amd-smi not used (no /dev/kfd)``."""
        return ", ".join(f"{SOURCE_NAMES[name]} {self.sources[name]}" for name in ("nvml", "dcgm", "amdsmi")
                         if name in self.sources)
