"""GPU discovery and health through NVML (the ``pynvml`` module of ``nvidia-ml-py``).

Every function takes the NVML module as an argument (``nvml``), so tests pass a strict fake
(tests/fake_nvml.py) and production passes :func:`load_pynvml`'s result. Initialisation and
shutdown are the caller's (:func:`nvml_session`).

Discovery reads, per GPU (NVML index = PCI bus order = nvidia-smi's index): UUID, PCI bus id,
minor number (``/dev/nvidiaN``), model name, NUMA node, CPU affinity; per NVLink: state,
version, remote PCI device and remote device type. Links to another GPU add up to ``NV<n>``;
links to NVSwitches make every pair of switch-attached GPUs ``NVS<n>`` with n the smaller of the
two GPUs' switch-link counts; pairs without NVLink get their PCIe level from the common-ancestor
query. The health report lists GPUs the Prolog should leave out.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

from ..core.hardware import build_graph
from ..core.links import Bandwidths
from ..errors import InputError
from ..extras import install_hint
from .gres import format_cpu_list
from .domains import infer_domains
from .nvlink import nvlink_generation_of
from .topofile import Topology

# NVML's NVLink version enum -> NVLink generation (1.0, 2.0, 2.2, 3.0, 3.1, 4.0, 5.0).
_NVLINK_VERSION_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 5}
# nvmlDeviceGetTopologyCommonAncestor's levels -> nvidia-smi's PCIe classes.
_ANCESTOR_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
CPU_SET_WORDS = 16  # 64-bit words of CPU affinity asked for: 1024 CPUs


@dataclass(frozen=True)
class NvLink:
    """One active NVLink of a GPU."""

    link: int
    version: int
    remote_bus_id: str
    remote_kind: str  # "gpu", "switch", "npu" (a POWER CPU) or "unknown"


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    pci_bus_id: str
    minor: int
    name: str
    numa_node: int | None
    cpu_affinity: str | None
    nvlinks: tuple[NvLink, ...] = ()


@dataclass(frozen=True)
class Discovery:
    topology: Topology
    devices: tuple[GpuDevice, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthReport:
    """GPUs to leave out, by topology index, each with the reasons."""

    problems: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def excluded(self) -> list[int]:
        return sorted(self.problems)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"excluded": self.excluded, "problems": {str(gpu): list(why) for gpu, why in sorted(self.problems.items())}}


def load_pynvml() -> Any:
    """Import pynvml (nvidia-ml-py, the ``nvml`` extra; :func:`slurm_mapa.extras.install_hint`)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        raise InputError(
            f"NVML discovery needs the nvidia-ml-py package ({install_hint('nvml')}); "
            "or use --source nvidia-smi"
        ) from None
    return pynvml


@contextmanager
def nvml_session(nvml: Any) -> Iterator[Any]:
    """``nvmlInit`` ... ``nvmlShutdown``; NVML errors become InputError."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise InputError(f"NVML could not start ({error}); is the NVIDIA driver loaded?") from None
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _code(nvml: Any, error: Exception) -> Any:
    return getattr(error, "value", None)


def _absent(nvml: Any, error: Exception) -> bool:
    """Errors that mean "this GPU / driver does not have that"."""
    return _code(nvml, error) in (
        nvml.NVML_ERROR_NOT_SUPPORTED,
        nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        nvml.NVML_ERROR_INVALID_ARGUMENT,
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: Any) -> str:
    """``0000:07:00.0`` or ``00000000:07:00.0`` -> ``00000000:07:00.0`` (upper-case hex)."""
    text = _text(bus_id).strip().rstrip("\x00")
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{int(function, 16):X}"
    except ValueError:
        raise InputError(f"PCI bus id {text!r}: expected domain:bus:device.function in hex") from None


def _cpu_list(words: Any) -> str | None:
    cpus = [word_index * 64 + bit for word_index, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]
    return format_cpu_list(cpus) if cpus else None


def _nvlinks(nvml: Any, handle: Any, gpu_buses: set[str]) -> list[NvLink]:
    found = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as error:
            if _absent(nvml, error):
                continue
            raise
        if state != nvml.NVML_FEATURE_ENABLED:
            continue
        version = nvml.nvmlDeviceGetNvLinkVersion(handle, link)
        remote = normalize_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        try:
            kind_code = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            kind = {
                nvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
                nvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU: "npu",
                nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
            }.get(kind_code, "unknown")
        except nvml.NVMLError as error:
            if not _absent(nvml, error):
                raise
            kind = "unknown"
        if kind == "unknown" and remote in gpu_buses:
            kind = "gpu"
        found.append(NvLink(link=link, version=int(version), remote_bus_id=remote, remote_kind=kind))
    return found


def discover(nvml: Any, *, name: str = "nvml", cpu_set_words: int = CPU_SET_WORDS) -> Discovery:
    """Read the GPUs of this machine through an initialised NVML module."""
    count = nvml.nvmlDeviceGetCount()
    if count < 1:
        raise InputError("NVML reports no GPUs on this machine")
    handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
    basics = []
    for index, handle in enumerate(handles):
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        bus = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        model = _text(nvml.nvmlDeviceGetName(handle))
        try:
            numa: int | None = int(nvml.nvmlDeviceGetNumaNodeId(handle))
            if numa < 0:
                numa = None
        except nvml.NVMLError as error:
            if not _absent(nvml, error):
                raise
            numa = None
        try:
            affinity = _cpu_list(nvml.nvmlDeviceGetCpuAffinity(handle, cpu_set_words))
        except nvml.NVMLError as error:
            if not _absent(nvml, error):
                raise
            affinity = None
        basics.append((index, uuid, bus, minor, model, numa, affinity))
    bus_of = [basic[2] for basic in basics]
    if len(set(bus_of)) != count:
        raise InputError(f"NVML reports the same PCI bus id for two GPUs: {bus_of}")
    gpu_buses = set(bus_of)
    devices = []
    for (index, uuid, bus, minor, model, numa, affinity), handle in zip(basics, handles):
        links = _nvlinks(nvml, handle, gpu_buses)
        devices.append(GpuDevice(index, uuid, bus, minor, model, numa, affinity, tuple(links)))
    return _assemble(nvml, devices, handles, name)


def _assemble(nvml: Any, devices: list[GpuDevice], handles: list[Any], name: str) -> Discovery:
    count = len(devices)
    index_of_bus = {device.pci_bus_id: device.index for device in devices}
    warnings: list[str] = []
    # Unknown remote ends shared by several GPUs are switches (an NVSwitch serves many GPUs;
    # a CPU's NVLink port serves one).
    sharers: dict[str, set[int]] = {}
    for device in devices:
        for link in device.nvlinks:
            if link.remote_kind == "unknown":
                sharers.setdefault(link.remote_bus_id, set()).add(device.index)
    direct = [[0] * count for _ in range(count)]
    switch_links = [0] * count
    versions: set[int] = set()
    for device in devices:
        for link in device.nvlinks:
            versions.add(link.version)
            kind = link.remote_kind
            if kind == "unknown" and len(sharers.get(link.remote_bus_id, ())) > 1:
                kind = "switch"
            if kind == "gpu":
                peer = index_of_bus.get(link.remote_bus_id)
                if peer is None or peer == device.index:
                    warnings.append(f"GPU {device.index} NVLink {link.link}: remote GPU {link.remote_bus_id} is not one of this machine's GPUs")
                    continue
                direct[device.index][peer] += 1
            elif kind == "switch":
                switch_links[device.index] += 1
    links: dict[tuple[int, int], str] = {}
    for a in range(count):
        for b in range(a + 1, count):
            if direct[a][b] != direct[b][a]:
                warnings.append(
                    f"GPUs {a}-{b}: {direct[a][b]} NVLinks seen from GPU {a} but {direct[b][a]} from GPU {b}; "
                    f"counting {min(direct[a][b], direct[b][a])}"
                )
            bonded = min(direct[a][b], direct[b][a])
            if bonded:
                links[(a, b)] = f"NV{bonded}"
            elif switch_links[a] and switch_links[b]:
                links[(a, b)] = f"NVS{min(switch_links[a], switch_links[b])}"
            else:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b])
                if level not in _ANCESTOR_LEVELS:
                    raise InputError(f"NVML common ancestor of GPUs {a} and {b} is {level!r}, not a known level")
                links[(a, b)] = _ANCESTOR_LEVELS[level]
    generation = None
    if versions:
        generation = _NVLINK_VERSION_GENERATION.get(max(versions))
    if generation is None:
        models = {nvlink_generation_of(device.name) for device in devices} - {None}
        generation = models.pop() if len(models) == 1 else 2
    affinity = [device.cpu_affinity for device in devices]
    numa = [device.numa_node for device in devices]
    cpu = tuple(affinity) if all(affinity) else None  # type: ignore[arg-type]
    numa_text = tuple(str(node) for node in numa) if all(node is not None for node in numa) else None
    graph = build_graph(
        name,
        count,
        links,
        bandwidths=Bandwidths(nvlink_generation=generation),
        domains=infer_domains(count, links, cpu, numa_text),
        cpu_affinity=cpu,
        description=f"discovered through NVML: {count} x {devices[0].name}",
    )
    topology = Topology(
        graph=graph,
        minor_numbers=tuple(device.minor for device in devices),
        uuids=tuple(device.uuid for device in devices),
        pci_bus_ids=tuple(device.pci_bus_id for device in devices),
    )
    return Discovery(topology=topology, devices=tuple(devices), warnings=tuple(warnings))


def health(nvml: Any, *, job_pids: Collection[int] | Callable[[int], bool] = ()) -> HealthReport:
    """GPUs the Prolog should leave out: pending page retirement or row remapping, volatile
    uncorrectable ECC errors, or compute processes that no job owns (``job_pids``: the PIDs of
    the node's jobs, or a predicate saying whether a PID belongs to one). A GPU that NVML
    cannot query is left out too."""
    owned = job_pids if callable(job_pids) else (lambda pid, pids=frozenset(job_pids): pid in pids)
    problems: dict[int, list[str]] = {}
    count = nvml.nvmlDeviceGetCount()
    for index in range(count):
        reasons: list[str] = []
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            _retirement(nvml, handle, reasons)
            try:
                errors = nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
                if errors:
                    reasons.append(f"{errors} uncorrectable ECC errors since the driver loaded")
            except nvml.NVMLError as error:
                if not _absent(nvml, error):
                    raise
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if not owned(int(process.pid)):
                    reasons.append(f"compute process {process.pid} belongs to no job")
        except nvml.NVMLError as error:
            reasons.append(f"NVML error: {error}")
        if reasons:
            problems[index] = reasons
    return HealthReport({gpu: tuple(why) for gpu, why in problems.items()})


def _retirement(nvml: Any, handle: Any, reasons: list[str]) -> None:
    try:
        if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED:
            reasons.append("page retirement pending (reset the GPU)")
        return
    except nvml.NVMLError as error:
        if not _absent(nvml, error):
            raise
    # A100 and newer remap rows instead of retiring pages.
    try:
        _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    except nvml.NVMLError as error:
        if not _absent(nvml, error):
            raise
        return
    if pending:
        reasons.append("row remapping pending (reset the GPU)")
    if failed:
        reasons.append("row remapping failed")
