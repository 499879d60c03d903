"""How much one decision may search: :class:`SearchLimit`, and the meter the searches count it on.

Owns SearchLimit, EXACT_SHARE, Meter and OutOfWork; imports nothing else from the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf
from typing import Callable

from ..errors import InputError


@dataclass(frozen=True)
class SearchLimit:
    """How much one decision may search: ``work`` units (search nodes expanded and candidates
    scored; deterministic) and/or ``seconds`` measured with ``clock`` (e.g. time.monotonic). The
    exact search gets :data:`EXACT_SHARE` of either; the rest improves the best found when it
    cannot finish. ``until``: a reading of ``clock`` no search under this limit may run past, so
    that the several searches of one decision share its time."""

    work: int | None = None
    seconds: float | None = None
    clock: Callable[[], float] | None = None
    until: float | None = None

    def __post_init__(self) -> None:
        if self.work is not None and (isinstance(self.work, bool) or not isinstance(self.work, int) or self.work < 1):
            raise InputError(f"search work limit must be a positive integer, got {self.work!r}")
        if self.seconds is not None:
            if self.clock is None:
                raise InputError("a search limit in seconds needs a clock (e.g. time.monotonic)")
            if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not self.seconds > 0:
                raise InputError(f"search limit in seconds must be a positive number, got {self.seconds!r}")


EXACT_SHARE = 0.8
_CLOCK_EVERY = 64  # work units between two looks at the clock


class OutOfWork(Exception):
    """The limit ran out; ``upper``: a proven upper bound of the objective key's first term (None:
    the caller knows it), ``found``: the best GPUs (a placement or a set) found so far, if any."""

    def __init__(self, upper: float | None = None, found: tuple[int, ...] | None = None) -> None:
        super().__init__("search limit reached")
        self.upper = upper
        self.found = found


class Meter:
    """Counts work against a SearchLimit: first the exact phase's share, then the rest."""

    def __init__(self, limit: SearchLimit | None) -> None:
        self.clock = limit.clock if limit is not None and limit.seconds is not None else None
        self.seconds = limit.seconds if self.clock is not None else None
        self.start = self.clock() if self.clock is not None else 0.0
        if self.seconds is not None and limit is not None and limit.until is not None:
            self.seconds = max(min(self.seconds, limit.until - self.start), 0.0)
        self.total = inf if limit is None or limit.work is None else limit.work
        self.granted = inf if self.total == inf else max(1, int(self.total * EXACT_SHARE))
        self.left = self.granted
        self.deadline = inf if self.clock is None else self.start + self.seconds * EXACT_SHARE
        self.since_clock = 0
        self.exact = True

    @property
    def unlimited(self) -> bool:
        return self.total == inf and self.clock is None

    def tick(self, units: int = 1) -> None:
        self.left -= units
        if self.left < 0:
            raise OutOfWork()
        if self.clock is not None:
            self.since_clock += units
            if self.since_clock >= _CLOCK_EVERY:
                self.since_clock = 0
                if self.clock() > self.deadline:
                    self.left = -1
                    raise OutOfWork()

    def fallback(self) -> None:
        """Leave the exact phase: the rest of the limit is for improving the best found."""
        if not self.exact:
            return
        self.exact = False
        if self.total != inf:
            self.left = max(0, self.total - (self.granted - max(self.left, 0)))
        if self.clock is not None:
            self.deadline = self.start + self.seconds
