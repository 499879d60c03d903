"""Compiling the C files slurm-mapa ships (the SPANK plugin, the hook wrappers' client): one
compiler run, bounded in time and in what it reads back; each caller words the failures for its
own command."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .. import trusted_files as trusted

BUILD_TIMEOUT_S = 120


class BuildFailed(Exception):
    """Why nothing was built: ``missing`` (no such compiler), ``unrunnable`` (it could not run or
    timed out), ``failed`` (it exited non-zero: ``detail`` is the end of its stderr) or ``too-large``."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(detail)
        self.stage, self.detail = stage, detail


def _where_missing(cc: str) -> str:
    """Why running ``cc`` found no file, in the admin's terms."""
    return "there is no such file" if "/" in cc else "it is not on this node's PATH"


def build(argv: list[str], output: Path, max_bytes: int) -> bytes:
    """Run the compiler command ``argv`` (which writes ``output``) and return what it wrote, at
    most ``max_bytes``; BuildFailed otherwise."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except FileNotFoundError:
        raise BuildFailed("missing", _where_missing(argv[0])) from None
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise BuildFailed("unrunnable", reason) from None
    if done.returncode != 0:
        raise BuildFailed("failed", done.stderr.strip()[-2000:])
    data = trusted.read_bytes(output, max_bytes)
    if len(data) > max_bytes:
        raise BuildFailed("too-large", f"more than {max_bytes} bytes")
    return data
