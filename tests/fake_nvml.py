"""A strict fake of the ``pynvml`` module, built from a topology description.

It implements only the NVML calls slurm_mapa uses. Anything else (a call, a constant) fails the
test at once with AssertionError, and every call checks that ``nvmlInit`` ran first and that
the handle is one of its own. Errors are raised as ``NVMLError`` carrying ``.value`` codes, as
pynvml does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from slurm_mapa.core.hardware import HardwareGraph
from slurm_mapa.hardware.gres import parse_cpu_list

# The constants slurm_mapa reads, with pynvml's values.
CONSTANTS = {
    "NVML_NVLINK_MAX_LINKS": 18,
    "NVML_FEATURE_DISABLED": 0,
    "NVML_FEATURE_ENABLED": 1,
    "NVML_NVLINK_DEVICE_TYPE_GPU": 0,
    "NVML_NVLINK_DEVICE_TYPE_IBMNPU": 1,
    "NVML_NVLINK_DEVICE_TYPE_SWITCH": 2,
    "NVML_NVLINK_DEVICE_TYPE_UNKNOWN": 0xFF,
    "NVML_TOPOLOGY_INTERNAL": 0,
    "NVML_TOPOLOGY_SINGLE": 10,
    "NVML_TOPOLOGY_MULTIPLE": 20,
    "NVML_TOPOLOGY_HOSTBRIDGE": 30,
    "NVML_TOPOLOGY_NODE": 40,
    "NVML_TOPOLOGY_SYSTEM": 50,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "nvmlEventTypeXidCriticalError": 0x8,
}
LEVEL_CODES = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
MODEL_VERSIONS = {1: 1, 2: 2, 3: 4, 4: 6, 5: 7}  # NVLink generation -> NVML version enum


class NVMLError(Exception):
    def __init__(self, value: int, text: str = ""):
        super().__init__(text or f"NVML error {value}")
        self.value = value


@dataclass
class FakeLink:
    remote_bus_id: str
    version: int
    remote_type: int  # NVML_NVLINK_DEVICE_TYPE_*
    enabled: bool = True


@dataclass
class FakeGpu:
    bus_id: str
    uuid: str
    minor: int
    name: str
    numa: int | None = None  # None: nvmlDeviceGetNumaNodeId not supported
    cpus: str | None = None  # None: no CPU affinity reported (an all-zero mask)
    links: list[FakeLink] | None = None  # None: the GPU has no NVLink at all
    link_slots: int = 0  # NVLink ports of the model; slots beyond the links are disabled
    retirement_pending: bool | None = False  # None: not supported (A100+: row remapping)
    remapped_rows: tuple[int, int, int, int] | None = None  # None: not supported
    ecc_uncorrected: int | None = 0  # None: ECC not supported
    processes: list[int] = field(default_factory=list)
    lost: bool = False


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    """A pynvml-like module. Build it with :func:`from_graph` or from FakeGpu records."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        ancestors: dict[tuple[int, int], int] | None = None,
        *,
        remote_type_supported: bool = True,
        numa_supported: bool = True,
    ):
        self.__dict__["_gpus"] = gpus
        self.__dict__["_ancestors"] = ancestors or {}
        self.__dict__["_remote_type_supported"] = remote_type_supported
        self.__dict__["_numa_supported"] = numa_supported
        self.__dict__["_initialised"] = 0
        self.__dict__["calls"] = []
        self.__dict__["_event_sets"] = {}  # id -> {"gpus": set of registered indices, "queue": [(index, xid)]}
        self.__dict__["_events_supported"] = True
        for key, value in CONSTANTS.items():
            self.__dict__[key] = value
        self.__dict__["NVMLError"] = NVMLError

    def __getattr__(self, name: str):
        raise AssertionError(f"fake NVML: {name} is not implemented (slurm_mapa may only use the calls the fake has)")

    def __setattr__(self, name: str, value) -> None:
        raise AssertionError(f"fake NVML: do not set {name}")

    # --- helpers ---
    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if not self._initialised:
            raise NVMLError(CONSTANTS["NVML_ERROR_UNINITIALIZED"], f"{call} before nvmlInit")

    def _gpu(self, handle) -> FakeGpu:
        assert isinstance(handle, FakeHandle), f"fake NVML: {handle!r} is not a device handle"
        gpu = self._gpus[handle.index]
        if gpu.lost:
            raise NVMLError(CONSTANTS["NVML_ERROR_GPU_IS_LOST"], "GPU is lost")
        return gpu

    def _link(self, handle, link: int) -> FakeLink:
        gpu = self._gpu(handle)
        assert isinstance(link, int), "fake NVML: link must be an int"
        if gpu.links is None:
            raise NVMLError(CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], "Not Supported")
        if not 0 <= link < max(gpu.link_slots, len(gpu.links)):
            raise NVMLError(CONSTANTS["NVML_ERROR_INVALID_ARGUMENT"], "Invalid Argument")
        if link >= len(gpu.links):
            return FakeLink("00000000:00:00.0", 0, 0xFF, enabled=False)
        return gpu.links[link]

    # --- the NVML calls ---
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        self.__dict__["_initialised"] += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.__dict__["_initialised"] -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._gpus):
            raise NVMLError(CONSTANTS["NVML_ERROR_INVALID_ARGUMENT"], "Invalid Argument")
        if self._gpus[index].lost:
            raise NVMLError(CONSTANTS["NVML_ERROR_GPU_IS_LOST"], "GPU is lost")
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle) -> int:
        self._enter("nvmlDeviceGetIndex")
        self._gpu(handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle):
        self._enter("nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetMinorNumber(self, handle) -> int:
        self._enter("nvmlDeviceGetMinorNumber")
        return self._gpu(handle).minor

    def nvmlDeviceGetNumaNodeId(self, handle) -> int:
        self._enter("nvmlDeviceGetNumaNodeId")
        gpu = self._gpu(handle)
        if not self._numa_supported:
            raise NVMLError(CONSTANTS["NVML_ERROR_FUNCTION_NOT_FOUND"], "Function Not Found")
        return -1 if gpu.numa is None else gpu.numa

    def nvmlDeviceGetCpuAffinity(self, handle, cpuSetSize: int) -> list[int]:
        self._enter("nvmlDeviceGetCpuAffinity")
        gpu = self._gpu(handle)
        assert isinstance(cpuSetSize, int) and cpuSetSize > 0
        words = [0] * cpuSetSize
        for cpu in parse_cpu_list(gpu.cpus) if gpu.cpus else []:
            if cpu < 64 * cpuSetSize:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState")
        return 1 if self._link(handle, link).enabled else 0

    def nvmlDeviceGetNvLinkVersion(self, handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkVersion")
        found = self._link(handle, link)
        assert found.enabled, "fake NVML: version of a disabled link asked"
        return found.version

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link: int):
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        return SimpleNamespace(busId=self._link(handle, link).remote_bus_id.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        found = self._link(handle, link)
        if not self._remote_type_supported:
            raise NVMLError(CONSTANTS["NVML_ERROR_FUNCTION_NOT_FOUND"], "Function Not Found")
        return found.remote_type

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        a, b = self._gpu(device1), self._gpu(device2)
        assert a is not b, "fake NVML: common ancestor of a GPU with itself"
        key = (min(device1.index, device2.index), max(device1.index, device2.index))
        return self._ancestors.get(key, CONSTANTS["NVML_TOPOLOGY_SYSTEM"])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus")
        gpu = self._gpu(device)
        if gpu.retirement_pending is None:
            raise NVMLError(CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], "Not Supported")
        return 1 if gpu.retirement_pending else 0

    def nvmlDeviceGetRemappedRows(self, device) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows")
        gpu = self._gpu(device)
        if gpu.remapped_rows is None:
            raise NVMLError(CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], "Not Supported")
        return gpu.remapped_rows

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType: int, counterType: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors")
        gpu = self._gpu(handle)
        assert errorType == 1 and counterType == 0, "fake NVML: only volatile uncorrected ECC counts are modelled"
        if gpu.ecc_uncorrected is None:
            raise NVMLError(CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], "Not Supported")
        return gpu.ecc_uncorrected

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in self._gpu(handle).processes]


    # --- XID events (nvmlEventSetCreate, nvmlDeviceRegisterEvents, nvmlEventSetWait, nvmlEventSetFree) ---
    def nvmlEventSetCreate(self) -> int:
        self._enter("nvmlEventSetCreate")
        if not self._events_supported:
            raise NVMLError(CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], "Not Supported")
        number = len(self._event_sets) + 1
        self._event_sets[number] = {"gpus": set(), "queue": []}
        return number

    def nvmlDeviceRegisterEvents(self, handle, eventTypes: int, eventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        gpu = self._gpu(handle)
        assert eventTypes == CONSTANTS["nvmlEventTypeXidCriticalError"], "fake NVML: only XID events are modelled"
        assert eventSet in self._event_sets, "fake NVML: not an event set of nvmlEventSetCreate"
        del gpu
        self._event_sets[eventSet]["gpus"].add(handle.index)

    def nvmlEventSetWait(self, eventSet, timeoutms: int):
        self._enter("nvmlEventSetWait")
        assert eventSet in self._event_sets, "fake NVML: not an event set of nvmlEventSetCreate"
        assert isinstance(timeoutms, int) and timeoutms >= 0
        queue = self._event_sets[eventSet]["queue"]
        if not queue:
            raise NVMLError(CONSTANTS["NVML_ERROR_TIMEOUT"], "Timeout")
        index, xid = queue.pop(0)
        return SimpleNamespace(device=FakeHandle(index), eventType=CONSTANTS["nvmlEventTypeXidCriticalError"],
                               eventData=xid, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    def nvmlEventSetFree(self, eventSet) -> None:
        self._enter("nvmlEventSetFree")
        assert self._event_sets.pop(eventSet, None) is not None, "fake NVML: event set freed twice"

    # --- the test's hand on the fake machine (not NVML calls) ---
    def raise_xid(self, index: int, xid: int) -> None:
        """The driver reports XID ``xid`` on GPU ``index``: queued in every set it is registered in."""
        for events in self._event_sets.values():
            if index in events["gpus"]:
                events["queue"].append((index, xid))

    def set_events_supported(self, supported: bool) -> None:
        self.__dict__["_events_supported"] = supported


IMPLEMENTED_CALLS = [name for name in vars(FakeNvml) if name.startswith("nvml")]


def bus_id(index: int) -> str:
    return f"00000000:{0x07 + 0x10 * index:02X}:00.0"


def from_graph(
    graph: HardwareGraph,
    *,
    model: str,
    ports: int,
    switches: int = 6,
    minors: list[int] | None = None,
    pcie: dict[tuple[int, int], str] | None = None,
    with_numa: bool = True,
    **options,
) -> FakeNvml:
    """A fake machine with the graph's GPUs and links.

    ``NV<n>`` pairs become n point-to-point links on both GPUs; a GPU with ``NVS<n>`` pairs gets
    n links spread over ``switches`` NVSwitches; PCIe pairs answer the common-ancestor query
    with their level; ``pcie`` gives the PCIe level of NVLink pairs (default SYS).
    """
    size = graph.size
    buses = [bus_id(gpu) for gpu in graph.gpus]
    switch_buses = [f"00000000:{0xC0 + s:02X}:00.0" for s in range(switches)]
    version = MODEL_VERSIONS[graph.bandwidths.nvlink_generation]
    links: list[list[FakeLink]] = [[] for _ in range(size)]
    nvs = [0] * size
    ancestors: dict[tuple[int, int], int] = {}
    for a, b in graph.pairs():
        link = graph.link(a, b)
        if link.kind == "nvlink":
            for _ in range(link.links):
                links[a].append(FakeLink(buses[b], version, 0))
                links[b].append(FakeLink(buses[a], version, 0))
            ancestors[(a, b)] = LEVEL_CODES[(pcie or {}).get((a, b), "SYS")]
        elif link.kind == "nvswitch":
            nvs[a] = max(nvs[a], link.links)
            nvs[b] = max(nvs[b], link.links)
            ancestors[(a, b)] = LEVEL_CODES[(pcie or {}).get((a, b), "SYS")]
        else:
            ancestors[(a, b)] = LEVEL_CODES[link.level]
    for gpu in range(size):
        for n in range(nvs[gpu]):
            links[gpu].append(FakeLink(switch_buses[n % switches], version, 2))
    gpus = [
        FakeGpu(
            bus_id=buses[gpu],
            uuid=f"GPU-{gpu:08x}-0000-4000-8000-{gpu:012x}",
            minor=(minors or list(range(size)))[gpu],
            name=model,
            numa=graph.domains[gpu] if with_numa else None,
            cpus=graph.cpu_affinity[gpu] if graph.cpu_affinity else None,
            links=links[gpu] if ports else None,
            link_slots=ports,
        )
        for gpu in range(size)
    ]
    return FakeNvml(gpus, ancestors, **options)
