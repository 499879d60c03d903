"""This node's hardware graph, as mapa.toml's [nodes] names it (a preset or a topology file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import MapaError
from ..config import HookConfig

if TYPE_CHECKING:
    from ...core.hardware import HardwareGraph


def load_graph(config: HookConfig, node: str) -> "HardwareGraph":
    from ...hardware.load import load_topology

    spec = config.topology_for(node)
    if spec is None:
        raise MapaError(f"no [nodes] entry of the config matches node {node!r}")
    return load_topology(spec)
