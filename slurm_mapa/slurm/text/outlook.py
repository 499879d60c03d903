"""A node's ring outlook, the text mapa-agent publishes in the node's ``Extra`` field for ``mapa
release``'s cost rule (issue 40): per MAPA feature, the best placement free now, the fleet's best,
and when a good one is expected free.

    mapa_ring2=48.10/53.60@0,mapa_ring4=-/53.60@1764330000,mapa_ring8=-/53.60@-

One entry per feature ``mapa_<shape><k>``: ``NOW/BEST@AT``. NOW is the predicted effective
bandwidth (GB/s) of the best k-GPU placement on the node's free GPUs (``-``: fewer than k free);
BEST is the fleet's best idle one (what the feature compares with); AT is 0 when a good placement
is free now, else the Unix time at which the running jobs' ends (their Slurm end times, from their
time limits) are expected to free one, ``-`` when no estimate (the node is too small, or the jobs
in the way have no known end). No blanks, so the field is one token of ``scontrol --oneliner show
node``; only administrators (mapa-agent runs as root) can write a node's Extra.

Pure: built and parsed here, written by agent/features.py, read by admin/release.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from .commands import CommandFailed

MAX_ENTRIES = 64
MAX_TEXT = 4096
_NUMBER = r"[0-9]{1,6}(?:\.[0-9]{1,3})?"
_ENTRY = re.compile(rf"(mapa_[A-Za-z0-9_]{{1,40}})=(-|{_NUMBER})/({_NUMBER})@(-|0|[1-9][0-9]{{0,11}})")


@dataclass(frozen=True)
class RingOutlook:
    now: float | None  # GB/s of the best k-placement free now; None: fewer than k GPUs free
    best: float  # GB/s of the fleet's best idle k-placement
    good_at: float | None  # 0: a good one is free now; Unix time: expected; None: no estimate


def _number(value: float) -> str:
    if not math.isfinite(value) or not 0 <= value < 1e6:
        raise ValueError(f"bandwidth {value!r} (accepted: 0 to 999999 GB/s)")
    return f"{value:.2f}".rstrip("0").rstrip(".") or "0"


def outlook_text(outlook: Mapping[str, RingOutlook]) -> str:
    """The Extra text for ``outlook`` (feature name -> RingOutlook), entries in the mapping's order."""
    if len(outlook) > MAX_ENTRIES:
        raise ValueError(f"{len(outlook)} outlook entries (accepted: at most {MAX_ENTRIES})")
    entries = []
    for name, entry in outlook.items():
        now = "-" if entry.now is None else _number(entry.now)
        at = "-" if entry.good_at is None else str(max(0, int(math.ceil(entry.good_at))))
        text = f"{name}={now}/{_number(entry.best)}@{at}"
        if not _ENTRY.fullmatch(text):
            raise ValueError(f"outlook entry {text!r} is not one mapa release reads")
        entries.append(text)
    return ",".join(entries)


def parse_outlook(text: str) -> dict[str, RingOutlook]:
    """``outlook_text``'s output back; {} for an empty field (``(null)`` or nothing: the node publishes
    none). CommandFailed, quoting the text, for anything else that is not a list of entries."""
    text = text.strip()
    if text in ("", "(null)"):
        return {}
    if len(text) > MAX_TEXT:
        raise CommandFailed(f"a node's Extra holds {len(text)} characters (accepted: a MAPA outlook of at most {MAX_TEXT})")
    found: dict[str, RingOutlook] = {}
    for part in text.split(","):
        match = _ENTRY.fullmatch(part)
        if match is None or len(found) >= MAX_ENTRIES:
            raise CommandFailed(f"a node's Extra holds {part[:80]!r} (accepted: MAPA's outlook, e.g. mapa_ring4=41.5/53.6@0)")
        name, now, best, at = match.groups()
        found.setdefault(name, RingOutlook(None if now == "-" else float(now), float(best), None if at == "-" else float(at)))
    return found


def extra_of_node(text: str) -> str:
    """The ``Extra=`` value of `scontrol --oneliner show node NODE` ("" when the node has none:
    Slurm then prints no such field). CommandFailed for more than one."""
    values = re.findall(r"(?:^|\s)Extra=(\S*)", text)
    if len(values) > 1:
        raise CommandFailed(f"scontrol show node printed {len(values)} Extra= fields (expected at most one): {text[:120]!r}")
    return "" if not values or values[0] == "(null)" else values[0]
