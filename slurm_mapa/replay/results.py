"""What a replay run yields: a :class:`RunResult` per policy (and node choice) and a
:class:`Record` per finished job, the per-job CSV's row.

The simulator fills them as jobs end, with fixed-size accumulators (:mod:`.stats`), so a run's
result does not grow with the log; :mod:`.report` and :mod:`.plots` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import inf
from typing import TYPE_CHECKING

from .stats import Dist, Series

if TYPE_CHECKING:
    from .decider import Decision
    from .jobs import Job


@dataclass
class Record:
    """One finished job of one run (what the per-job CSV holds)."""

    id: str
    policy: str
    node: str
    submit: float
    start: float
    end: float
    gpus: tuple[int, ...]
    sensitive: bool
    shape: str
    effective: float | None  # by the judging model
    aggregated: float
    preserved: float
    base_runtime: float
    ranked: float | None = None  # by the ranking model (what the policy maximized)
    fast_ring: bool | None = None  # its GPUs hold a ring over fast links only (None: not checked)

    @property
    def wait(self) -> float:
        return self.start - self.submit

    @property
    def runtime(self) -> float:
        return self.end - self.start


@dataclass
class SizeStats:
    """The results of the jobs of one size (GPUs per node) in one run."""

    jobs: int = 0
    eff_sensitive: Dist = field(default_factory=Dist)
    eff_insensitive: Dist = field(default_factory=Dist)
    wait: Dist = field(default_factory=Dist)
    grounded: int = 0
    extrapolated: int = 0
    ranked_sensitive: Dist = field(default_factory=Dist)  # the ranking model's own score of the sensitive jobs
    hop_sensitive: Dist = field(default_factory=Dist)  # the slowest hop of the sensitive jobs (Decision.slowest_hop)
    ring_checked: int = 0  # sensitive jobs whose GPU set was checked for a ring over fast links only
    fast_ring: int = 0  # ... and those that hold one


@dataclass
class RunResult:
    policy: str
    jobs: int = 0
    dropped: dict = field(default_factory=dict)
    eff_sensitive: Dist = field(default_factory=Dist)
    eff_insensitive: Dist = field(default_factory=Dist)
    ranked_sensitive: Dist = field(default_factory=Dist)  # the ranking model's own score of the sensitive jobs
    hop_sensitive: Dist = field(default_factory=Dist)  # the slowest hop of the sensitive jobs (Decision.slowest_hop)
    wait: Dist = field(default_factory=Dist)
    wait_sensitive: Dist = field(default_factory=Dist)  # sensitive jobs of 2+ GPUs
    runtime: Dist = field(default_factory=Dist)
    runtime_sensitive: Dist = field(default_factory=Dist)
    preserved_after: Dist = field(default_factory=Dist)
    first_submit: float = inf
    last_end: float = -inf
    preserved_area: float = 0.0
    fragmentation_area: float = 0.0
    covered: float = 0.0
    series: Series = field(default_factory=Series)
    out_of_order: int = 0
    decisions: int = 0
    stuck: int = 0
    by_gpus: dict = field(default_factory=dict)  # GPUs per node -> SizeStats
    grounded: int = 0  # jobs whose effective bandwidth came from the link-bound model (outside the judge's fitted range)
    extrapolated: int = 0  # jobs whose effective bandwidth the judge extrapolated (--extrapolate)
    judge: str = "link-bound"  # the model every effective bandwidth above is judged by
    ring_checked: int = 0  # sensitive jobs of 2+ GPUs whose set was checked for a ring over fast links only
    fast_ring: int = 0  # ... and those that hold one
    node_choice: str = "first-fit"
    preference_met: int = 0  # jobs that wanted a feature (prefer/require) and started on a node that had it
    preference_missed: int = 0  # ... and started elsewhere (Slurm's fallback, or a relaxed constraint)
    relaxed: int = 0  # require: jobs that started without their feature after the wait bound
    affinity_local: int = 0  # jobs whose GPUs are all local to their modelled CPUs (Options.affinity set)
    affinity_remote: int = 0  # ... and jobs with a GPU that is not

    @property
    def label(self) -> str:
        return self.policy if self.node_choice == "first-fit" else f"{self.policy}/{self.node_choice}"

    def size(self, gpus: int) -> "SizeStats":
        found = self.by_gpus.get(gpus)
        if found is None:
            found = self.by_gpus[gpus] = SizeStats()
        return found

    def add_ended(self, job: "Job", first: "Decision", localities: list, start: float, end: float) -> None:
        """An ended job in the accumulators, all jobs' and its size's: ``first``, its decision on
        its first node; ``localities``, each node's (None where affinity was not modelled)."""
        localities = [local for local in localities if local is not None]
        if localities:
            if all(localities):
                self.affinity_local += 1
            else:
                self.affinity_remote += 1
        self.jobs += 1
        self.last_end = max(self.last_end, end)
        self.wait.add(start - job.submit)
        if job.sensitive and job.gpus >= 2:
            self.wait_sensitive.add(start - job.submit)
        self.runtime.add(end - start)
        if job.sensitive:
            self.runtime_sensitive.add(end - start)
        size = self.size(job.gpus)
        size.jobs += 1
        size.wait.add(start - job.submit)
        if first.effective is not None:
            (self.eff_sensitive if job.sensitive else self.eff_insensitive).add(first.effective)
            (size.eff_sensitive if job.sensitive else size.eff_insensitive).add(first.effective)
        if job.sensitive and job.gpus >= 2 and first.slowest_hop is not None:
            self.hop_sensitive.add(first.slowest_hop)
            size.hop_sensitive.add(first.slowest_hop)
        if job.sensitive and first.ranked is not None:
            self.ranked_sensitive.add(first.ranked)
            size.ranked_sensitive.add(first.ranked)
        if job.sensitive and first.fast_ring is not None:
            self.ring_checked += 1
            size.ring_checked += 1
            if first.fast_ring:
                self.fast_ring += 1
                size.fast_ring += 1
        if first.grounded:
            self.grounded += 1
            size.grounded += 1
        if first.extrapolated:
            self.extrapolated += 1
            size.extrapolated += 1
        self.preserved_after.add(first.preserved)

    @property
    def makespan(self) -> float:
        return max(0.0, self.last_end - self.first_submit) if self.jobs else 0.0

    @property
    def throughput_per_hour(self) -> float:
        return self.jobs / self.makespan * 3600.0 if self.makespan > 0 else 0.0

    @property
    def mean_preserved(self) -> float:
        return self.preserved_area / self.covered if self.covered > 0 else 0.0

    @property
    def mean_fragmentation(self) -> float:
        return self.fragmentation_area / self.covered if self.covered > 0 else 0.0
