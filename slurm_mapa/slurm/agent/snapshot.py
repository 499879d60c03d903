"""One view of the node for the agent's readers of its state: the features it publishes
(features.py) and the gauges it serves (metrics.py) both start from a :class:`NodeSnapshot`, the
node's topology and its ledger as they are on disk.

The ledger is read without its lock: a read never needs it, since the ledger is replaced whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.hardware import HardwareGraph
from ..config import HookConfig
from ..node_state import Ledger, NodeState


@dataclass(frozen=True)
class NodeSnapshot:
    graph: HardwareGraph
    ledger: Ledger

    @property
    def free(self) -> tuple[int, ...]:
        """The GPUs no job of the ledger holds."""
        return self.ledger.free(self.graph.size)


def read_snapshot(config: HookConfig, node: str) -> NodeSnapshot:
    """The node's topology and ledger now. Raises MapaError or OSError (the topology) or
    LedgerCorrupt (the ledger) when one cannot be read."""
    from ..hooks.node_graph import load_graph

    graph = load_graph(config, node)
    return NodeSnapshot(graph, NodeState.of(config).read_ledger(graph.size))
