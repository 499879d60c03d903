"""The replay's job record and the counters every reader fills."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class Job:
    """One GPU job to replay. Times are seconds (any origin: epoch for sacct logs, 0 for generated)."""

    id: str
    submit: float
    runtime: float
    gpus: int  # GPUs per node
    shape: str = "ring"
    sensitive: bool = False
    nodes: int = 1
    name: str = ""
    task: str = ""
    source: str = "default"  # where the directive came from: directive, rule, default, file, generator
    node: str | None = None  # the node it ran on (sacct), first of NodeList
    recorded: tuple[int, ...] | None = None  # the GPUs MAPA recorded in the AdminComment
    start: float | None = None  # the recorded start (sacct), for the decision audit
    recorded_free: tuple[int, ...] | None = None  # the free GPUs the Prolog chose from, if recorded
    recorded_policy: str | None = None  # the policy of the recorded decision ("fallback" when it fell back)
    recorded_running: tuple[tuple[int, ...], ...] = ()  # the GPUs of each job running on the node then, if recorded
    recorded_slurm: tuple[int, ...] = ()  # the GPUs Slurm picked for it there, if recorded
    recorded_affinity: tuple[str, float] | None = None  # (mode, max_loss) of the CPU affinity rule it was chosen under
    recorded_cpus: frozenset[int] | None = None  # its CPUs there as its cgroup held them, if recorded (else Slurm's GPUs')
    recorded_bw: float | None = None  # effective bandwidth of the recorded decision (filled by the audit)
    domain: str | None = None  # NVLink domain need (issue 51): required, preferred, any; None: the default (core.domains)


@dataclass
class ReadStats:
    """What a reader saw: jobs read, lines skipped for a normal reason, malformed lines by reason."""

    jobs: int = 0
    skipped: Counter = field(default_factory=Counter)
    malformed: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> first line number it happened on
    sources: Counter = field(default_factory=Counter)  # where each job's directive came from: directive, rule, default, ...
    assumed_sensitive: int = 0  # jobs without a directive taken as sensitive by --sensitive-share
    share_candidates: int = 0  # the jobs --sensitive-share picks among (2+ GPUs on a node, no directive or rule)
    notes: Counter = field(default_factory=Counter)  # what a reader assumed, with counts (e.g. fractional GPUs rounded up)

    def bad(self, reason: str, line: int | str) -> None:
        self.malformed[reason] += 1
        self.examples.setdefault(reason, line)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())

    def as_dict(self) -> dict:
        return {
            "jobs": self.jobs,
            "directive_sources": dict(self.sources),
            "assumed_sensitive": self.assumed_sensitive,
            "share_candidates": self.share_candidates,
            "reader_notes": dict(self.notes),
            "skipped": dict(self.skipped),
            "malformed": {reason: {"count": n, "first": self.examples.get(reason)} for reason, n in self.malformed.items()},
        }

    def summary(self) -> str:
        parts = [f"{self.jobs} GPU job(s) read"]
        if self.skipped:
            parts.append("skipped: " + ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())))
        if self.malformed:
            parts.append(
                "malformed: "
                + ", ".join(f"{n} {r} (first at line {self.examples.get(r)})" for r, n in sorted(self.malformed.items()))
            )
        return "; ".join(parts)
