"""``mapa hooks DIR``: write the hook wrappers Slurm runs, for this installation of slurm-mapa.

Slurm runs hooks with no PATH and a bare environment, and a hook that fails drains the node, so
the wrappers name every path absolutely and always exit 0. Each tries the node's mapa-agent first
(a client that imports only built-in modules) and runs the hook in-process when there is none.
The text is built by pure functions (tested on literal output); only ``cmd_hooks`` writes files.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ..errors import InputError

PACKAGE_DIR = Path(__file__).resolve().parents[1]
TASKPROLOG = PACKAGE_DIR / "data" / "hooks" / "mapa-taskprolog"
ENTRY = {"prolog": ("slurm_mapa.slurm.hooks", "prolog_main"), "epilog": ("slurm_mapa.slurm.epilog", "epilog_main")}
WRAPPER_NAMES = {"prolog": "mapa-prolog-wrapper", "epilog": "mapa-epilog-wrapper"}


def wrapper_text(kind: str, python: str, package_parent: str, config: str, pycache_prefix: str | None = None) -> str:
    """The POSIX shell wrapper for ``kind`` (prolog or epilog) of an installation.

    ``pycache_prefix``: where the in-process hook keeps byte code when the package directory is
    read-only (compiling on every job costs about 50 ms).
    """
    paths = [("python", python), ("package directory", package_parent), ("config", config)]
    if pycache_prefix is not None:
        paths.append(("pycache prefix", pycache_prefix))
    for what, path in paths:
        if not os.path.isabs(path) or any(c in path for c in "\n'\"\\$`"):
            raise InputError(f"the {what} path {path!r} must be absolute and free of quotes, backslashes, $ and newlines")
    module, function = ENTRY[kind]
    client = os.path.join(package_parent, "slurm_mapa", "slurm", "agent_client.py")
    code = f'import sys; sys.path.insert(0, "{package_parent}"); from {module} import {function}; sys.exit({function}())'
    return (
        "#!/bin/sh\n"
        f"# slurm-mapa {kind} wrapper, written by `mapa hooks`. Slurm gives hooks no PATH, and a hook that\n"
        "# fails drains the node: absolute paths only, and exit 0 whatever happens.\n"
        f"MAPA_CONFIG={shlex.quote(config)}\n"
        "export MAPA_CONFIG\n"
        "# Fast path: the node's mapa-agent runs the hook; otherwise (no agent, killed, refused) in-process.\n"
        f"{shlex.quote(python)} -I -S {shlex.quote(client)} {kind} && exit 0\n"
        f"{shlex.quote(python)} -I{' -X pycache_prefix=' + shlex.quote(pycache_prefix) if pycache_prefix else ''} -c {shlex.quote(code)}\n"
        "exit 0\n"
    )


def slurm_conf_lines(directory: str) -> str:
    return (
        "PrologFlags=Alloc\n"
        f"Prolog={os.path.join(directory, WRAPPER_NAMES['prolog'])}\n"
        f"Epilog={os.path.join(directory, WRAPPER_NAMES['epilog'])}\n"
        f"TaskProlog={os.path.join(directory, 'mapa-taskprolog')}\n"
    )


def cmd_hooks(args: argparse.Namespace) -> int:
    directory = Path(args.directory).resolve()
    python = args.python or sys.executable
    if not os.access(python, os.X_OK):
        raise InputError(f"--python {python!r} is not an executable file")
    texts = {WRAPPER_NAMES[kind]: wrapper_text(kind, python, str(PACKAGE_DIR.parent), args.config, args.pycache_prefix) for kind in ENTRY}
    texts["mapa-taskprolog"] = TASKPROLOG.read_text()
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        target = directory / name
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # a hook being replaced while slurmd runs it sees old or new, never half
        print(f"wrote {target}", file=sys.stderr)
    print(slurm_conf_lines(str(directory)), end="")
    return 0


def add_commands(commands: Any) -> None:
    hooks = commands.add_parser(
        "hooks",
        help="write the Prolog/Epilog wrappers and the TaskProlog for this installation",
        description="Write mapa-prolog-wrapper, mapa-epilog-wrapper and mapa-taskprolog into DIRECTORY (mode 755) "
        "and print the slurm.conf lines that use them.",
    )
    hooks.add_argument("directory", help="where to write them, e.g. /usr/local/sbin")
    hooks.add_argument("--python", help="the Python that has slurm-mapa installed (default: this one)")
    hooks.add_argument("--config", default="/etc/slurm/mapa.toml", help="the hooks' config (default %(default)s)")
    hooks.add_argument("--pycache-prefix", help="byte-code cache for the in-process hooks, when the package directory is read-only")
    hooks.set_defaults(handler=cmd_hooks)
