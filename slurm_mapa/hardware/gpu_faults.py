"""Whether a GPU is fit for new jobs, decided from plain readings of the driver's library (issue 50).

A :class:`GpuReading` is what one pass of a health source (NVML, AMD SMI) saw on one GPU, as
literal values; :func:`findings` turns it into the problems that hold the GPU out of new jobs.
No I/O here: the NVML calls are in nvml_watch.py, and what a finding does to the held-GPUs file
is node_state/health_holds.py.

Which NVML conditions count (docs/admin.md "Health sources", with NVIDIA's documents):

* the GPU is lost (``NVML_ERROR_GPU_IS_LOST`` from any query);
* an XID event of :data:`HOLDING_XIDS` (``nvmlEventTypeXidCriticalError``): NVIDIA documents each
  as needing a GPU reset or as the GPU being lost. An XID is an event, not a state NVML can be
  asked about again, so its finding is *sticky*: the source never releases it (an admin does,
  with ``mapa gpu release``, after resetting the GPU);
* row remapping failed, or pending (``nvmlDeviceGetRemappedRows``), page retirement pending
  (``nvmlDeviceGetRetiredPagesPendingStatus``): states NVML reports until a reset (pending) or
  for good (failed);
* an NVLink seen active earlier and inactive now (``nvmlDeviceGetNvLinkState``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# XIDs that hold a GPU, with the words of NVIDIA's Xid documentation
# (https://docs.nvidia.com/deploy/xid-errors/): each needs a GPU reset (or a node reboot) before
# the GPU can be trusted again, or means the GPU is gone. Left out on purpose: 63 (a row marked for
# remapping: read as "row remapping pending" instead, which clears by itself after the reset),
# 92 (a high single-bit ECC rate: corrected errors, informational) and 94 (a contained ECC error:
# only the application that hit it ends, and new work may start without a GPU reset: NVIDIA's
# A100 GPU Memory Error Management guide, https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/).
HOLDING_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU fell off the bus",
    95: "uncontained ECC error",
}
STICKY_PREFIX = "XID "  # a hold's reason part that names an XID event: its source never releases it


@dataclass(frozen=True)
class GpuReading:
    """What one pass of a health source read on one GPU (topology index ``gpu``).

    ``error``: the GPU could not be read (another error than "lost"): nothing is concluded about
    it, its holds stay as they are. None in a field: the GPU does not report that."""

    gpu: int
    lost: bool = False
    error: str = ""
    xids: tuple[int, ...] = ()  # XID events seen since the last pass
    retirement_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    links_expected: frozenset[int] = frozenset()  # NVLinks seen active on this GPU at some pass
    links_active: frozenset[int] = frozenset()  # ... and those active now
    other: tuple[str, ...] = ()  # problems a source states in words (AMD SMI)

    @property
    def read(self) -> bool:
        """Whether the pass could tell this GPU's health (a lost GPU is read: it is lost)."""
        return self.lost or not self.error


@dataclass(frozen=True)
class Finding:
    reason: str
    sticky: bool = False  # an event: its source does not release the hold when it is not seen again


def xid_reason(xid: int) -> str:
    return f"{STICKY_PREFIX}{xid} ({HOLDING_XIDS[xid]})"


def findings(reading: GpuReading) -> tuple[Finding, ...]:
    """The problems that hold this GPU out of new jobs, in a fixed order (none: healthy)."""
    found: list[Finding] = []
    if reading.lost:
        found.append(Finding("GPU lost (NVML: GPU is lost)"))
    for xid in sorted(set(reading.xids)):
        if xid in HOLDING_XIDS:
            found.append(Finding(xid_reason(xid), sticky=True))
    if reading.remap_failed:
        found.append(Finding("row remapping failed"))
    if reading.remap_pending:
        found.append(Finding("row remapping pending (reset the GPU)"))
    if reading.retirement_pending:
        found.append(Finding("page retirement pending (reset the GPU)"))
    down = sorted(reading.links_expected - reading.links_active)
    if down:
        found.append(Finding(f"NVLink {','.join(map(str, down))} down"))
    found.extend(Finding(text) for text in reading.other)
    return tuple(found)


def is_sticky(part: str) -> bool:
    """Whether one ``; ``-separated part of a hold's reason names an event (an XID)."""
    return part.startswith(STICKY_PREFIX)


def reason_parts(reason: str) -> list[str]:
    return [part for part in reason.split("; ") if part]


def join_reasons(parts: Iterable[str], limit: int) -> str:
    """The parts, each once, in order, as one reason of at most ``limit`` characters."""
    seen: list[str] = []
    for part in parts:
        if part not in seen:
            seen.append(part)
    text = "; ".join(seen)
    return text if len(text) <= limit else text[: limit - 3] + "..."
