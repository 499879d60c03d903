"""The optional execution-time model: how much slower a bandwidth-sensitive job runs on the bandwidth it got.

A curve of (effective bandwidth GB/s, slowdown) points, linear between points and flat outside
them. A job's time in the input is its time at full speed (slowdown 1); a sensitive job of 2+
GPUs then runs ``time * slowdown(effective bandwidth)``; insensitive and 1-GPU jobs are unaffected.
The default follows the paper (figures 2b, 6 and 16): VGG-16 up to about 3x slower on PCIe only
(predicted ring bandwidth 12.3 GB/s) than on double NVLink, and little gain past about 50 GB/s.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from ..errors import InputError

DEFAULT_CURVE = ((12.3, 3.0), (25.0, 1.8), (40.0, 1.2), (50.0, 1.05), (60.0, 1.0))


@dataclass(frozen=True)
class TimeModel:
    points: tuple[tuple[float, float], ...] = DEFAULT_CURVE

    def __post_init__(self) -> None:
        if not self.points:
            raise InputError("a time curve needs at least one BW:SLOWDOWN point")
        xs = [p[0] for p in self.points]
        if xs != sorted(xs) or len(set(xs)) != len(xs):
            raise InputError(f"time curve bandwidths must increase strictly, got {xs}")
        if any(s <= 0 for _, s in self.points):
            raise InputError("time curve slowdowns must be positive")

    def slowdown(self, bandwidth: float | None) -> float:
        if bandwidth is None:
            return 1.0
        xs = [p[0] for p in self.points]
        i = bisect_right(xs, bandwidth)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (bandwidth - x0) / (x1 - x0)

    def runtime(self, base: float, sensitive: bool, gpus: int, bandwidth: float | None) -> float:
        if not sensitive or gpus < 2:
            return base
        return base * self.slowdown(bandwidth)


def parse_curve(text: str) -> TimeModel:
    """``"12.3:3,25:1.8,50:1"`` -> a TimeModel; ``default`` -> the paper's curve."""
    if text.strip().lower() in ("", "default", "paper"):
        return TimeModel()
    points = []
    for part in text.split(","):
        try:
            bw, slow = part.split(":")
            points.append((float(bw), float(slow)))
        except ValueError:
            raise InputError(f"time curve point {part!r} (accepted: BW:SLOWDOWN pairs, e.g. 12.3:3,25:1.8,50:1)") from None
    return TimeModel(tuple(points))
