"""Link classes between two GPUs and their bandwidths.

A link class is what `nvidia-smi topo -m` prints for a GPU pair, made exact:

* ``NV<n>``  - a bonded set of n point-to-point NVLinks (``NV1``, ``NV2``, ... ``NV18``);
* ``NVS<n>`` - both GPUs sit on an NVSwitch fabric; n is the smaller of the two GPUs'
  switch-link counts (nvidia-smi prints these as plain ``NV<n>`` too);
* ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` - PCIe paths, from the shortest to the longest
  (``SOC`` is the old name of ``SYS``).

Bandwidths default to the MAPA paper's Table 1 (GB/s, one direction): NVLink-v2 25 per link,
NVLink-v1 20 per link, PCIe 12 whatever the path. Every number is configurable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import InputError

PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_LEGACY_ALIASES = {"SOC": "SYS"}
_NV_TOKEN = re.compile(r"^NV(S?)([1-9][0-9]?)$")
MAX_BONDED_LINKS = 64


@dataclass(frozen=True, order=True)
class Link:
    """The connection class of one GPU pair.

    ``kind`` is "nvlink", "nvswitch" or "pcie"; ``links`` is the bonded NVLink count (0 for
    PCIe); ``level`` is the PCIe path level (empty for NVLink classes).
    """

    kind: str
    links: int = 0
    level: str = ""

    @property
    def token(self) -> str:
        if self.kind == "nvlink":
            return f"NV{self.links}"
        if self.kind == "nvswitch":
            return f"NVS{self.links}"
        return self.level

    @property
    def is_nvlink(self) -> bool:
        return self.kind in ("nvlink", "nvswitch")

    def __str__(self) -> str:
        return self.token


def parse_link(token: str) -> Link:
    """Parse a link token (``NV2``, ``NVS12``, ``PIX``, ``SYS``, ``SOC``...) into a Link."""
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
    raise InputError(
        f"unknown link class {token!r} (accepted: NV<n> for n bonded NVLinks, NVS<n> for an NVSwitch fabric, "
        f"or a PCIe level: {', '.join(PCIE_LEVELS)}; SOC is read as SYS)"
    )


def _default_nvlink_per_link() -> dict[int, float]:
    # GB/s per link and direction: v1 (P100) 20, v2 (V100) 25 as in the paper's Table 1;
    # v3 (A100) and v4 (H100) carry 25 per link too, v5 (B200) 50.
    return {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def _default_pcie() -> dict[str, float]:
    return {level: 12.0 for level in PCIE_LEVELS}


@dataclass(frozen=True)
class Bandwidths:
    """Bandwidth in GB/s of each link class, for one NVLink generation."""

    nvlink_generation: int = 2
    nvlink_per_link: dict[int, float] = field(default_factory=_default_nvlink_per_link)
    pcie: dict[str, float] = field(default_factory=_default_pcie)

    def __post_init__(self) -> None:
        if self.nvlink_generation not in self.nvlink_per_link:
            raise InputError(
                f"NVLink generation {self.nvlink_generation} has no per-link bandwidth "
                f"(known generations: {', '.join(map(str, sorted(self.nvlink_per_link)))})"
            )
        missing = [level for level in PCIE_LEVELS if level not in self.pcie]
        if missing:
            raise InputError(f"PCIe bandwidths miss the levels {', '.join(missing)}")
        for value in [*self.nvlink_per_link.values(), *self.pcie.values()]:
            if not value > 0:
                raise InputError(f"bandwidths must be positive numbers, got {value!r}")

    def of(self, link: Link) -> float:
        if link.kind == "pcie":
            return self.pcie[link.level]
        return link.links * self.nvlink_per_link[self.nvlink_generation]

    def __hash__(self) -> int:
        return hash((self.nvlink_generation, tuple(sorted(self.nvlink_per_link.items())), tuple(sorted(self.pcie.items()))))
