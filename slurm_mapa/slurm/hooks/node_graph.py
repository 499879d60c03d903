"""This node's hardware graph, as mapa.toml's [nodes] names it (a preset or a topology file), and
where its ring-rate table is kept when none ships (ring_rate_cache.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...errors import MapaError
from ..config import HookConfig, hook_logger
from ..ring_rate_cache import use_directory, use_user_cache

if TYPE_CHECKING:
    from ...core.hardware import HardwareGraph


def load_graph(config: HookConfig, node: str) -> "HardwareGraph":
    from ...hardware.load import load_topology

    spec = config.topology_for(node)
    if spec is None:
        raise MapaError(f"no [nodes] entry of the config matches node {node!r}")
    use_ring_rate_store(config)
    return load_topology(spec)


def use_ring_rate_store(config: HookConfig) -> None:
    """Keep the ring-rate tables of this process's graphs beside the ledger, as root (the hooks,
    the agent), so the Prolog reads the node's table instead of solving it; in the user's cache
    as anyone else (``mapa status`` run by a user cannot write root's directory)."""
    if os.geteuid() == 0:
        use_directory(config.ring_rates_dir, hook_logger(config.log))
    else:
        use_user_cache()
