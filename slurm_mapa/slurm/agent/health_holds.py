"""What a health source's pass does to the held GPUs (issue 50): a pure merge, tested on literals.

* A GPU with findings is held with the source's name and a reason naming what was seen; a GPU the
  source already holds keeps its ``since`` and gets the new reason (its XID parts kept).
* A hold of anyone else (an admin's, another source's) is never overwritten nor released.
* A hold of this source on a GPU it read and found healthy is released, unless it names an XID
  (an event, which is not seen again: an admin releases it after the reset); then it keeps only
  its XID parts.
* A GPU the source could not read keeps whatever it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ...hardware.gpu_faults import Finding, is_sticky, join_reasons, reason_parts
from ..node_state import MAX_REASON_CHARS, GpuHold


@dataclass(frozen=True)
class HoldChanges:
    holds: dict[int, GpuHold]  # the held GPUs after the pass
    lines: tuple[str, ...]  # what changed, for the log ("" when nothing did)

    @property
    def changed(self) -> bool:
        return bool(self.lines)


def merge_source(holds: Mapping[int, GpuHold], source: str, found: Mapping[int, tuple[Finding, ...]],
                 read: frozenset[int], now: float) -> HoldChanges:
    """The held GPUs after ``source``'s pass: ``found`` (GPU -> its findings, empty or absent when
    healthy) over the GPUs it ``read``."""
    after = dict(holds)
    lines: list[str] = []
    for gpu in sorted(read | set(found)):
        problems = found.get(gpu, ())
        hold = after.get(gpu)
        if hold is not None and hold.source != source:
            continue  # an admin's or another source's hold: theirs to change
        sticky = [part for part in reason_parts(hold.reason) if is_sticky(part)] if hold is not None else []
        if problems:
            reason = join_reasons([*sticky, *(f.reason for f in problems)], MAX_REASON_CHARS)
            if hold is None:
                after[gpu] = GpuHold(reason, now, source)
                lines.append(f"GPU {gpu} held out of new jobs ({source}): {reason}")
            elif reason != hold.reason:
                after[gpu] = GpuHold(reason, hold.since, source)
                lines.append(f"GPU {gpu} still held ({source}), now: {reason}")
        elif hold is not None and gpu in read:
            if sticky:
                reason = join_reasons(sticky, MAX_REASON_CHARS)
                if reason != hold.reason:
                    after[gpu] = GpuHold(reason, hold.since, source)
                    lines.append(f"GPU {gpu} still held ({source}) for {reason}: an XID is released by an admin "
                                 f"(mapa gpu release {gpu}) after the GPU is reset; cleared: {hold.reason}")
            else:
                del after[gpu]
                lines.append(f"GPU {gpu} released ({source}): healthy again (was: {hold.reason})")
    return HoldChanges(after, tuple(lines))
