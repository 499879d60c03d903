"""The hardware graph: a GPU server as a complete graph over its GPUs.

Every pair of GPUs has a link class (see :mod:`.links`) and so a bandwidth. GPUs are numbered
0..n-1 as nvidia-smi numbers them (PCI bus order). ``domains`` groups GPUs by CPU socket /
NUMA node / PCIe root, which the topology-aware baseline policy needs.

Owns HardwareGraph and build_graph; imports only :mod:`.links`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Mapping

from ..errors import InputError
from .links import Bandwidths, Link, parse_link

MAX_GPUS = 64


@dataclass(frozen=True)
class HardwareGraph:
    """A GPU server. Build it with :func:`build_graph`, which validates the input."""

    name: str
    links: tuple[tuple[Link | None, ...], ...]
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    domains: tuple[int, ...] = ()
    cpu_affinity: tuple[str, ...] = ()
    description: str = ""

    @property
    def size(self) -> int:
        return len(self.links)

    @property
    def gpus(self) -> range:
        return range(self.size)

    def link(self, a: int, b: int) -> Link:
        found = self.links[a][b]
        if found is None:
            raise InputError(f"GPU {a} has no link to itself")
        return found

    def bandwidth(self, a: int, b: int) -> float:
        return self.bandwidths.of(self.link(a, b))

    def pairs(self) -> Iterable[tuple[int, int]]:
        for a in range(self.size):
            for b in range(a + 1, self.size):
                yield a, b

    @cached_property
    def _bandwidth_rows(self) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(0.0 if a == b else self.bandwidth(a, b) for b in self.gpus) for a in self.gpus)

    def bandwidth_matrix(self) -> tuple[tuple[float, ...], ...]:
        """Bandwidth of every pair, 0 on the diagonal (computed once per graph)."""
        return self._bandwidth_rows

    def link_tokens(self) -> dict[str, str]:
        """Every pair as ``{"a-b": token}``, the form topology files use."""
        return {f"{a}-{b}": self.link(a, b).token for a, b in self.pairs()}

    @cached_property
    def _hash(self) -> int:
        return hash((self.name, self.links, self.bandwidths, self.domains, self.cpu_affinity))

    def __hash__(self) -> int:
        # Graphs key the search's caches: hash the link matrix once, not on every lookup.
        return self._hash


def build_graph(
    name: str,
    size: int,
    links: Mapping[tuple[int, int], Link | str],
    *,
    default_link: Link | str = "SYS",
    bandwidths: Bandwidths | None = None,
    domains: Iterable[int] | None = None,
    cpu_affinity: Iterable[str] | None = None,
    description: str = "",
) -> HardwareGraph:
    """Build a validated hardware graph.

    ``links`` maps GPU pairs to link classes; a pair may be given in either order but only once
    (or twice with the same class). Pairs not given get ``default_link`` (a PCIe class).
    """
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_GPUS:
        raise InputError(f"topology {name!r}: GPU count must be an integer from 1 to {MAX_GPUS}, got {size!r}")
    default = parse_link(default_link) if isinstance(default_link, str) else default_link
    if default.is_nvlink:
        raise InputError(f"topology {name!r}: the default link for pairs not listed must be a PCIe level, got {default.token}")
    matrix: list[list[Link | None]] = [[None if a == b else default for b in range(size)] for a in range(size)]
    given: dict[tuple[int, int], Link] = {}
    for (a, b), raw in links.items():
        for gpu in (a, b):
            if not isinstance(gpu, int) or not 0 <= gpu < size:
                raise InputError(f"topology {name!r}: link {a}-{b} names unknown GPU {gpu!r} (GPUs are 0..{size - 1})")
        if a == b:
            raise InputError(f"topology {name!r}: link {a}-{b} links a GPU to itself")
        link = parse_link(raw) if isinstance(raw, str) else raw
        key = (min(a, b), max(a, b))
        if key in given and given[key] != link:
            raise InputError(
                f"topology {name!r}: conflicting entries for GPUs {key[0]}-{key[1]}: {given[key].token} and {link.token}"
            )
        given[key] = link
        matrix[a][b] = matrix[b][a] = link
    domain_tuple = tuple(domains) if domains is not None else tuple(0 for _ in range(size))
    if len(domain_tuple) != size:
        raise InputError(f"topology {name!r}: {len(domain_tuple)} domain entries for {size} GPUs")
    affinity = tuple(cpu_affinity) if cpu_affinity is not None else ()
    if affinity and len(affinity) != size:
        raise InputError(f"topology {name!r}: {len(affinity)} CPU affinity entries for {size} GPUs")
    return HardwareGraph(
        name=name,
        links=tuple(tuple(row) for row in matrix),
        bandwidths=bandwidths or Bandwidths(),
        domains=domain_tuple,
        cpu_affinity=affinity,
        description=description,
    )
