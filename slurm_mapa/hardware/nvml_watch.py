"""Per-GPU health readings through NVML for mapa-agent's passes (issue 50): the calls at the edge.

:class:`NvmlWatcher` keeps one NVML session for the agent's life, so that XID events are caught
between passes: at its start it creates an event set (``nvmlEventSetCreate``) and registers every
GPU for ``nvmlEventTypeXidCriticalError`` (``nvmlDeviceRegisterEvents``); each pass drains the
events that arrived (``nvmlEventSetWait`` with a 0 ms timeout, until ``NVML_ERROR_TIMEOUT``; the
event's GPU by ``nvmlDeviceGetIndex``), then
reads per GPU ``nvmlDeviceGetRemappedRows`` (corrected, uncorrected, pending, failure occurred),
``nvmlDeviceGetRetiredPagesPendingStatus`` and ``nvmlDeviceGetNvLinkState`` of every link. An
``NVML_ERROR_GPU_IS_LOST`` from any query makes the GPU lost. What the readings mean is
gpu_faults.py (pure). NVML's index is the topology's (PCI bus order, as discovery assumes).
"""

from __future__ import annotations

from typing import Any

from .gpu_faults import GpuReading

MAX_EVENTS_PER_PASS = 1000  # bounds the drain if the driver floods events


class NvmlWatcher:
    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.started = False
        self.event_set: Any = None
        self.handles: list[Any] = []
        self.xid_gpus: set[int] = set()  # GPUs registered for XID events
        self.links_seen: dict[int, set[int]] = {}  # GPU -> NVLinks seen active at some pass

    def _value(self, error: Exception) -> Any:
        return getattr(error, "value", None)

    def _absent(self, error: Exception) -> bool:
        nvml = self.nvml
        return self._value(error) in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                      nvml.NVML_ERROR_INVALID_ARGUMENT)

    def start(self) -> None:
        """nvmlInit, the device handles and the XID event set. NVMLError if NVML cannot start."""
        nvml = self.nvml
        nvml.nvmlInit()
        self.started = True
        count = nvml.nvmlDeviceGetCount()
        self.handles = []
        for index in range(count):
            try:
                self.handles.append(nvml.nvmlDeviceGetHandleByIndex(index))
            except nvml.NVMLError:
                self.handles.append(None)  # lost or unreadable now: each pass tries again
        try:
            self.event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            self.event_set = None  # no XID events on this driver; the states are still read
        self._register()

    def _register(self) -> None:
        nvml = self.nvml
        if self.event_set is None:
            return
        for index, handle in enumerate(self.handles):
            if handle is None or index in self.xid_gpus:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
                self.xid_gpus.add(index)
            except nvml.NVMLError:
                pass  # not supported on this GPU, or lost: its other readings still count

    def close(self) -> None:
        if not self.started:
            return
        nvml = self.nvml
        try:
            if self.event_set is not None:
                nvml.nvmlEventSetFree(self.event_set)
        except nvml.NVMLError:
            pass
        finally:
            self.event_set = None
            self.started = False
            nvml.nvmlShutdown()

    def _xids(self) -> dict[int, list[int]]:
        """The XID events since the last pass, by GPU index."""
        nvml = self.nvml
        found: dict[int, list[int]] = {}
        if self.event_set is None:
            return found
        for _ in range(MAX_EVENTS_PER_PASS):
            try:
                event = nvml.nvmlEventSetWait(self.event_set, 0)
            except nvml.NVMLError as error:
                if self._value(error) == nvml.NVML_ERROR_TIMEOUT:
                    break
                raise
            if not int(event.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            # The event's device is a new ctypes pointer (``==`` compares objects, not devices): ask its index.
            try:
                index = int(nvml.nvmlDeviceGetIndex(event.device))
            except nvml.NVMLError:
                continue  # lost meanwhile: its other queries say so
            found.setdefault(index, []).append(int(event.eventData))
        return found

    def read(self) -> tuple[GpuReading, ...]:
        """One pass: every GPU's reading. Starts NVML first if it is not (NVMLError if it cannot)."""
        if not self.started:
            self.start()
        nvml = self.nvml
        xids = self._xids()
        readings = []
        for index in range(len(self.handles)):
            try:
                if self.handles[index] is None:
                    self.handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
                    self._register()
                readings.append(self._read_gpu(index, self.handles[index], tuple(xids.get(index, ()))))
            except nvml.NVMLError as error:
                lost = self._value(error) == nvml.NVML_ERROR_GPU_IS_LOST
                readings.append(GpuReading(index, lost=lost, error="" if lost else f"NVML: {error}",
                                           xids=tuple(xids.get(index, ()))))
        return tuple(readings)

    def _read_gpu(self, index: int, handle: Any, xids: tuple[int, ...]) -> GpuReading:
        nvml = self.nvml
        retirement = remap_pending = remap_failed = None
        try:
            retirement = nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED
        except nvml.NVMLError as error:
            if not self._absent(error):
                raise
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
            remap_pending, remap_failed = bool(pending), bool(failed)
        except nvml.NVMLError as error:
            if not self._absent(error):
                raise
        active = set()
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                    active.add(link)
            except nvml.NVMLError as error:
                if not self._absent(error):
                    raise
                if self._value(error) == nvml.NVML_ERROR_NOT_SUPPORTED and link == 0:
                    break  # no NVLink on this GPU
        seen = self.links_seen.setdefault(index, set())
        seen |= active
        return GpuReading(index, xids=xids, retirement_pending=retirement, remap_pending=remap_pending,
                          remap_failed=remap_failed, links_expected=frozenset(seen), links_active=frozenset(active))
