"""A strict fake of AMD SMI's Python package (``amdsmi``), built from an AMD hardware graph.

It implements only the calls and names slurm_mapa uses, with the signatures and return shapes
of amdsmi's Python interface (amdsmi_interface.py of amdsmi 7.0.2 on PyPI: dicts for bandwidth,
link type, enumeration, ECC counts; lists of dicts for processes and bad pages; AmdSmiLinkType;
tests/hardware/test_amd_discovery.py compares the signatures with the real file when it is installed). Anything else fails the test at once with AssertionError; every call checks
that ``amdsmi_init`` ran and that the handle is one of its own. Library errors are raised as
``AmdSmiLibraryException`` carrying amdsmi_status_t codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from slurm_mapa.core.hardware import HardwareGraph

STATUS_INVAL = 1
STATUS_NOT_SUPPORTED = 2
STATUS_NOT_INIT = 32


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int, text: str = ""):
        super().__init__(text or f"AMD SMI error {err_code}")
        self.err_code = err_code

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1 << 0
    INIT_AMD_GPUS = 1 << 1


class AmdSmiLinkType(IntEnum):
    AMDSMI_LINK_TYPE_INTERNAL = 0
    AMDSMI_LINK_TYPE_PCIE = 1
    AMDSMI_LINK_TYPE_XGMI = 2


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


@dataclass
class FakeAmdGpu:
    bdf: str
    uuid: str
    render: int | None  # None: enumeration info not supported
    hip_id: int | None
    name: str = "AMD Instinct MI250X"
    numa: int = 0
    ecc_uncorrectable: int | None = 0  # None: not supported
    bad_pages: list[int] | None = None  # page statuses; None: not supported
    processes: list[int] = field(default_factory=list)
    lost: bool = False


@dataclass(frozen=True)
class FakeHandle:
    position: int


_NAMES = {
    "AmdSmiException": AmdSmiException,
    "AmdSmiLibraryException": AmdSmiLibraryException,
    "AmdSmiInitFlags": AmdSmiInitFlags,
    "AmdSmiLinkType": AmdSmiLinkType,
    "AmdSmiMemoryPageStatus": AmdSmiMemoryPageStatus,
}


class FakeAmdSmi:
    """An amdsmi-like module. ``gpus`` are in the library's handle order; ``links`` maps a pair of
    handle positions to its xGMI link count (0: same hive, no direct link) or a PCIe hop count
    as ``"pcie:<hops>"``."""

    def __init__(self, gpus: list[FakeAmdGpu], links: dict[tuple[int, int], int | str], *, per_link_mbs: int = 50000):
        self.__dict__.update(_NAMES)
        self.__dict__["_gpus"] = gpus
        self.__dict__["_links"] = {tuple(sorted(pair)): value for pair, value in links.items()}
        self.__dict__["_per_link"] = per_link_mbs
        self.__dict__["_initialised"] = 0
        self.__dict__["calls"] = []

    def __getattr__(self, name: str):
        raise AssertionError(f"fake amdsmi: {name} is not implemented (slurm_mapa may only use the calls the fake has)")

    def __setattr__(self, name: str, value) -> None:
        raise AssertionError(f"fake amdsmi: do not set {name}")

    def __dir__(self):
        return [*_NAMES, *(name for name in type(self).__dict__ if name.startswith("amdsmi_")), "calls"]

    # --- helpers ---
    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if not self._initialised:
            raise AmdSmiLibraryException(STATUS_NOT_INIT, f"{call} before amdsmi_init")

    def _gpu(self, handle) -> FakeAmdGpu:
        assert isinstance(handle, FakeHandle), f"fake amdsmi: {handle!r} is not a processor handle"
        gpu = self._gpus[handle.position]
        if gpu.lost:
            raise AmdSmiLibraryException(STATUS_INVAL, "GPU is lost")
        return gpu

    def _pair(self, a, b):
        self._gpu(a), self._gpu(b)
        assert a != b, "fake amdsmi: a link query of a GPU with itself"
        return self._links.get(tuple(sorted((a.position, b.position))), "pcie:3")

    # --- the calls slurm_mapa makes ---
    def amdsmi_init(self, flag=AmdSmiInitFlags.INIT_AMD_GPUS) -> None:  # noqa: the real default is the same
        assert isinstance(flag, AmdSmiInitFlags), f"fake amdsmi: amdsmi_init wants an AmdSmiInitFlags, got {flag!r}"
        self.__dict__["_initialised"] += 1
        self.calls.append("amdsmi_init")

    def amdsmi_shut_down(self) -> None:
        self._enter("amdsmi_shut_down")
        self.__dict__["_initialised"] -= 1

    def amdsmi_get_processor_handles(self) -> list[FakeHandle]:
        self._enter("amdsmi_get_processor_handles")
        return [FakeHandle(i) for i in range(len(self._gpus))]

    def amdsmi_get_gpu_enumeration_info(self, handle) -> dict:
        self._enter("amdsmi_get_gpu_enumeration_info")
        gpu = self._gpu(handle)
        if gpu.render is None:
            raise AmdSmiLibraryException(STATUS_NOT_SUPPORTED)
        return {"drm_card": gpu.render - 128, "drm_render": gpu.render, "hsa_id": 2 + handle.position,
                "hip_id": gpu.hip_id, "hip_uuid": gpu.uuid}

    def amdsmi_get_gpu_device_bdf(self, handle) -> str:
        self._enter("amdsmi_get_gpu_device_bdf")
        return self._gpu(handle).bdf

    def amdsmi_get_gpu_device_uuid(self, handle) -> str:
        self._enter("amdsmi_get_gpu_device_uuid")
        return self._gpu(handle).uuid

    def amdsmi_get_gpu_asic_info(self, handle) -> dict:
        self._enter("amdsmi_get_gpu_asic_info")
        return {"market_name": self._gpu(handle).name, "vendor_id": "0x1002", "device_id": "0x740c"}

    def amdsmi_topo_get_numa_node_number(self, handle) -> int:
        self._enter("amdsmi_topo_get_numa_node_number")
        return self._gpu(handle).numa

    def amdsmi_topo_get_link_type(self, a, b) -> dict:
        self._enter("amdsmi_topo_get_link_type")
        value = self._pair(a, b)
        if isinstance(value, str):
            return {"hops": int(value.split(":")[1]), "type": int(AmdSmiLinkType.AMDSMI_LINK_TYPE_PCIE)}
        return {"hops": 1, "type": int(AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI)}  # 1 for every pair of the hive

    def amdsmi_get_minmax_bandwidth_between_processors(self, a, b) -> dict:
        self._enter("amdsmi_get_minmax_bandwidth_between_processors")
        value = self._pair(a, b)
        if isinstance(value, str) or value == 0:
            raise AmdSmiLibraryException(STATUS_NOT_SUPPORTED, "no direct xGMI link")
        return {"min_bandwidth": self._per_link, "max_bandwidth": self._per_link * value}

    def amdsmi_get_gpu_total_ecc_count(self, handle) -> dict:
        self._enter("amdsmi_get_gpu_total_ecc_count")
        gpu = self._gpu(handle)
        if gpu.ecc_uncorrectable is None:
            raise AmdSmiLibraryException(STATUS_NOT_SUPPORTED)
        return {"correctable_count": 0, "uncorrectable_count": gpu.ecc_uncorrectable, "deferred_count": 0}

    def amdsmi_get_gpu_bad_page_info(self, handle):
        self._enter("amdsmi_get_gpu_bad_page_info")
        gpu = self._gpu(handle)
        if gpu.bad_pages is None:
            raise AmdSmiLibraryException(STATUS_NOT_SUPPORTED)
        if not gpu.bad_pages:
            return []
        return [{"value": n, "page_address": 0x1000 * n, "page_size": 4096, "status": status}
                for n, status in enumerate(gpu.bad_pages)]

    def amdsmi_get_gpu_process_list(self, handle) -> list[dict]:
        self._enter("amdsmi_get_gpu_process_list")
        return [{"name": "python", "pid": pid, "mem": 0, "engine_usage": {}, "memory_usage": {}}
                for pid in self._gpu(handle).processes]


def from_graph(graph: HardwareGraph, *, shuffle: list[int] | None = None, per_link_mbs: int = 50000) -> FakeAmdSmi:
    """A fake whose GPUs are ``graph``'s (topology GPU i has HIP id i and render minor 128 + i);
    ``shuffle`` gives the library's handle order as a list of topology indices."""
    order = shuffle or list(range(graph.size))
    position_of = {gpu: position for position, gpu in enumerate(order)}
    bus = [0xC1, 0xC6, 0xC9, 0xCE, 0xD1, 0xD6, 0xD9, 0xDE]
    gpus = []
    for gpu in order:
        gpus.append(FakeAmdGpu(
            bdf=f"0000:{bus[gpu] if gpu < len(bus) else 0x10 + gpu:02x}:00.0",
            uuid=f"GPU-{gpu:016x}",
            render=128 + gpu,
            hip_id=gpu,
            numa=graph.domains[gpu],
        ))
    links: dict[tuple[int, int], int | str] = {}
    levels = {"PIX": 1, "PXB": 1, "PHB": 2, "NODE": 2, "SYS": 3}
    for a, b in graph.pairs():
        link = graph.link(a, b)
        key = (position_of[a], position_of[b])
        links[key] = (link.links if link.kind == "nvlink" else 0) if link.is_xgmi else f"pcie:{levels[link.level]}"
    return FakeAmdSmi(gpus, links, per_link_mbs=per_link_mbs)
