"""The GPUs held out of new jobs on this node (issue 50): ``held-gpus.json`` beside the ledger.

Slurm cannot drain one GPU of a node, but MAPA chooses which GPUs each job gets, so it can keep
one out of every new job while the node keeps running. An admin holds a GPU with ``mapa gpu
hold GPU --reason TEXT`` (source ``admin``); mapa-agent's health passes (agent/health.py: NVML,
AMD SMI) write the same record with their own ``source``. The format::

    {"version": 1, "gpus": {"3": {"reason": "XID 79 twice", "since": 1718000000.0, "source": "admin"}}}

Parsed strictly (:func:`held_from_json`): any other shape, key, type or size raises HeldCorrupt,
and the hooks then hold nothing out (fail open: a job is never stopped by this file) and say so
in the log; ``mapa status`` and ``mapa doctor`` show it. The file is root's, in the ledger's
root-owned directory, written whole under a fresh name and renamed into place (trusted_files.py),
and changed only under the ledger's lock, so two admins' holds never lose one another.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .. import trusted_files as trusted

HELD_FILE_NAME = "held-gpus.json"
MAX_HELD_BYTES = 1 << 16
MAX_GPU_INDEX = 1023  # no node has more GPUs; bounds the file and every loop over it
MAX_REASON_CHARS = 200
SOURCES = ("admin", "nvml", "dcgm", "amdsmi")
_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")
_FIELDS = {"reason", "since", "source"}


class HeldCorrupt(ValueError):
    """The held-GPUs file is not what this module writes."""


@dataclass(frozen=True)
class GpuHold:
    reason: str  # printable text, at most MAX_REASON_CHARS characters ("" when none was given)
    since: float  # seconds since the epoch
    source: str  # one of SOURCES


def reason_problem(reason: str) -> str:
    """Why ``reason`` cannot be a hold's reason ("" when it can)."""
    if len(reason) > MAX_REASON_CHARS:
        return f"{len(reason)} characters; accepted: at most {MAX_REASON_CHARS} printable characters on one line"
    if not reason.isprintable():
        return "it has a control character or a line break; accepted: printable characters on one line"
    return ""


def held_to_json(holds: Mapping[int, GpuHold]) -> str:
    return json.dumps({"version": 1, "gpus": {str(gpu): {"reason": h.reason, "since": h.since, "source": h.source}
                                              for gpu, h in sorted(holds.items())}}, indent=1, ensure_ascii=True)


def _is_time(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and 0 <= value < 1e11


def held_from_json(text: str) -> dict[int, GpuHold]:
    """Strictly parse the held-GPUs file; anything unexpected, in any field, raises HeldCorrupt."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise HeldCorrupt(f"not JSON: {str(error)[:80]}") from None
    if not isinstance(data, dict) or set(data) != {"version", "gpus"} or data["version"] != 1 or not isinstance(data["gpus"], dict):
        raise HeldCorrupt("expected an object with version 1 and a gpus table, nothing else")
    holds: dict[int, GpuHold] = {}
    for key, entry in data["gpus"].items():
        if not _INDEX.fullmatch(key) or int(key) > MAX_GPU_INDEX:
            raise HeldCorrupt(f"GPU {key[:20]!r} is not an index 0 to {MAX_GPU_INDEX}")
        if not isinstance(entry, dict) or set(entry) != _FIELDS:
            raise HeldCorrupt(f"GPU {key}: expected the fields reason, since, source")
        reason, since, source = entry["reason"], entry["since"], entry["source"]
        if not isinstance(reason, str) or reason_problem(reason):
            raise HeldCorrupt(f"GPU {key}: reason is not printable text of at most {MAX_REASON_CHARS} characters")
        if not _is_time(since) or source not in SOURCES:
            raise HeldCorrupt(f"GPU {key}: since must be seconds since the epoch and source one of {', '.join(SOURCES)}")
        holds[int(key)] = GpuHold(reason, float(since), source)
    return holds


def held_path(ledger_path: Path) -> Path:
    return Path(ledger_path).with_name(HELD_FILE_NAME)


def read_held(path: Path) -> dict[int, GpuHold]:
    """The held GPUs (none if there is no file); HeldCorrupt if the file cannot be trusted."""
    try:
        if Path(path).parent.exists():
            trusted.check_trusted_dir(Path(path).parent)
        raw = trusted.read_bytes(path, MAX_HELD_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, trusted.UnsafePath) as error:  # a symlink or a device planted in its place, a directory others change
        raise HeldCorrupt(f"unreadable: {error}") from None
    if len(raw) > MAX_HELD_BYTES:
        raise HeldCorrupt(f"larger than {MAX_HELD_BYTES} bytes")
    try:
        return held_from_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise HeldCorrupt("not UTF-8") from None


def write_held(path: Path, holds: Mapping[int, GpuHold]) -> None:
    trusted.replace_file(path, held_to_json(holds).encode(), mode=0o644)
