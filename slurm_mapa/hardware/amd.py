"""AMD GPU discovery and health through AMD SMI's Python package (``amdsmi``, shipped with ROCm).

As in :mod:`.nvml`, every function takes the module as an argument (``amdsmi``), so tests pass a
strict fake (tests/fake_amdsmi.py) and production passes :func:`load_amdsmi`'s result.

Numbering: a topology's GPU ``i`` is HIP's and ROCr's device ``i`` (``hip_id`` of
``amdsmi_get_gpu_enumeration_info``), because that is what ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` index; without enumeration info, the library's handle order. Each GPU's
device file is ``/dev/dri/renderD<drm_render>``, as Slurm's ``AutoDetect=rsmi`` declares it.

Links, per pair: ``amdsmi_topo_get_link_type`` says XGMI or PCIe; its hop count is 1 for every
pair of an xGMI hive, direct or not (ROCm/rocm-systems#5763), so the link count comes from
``amdsmi_get_minmax_bandwidth_between_processors``: min is one link, max the links times one
link (hwloc's rsmi backend reads it the same way), and a pair without a direct link has no
bandwidth (an error or 0): ``XGMI0``. PCIe pairs get a level from the hop count (1 PXB, 2
NODE, 3 SYS), as the ROCm docs define hops.

Health (the GPUs the Prolog should leave out): uncorrectable ECC errors, bad pages pending
retirement or that could not be retired, and compute processes no job owns. A query the GPU
does not support is skipped; a GPU the library cannot query at all is left out.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator

from ..core.hardware import build_graph
from ..core.links import Bandwidths
from ..errors import InputError
from ..extras import install_hint
from .domains import infer_domains
from .nvml import HealthReport
from .topofile import RENDER_MINOR_BASE, Topology

# amdsmi_status_t values meaning "this GPU / library does not have that" (amdsmi.h).
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
_ABSENT = {AMDSMI_STATUS_NOT_SUPPORTED, AMDSMI_STATUS_NOT_YET_IMPLEMENTED}
# AmdSmiMemoryPageStatus: RESERVED 0 (retired), PENDING 1, UNRESERVABLE 2.
_PAGE_PENDING = 1
_PAGE_UNRESERVABLE = 2


@dataclass(frozen=True)
class AmdGpu:
    index: int  # topology index (= HIP / ROCr index)
    bdf: str
    uuid: str
    render_minor: int
    name: str
    numa_node: int | None
    hip_id: int | None


@dataclass(frozen=True)
class AmdDiscovery:
    topology: Topology
    devices: tuple[AmdGpu, ...]
    warnings: tuple[str, ...] = ()


def load_amdsmi() -> Any:
    """Import AMD SMI's Python package (the ``amd`` extra, on a node with ROCm; :func:`slurm_mapa.extras.install_hint`)."""
    try:
        import amdsmi  # type: ignore[import-not-found]
    except (ImportError, OSError) as error:
        raise InputError(
            f"AMD discovery needs the amdsmi package from ROCm ({error}); install ROCm's amd-smi and its Python "
            f"package ({install_hint('amd')}), or read a saved `rocm-smi --showtopo --shownodesbw`"
        ) from None
    return amdsmi


def _code(error: Exception) -> Any:
    getter = getattr(error, "get_error_code", None)
    return getter() if callable(getter) else getattr(error, "err_code", None)


def _absent(error: Exception) -> bool:
    return _code(error) in _ABSENT


@contextmanager
def amdsmi_session(amdsmi: Any) -> Iterator[Any]:
    """``amdsmi_init(INIT_AMD_GPUS)`` ... ``amdsmi_shut_down``; library errors become InputError."""
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as error:
        raise InputError(f"AMD SMI could not start ({error}); is the amdgpu driver loaded?") from None
    try:
        yield amdsmi
    finally:
        amdsmi.amdsmi_shut_down()


def normalize_bdf(value: Any) -> str:
    """``0000:C1:00.0`` -> ``0000:c1:00.0`` (domain:bus:device.function, lower-case hex)."""
    text = str(value).strip()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        raise InputError(f"PCI bus id {text!r}: expected domain:bus:device.function in hex") from None


def _xgmi_type(amdsmi: Any) -> int:
    for enum, member in (("AmdSmiLinkType", "AMDSMI_LINK_TYPE_XGMI"), ("AmdSmiIoLinkType", "XGMI")):
        holder = getattr(amdsmi, enum, None) if enum in dir(amdsmi) else None
        if holder is not None and hasattr(holder, member):
            return int(getattr(holder, member))
    raise InputError("the amdsmi package has neither AmdSmiLinkType nor AmdSmiIoLinkType; unsupported version")


def _ordered_handles(
    amdsmi: Any, *, tolerant: bool = False
) -> tuple[list[Any], list[dict[str, Any] | None], list[str], dict[int, str]]:
    """The handles in HIP order, their enumeration info, warnings, and (``tolerant``) the
    topology indices whose enumeration query failed, with the error."""
    handles = list(amdsmi.amdsmi_get_processor_handles())
    if not handles:
        raise InputError("AMD SMI reports no GPUs on this machine")
    count = len(handles)
    warnings: list[str] = []
    enumeration: list[dict[str, Any] | None] = []
    errors: dict[int, str] = {}  # handle position -> error
    for position, handle in enumerate(handles):
        try:
            enumeration.append(dict(amdsmi.amdsmi_get_gpu_enumeration_info(handle)))
        except amdsmi.AmdSmiException as error:
            if not _absent(error) and not tolerant:
                raise
            if not _absent(error):
                errors[position] = str(error)
            enumeration.append(None)
    hip_ids = [info.get("hip_id") if info else None for info in enumeration]
    known = [hip for hip in hip_ids if isinstance(hip, int)]
    if known and len(set(known)) == len(known) and all(0 <= hip < count for hip in known):
        # GPUs whose HIP id is known take it; the others (a failed query) fill the gaps in order.
        gaps = iter(sorted(set(range(count)) - set(known)))
        index_of = [hip if isinstance(hip, int) else next(gaps) for hip in hip_ids]
        order = sorted(range(count), key=lambda position: index_of[position])
    else:
        if known:
            warnings.append(f"HIP ids {hip_ids} are not 0..{count - 1}; numbering GPUs in AMD SMI's order")
        else:
            warnings.append("no HIP ids (amdsmi_get_gpu_enumeration_info unsupported); numbering GPUs in AMD SMI's order")
        order = list(range(count))
    failed = {order.index(position): error for position, error in errors.items()}
    return [handles[i] for i in order], [enumeration[i] for i in order], warnings, failed


def discover(
    amdsmi: Any, *, name: str = "amdsmi", cpulist_of: Callable[[str], str | None] | None = None
) -> AmdDiscovery:
    """Read the AMD GPUs of this machine through an initialised ``amdsmi`` module.

    ``cpulist_of`` maps a PCI bus id to its CPU list (e.g. sysfs ``local_cpulist``); AMD SMI has
    no CPU affinity query.
    """
    handles, enumeration, warnings, _failed = _ordered_handles(amdsmi)
    devices: list[AmdGpu] = []
    for index, (handle, info) in enumerate(zip(handles, enumeration)):
        bdf = normalize_bdf(amdsmi.amdsmi_get_gpu_device_bdf(handle))
        uuid = str(amdsmi.amdsmi_get_gpu_device_uuid(handle))
        model = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name", "AMD GPU"))
        try:
            numa: int | None = int(amdsmi.amdsmi_topo_get_numa_node_number(handle))
            if numa is not None and numa < 0:
                numa = None
        except amdsmi.AmdSmiException as error:
            if not _absent(error):
                raise
            numa = None
        render = info.get("drm_render") if info else None
        if not isinstance(render, int) or render < 0:
            render = RENDER_MINOR_BASE + index
            warnings.append(f"GPU {index} ({bdf}): no DRM render minor from AMD SMI; assuming /dev/dri/renderD{render}")
        devices.append(AmdGpu(index, bdf, uuid, render, model, numa, info.get("hip_id") if info else None))
    if len({device.bdf for device in devices}) != len(devices):
        raise InputError(f"AMD SMI reports the same PCI bus id for two GPUs: {[device.bdf for device in devices]}")
    if len({device.render_minor for device in devices}) != len(devices):
        raise InputError(f"AMD SMI reports the same render minor for two GPUs: {[d.render_minor for d in devices]}")
    xgmi = _xgmi_type(amdsmi)
    links: dict[tuple[int, int], str] = {}
    per_link: set[int] = set()
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            found = amdsmi.amdsmi_topo_get_link_type(handles[a], handles[b])
            hops, kind = int(found["hops"]), int(found["type"])
            if kind != xgmi:
                links[(a, b)] = "PXB" if hops <= 1 else "NODE" if hops == 2 else "SYS"
                continue
            try:
                bandwidth = amdsmi.amdsmi_get_minmax_bandwidth_between_processors(handles[a], handles[b])
                low, high = int(bandwidth["min_bandwidth"]), int(bandwidth["max_bandwidth"])
            except amdsmi.AmdSmiException as error:
                if not _absent(error):
                    raise
                low = high = 0
            if low <= 0 or high <= 0:
                links[(a, b)] = "XGMI0"
                continue
            count = high // low
            if high % low or count < 1:
                warnings.append(f"GPUs {a}-{b}: xGMI bandwidth {low}-{high} MB/s is not whole links; counting {max(count, 1)}")
                count = max(count, 1)
            links[(a, b)] = f"XGMI{count}"
            per_link.add(low)
    if len(per_link) > 1:
        warnings.append(f"xGMI links of different speeds {sorted(per_link)} MB/s; using the slowest")
    bandwidths = Bandwidths(xgmi_per_link=min(per_link) / 1000.0) if per_link else Bandwidths()
    numa_nodes = [device.numa_node for device in devices]
    numa_text = tuple(str(node) for node in numa_nodes) if all(node is not None for node in numa_nodes) else None
    affinity = [cpulist_of(device.bdf) if cpulist_of else None for device in devices]
    cpu = tuple(affinity) if all(affinity) else None  # type: ignore[arg-type]
    graph = build_graph(
        name,
        len(devices),
        links,
        bandwidths=bandwidths,
        domains=infer_domains(len(devices), links, cpu, numa_text),
        cpu_affinity=cpu,
        description=f"discovered through AMD SMI: {len(devices)} x {devices[0].name}",
    )
    topology = Topology(
        graph=graph,
        minor_numbers=tuple(device.render_minor for device in devices),
        uuids=tuple(device.uuid for device in devices),
        pci_bus_ids=tuple(device.bdf for device in devices),
        vendor="amd",
    )
    return AmdDiscovery(topology=topology, devices=tuple(devices), warnings=tuple(warnings))


def health(amdsmi: Any, *, job_pids: Collection[int] | Callable[[int], bool] = ()) -> HealthReport:
    """GPUs (topology indices) the Prolog should leave out, with the reasons."""
    owned = job_pids if callable(job_pids) else (lambda pid, pids=frozenset(job_pids): pid in pids)
    handles, _enumeration, _warnings, failed = _ordered_handles(amdsmi, tolerant=True)
    problems: dict[int, tuple[str, ...]] = {}
    for index, handle in enumerate(handles):
        reasons: list[str] = []
        if index in failed:
            problems[index] = (f"AMD SMI error: {failed[index]}",)
            continue
        try:
            _check(amdsmi, handle, owned, reasons)
        except amdsmi.AmdSmiException as error:
            reasons.append(f"AMD SMI error: {error}")
        if reasons:
            problems[index] = tuple(reasons)
    return HealthReport(problems)


def _unless_absent(amdsmi: Any, query: Callable[[], Any], default: Any) -> Any:
    """``query()``, or ``default`` where the GPU or the driver does not offer it."""
    try:
        return query()
    except amdsmi.AmdSmiException as error:
        if not _absent(error):
            raise
        return default


def _check(amdsmi: Any, handle: Any, owned: Callable[[int], bool], reasons: list[str]) -> None:
    ecc = _unless_absent(amdsmi, lambda: amdsmi.amdsmi_get_gpu_total_ecc_count(handle), {})
    errors = int(ecc.get("uncorrectable_count", 0))
    if errors:
        reasons.append(f"{errors} uncorrectable ECC errors")
    pages = _unless_absent(amdsmi, lambda: amdsmi.amdsmi_get_gpu_bad_page_info(handle), [])
    if isinstance(pages, (list, tuple)):  # the library returns a sentence when there are none
        statuses = [int(page.get("status", -1)) for page in pages if isinstance(page, dict)]
        if _PAGE_PENDING in statuses:
            reasons.append("bad page retirement pending (reset the GPU)")
        if _PAGE_UNRESERVABLE in statuses:
            reasons.append("a bad page could not be retired")
    processes = _unless_absent(amdsmi, lambda: amdsmi.amdsmi_get_gpu_process_list(handle), [])
    for process in processes:
        pid = int(process["pid"]) if isinstance(process, dict) else int(process)
        if not owned(pid):
            reasons.append(f"compute process {pid} belongs to no job")


def health_probe(job_pid: Callable[[int], bool]) -> Callable[[], dict[int, tuple[str, ...]]] | None:
    """What the Prolog calls on an AMD node for the GPUs to leave out (None: no amdsmi package),
    the AMD counterpart of the NVML probe."""
    import importlib.util

    if importlib.util.find_spec("amdsmi") is None:
        return None

    def probe() -> dict[int, tuple[str, ...]]:
        with amdsmi_session(load_amdsmi()) as amdsmi:
            return health(amdsmi, job_pids=job_pid).problems

    return probe
