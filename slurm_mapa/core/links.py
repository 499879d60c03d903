"""Link classes between two GPUs and their bandwidths.

A link class is what `nvidia-smi topo -m` prints for a GPU pair, made exact, plus AMD's
Infinity Fabric (xGMI):

* ``NV<n>``  - a bonded set of n point-to-point NVLinks (``NV1``, ``NV2``, ... ``NV18``);
* ``NVS<n>`` - both GPUs sit on an NVSwitch fabric; n is the smaller of the two GPUs'
  switch-link counts (nvidia-smi prints these as plain ``NV<n>`` too);
* ``XGMI<n>`` - n point-to-point xGMI (Infinity Fabric) links between two AMD GPUs or GCDs
  (``XGMI4`` joins the two GCDs of one MI250X package, ``XGMI1`` each pair of an MI300X node);
* ``XGMI0`` - two AMD GPUs of one xGMI hive with no direct link: their traffic is relayed
  through another GPU of the hive (MI250X GCDs of different packages without a cable);
* ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` - PCIe paths, from the shortest to the longest
  (``SOC`` is the old name of ``SYS``).

How the classes map onto the three families the scoring code knows (``kind``): a direct
bonded link is ``"nvlink"`` whatever its fabric (``fabric`` says ``"xgmi"`` for AMD), so an
effective-bandwidth model's ``NV1`` / ``NV>=2`` classes count xGMI bonds by their link count,
as the MAPA paper counts single and double links; a switch is ``"nvswitch"``; a pair without a
direct link is ``"pcie"`` - for ``XGMI0`` with the level ``SYS``, the slowest path of the
node, so that a model's ``PCIE`` class (the paper's "no NVLink") and every PCIe-level table
count it. The token and the bandwidth always tell XGMI0 from a real SYS path.

Bandwidths default to the MAPA paper's Table 1 (GB/s, one direction): NVLink-v2 25 per link,
NVLink-v1 20 per link, PCIe 12 whatever the path. xGMI: 50 per link (MI250X: 25 GT/s x16;
MI300X links are faster, 64, set by its preset), a relayed pair half a link. Every number is
configurable.

Owns the link classes (Link, parse_link) and their bandwidths; imports no other core module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InputError, toml_text

PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_LEGACY_ALIASES = {"SOC": "SYS"}
_NV_TOKEN = re.compile(r"^NV(S?)([1-9][0-9]?)$")
_XGMI_TOKEN = re.compile(r"^XGMI(0|[1-9][0-9]?)$")
MAX_BONDED_LINKS = 64
XGMI = "xgmi"
# The PCIe level a relayed xGMI pair (XGMI0) carries for code that only knows PCIe levels.
XGMI_RELAYED_LEVEL = "SYS"


@dataclass(frozen=True, order=True)
class Link:
    """The connection class of one GPU pair.

    ``kind`` is "nvlink" (a direct bond of ``links`` links), "nvswitch" or "pcie" (no direct
    link; ``level`` is the PCIe path level). ``fabric`` is ``""`` for NVIDIA/PCIe classes and
    ``"xgmi"`` for AMD Infinity Fabric ones (``XGMI<n>``: kind "nvlink"; ``XGMI0``: kind "pcie").
    """

    kind: str
    links: int = 0
    level: str = ""
    fabric: str = ""

    @property
    def token(self) -> str:
        if self.fabric == XGMI:
            return f"XGMI{self.links}" if self.kind == "nvlink" else "XGMI0"
        if self.kind == "nvlink":
            return f"NV{self.links}"
        if self.kind == "nvswitch":
            return f"NVS{self.links}"
        return self.level

    @property
    def is_nvlink(self) -> bool:
        """A direct bond (NVLink or xGMI) or an NVSwitch: the classes Slurm's Links= counts."""
        return self.kind in ("nvlink", "nvswitch")

    @property
    def is_xgmi(self) -> bool:
        return self.fabric == XGMI

    def __str__(self) -> str:
        return self.token


def xgmi_link(links: int) -> Link:
    """``XGMI<links>``; 0 for a pair of one hive without a direct link."""
    if not isinstance(links, int) or isinstance(links, bool) or not 0 <= links <= MAX_BONDED_LINKS:
        raise InputError(f"xGMI link count must be 0..{MAX_BONDED_LINKS}, got {toml_text(links)}")
    if links == 0:
        return Link(kind="pcie", level=XGMI_RELAYED_LEVEL, fabric=XGMI)
    return Link(kind="nvlink", links=links, fabric=XGMI)


def parse_link(token: str) -> Link:
    """Parse a link token (``NV2``, ``NVS12``, ``XGMI4``, ``PIX``, ``SYS``, ``SOC``...) into a Link."""
    text = token.strip().upper()
    text = _LEGACY_ALIASES.get(text, text)
    if text in PCIE_LEVELS:
        return Link(kind="pcie", level=text)
    match = _NV_TOKEN.match(text)
    if match:
        count = int(match.group(2))
        if count > MAX_BONDED_LINKS:
            raise InputError(f"link {token!r}: {count} bonded NVLinks is more than the {MAX_BONDED_LINKS} accepted")
        return Link(kind="nvswitch" if match.group(1) else "nvlink", links=count)
    match = _XGMI_TOKEN.match(text)
    if match:
        count = int(match.group(1))
        if count > MAX_BONDED_LINKS:
            raise InputError(f"link {token!r}: {count} xGMI links is more than the {MAX_BONDED_LINKS} accepted")
        return xgmi_link(count)
    raise InputError(
        f"unknown link class {token!r} (accepted: NV<n> for n bonded NVLinks, NVS<n> for an NVSwitch fabric, "
        f"XGMI<n> for n xGMI links (XGMI0: same hive, no direct link), "
        f"or a PCIe level: {', '.join(PCIE_LEVELS)}; SOC is read as SYS)"
    )


# GB/s per link and direction, by NVLink generation: v1 (P100) 20, v2 (V100) 25 as in the
# paper's Table 1; v3 (A100), v4 (H100/H200/H20) 25 per link too, v5 (B200/GB200/B300/GB300)
# 50 per link (18 links, 1.8 TB/s both ways per GPU: NVIDIA's Blackwell data sheets).
NVLINK_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def _default_nvlink_per_link() -> dict[int, float]:
    return dict(NVLINK_PER_LINK)


def _default_pcie() -> dict[str, float]:
    return {level: 12.0 for level in PCIE_LEVELS}


# xGMI GB/s per link and direction: MI250X 50 (16 bits at 25 GT/s; AMD's CDNA2 white paper),
# MI300X 64 (16 bits at 32 GT/s; AMD's CDNA3 white paper), MI355X 76.8 (CDNA4 white paper).
XGMI_PER_LINK = {"mi250x": 50.0, "mi300x": 64.0, "mi355x": 76.8}
DEFAULT_XGMI_PER_LINK = 50.0


@dataclass(frozen=True)
class Bandwidths:
    """Bandwidth in GB/s of each link class, for one NVLink generation and one xGMI link speed.

    ``xgmi_relayed`` is the bandwidth of ``XGMI0`` (a pair relayed through a third GPU); it
    defaults to half a link: the relay shares the two links it crosses with their own pairs.
    """

    nvlink_generation: int = 2
    nvlink_per_link: dict[int, float] = field(default_factory=_default_nvlink_per_link)
    pcie: dict[str, float] = field(default_factory=_default_pcie)
    xgmi_per_link: float = DEFAULT_XGMI_PER_LINK
    xgmi_relayed: float | None = None

    def __post_init__(self) -> None:
        if self.nvlink_generation not in self.nvlink_per_link:
            raise InputError(
                f"NVLink generation {self.nvlink_generation} has no per-link bandwidth "
                f"(known generations: {', '.join(map(str, sorted(self.nvlink_per_link)))})"
            )
        missing = [level for level in PCIE_LEVELS if level not in self.pcie]
        if missing:
            raise InputError(f"PCIe bandwidths miss the levels {', '.join(missing)}")
        values = [*self.nvlink_per_link.values(), *self.pcie.values(), self.xgmi_per_link]
        if self.xgmi_relayed is not None:
            values.append(self.xgmi_relayed)
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"bandwidths must be positive numbers, got {toml_text(value)}")

    @property
    def relayed(self) -> float:
        return self.xgmi_relayed if self.xgmi_relayed is not None else self.xgmi_per_link / 2

    def of(self, link: Link) -> float:
        if link.fabric == XGMI:
            return link.links * self.xgmi_per_link if link.kind == "nvlink" else self.relayed
        if link.kind == "pcie":
            return self.pcie[link.level]
        return link.links * self.nvlink_per_link[self.nvlink_generation]

    def __hash__(self) -> int:
        return hash(
            (
                self.nvlink_generation,
                tuple(sorted(self.nvlink_per_link.items())),
                tuple(sorted(self.pcie.items())),
                self.xgmi_per_link,
                self.xgmi_relayed,
            )
        )


# How much of a PCIe link's nominal bandwidth a GPU-to-GPU transfer gets, by path. Applied by
# path_bandwidth() (and so by bottleneck_model() and the link-bound model) only when the graph
# gives every PCIe level the same bandwidth (the default): a site that configured per-level
# bandwidths has already said what each path delivers.
#   PIX/PXB: peer-to-peer through PCIe switches only, full link rate.
#   PHB: through the CPU's root complex; P2P still works but the root port is shared (~0.8).
#   NODE: between host bridges of one socket; P2P often crosses the CPU's internal fabric (~0.6).
#   SYS: across the socket interconnect (QPI/UPI/xGMI); NCCL disables P2P there by default and
#        stages through host memory, roughly halving the rate again (~0.35).
DEFAULT_PCIE_PATH_FACTORS: dict[str, float] = {"PIX": 1.0, "PXB": 0.9, "PHB": 0.8, "NODE": 0.6, "SYS": 0.35}


def path_bandwidth(graph: Any, link: Link, factors: Mapping[str, float] | None = None) -> float:
    """The graph's bandwidth of ``link`` (GB/s, one direction); a PCIe path's times its level's
    factor (DEFAULT_PCIE_PATH_FACTORS, or ``factors``) when the graph gives every PCIe level the same value."""
    value = graph.bandwidths.of(link)
    if link.kind == "pcie" and len({graph.bandwidths.pcie[level] for level in PCIE_LEVELS}) == 1:
        value *= (DEFAULT_PCIE_PATH_FACTORS if factors is None else factors).get(link.level, 1.0)
    return value
