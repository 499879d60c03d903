"""The replay's options (what ``mapa-replay run`` sets) and their checks, which :mod:`.simulate` reads.

Which node a job starts on is ``Options.node_choice`` (issue 15, see :func:`.node_pick.slurm_pick`):

* ``first-fit`` - the first node in node order where the policy finds room (the default);
* ``slurm``     - select/cons_tres' choice for equal node weights: among the maximal runs of
  consecutive nodes (node order) that can hold the job, the run with the fewest free resources,
  and in it the node with the fewest (the tightest fit); free GPUs stand for free resources;
* ``prefer``    - the same choice among the nodes whose MAPA features (:mod:`~slurm_mapa.core.features`)
  match what the job prefers, else among all (Slurm's ``--prefer``): a sensitive k-GPU job prefers
  ``mapa_ring<k>``, an insensitive one the complement or nothing (``Options.insensitive``). The
  features are those the agents would have published at the start of the scheduling pass: a job
  started earlier in the same pass does not update them (stale within a pass, as in Slurm);
* ``require``   - sensitive jobs hold out for a node with their feature (``--constraint``), then
  prefer it. How long is ``Options.wait_rule`` (issue 40): ``fixed`` holds out ``require_wait``
  seconds (the simulator wakes at that bound so the relaxed job is looked at again even if nothing
  else happens); ``cost`` holds out while the expected wait for a node with the ring is shorter
  than the time the job would lose on the best node free now (:meth:`.simulate.Simulation.holding_pays`).

Node weights (``Options.node_weights``, issue 40, cluster-level Preserve): each node publishes a
Slurm weight, the preserved bandwidth (Eq. 3) of its free GPUs (:func:`slurm_mapa.core.features.node_weight`,
what mapa-agent publishes with mapa.toml's ``[features] weights = true``), and Slurm takes the lowest weight
first (:func:`.node_pick.weighted_pick`): jobs land on the nodes whose free GPUs are worth least to
rings (the PCIe nodes of a mixed fleet, the fragmented nodes of a busy one), and the whole nodes
stay whole. Published like the features: as they were at the start of a scheduling pass.

CPU affinity (``Options.affinity``, issue 14 item 4, :mod:`~slurm_mapa.core.affinity`): each job's
CPUs on a node are modelled as cons_tres would give them *if it took the lowest-numbered free GPUs*:
every CPU in those GPUs' affinity (:func:`~slurm_mapa.core.affinity.modelled_job_cpus`); the
simulator does not track which cores are busy. Then the affinity mode (strict, prefer, ignore)
wraps the policy as the Prolog would. ``None`` (the default) leaves affinity out, as before;
``ignore`` decides the same but counts how many jobs got GPUs local to their CPUs. Nodes whose
topology has no CPU affinity count every GPU as local; round-robin's stateful path ignores affinity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core import features as mapa_features
from ..core.affinity import check_settings as check_affinity
from ..core.effbw import EffectiveBandwidthModel, LinkBoundModel
from ..core.hardware import HardwareGraph
from ..errors import InputError
from .decider import ALL_POLICIES
from .timemodel import TimeModel

NODE_CHOICES = ("first-fit", "slurm", "prefer", "require")
# How long a 'require' job holds out for a node with its ring: see the module's docstring.
WAIT_RULES = ("fixed", "cost")
# What an insensitive job (or a 1-GPU one) prefers under prefer/require:
#   complement     - mapa_noring<k> of its own size (mapa_noring<smallest size> for a 1-GPU job)
#   complement-min - mapa_noring<smallest size>: a node with no good ring of any size left
#   best-fit       - nothing: Slurm's tightest fit
INSENSITIVE_CHOICES = ("best-fit", "complement", "complement-min")


@dataclass(frozen=True)
class Node:
    name: str
    graph: HardwareGraph


@dataclass
class Options:
    backfill: bool = False
    backfill_depth: int = 64
    time_model: TimeModel | None = None
    pin_nodes: bool = True
    reorder_window: int = 10_000
    model: EffectiveBandwidthModel | None = None
    configured: dict | None = None  # policies built with site settings (preserve-ahead's sizes)
    extrapolate: bool = False  # keep the judge's own predictions outside its fitted range (marked)
    judge: EffectiveBandwidthModel | LinkBoundModel | None = None  # what scores the decisions (None: link-bound); see Decider
    node_choice: str = "first-fit"  # see NODE_CHOICES
    insensitive: str = "complement"  # what insensitive jobs prefer under prefer/require: see INSENSITIVE_CHOICES
    feature_threshold: float = mapa_features.DEFAULT_THRESHOLD
    feature_sizes: tuple[int, ...] | None = None  # ring sizes the nodes publish (None: 2 .. largest node)
    require_wait: float = 3600.0  # seconds a 'require' job holds out for its feature (wait_rule fixed)
    wait_rule: str = "fixed"  # see WAIT_RULES
    wait_pricing: TimeModel | None = None  # the slowdown the cost rule expects (None: time_model, else the default curve)
    # 0: the cost rule knows each job's run time and the running jobs' ends (an oracle); F > 0: as
    # `mapa release --wait-rule cost` in Slurm, a job's time limit is F x its run time (at full
    # speed), the running jobs end at their limits, and the loss is priced at the worst ring free
    # now on a node with room (Slurm picks the node).
    wait_limits: float = 0.0
    node_weights: bool = False  # nodes publish the preserved bandwidth of their free GPUs as Slurm weights
    affinity: str | None = None  # CPU affinity mode (strict, prefer, ignore); None: not modelled
    affinity_max_loss: float = 0.1  # prefer: the fraction of the value a local choice may give up


def check_options(policy: str, nodes: Sequence[Node], options: Options) -> None:
    if policy not in ALL_POLICIES:
        raise InputError(f"unknown policy {policy!r} (accepted: {', '.join(ALL_POLICIES)})")
    if not nodes:
        raise InputError("the simulated cluster has no nodes")
    if options.node_choice not in NODE_CHOICES:
        raise InputError(f"unknown node choice {options.node_choice!r} (accepted: {', '.join(NODE_CHOICES)})")
    if options.insensitive not in INSENSITIVE_CHOICES:
        raise InputError(f"unknown choice for insensitive jobs {options.insensitive!r} (accepted: {', '.join(INSENSITIVE_CHOICES)})")
    if not 0 < options.feature_threshold <= 1:
        raise InputError(f"feature threshold must be a fraction in (0, 1], got {options.feature_threshold:g}")
    if options.require_wait < 0:
        raise InputError(f"the require wait bound must be 0 or more, got {options.require_wait:g}")
    if options.wait_rule not in WAIT_RULES:
        raise InputError(f"unknown wait rule {options.wait_rule!r} (accepted: {', '.join(WAIT_RULES)})")
    if not (options.wait_limits == 0 or 1 <= options.wait_limits <= 100):
        raise InputError(f"time limits as a multiple of run times must be 0 (the cost rule knows run times) or 1 to 100, "
                         f"got {options.wait_limits:g}")
    if options.node_weights and options.node_choice == "first-fit":
        raise InputError("node weights need a node choice that models Slurm's (slurm, prefer or require), not first-fit")
    if options.affinity is not None:
        check_affinity(options.affinity, options.affinity_max_loss)
