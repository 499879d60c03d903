"""Built-in GPU servers. GPUs are numbered as nvidia-smi numbers them (0-based).

Sources:

* ``dgx1-v100`` - NVIDIA DGX-1 with V100 (hybrid cube-mesh, NVLink 2): the `nvidia-smi topo -m`
  of a real DGX-1V (tests/data/nvidia-smi/dgx1-v100.txt); the same pairs as the MAPA artifact's
  ``dgx-v`` table shifted to 0-based ids.
* ``dgx1-p100`` - the same cube-mesh with one NVLink-1 per pair (the real `topo -m` of a
  DGX-1P and MAPA's ``dgx-p`` table).
* ``summit`` - an IBM AC922 Summit node: two sockets, each a triangle of double NVLink-2
  (`topo -m` of a Summit node; MAPA's ``summit``).
* ``torus2d-16`` - the MAPA paper's 16-GPU 2-D torus (figure 17a) as the artifact codes it:
  rows 0-1-2-3 double, row wrap single, columns single except 0-12 and 3-15 double. The
  artifact forgets the column link 0-4 (1-5 in its 1-based ids); we keep it, as the figure
  and the torus's regularity say.
* ``cubemesh-16`` - the paper's 16-GPU cube-mesh (figure 17b). The artifact's table is
  inconsistent (conflicting entries, a missing row that crashes it), so we define it: four
  DGX-1-like quads {0-3}, {4-7}, {8-11}, {12-15}, each fully connected (pairs 0-1 and 2-3 of a
  quad double, the other four single), and the quads joined in a ring by single links between
  GPUs at the same position (GPU q*4+i to ((q+1) mod 4)*4+i). Every GPU then uses six NVLink
  ports, as a V100 has.
* ``dgx-a100`` - NVIDIA DGX A100: eight A100 on six NVSwitches, 12 NVLink-3 links per GPU
  (`topo -m` of a real DGX A100).
* ``hgx-h100`` - NVIDIA HGX H100 8-GPU: NVSwitch, 18 NVLink-4 links per GPU.
* ``pcie-8`` - an 8-GPU PCIe server without NVLink: pairs behind one switch (PIX), switches
  under one host bridge (PHB), sockets joined by SYS (`topo -m` of such a server).
* ``mi250x`` - an HPE Cray EX235a node as in LUMI-G, Frontier, Setonix and Adastra: four AMD
  MI250X packages, eight GCDs (Slurm and HIP see each GCD as a GPU). The xGMI link counts are
  the ``xgmi_num_links`` matrix the amdgpu driver printed on such a node
  (https://github.com/ROCm/rocm-systems/issues/5763), which matches the OLCF Frontier and
  LUMI-G node diagrams: 4 links inside each package (0-1, 2-3, 4-5, 6-7), 2 links for 0-6 and
  2-4, 1 link for 0-2, 1-3, 1-5, 3-7, 4-6, 5-7, none for the other 16 pairs (XGMI0: relayed
  through another GCD). 50 GB/s per link and direction. One 64-core EPYC 7A53 in NPS4: GCDs
  0-1 sit next to NUMA node 3, 2-3 to 1, 4-5 to 0, 6-7 to 2 (the LUMI-G binding table).
* ``mi300x`` - an 8-GPU AMD MI300X platform (UBB): every GPU has 7 xGMI links, one to each
  other GPU (all-to-all, XGMI1), 64 GB/s per link and direction; GPUs 0-3 on socket 0 and 4-7
  on socket 1 as in the usual two-socket servers.
* ``gb200-nvl72-tray`` - one compute tray (node) of an NVIDIA GB200 NVL72 rack: two GB200
  superchips, each one Grace CPU with two Blackwell GPUs, so 4 GPUs and 2 Grace CPUs (GPUs 0-1
  next to CPU 0, 2-3 next to CPU 1). Every GPU has 18 NVLink 5 links to the rack's NVLink switch
  trays, 50 GB/s per link and direction (900 GB/s per GPU and direction, 1.8 TB/s both ways; 72
  GPUs and 36 Grace CPUs per rack, 130 TB/s of NVLink in all:
  https://www.nvidia.com/en-us/data-center/gb200-nvl72/). Inside the tray every pair is therefore
  ``NVS18``; the same switches join the tray to the other 17 trays of its rack, which makes the
  rack one NVLink domain (:mod:`slurm_mapa.replay.domains` models the domains; NVL36x2 racks: two
  domains of 9 trays). The NICs are not modelled here.
"""

from __future__ import annotations

from typing import Callable

from ..core.hardware import HardwareGraph, build_graph
from ..core.links import XGMI_PER_LINK, Bandwidths
from ..errors import InputError

_DGX1_DOUBLE = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)]
_DGX1_SINGLE = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)]


def dgx1_v100() -> HardwareGraph:
    links = {pair: "NV2" for pair in _DGX1_DOUBLE} | {pair: "NV1" for pair in _DGX1_SINGLE}
    return build_graph(
        "dgx1-v100",
        8,
        links,
        domains=[0, 0, 0, 0, 1, 1, 1, 1],
        cpu_affinity=["0-19,40-59"] * 4 + ["20-39,60-79"] * 4,
        description="NVIDIA DGX-1 V100, hybrid cube-mesh of NVLink 2",
    )


def dgx1_p100() -> HardwareGraph:
    links = {pair: "NV1" for pair in _DGX1_DOUBLE + _DGX1_SINGLE}
    return build_graph(
        "dgx1-p100",
        8,
        links,
        bandwidths=Bandwidths(nvlink_generation=1),
        domains=[0, 0, 0, 0, 1, 1, 1, 1],
        description="NVIDIA DGX-1 P100, hybrid cube-mesh of NVLink 1",
    )


def summit() -> HardwareGraph:
    links = {(a, b): "NV2" for group in ((0, 1, 2), (3, 4, 5)) for i, a in enumerate(group) for b in group[i + 1 :]}
    return build_graph(
        "summit",
        6,
        links,
        domains=[0, 0, 0, 1, 1, 1],
        cpu_affinity=["0-83"] * 3 + ["88-171"] * 3,
        description="IBM AC922 (Summit node): two triangles of double NVLink 2",
    )


def torus2d_16() -> HardwareGraph:
    links: dict[tuple[int, int], str] = {}
    for row in range(4):
        base = row * 4
        for col in range(3):
            links[(base + col, base + col + 1)] = "NV2"
        links[(base, base + 3)] = "NV1"
    for col in range(4):
        for row in range(4):
            a, b = row * 4 + col, ((row + 1) % 4) * 4 + col
            links[(min(a, b), max(a, b))] = "NV1"
    links[(0, 12)] = "NV2"
    links[(3, 15)] = "NV2"
    return build_graph(
        "torus2d-16",
        16,
        links,
        domains=[gpu // 4 for gpu in range(16)],
        description="MAPA paper figure 17a: 16-GPU 2-D torus of NVLink 2",
    )


def cubemesh_16() -> HardwareGraph:
    links: dict[tuple[int, int], str] = {}
    for quad in range(4):
        a, b, c, d = (quad * 4 + i for i in range(4))
        links.update({(a, b): "NV2", (c, d): "NV2", (a, c): "NV1", (a, d): "NV1", (b, c): "NV1", (b, d): "NV1"})
        for position in range(4):
            here, there = quad * 4 + position, ((quad + 1) % 4) * 4 + position
            links[(min(here, there), max(here, there))] = "NV1"
    return build_graph(
        "cubemesh-16",
        16,
        links,
        domains=[gpu // 4 for gpu in range(16)],
        description="MAPA paper figure 17b: 16-GPU cube-mesh (four NVLink quads in a ring; our consistent definition)",
    )


def dgx_a100() -> HardwareGraph:
    links = {(a, b): "NVS12" for a in range(8) for b in range(a + 1, 8)}
    return build_graph(
        "dgx-a100",
        8,
        links,
        bandwidths=Bandwidths(nvlink_generation=3),
        domains=[3, 3, 1, 1, 7, 7, 5, 5],
        cpu_affinity=["48-63,176-191"] * 2 + ["16-31,144-159"] * 2 + ["112-127,240-255"] * 2 + ["80-95,208-223"] * 2,
        description="NVIDIA DGX A100: 8 A100 on NVSwitch, 12 NVLink 3 per GPU",
    )


def hgx_h100() -> HardwareGraph:
    links = {(a, b): "NVS18" for a in range(8) for b in range(a + 1, 8)}
    return build_graph(
        "hgx-h100",
        8,
        links,
        bandwidths=Bandwidths(nvlink_generation=4),
        domains=[0, 0, 0, 0, 1, 1, 1, 1],
        cpu_affinity=["0-51,104-155"] * 4 + ["52-103,156-207"] * 4,
        description="NVIDIA HGX H100 8-GPU: NVSwitch, 18 NVLink 4 per GPU",
    )


def pcie_8() -> HardwareGraph:
    links: dict[tuple[int, int], str] = {}
    for socket in (0, 4):
        for a in range(socket, socket + 4):
            for b in range(a + 1, socket + 4):
                links[(a, b)] = "PIX" if b == a + 1 and a % 2 == 0 else "PHB"
    return build_graph(
        "pcie-8",
        8,
        links,
        default_link="SYS",
        domains=[0, 0, 0, 0, 1, 1, 1, 1],
        description="8-GPU PCIe server: PIX pairs, PHB within a socket, SYS across",
    )


# xGMI links between the GCDs of an MI250X node (amdgpu's xgmi_num_links; 0: no direct link).
_MI250X_LINKS = {
    (0, 1): 4, (2, 3): 4, (4, 5): 4, (6, 7): 4,
    (0, 6): 2, (2, 4): 2,
    (0, 2): 1, (1, 3): 1, (1, 5): 1, (3, 7): 1, (4, 6): 1, (5, 7): 1,
}
_LUMI_NUMA_CPUS = {0: "0-15,64-79", 1: "16-31,80-95", 2: "32-47,96-111", 3: "48-63,112-127"}
_MI250X_NUMA = [3, 3, 1, 1, 0, 0, 2, 2]


def mi250x() -> HardwareGraph:
    links = {(a, b): f"XGMI{_MI250X_LINKS.get((a, b), 0)}" for a in range(8) for b in range(a + 1, 8)}
    return build_graph(
        "mi250x",
        8,
        links,
        bandwidths=Bandwidths(xgmi_per_link=XGMI_PER_LINK["mi250x"]),
        domains=_MI250X_NUMA,
        cpu_affinity=[_LUMI_NUMA_CPUS[node] for node in _MI250X_NUMA],
        description="HPE Cray EX235a (LUMI-G, Frontier): 4 AMD MI250X, 8 GCDs on xGMI (4, 2, 1 or no direct link)",
    )


def mi300x() -> HardwareGraph:
    links = {(a, b): "XGMI1" for a in range(8) for b in range(a + 1, 8)}
    return build_graph(
        "mi300x",
        8,
        links,
        bandwidths=Bandwidths(xgmi_per_link=XGMI_PER_LINK["mi300x"]),
        domains=[0, 0, 0, 0, 1, 1, 1, 1],
        description="AMD MI300X platform: 8 GPUs, one xGMI link between every pair",
    )


def gb200_nvl72_tray() -> HardwareGraph:
    links = {(a, b): "NVS18" for a in range(4) for b in range(a + 1, 4)}
    return build_graph(
        "gb200-nvl72-tray",
        4,
        links,
        bandwidths=Bandwidths(nvlink_generation=5),
        domains=[0, 0, 1, 1],
        description="NVIDIA GB200 NVL72 compute tray: 4 Blackwell GPUs, 2 Grace CPUs, 18 NVLink 5 per GPU to the rack's switches",
    )


PRESETS: dict[str, Callable[[], HardwareGraph]] = {
    "dgx1-v100": dgx1_v100,
    "dgx1-p100": dgx1_p100,
    "summit": summit,
    "torus2d-16": torus2d_16,
    "cubemesh-16": cubemesh_16,
    "dgx-a100": dgx_a100,
    "hgx-h100": hgx_h100,
    "pcie-8": pcie_8,
    "mi250x": mi250x,
    "mi300x": mi300x,
    "gb200-nvl72-tray": gb200_nvl72_tray,
}


# The effective-bandwidth model that prices each preset (data/models/NAME.toml; docs/engine.md):
# published nccl-tests figures where we found them, else a model derived from the links and the
# DGX-1 efficiency curve (the DGX-1 V100 too: the paper's own regression, mapa-paper-dgx1, is not
# monotone in link quality and ranks no server by default).
PRESET_MODELS: dict[str, str] = {
    "dgx1-v100": "derived-dgx1-v100",
    "dgx1-p100": "derived-dgx1-p100",
    "summit": "derived-summit",
    "torus2d-16": "derived-torus2d-16",
    "cubemesh-16": "derived-cubemesh-16",
    "dgx-a100": "nccl-tests-dgx-a100",
    "hgx-h100": "nccl-tests-hgx-h100",
    "pcie-8": "derived-pcie-8",
    "mi250x": "derived-mi250x",
    "mi300x": "derived-mi300x",
    "gb200-nvl72-tray": "derived-gb200-nvl72-tray",
}


def preset(name: str) -> HardwareGraph:
    try:
        return PRESETS[name]()
    except KeyError:
        raise InputError(f"unknown topology preset {name!r} (accepted: {', '.join(PRESETS)})") from None
