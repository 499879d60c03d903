"""MAPA directives and recorded decisions in sacct comments, and the site rules for jobs without one.

A comment carries a directive when it starts with ``mapa:`` (AdminComment first, then Comment).
The Prolog appends its decision after ``#`` (see :mod:`slurm_mapa.slurm.text.decision`):
``mapa:topology=ring sensitive=yes # n1=0,3 policy=preserve free=0-7 ...``. The request is read
with the project's directive grammar (:mod:`slurm_mapa.slurm.text.directive`), the one the job_submit
plugin and the Prolog use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping

from ..core.affinity import parse_cpu_ids
from ..core.patterns import make_pattern
from ..core.policies import Request
from ..errors import InputError
from ..slurm.text.decision import parse_affinity, parse_decisions
from ..slurm.text.directive import parse_comment


@dataclass(frozen=True)
class Intent:
    """What a job asks for (shape, sensitivity) and what MAPA recorded (node, GPUs), if anything."""

    shape: str | None
    sensitive: bool | None
    recorded: tuple[int, ...] | None = None
    node: str | None = None
    recorded_free: tuple[int, ...] | None = None  # the free GPUs the Prolog saw (``free=``)
    recorded_policy: str | None = None
    recorded_running: tuple[tuple[int, ...], ...] = ()  # the running jobs' GPUs the Prolog saw (``running=``)
    recorded_slurm: tuple[int, ...] = ()  # the GPUs Slurm picked (``slurm=``)
    recorded_affinity: tuple[str, float] | None = None  # the CPU affinity rule of the choice (``affinity=``)
    recorded_cpus: frozenset[int] | None = None  # the job's CPUs from its cgroup (``cpus=``), if recorded


@lru_cache(maxsize=4096)
def read_intent(text: str) -> Intent | None:
    """The intent in one comment, or None when it carries no ``mapa:`` text. Raises InputError when malformed."""
    text = (text or "").strip()
    if not text.lower().startswith("mapa:"):
        return None
    directive = parse_comment(text.split("#")[0])
    decisions = parse_decisions(text)
    assert directive is not None
    if not decisions:
        return Intent(shape=directive.topology, sensitive=directive.sensitive)
    first = next(iter(decisions.values()))
    return Intent(
        shape=directive.topology,
        sensitive=directive.sensitive,
        recorded=first.gpus,
        node=first.node,
        recorded_free=first.free or None,
        recorded_policy=first.policy or None,
        recorded_running=first.running,
        recorded_slurm=first.slurm_gpus,
        recorded_affinity=parse_affinity(first.affinity) if first.affinity else None,
        recorded_cpus=_cpus(first.job_cpus),
    )


def _cpus(text: str) -> frozenset[int] | None:
    """A record's ``cpus=`` list, None when there is none or it does not parse (then Slurm's GPUs' CPUs stand in)."""
    try:
        return parse_cpu_ids(text) if text else None
    except InputError:
        return None


@dataclass(frozen=True)
class SiteRule:
    """``field`` (name, account, partition, user) matching ``pattern`` (a regex) gets ``directive``."""

    field: str
    pattern: re.Pattern
    directive: str


RULE_FIELDS = ("name", "account", "partition", "user")


def make_rules(raw: Iterable[Mapping[str, Any]]) -> list[SiteRule]:
    rules = []
    for i, item in enumerate(raw):
        fields = [f for f in RULE_FIELDS if f in item]
        if len(fields) != 1 or "directive" not in item:
            raise InputError(
                f"site rule {i + 1}: needs exactly one of {', '.join(RULE_FIELDS)} (a regular expression) and a directive, got {dict(item)}"
            )
        try:
            pattern = re.compile(str(item[fields[0]]))
        except re.error as exc:
            raise InputError(f"site rule {i + 1}: bad regular expression {item[fields[0]]!r}: {exc}") from None
        directive = str(item["directive"]).strip()
        if not directive.lower().startswith("mapa:"):
            directive = "mapa:" + directive
        read_intent(directive)  # validate now
        rules.append(SiteRule(fields[0], pattern, directive))
    return rules


def match_rule(rules: list[SiteRule], values: Mapping[str, str]) -> Intent | None:
    for rule in rules:
        if rule.pattern.search(values.get(rule.field, "") or ""):
            return read_intent(rule.directive)
    return None


@lru_cache(maxsize=1024)
def request_for(shape: str, gpus: int, sensitive: bool) -> Request:
    """The request of a job: its pattern over its GPU count (a shape that needs more GPUs falls back to ring)."""
    try:
        pattern = make_pattern(shape, gpus)
    except InputError:
        pattern = make_pattern("ring", gpus)
    return Request(pattern, sensitive)
