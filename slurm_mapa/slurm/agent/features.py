"""mapa-agent's side of node choice: publish which good placements this node has free.

The pure part (which features a node has) is :mod:`slurm_mapa.core.features`; this module reads
the node's free GPUs from the ledger (snapshot.py) and writes the features into slurmctld with
``scontrol update NodeName=NODE ActiveFeatures=...``, leaving every feature of the node that is not
MAPA's as it is (active if active now, inactive if an administrator made it inactive). Such
updates live in slurmctld only (a restart forgets them), so the agent publishes again at every
reconcile pass as well as after starts and ends; it asks slurmctld only when the features changed,
or at the reconcile pass. Configured by ``[features]`` in mapa.toml; without it nothing
is published. docs/admin.md, "Choosing the node", has the slurm.conf lines.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...core.features import PREFIX, feature_names, fleet_best, node_features
from ...errors import MapaError
from ..text.commands import CommandFailed, RunCommand, active_features_argv, parse_active_features, parse_available_features, show_node_argv
from ..config import HookConfig
from ..node_state import LedgerCorrupt
from .snapshot import read_snapshot



def merged_features(active: Sequence[str], mapa: Sequence[str]) -> tuple[str, ...]:
    """The node's new ActiveFeatures: its currently active features that are not MAPA's, in their
    order, then MAPA's. Not its available ones: that would re-activate a feature an administrator
    made inactive (``scontrol update NodeName=... ActiveFeatures=...``) at every publication."""
    return tuple(name for name in active if not name.startswith(PREFIX)) + tuple(mapa)


class Publisher:
    """Publishes this node's MAPA features; remembers what it last wrote, so that an unchanged
    set costs slurmctld nothing (``force``: write anyway, after a possible slurmctld restart)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.last: tuple[str, ...] | None = None
        self.last_problem = ""  # said once, not at every start and end
        self._best: dict | None = None
        self._best_key: tuple | None = None

    def wanted(self, config: HookConfig) -> tuple[str, ...] | None:
        """MAPA's features for the node's free GPUs now (None: not configured, or no topology)."""
        from ...core.model_files import load_model
        from ...hardware.load import load_topology, model_for_topology

        if not config.feature_sizes:
            return None
        try:
            snapshot = read_snapshot(config, self.node)
        except LedgerCorrupt:
            return None  # the next Prolog rebuilds it; publish then
        graph = snapshot.graph
        # The configured `model` for every server of the fleet, else each server's own default
        # (true to its links, in GB/s: rings of different servers compare on that scale).
        model = load_model(config.model) if config.model not in ("", "auto") else model_for_topology
        key = (config.feature_sizes, config.feature_fleet, config.model, graph)
        if self._best_key != key:  # the fleet's idle best: computed once per configuration
            fleet = [load_topology(spec) for spec in config.feature_fleet] or [graph]
            self._best, self._best_key = fleet_best(fleet + [graph], config.feature_sizes, model), key
        return node_features(graph, snapshot.free, self._best or {}, model, config.feature_threshold)

    def publish(self, config: HookConfig, run: RunCommand, log: Callable[[str], None], force: bool = False) -> bool:
        """Write the node's features if they changed (or ``force``). True if slurmctld was asked."""
        try:
            mapa = self.wanted(config)
        except (MapaError, OSError) as error:
            if str(error) != self.last_problem:
                log(f"features of {self.node}: cannot tell them ({error}); nothing published")
            self.last_problem = str(error)
            return False
        self.last_problem = ""
        if mapa is None or (mapa == self.last and not force):
            return False
        try:
            shown = run(show_node_argv(config.scontrol, self.node))
            available, active = parse_available_features(shown), parse_active_features(shown)
            missing = [name for name in mapa if name not in available]
            if missing:
                log(f"features of {self.node}: slurm.conf does not list {','.join(missing)} in the node's Features= "
                    f"(needed: {','.join(feature_names(config.feature_sizes))}); nothing published")
                self.last = mapa  # said once per change, not at every start
                return True
            run(active_features_argv(config.scontrol, self.node, merged_features(active, mapa)))
        except (CommandFailed, ValueError) as error:
            log(f"features of {self.node}: could not publish {','.join(mapa)} ({error}); trying again at the next change or pass")
            self.last = None
            return True
        self.last = mapa
        return True
