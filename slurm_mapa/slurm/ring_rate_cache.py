"""Ring-rate tables kept on disk for graphs with no shipped table (issue 49): the
:class:`~slurm_mapa.core.ring_rate_tables.TableStore` of the hooks, the agent and the commands.

A topology file whose links match no bundled preset has no table in the package; the first
process that needs its ring rates computes the table (every set of 3 to 8 GPUs, once per orbit:
tens of ms and numpy) and writes it here, as ``<fingerprint>.json`` in the shipped tables'
format; every later process, the in-process Prolog included, reads it back with json alone.

Where: as the hooks, the agent and ``mapa hooks`` run (root), ``ring-rates/`` beside the node's
ledger (``HookConfig.ring_rates_dir``); for the commands (``mapa select``, ``mapa-replay``),
``$XDG_CACHE_HOME/slurm-mapa/ring-rates`` (default ``~/.cache/...``). Either is safe to delete:
the next process that needs a table computes it again.

Trust: root reads a table only when the file and every directory above it are root's and not
writable by group or others (trusted_files, as for the ledger; a user's own cache may be the
user's); writes go through a fresh temporary name renamed into place (mode 0644, directories 0755).
Whatever is read is checked against the graph (core.ring_rate_tables.table_from_bytes) and
ignored unless it is exactly that graph's table. A store never fails a decision: a table it
cannot read is computed, one it cannot write is kept in memory for the process, and the log
says so once per directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import MapaError
from . import trusted_files

if TYPE_CHECKING:
    from ..core.hardware import HardwareGraph

MAX_TABLE_BYTES = 1 << 20  # an 8-GPU table is about 5 kB


class DiskTables:
    """Ring-rate tables in ``directory``, one file per fingerprint; ``log`` gets one line per kind of trouble."""

    def __init__(self, directory: Path, log: Callable[[str], None]) -> None:
        self.directory = Path(os.path.abspath(directory))
        self.log = log
        self._said: set[str] = set()

    def path_of(self, fingerprint: str) -> Path:
        return self.directory / f"{fingerprint}.json"

    def load(self, fingerprint: str) -> bytes | None:
        path = self.path_of(fingerprint)
        if not os.path.lexists(path):
            return None
        try:
            trusted_files.check_trusted_file(path)
            return trusted_files.read_bytes(path, MAX_TABLE_BYTES)
        except (OSError, MapaError) as error:
            self._say_once("read", f"ring rates: ignoring the stored table {path} ({error}); computing it in this process")
            return None

    def save(self, fingerprint: str, data: bytes) -> None:
        path = self.path_of(fingerprint)
        try:
            trusted_files.ensure_trusted_dir(self.directory)
            trusted_files.replace_file(path, data, mode=0o644)
        except (OSError, MapaError) as error:
            self._say_once("write", f"ring rates: cannot store a table in {self.directory} ({error}); "
                                    "solving the ring rates in each process instead")

    def _say_once(self, kind: str, line: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            self.log(line)


def user_cache_dir(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """``$XDG_CACHE_HOME/slurm-mapa/ring-rates``, ``~/.cache/...`` where it is unset or not absolute (XDG's rule)."""
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slurm-mapa" / "ring-rates"


def _stderr_line(line: str) -> None:
    print(f"mapa: {line}", file=sys.stderr)


def use_directory(directory: Path, log: Callable[[str], None] = _stderr_line) -> DiskTables:
    """Keep this process's ring-rate tables in ``directory`` (again: the store in use stays, with what it read)."""
    from ..core.ring_rate_tables import current_store, use_store

    store = current_store()
    if isinstance(store, DiskTables) and store.directory == Path(os.path.abspath(directory)):
        return store
    store = DiskTables(directory, log)
    use_store(store)
    return store


def use_user_cache() -> DiskTables:
    """The commands' store (``mapa``, ``mapa-replay``): the user's cache directory."""
    return use_directory(user_cache_dir())


def prepare_table(graph: "HardwareGraph", directory: Path, log: Callable[[str], None] = _stderr_line) -> str | None:
    """Compute and store the ring-rate table of ``graph`` in ``directory`` where none ships or is
    stored already (``mapa hooks``, mapa-agent's start), so no decision on the node solves one;
    the line to show the admin, None where there was nothing to do."""
    from ..core.ring_packing import solved_per_orbit
    from ..core.ring_rate_tables import MAX_TABLE_SET, fingerprint, shipped_table, table_bytes, table_from_bytes

    if shipped_table(graph) is not None:
        return None
    if graph.size > MAX_TABLE_SET:
        return (f"ring rates: no table for the {graph.size} GPUs of {graph.name} (tables hold nodes of up to "
                f"{MAX_TABLE_SET}); each process solves the rates it needs, once per orbit")
    store = DiskTables(directory, log)
    key = fingerprint(graph)
    data = store.load(key)
    if data is not None and table_from_bytes(data, graph) is not None:
        return None
    store.save(key, table_bytes(graph, solved_per_orbit))
    data = store.load(key)
    if data is None or table_from_bytes(data, graph) is None:
        return f"ring rates: computed the table of {graph.name} but could not store it in {directory}: each process solves it"
    return f"ring rates: computed the table of {graph.name} (links match no preset) into {store.path_of(key)}"


__all__ = ["DiskTables", "MAX_TABLE_BYTES", "prepare_table", "use_directory", "use_user_cache", "user_cache_dir"]
