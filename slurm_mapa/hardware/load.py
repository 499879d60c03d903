"""Turn what an admin names on the command line (a preset or a file) into a hardware graph."""

from __future__ import annotations

from pathlib import Path

from ..core.hardware import HardwareGraph
from ..errors import InputError
from .presets import PRESETS, preset

MAX_TOPOLOGY_FILE_BYTES = 1 << 20


def load_topology(spec: str) -> HardwareGraph:
    """A preset name, a TOML topology file, or a saved `nvidia-smi topo -m` output."""
    if spec in PRESETS:
        return preset(spec)
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"topology {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a readable file")
    if path.stat().st_size > MAX_TOPOLOGY_FILE_BYTES:
        raise InputError(f"topology file {spec!r} is larger than {MAX_TOPOLOGY_FILE_BYTES} bytes")
    text = path.read_text(encoding="utf-8", errors="strict")
    if path.suffix == ".toml":
        from .topofile import graph_from_toml_text

        return graph_from_toml_text(text, source=str(path))
    from .nvidia_smi import parse_topo_matrix

    return parse_topo_matrix(text, source=str(path)).graph
