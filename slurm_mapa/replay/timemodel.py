"""The optional execution-time model: how much slower a bandwidth-sensitive job runs on the bandwidth it got.

A curve of (effective bandwidth GB/s, slowdown) points, linear between points and flat outside
them. The default follows the paper (figures 2b, 6 and 16): VGG-16 about 3x slower on PCIe only
(predicted ring bandwidth 12.3 GB/s) than on double NVLink, and little gain past about 50 GB/s.

The curve is read **relative to the best set** (issue 49): a job's time in the input is its time
on the best GPU set the fleet offers for its size (slowdown 1), and a set of bandwidth ``b``
against that best ``B`` is read at ``b / B`` of the curve's last point (60 GB/s by default), the
curve's own full speed. A 2-GPU job on a DGX-1's PCIe pair (9.6 GB/s judged, against 40 for its
NVLink pair) thus reads the curve at 14.4 GB/s: 2.8x. Reading the judge's GB/s on the paper's
absolute scale instead made the best 2-, 3- and 5-GPU DGX-1 rings 1.2x slower than the workload
says, because the judge's numbers are not the paper model's. It is an assumption that one
application's curve, so scaled, holds for every job and server; the curve is a site's to replace
(``--time-model BW:SLOWDOWN,...``). Insensitive and 1-GPU jobs are unaffected.
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
        if xs[-1] <= 0:
            raise InputError(f"a time curve's last bandwidth is its full speed and must be positive, got {xs[-1]:g}")

    def slowdown(self, bandwidth: float | None) -> float:
        """The curve read at ``bandwidth`` GB/s as it stands (absolute)."""
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

    def slowdown_against(self, bandwidth: float | None, best: float | None) -> float:
        """The slowdown of a set of ``bandwidth`` GB/s where the best set for the job gives ``best``:
        1 on the best set (or better), the curve read at ``bandwidth / best`` of its full speed
        otherwise. No bandwidth: 1; no best known: the absolute reading, as a fallback."""
        if bandwidth is None:
            return 1.0
        if best is None or best <= 0:
            return self.slowdown(bandwidth)
        full_bandwidth, full_slowdown = self.points[-1]
        return self.slowdown(full_bandwidth * min(bandwidth / best, 1.0)) / full_slowdown

    def runtime(self, base: float, sensitive: bool, gpus: int, bandwidth: float | None, best: float | None) -> float:
        """``base`` seconds (the time on the best set) stretched by the slowdown of ``bandwidth`` against ``best``."""
        if not sensitive or gpus < 2:
            return base
        return base * self.slowdown_against(bandwidth, best)


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
