"""bench_burst's on/off ratios and their bootstrap intervals (issue 41): known answers on made-up
bursts (the benchmark itself needs the mini cluster)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if not (BENCHMARKS / "bench_burst.py").is_file():
    pytest.skip("benchmarks/ is not here (an unpacked sdist carries tests/ only)", allow_module_level=True)
sys.path.insert(0, str(BENCHMARKS))

from bench_burst import ratio_interval, waits  # noqa: E402


def burst(*delays: float, never_started: int = 0) -> dict:
    """A burst whose jobs started ``delays`` seconds after their submit (and some that never did)."""
    submitted = {job: 100.0 + job for job in range(len(delays) + never_started)}
    return {"submitted": submitted, "started": {job: submitted[job] + d for job, d in enumerate(delays)}}


def test_waits_are_the_started_jobs_submit_to_start():
    assert sorted(waits([burst(1.0, 2.5), burst(0.5, never_started=2)])) == [0.5, 1.0, 2.5]


def test_the_same_bursts_every_round_give_one_ratio_and_no_spread():
    on, off = [burst(2.0, 2.0, 4.0)] * 3, [burst(1.0, 1.0, 2.0)] * 3
    assert ratio_interval(on, off, statistics.median) == (2.0, 2.0, 2.0)
    assert ratio_interval(on, off, max) == (2.0, 2.0, 2.0)


def test_the_interval_spans_what_drawing_the_bursts_again_can_give():
    # Pooled, on's median is 2 (one burst at 1 s, one at 3 s); drawn again, a quarter of the draws
    # hold the fast burst twice (median 1) and a quarter the slow one twice (median 3).
    on, off = [burst(1.0, 1.0), burst(3.0, 3.0)], [burst(1.0, 1.0), burst(1.0, 1.0)]
    assert ratio_interval(on, off, statistics.median) == (2.0, 1.0, 3.0)
    point, low, high = ratio_interval(on, off, max)
    assert point == 3.0 and low == 1.0 and high == 3.0
