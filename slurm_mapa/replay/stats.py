"""Bounded-memory accumulators: exact quantiles for small samples, a fine histogram past that."""

from __future__ import annotations

from array import array
from collections import Counter
from math import floor, log10


class Dist:
    """Count, mean, min, max and quantiles of a stream of numbers.

    Up to ``exact_limit`` values are kept and quantiles are exact (linear interpolation, as
    numpy's default). Past it the values go into a histogram rounded to 4 significant digits, so
    memory stays bounded (bandwidths take few distinct values anyway). The kept values are a
    packed array of doubles (8 bytes each, not a list of float objects), so a run's many
    distributions stay small while exact.
    """

    __slots__ = ("values", "hist", "count", "total", "low", "high", "exact_limit")

    def __init__(self, exact_limit: int = 100_000) -> None:
        self.values: array | list | None = array("d")
        self.hist: Counter | None = None
        self.count = 0
        self.total = 0.0
        self.low = float("inf")
        self.high = float("-inf")
        self.exact_limit = exact_limit

    @staticmethod
    def _round(value: float) -> float:
        if value == 0:
            return 0.0
        return round(value, 3 - int(floor(log10(abs(value)))))

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value
        if self.values is not None:
            if type(value) is not float and type(self.values) is array:
                self.values = list(self.values)  # keep what was given (an int stays an int), as a list does
            self.values.append(value)
            if len(self.values) > self.exact_limit:
                self.hist = Counter(self._round(v) for v in self.values)
                self.values = None
        else:
            assert self.hist is not None
            self.hist[self._round(value)] += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        if q <= 0:
            return self.low
        if q >= 1:
            return self.high
        if self.values is not None:
            data = sorted(self.values)
            pos = q * (len(data) - 1)
            lo = int(pos)
            hi = min(lo + 1, len(data) - 1)
            return data[lo] + (data[hi] - data[lo]) * (pos - lo)
        assert self.hist is not None
        target = q * (self.count - 1)
        seen = 0
        for value in sorted(self.hist):
            seen += self.hist[value]
            if seen > target:
                return value
        return self.high

    def five(self) -> dict:
        """min, p10, p25, median, p75, p90, max and mean (None when empty)."""
        return {
            "n": self.count,
            "min": self.quantile(0),
            "p10": self.quantile(0.10),
            "p25": self.quantile(0.25),
            "median": self.quantile(0.5),
            "p75": self.quantile(0.75),
            "p90": self.quantile(0.90),
            "max": self.quantile(1),
            "mean": self.mean,
        }


class Series:
    """A thinned time series of (t, preserved GB/s, fragmentation, queued, running): at most ``limit`` points."""

    __slots__ = ("points", "step", "limit", "_last")

    def __init__(self, limit: int = 2000) -> None:
        self.points: list[tuple[float, float, float, int, int]] = []
        self.step = 0.0
        self.limit = limit
        self._last = float("-inf")

    def add(self, t: float, preserved: float, fragmentation: float, queued: int, running: int) -> None:
        if self.points and t - self._last < self.step:
            return
        self.points.append((t, preserved, fragmentation, queued, running))
        self._last = t
        if len(self.points) > self.limit:
            self.points = self.points[::2]
            span = self.points[-1][0] - self.points[0][0]
            self.step = max(self.step * 2, span / self.limit)
