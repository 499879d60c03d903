"""Whether a job that wants a good ring should hold out for one (issue 40): the pure rule.

A sensitive job whose ring is free on no node can start now on the best node free, or wait. It
should wait exactly while the expected wait costs less than what it would lose by running now:

* **lost now** = its run time x (slowdown at the bandwidth it would get now - 1), the slowdown
  read against the fleet's best ring for its size (the time curve's ``slowdown_against``: 1 on
  the best ring, the paper's curve, or the site's own, at the fraction of it otherwise);
* **and what the slow run costs the queue**: it holds its GPUs that much longer, and each of the
  ``queued`` jobs behind it waits for about those extra GPU-seconds spread over the cluster's GPUs,
  so the loss is scaled by ``1 + queued x gpus / total_gpus``. Without this term a busy mixed fleet
  relaxes a third of its sensitive jobs onto PCIe nodes, where they run up to 3x longer and make
  every other job wait (docs/policies.md, "Waiting only when it pays").

The expected wait is the caller's: the replay knows when the running jobs end; a Slurm site
estimates it from the running jobs' time limits.
"""

from __future__ import annotations

from typing import Protocol


class SlowdownCurve(Protocol):
    def slowdown_against(self, bandwidth: float | None, best: float | None) -> float: ...


def loss_if_started_now(runtime: float, bandwidth_now: float | None, best_bandwidth: float | None,
                        curve: SlowdownCurve, queued: int, gpus: int, total_gpus: int) -> float:
    """Seconds lost by starting now at ``bandwidth_now`` instead of on the best ring (0 when that is
    no worse), counting the delay of the ``queued`` jobs behind it; see the module's docstring."""
    own = runtime * (curve.slowdown_against(bandwidth_now, best_bandwidth) - 1.0)
    if own <= 0:
        return 0.0
    return own * (1.0 + max(queued, 0) * gpus / total_gpus) if total_gpus > 0 else own


def holding_pays(expected_wait: float, loss: float) -> bool:
    """Hold out exactly while the expected wait is shorter than the loss of starting now."""
    return expected_wait < loss
