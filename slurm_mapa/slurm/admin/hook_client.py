"""The hook wrappers' compiled client (data/client/mapa_hook_client.c), built by ``mapa hooks``.

The wrappers hand each Prolog and Epilog to mapa-agent; the Python client for that costs a Python
start (about 15 ms of CPU, twice per job: docs/benchmarks.md, "Job start under a burst"). The C
client sends the same request and exits with the same statuses. ``mapa hooks`` builds it next to
the wrappers when a C compiler is at hand, and the wrappers name whichever client it wrote.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from .. import trusted_files as trusted

PACKAGE_DIR = Path(__file__).resolve().parents[2]
SOURCE = PACKAGE_DIR / "data" / "client" / "mapa_hook_client.c"
NAME = "mapa-hook-client"
MAX_BINARY_BYTES = 4 << 20
BUILD_TIMEOUT_S = 120


def build_argv(cc: str, source: Path, output: Path) -> list[str]:
    """The compiler command: C11 with POSIX, no library beyond libc."""
    return [cc, "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-o", str(output), str(source)]


def build_into(directory: Path, cc: str) -> tuple[Path | None, str]:
    """Compile the client into ``directory`` (replaced whole, mode 755): its path and a line for
    the admin, or None and why not (the wrappers then use the Python client: slower, same answers)."""
    slower = "the wrappers ask mapa-agent through Python (about 15 ms more CPU per Prolog and Epilog)"
    with tempfile.TemporaryDirectory(prefix="mapa-client-") as scratch:
        built = Path(scratch) / NAME
        try:
            done = subprocess.run(build_argv(cc, SOURCE, built), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except FileNotFoundError:
            where = "there is no such file" if "/" in cc else "it is not on this node's PATH"
            return None, f"note: no C compiler {cc!r} ({where}): {slower}; --cc names one"
        except (OSError, subprocess.TimeoutExpired) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            return None, f"WARNING: cannot run the compiler {cc!r}: {reason}: {slower}"
        if done.returncode != 0:
            return None, f"WARNING: {cc} failed on {SOURCE}: {slower}:\n{done.stderr.strip()[-2000:]}"
        data = trusted.read_bytes(built, MAX_BINARY_BYTES)
        if len(data) > MAX_BINARY_BYTES:
            return None, f"WARNING: {cc} made a client of more than {MAX_BINARY_BYTES} bytes, not installed: {slower}"
        target = directory / NAME
        trusted.replace_file(target, data, mode=0o755)
    return target, f"wrote {target} (the wrappers' client of mapa-agent, built with {cc})"
