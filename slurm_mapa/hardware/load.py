"""Turn what an admin names on the command line (a preset or a file) into a hardware graph."""

from __future__ import annotations

import difflib
from pathlib import Path

from ..core.effbw import EffectiveBandwidthModel
from ..core.model_files import bundled_model, load_model
from ..core.server_models import matching_model
from ..core.hardware import HardwareGraph
from ..errors import InputError
from ..textfile import read_text
from .presets import PRESET_MODELS, PRESETS, preset
from .topofile import Topology, topology_from_toml_text

MAX_TOPOLOGY_FILE_BYTES = 1 << 20


def topology_from_text(text: str, *, source: str) -> Topology:
    """A saved tool output, its format detected: ``rocm-smi --showtopo [--shownodesbw]`` or
    ``amd-smi topology`` (by their section titles), else ``nvidia-smi topo -m``."""
    from .rocm_smi import detect_amd_tool, parse_amd_topology

    if detect_amd_tool(text):
        amd = parse_amd_topology(text, source=source)
        return Topology(graph=amd.graph, pci_bus_ids=amd.pci_bus_ids, vendor="amd", notes=amd.notes)
    from .nvidia_smi import parse_topo_matrix

    smi = parse_topo_matrix(text, source=source)
    return Topology(graph=smi.graph, vendor="nvidia", notes=smi.notes)


def unknown_topology(spec: str) -> InputError:
    """The one message for a topology that is neither a preset nor a file, from every command
    (``mapa select``, ``mapa topo show``, ``mapa-replay --topology``, ...)."""
    close = difflib.get_close_matches(spec, PRESETS, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return InputError(f"topology {spec!r}{hint} is neither a preset ({', '.join(PRESETS)}) nor a readable file")


def load_topology_file(spec: str) -> Topology:
    """A preset name, a TOML topology file, or a saved `nvidia-smi topo -m`, `rocm-smi --showtopo`
    or `amd-smi topology` output, with its GPU facts."""
    if spec in PRESETS:
        return Topology(graph=preset(spec))
    path = Path(spec)
    if not path.is_file():
        raise unknown_topology(spec)
    text = read_text(spec, what="topology file", max_bytes=MAX_TOPOLOGY_FILE_BYTES,
                     accepted=f"a preset ({', '.join(PRESETS)}), a TOML topology file (docs/hardware.md) or a saved "
                              "`nvidia-smi topo -m`, `rocm-smi --showtopo --shownodesbw` or `amd-smi topology` text (UTF-8)")
    if path.suffix == ".toml":
        return topology_from_toml_text(text, source=str(path))
    return topology_from_text(text, source=str(path))


def load_topology(spec: str) -> HardwareGraph:
    """The hardware graph of a preset name, a TOML topology file, or a saved tool output (see
    :func:`topology_from_text`)."""
    return load_topology_file(spec).graph


AUTO_MODEL = "auto"  # the model follows the topology (config `model`, `[models]`; `--model auto`)


def model_for_topology(graph: HardwareGraph) -> EffectiveBandwidthModel:
    """The model that prices ``graph``: a preset's own (PRESET_MODELS) when the graph is that preset,
    else the bundled model fitted on its link classes at its bandwidths (its GPUs' link generation),
    else one derived from its links (core.server_models.matching_model)."""
    name = PRESET_MODELS.get(graph.name)
    if name is not None and graph == preset(graph.name):
        return bundled_model(name)
    return matching_model(graph)


def resolve_model(spec: str | None, graph: HardwareGraph) -> EffectiveBandwidthModel:
    """``spec`` (a model file, a bundled model's name, or ""/None/"auto": the topology's own) for ``graph``."""
    if not spec or spec == AUTO_MODEL:
        return model_for_topology(graph)
    return load_model(spec)
