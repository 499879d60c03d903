"""``mapa contrib``: the files slurm-mapa ships for an admin to put in place, wherever it was
installed from (a wheel, an sdist, a checkout).

They are package data under ``slurm_mapa/data/``, named by their path there:

* ``contrib/grafana/mapa-dashboard.json``: the Grafana dashboard (docs/admin.md, "Metrics");
* ``contrib/prometheus/mapa-alerts.yml``: the example Prometheus alert rules (the same);
* ``gres_conf/<preset>.gres.conf`` and ``gres_conf/<preset>.toml``: gres.conf and the topology
  file of every preset (docs/hardware.md; ``mapa gres-conf --write-presets`` writes them anew).

``mapa contrib list`` names them, ``mapa contrib show NAME`` prints one, and ``mapa contrib write
DIR [NAME...]`` copies them (all, or the files and directories named) under DIR with the same
relative paths, so that DIR/contrib/prometheus/mapa-alerts.yml is the file the docs name. A file
that is there already is left alone, and nothing is written, unless ``--force`` is given; each
file is written whole (a new file renamed over the old, never half of one).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...errors import InputError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
#: The directories of slurm_mapa/data that hold an admin's files (the others are the package's own).
GROUPS = ("contrib", "gres_conf")


def bundled_files(data_dir: Path | None = None) -> dict[str, Path]:
    """Every bundled file by its name (its path under slurm_mapa/data, with '/'), sorted."""
    data_dir = DATA_DIR if data_dir is None else data_dir
    found: dict[str, Path] = {}
    for group in GROUPS:
        base = data_dir / group
        if not base.is_dir():
            raise InputError(f"{base} is missing: this installation of slurm-mapa is incomplete; "
                             f"reinstall it from its wheel or sdist")
        for path in base.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found[path.relative_to(data_dir).as_posix()] = path
    return dict(sorted(found.items()))


def describe(name: str) -> str:
    """What the file named ``name`` is, for ``mapa contrib list``."""
    if name == "contrib/grafana/mapa-dashboard.json":
        return "Grafana dashboard of mapa-agent's metrics (docs/admin.md, Metrics)"
    if name == "contrib/prometheus/mapa-alerts.yml":
        return "Prometheus alert rules for mapa-agent's metrics (docs/admin.md, Metrics)"
    stem = Path(name).name
    if name.startswith("gres_conf/") and stem.endswith(".gres.conf"):
        return f"gres.conf of the preset {stem[:-len('.gres.conf')]} (docs/hardware.md)"
    if name.startswith("gres_conf/") and stem.endswith(".toml"):
        return f"topology file of the preset {stem[:-len('.toml')]} (docs/hardware.md)"
    return ""


def select(names: list[str], files: dict[str, Path]) -> dict[str, Path]:
    """The files ``names`` ask for: a file's name, or a directory (``contrib``, ``gres_conf``,
    ``contrib/grafana``), each with or without a trailing '/'; none: every file."""
    if not names:
        return dict(files)
    chosen: dict[str, Path] = {}
    for asked in names:
        key = asked.strip().rstrip("/")
        matched = {name: path for name, path in files.items() if name == key or name.startswith(key + "/")} if key else {}
        if not matched:
            raise InputError(f"no bundled file or directory {asked!r}; accepted: {', '.join(GROUPS)}, a directory under "
                             f"them or a file's name as `mapa contrib list` prints it, e.g. contrib/prometheus/mapa-alerts.yml")
        chosen.update(matched)
    return dict(sorted(chosen.items()))


def write_files(directory: Path, chosen: dict[str, Path], force: bool = False) -> list[Path]:
    """Copy ``chosen`` under ``directory`` (made if missing) with their relative paths; returns the
    paths written. Raises InputError, having written nothing, when a target exists and ``force`` is
    false, or is a directory, or a parent is not a directory."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{directory} is not a directory; give the directory to write the files into")
    targets = {name: directory.joinpath(*name.split("/")) for name in chosen}
    there = []
    for name, target in targets.items():
        for parent in target.relative_to(directory).parents:
            above = directory / parent
            if above != directory and (above.exists() or above.is_symlink()) and not above.is_dir():
                raise InputError(f"cannot write {target}: {above} is not a directory")
        if target.is_dir() and not target.is_symlink():
            raise InputError(f"cannot write {target}: it is a directory")
        if target.exists() or target.is_symlink():
            there.append(target)
    if there and not force:
        which = f"{there[0]} and {len(there) - 1} more file(s) exist" if len(there) > 1 else f"{there[0]} exists"
        raise InputError(f"{which} already; nothing written (--force replaces {'them' if len(there) > 1 else 'it'})")
    written = []
    for name, target in targets.items():
        data = chosen[name].read_bytes()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _replace(target, data)
        except OSError as error:
            raise InputError(f"cannot write {target}: {error.strerror or error}"
                             + (f" (written before it: {len(written)} file(s))" if written else "")) from None
        written.append(target)
    return written


def _replace(target: Path, data: bytes) -> None:
    """``target`` holds ``data``, mode 644: a new file renamed over it (a symlink there is replaced, not followed)."""
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(scratch, 0o644)
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def cmd_list(args: argparse.Namespace) -> int:
    files = select(args.names, bundled_files())
    width = max(len(name) for name in files)
    for name in files:
        print(f"{name:<{width}}  {describe(name)}".rstrip())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    files = bundled_files()
    if args.name not in files:
        select([args.name], files)  # the error for a name that is nothing
        raise InputError(f"{args.name!r} is a directory; name one file, e.g. contrib/prometheus/mapa-alerts.yml "
                         f"(`mapa contrib list {args.name}` names its files)")
    data = files[args.name].read_bytes()
    binary = getattr(sys.stdout, "buffer", None)  # none when stdout is replaced by a text stream
    sys.stdout.flush()
    if binary is not None:
        binary.write(data)
        binary.flush()
    else:
        sys.stdout.write(data.decode("utf-8"))
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    for path in write_files(directory, select(args.names, bundled_files()), force=args.force):
        print(f"wrote {path}")
    return 0


def add_commands(commands: Any) -> None:
    contrib = commands.add_parser(
        "contrib",
        help="list or write the files slurm-mapa ships for admins (Grafana dashboard, Prometheus rules, gres.conf per preset)",
        description="The Grafana dashboard, the Prometheus alert rules and the gres.conf and topology files of every "
        "preset, as this installation carries them: list them, print one, or write them into a directory.",
    )
    sub = contrib.add_subparsers(dest="contrib_command", required=True, metavar="SUBCOMMAND")
    listing = sub.add_parser("list", help="name the bundled files", description="Name each bundled file and what it is.")
    listing.add_argument("names", nargs="*", metavar="NAME", help="only these files or directories (default: all)")
    listing.set_defaults(handler=cmd_list)
    show = sub.add_parser("show", help="print one bundled file", description="Print one bundled file to stdout.")
    show.add_argument("name", metavar="NAME", help="the file, as `mapa contrib list` names it")
    show.set_defaults(handler=cmd_show)
    write = sub.add_parser(
        "write",
        help="write the bundled files into a directory",
        description="Write the bundled files (all, or the files and directories named) under DIRECTORY with the "
        "paths `mapa contrib list` prints, e.g. DIRECTORY/contrib/prometheus/mapa-alerts.yml; DIRECTORY is made if "
        "missing. Nothing is written if one of the files exists, unless --force.",
    )
    write.add_argument("directory", metavar="DIRECTORY", help="where to write them, e.g. /usr/local/share/slurm-mapa")
    write.add_argument("names", nargs="*", metavar="NAME",
                       help="only these files or directories, e.g. contrib or gres_conf/dgx1-v100.gres.conf (default: all)")
    write.add_argument("--force", action="store_true", help="replace files that exist")
    write.set_defaults(handler=cmd_write)
