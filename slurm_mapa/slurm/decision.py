"""The decision record the Prolog appends to a job's AdminComment, and its parser.

    mapa:topology=ring sensitive=yes # dgx1=0,3,2,1 policy=preserve free=0-7 eff=68.707 agg=175.000 pres=216.000

The directive comes first (what the job_submit plugin stored); each node of the job appends
`# NODE=GPUS key=value...`, GPUs in pattern order. `free=` is what the Prolog chose from and
`running=0,1/4,5` the GPUs of each job running on the node then (jobs separated by `/`), so a
replay can make the same decision again. The directive grammar ends a body at `#`, so
the whole text still parses as the directive. sacct keeps it; mapa-replay and mapa explain read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .commands import parse_gpu_indices
from .directive import Directive


@dataclass(frozen=True)
class Decision:
    """What one node chose for one job, as recorded in the AdminComment and the ledger."""

    node: str
    gpus: tuple[int, ...]
    policy: str
    effective: float | None = None
    aggregated: float | None = None
    preserved: float | None = None
    fallback: str = ""
    free: tuple[int, ...] = ()
    running: tuple[tuple[int, ...], ...] = ()

    def text(self) -> str:
        parts = [f"{self.node}={','.join(map(str, self.gpus))}", f"policy={self.policy}"]
        if self.free:
            parts.append(f"free={','.join(map(str, self.free))}")
        if self.running:
            parts.append("running=" + "/".join(",".join(map(str, group)) for group in self.running))
        for name, value in (("eff", self.effective), ("agg", self.aggregated), ("pres", self.preserved)):
            if value is not None:
                parts.append(f"{name}={value:.3f}")
        if self.fallback:
            parts.append(f"fallback={self.fallback}")
        return " ".join(parts)


def parse_decisions(admin_comment: str) -> dict[str, Decision]:
    """The per-node decisions recorded after `#` in a `mapa:` AdminComment."""
    decisions: dict[str, Decision] = {}
    for segment in admin_comment.split("#")[1:]:
        tokens = segment.split()
        if not tokens or "=" not in tokens[0]:
            continue
        node, _, gpu_text = tokens[0].partition("=")
        try:
            gpus = parse_gpu_indices(gpu_text)
        except ValueError:
            continue
        fields = dict(token.partition("=")[::2] for token in tokens[1:])

        def number(key: str) -> float | None:
            try:
                return float(fields[key]) if key in fields else None
            except ValueError:
                return None

        try:
            free = parse_gpu_indices(fields.get("free", ""))
        except ValueError:
            free = ()
        try:
            running = tuple(parse_gpu_indices(group) for group in fields["running"].split("/")) if "running" in fields else ()
        except ValueError:
            running = ()
        decisions[node] = Decision(
            node, gpus, fields.get("policy", ""), number("eff"), number("agg"), number("pres"), fields.get("fallback", ""), free,
            tuple(group for group in running if group),
        )
    return decisions


def with_decision(admin_comment: str, directive: Directive, decision: Decision) -> str:
    """The AdminComment with this node's decision added (replacing an older one of the same node)."""
    kept = [d.text() for node, d in parse_decisions(admin_comment).items() if node != decision.node]
    return " # ".join([directive.as_comment(), *kept, decision.text()])


