"""The hook wrappers' compiled client (data/client/mapa_hook_client.c), built by ``mapa hooks``.

The wrappers hand each Prolog and Epilog to mapa-agent; the Python client for that costs a Python
start (about 15 ms of CPU, twice per job: docs/benchmarks.md, "Job start under a burst"). The C
client sends the same request and exits with the same statuses. ``mapa hooks`` builds it next to
the wrappers when a C compiler is at hand, and the wrappers name whichever client it wrote.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .. import trusted_files as trusted
from . import c_build

PACKAGE_DIR = Path(__file__).resolve().parents[2]
SOURCE = PACKAGE_DIR / "data" / "client" / "mapa_hook_client.c"
NAME = "mapa-hook-client"
MAX_BINARY_BYTES = 4 << 20


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
            data = c_build.build(build_argv(cc, SOURCE, built), built, MAX_BINARY_BYTES)
        except c_build.BuildFailed as error:
            return None, {
                "missing": f"note: no C compiler {cc!r} ({error.detail}): {slower}; --cc names one",
                "unrunnable": f"WARNING: cannot run the compiler {cc!r}: {error.detail}: {slower}",
                "failed": f"WARNING: {cc} failed on {SOURCE}: {slower}:\n{error.detail}",
                "too-large": f"WARNING: {cc} made a client of {error.detail}, not installed: {slower}",
            }[error.stage]
        target = directory / NAME
        trusted.replace_file(target, data, mode=0o755)
    return target, f"wrote {target} (the wrappers' client of mapa-agent, built with {cc})"
