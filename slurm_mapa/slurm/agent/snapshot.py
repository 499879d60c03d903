"""One view of the node for the agent's readers of its state: the features it publishes
(features.py) and the gauges it serves (metrics.py) both start from a :class:`NodeSnapshot`, the
node's topology and its ledger as they are on disk.

The ledger is read without its lock: a read never needs it, since the ledger is replaced whole.
GPUs held out of new jobs (``mapa gpu hold``) are not free: no feature advertises a ring through
one, since no new job would get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.hardware import HardwareGraph
from ..config import HookConfig
from ..node_state import HeldCorrupt, Ledger, NodeState


@dataclass(frozen=True)
class NodeSnapshot:
    graph: HardwareGraph
    ledger: Ledger
    held_out: frozenset[int] = field(default_factory=frozenset)  # held out of new jobs (mapa gpu hold)

    @property
    def free(self) -> tuple[int, ...]:
        """The GPUs no job of the ledger holds and none is held out."""
        return self.ledger.free(self.graph.size, self.held_out)


def read_snapshot(config: HookConfig, node: str) -> NodeSnapshot:
    """The node's topology and ledger now. Raises MapaError or OSError (the topology) or
    LedgerCorrupt (the ledger) when one cannot be read."""
    from ..hooks.node_graph import load_graph

    graph = load_graph(config, node)
    state = NodeState.of(config)
    try:
        held_out = frozenset(state.held_gpus())
    except (HeldCorrupt, OSError):
        held_out = frozenset()  # as the hooks: an unreadable file holds nothing out (mapa doctor says so)
    return NodeSnapshot(graph, state.read_ledger(graph.size), held_out)
