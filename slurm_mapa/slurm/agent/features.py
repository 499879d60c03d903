"""mapa-agent's side of node choice: publish which good placements this node has free.

The pure part (which features a node has) is :mod:`slurm_mapa.core.features`; this module reads
the node's free GPUs from the ledger (snapshot.py) and writes the features into slurmctld with
``scontrol update NodeName=NODE ActiveFeatures=...``, leaving every feature of the node that is not
MAPA's as it is (active if active now, inactive if an administrator made it inactive). Such
updates live in slurmctld only (a restart forgets them), so the agent publishes again at every
reconcile pass as well as after starts and ends; it asks slurmctld only when the features changed,
or at the reconcile pass. Configured by ``[features]`` in mapa.toml; without it nothing
is published. docs/admin.md, "Choosing the node", has the slurm.conf lines.

With ``outlook = true`` it also writes the node's ring outlook (text/outlook.py: per feature, the
best placement free now, the fleet's best, and when the running jobs' Slurm end times are expected
to free a good one) into the node's ``Extra`` field, in the same update; ``mapa release
--wait-rule cost`` reads it. The end times come from one ``squeue --json`` call for the ledger's
jobs whose end this agent does not know yet (each job once; all of them again at a reconcile pass:
a time limit may have changed). A node whose Extra holds someone else's text keeps it.

With ``weights = true`` the same update sets the node's Slurm ``Weight`` (core.features.node_weight:
the preserved bandwidth of its free GPUs, plus ``weight_base``), so that Slurm gives every job the
node whose free GPUs are worth least to rings first. Like the features, slurmctld forgets it at a
restart or ``scontrol reconfigure`` (slurm.conf's weight again) until the next reconcile pass.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ...core.features import (PREFIX, ModelFor, best_free, feature_name, feature_names, fleet_best, good_free_at, node_features,
                              node_weight)
from ...errors import MapaError
from ..text.commands import (CommandFailed, RunCommand, active_features_argv, is_job_id, job_end_time, job_records,
                             parse_active_features, parse_available_features, show_jobs_argv, show_node_argv)
from ..text.outlook import RingOutlook, extra_of_node, outlook_text, parse_outlook
from ..config import HookConfig
from ..node_state import LedgerCorrupt
from .snapshot import NodeSnapshot, read_snapshot

MAX_ENDS_PER_READ = 200  # the ledger's jobs asked about in one squeue call (a node holds at most a few dozen)


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
        self.last: tuple[tuple[str, ...], str | None, int | None] | None = None  # the features, outlook and weight written last
        self.last_problem = ""  # said once, not at every start and end
        self._best: dict | None = None
        self._best_key: tuple | None = None
        self.ends: dict[str, float | None] = {}  # job -> its Slurm end time (None: asked, not known)
        self.foreign_extra = False  # the node's Extra holds text that is not MAPA's: left alone
        self.ends_problem = ""  # the last failure to read the jobs' end times (said once)

    @property
    def published(self) -> tuple[str, ...] | None:
        """MAPA's features as last written (None: nothing yet); the metrics show them."""
        return self.last[0] if self.last is not None else None

    def wanted(self, config: HookConfig) -> tuple[tuple[str, ...], NodeSnapshot, ModelFor] | None:
        """MAPA's features for the node's free GPUs now, with the node as read and the model that
        priced them (None: not configured, or no ledger to read)."""
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
        return node_features(graph, snapshot.free, self._best or {}, model, config.feature_threshold), snapshot, model

    def outlook(self, config: HookConfig, snapshot: NodeSnapshot, model: ModelFor, now: float) -> dict[str, RingOutlook]:
        """The node's ring outlook, with the end times in ``self.ends``."""
        graph, free = snapshot.graph, snapshot.free
        ends = [(end, holding.gpus) for job, holding in snapshot.ledger.holdings.items()
                if (end := self.ends.get(job)) is not None]
        found: dict[str, RingOutlook] = {}
        for k, best in sorted((self._best or {}).items()):
            at = good_free_at(graph, free, ends, k, best, model, config.feature_threshold)
            found[feature_name(k)] = RingOutlook(best_free(graph, free, k, model), best,
                                                 None if at is None else (0.0 if at == 0.0 else max(at, now + 1)))
        return found

    def learn_ends(self, config: HookConfig, jobs: list[str], run: RunCommand, log: Callable[[str], None], again: bool) -> None:
        """Ask Slurm the end times of ``jobs`` (the ledger's) not asked about yet (``again``: all of them)."""
        self.ends = {job: end for job, end in self.ends.items() if job in jobs}
        unknown = [job for job in jobs if (again or job not in self.ends) and is_job_id(job)][:MAX_ENDS_PER_READ]
        if not unknown:
            return
        try:
            records = job_records(run(show_jobs_argv(config.squeue, unknown)), "squeue --json")
        except CommandFailed as error:
            if "Invalid job id" not in str(error):  # else slurmctld knows none of them: no ends to learn
                if str(error) != self.ends_problem:  # said once, not at every start and end while it lasts
                    log(f"features of {self.node}: the running jobs' end times are unknown ({error}); the outlook leaves them out")
                self.ends_problem = str(error)
                return
            records = []
        self.ends_problem = ""
        for job in unknown:
            self.ends.setdefault(job, None)
        for record in records:
            job = str(record.get("job_id")) if isinstance(record, dict) else ""
            if job in self.ends:
                self.ends[job] = job_end_time(record)

    def publish(self, config: HookConfig, run: RunCommand, log: Callable[[str], None], force: bool = False) -> bool:
        """Write the node's features if they changed (or ``force``). True if slurmctld was asked."""
        try:
            found = self.wanted(config)
        except (MapaError, OSError) as error:
            if str(error) != self.last_problem:
                log(f"features of {self.node}: cannot tell them ({error}); nothing published")
            self.last_problem = str(error)
            return False
        self.last_problem = ""
        if found is None:
            return False
        mapa, snapshot, model = found
        extra = None
        if config.feature_outlook and not (self.foreign_extra and not force):
            self.learn_ends(config, list(snapshot.ledger.holdings), run, log, again=force)
            extra = outlook_text(self.outlook(config, snapshot, model, time.time()))
        weight = node_weight(snapshot.graph, snapshot.free, config.feature_weight_base) if config.feature_weights else None
        if (mapa, extra, weight) == self.last and not force:
            return False
        try:
            shown = run(show_node_argv(config.scontrol, self.node))
            available, active = parse_available_features(shown), parse_active_features(shown)
            missing = [name for name in mapa if name not in available]
            if missing:
                log(f"features of {self.node}: slurm.conf does not list {','.join(missing)} in the node's Features= "
                    f"(needed: {','.join(feature_names(config.feature_sizes))}); nothing published")
                self.last = (mapa, extra, weight)  # said once per change, not at every start
                return True
            if extra is not None and not self._extra_is_ours(shown, log):
                extra = None
            run(active_features_argv(config.scontrol, self.node, merged_features(active, mapa), extra, weight))
        except (CommandFailed, ValueError) as error:
            log(f"features of {self.node}: could not publish {','.join(mapa)} ({error}); trying again at the next change or pass")
            self.last = None
            return True
        self.last = (mapa, extra, weight)
        return True

    def _extra_is_ours(self, shown: str, log: Callable[[str], None]) -> bool:
        """Whether the node's Extra is empty or MAPA's outlook (else it is left as it is, said once)."""
        try:
            parse_outlook(extra_of_node(shown))
        except CommandFailed as error:
            if not self.foreign_extra:
                log(f"features of {self.node}: the node's Extra is not MAPA's ({error}); the outlook is not published there")
            self.foreign_extra = True
            return False
        self.foreign_extra = False
        return True
