"""The replay configuration (TOML): node topologies, the cluster for generated workloads, site rules.

    [nodes]                      # node-name pattern (shell glob) -> preset name
    "n1" = "dgx1-v100"
    "gpu*" = "pcie-8"

    [cluster]                    # the nodes of a generated workload (name:topology)
    nodes = ["n1:dgx1-v100", "n2:torus2d-16"]

    [defaults]                   # what a job with no directive and no matching rule asks for
    topology = "ring"
    sensitive = false

    [[rules]]                    # site rules, first match wins: name, account, partition or user
    name = "^train-"             # (a regular expression) -> a directive
    directive = "topology=ring sensitive=yes"

    [preserve_ahead]             # as for the Prolog: the likely job sizes and the tolerance
    sizes = { 1 = 0.4, 2 = 0.3, 4 = 0.3 }
    tolerance = 0.0

    [affinity]                   # as for the Prolog: CPU affinity in the decision; the replay
    mode = "prefer"              # uses it unless --affinity is given (without either: ignore)
    max_loss = 0.1

    model = "/etc/slurm/mapa-model.toml"   # the hooks' effective-bandwidth model (a file or a
                                           # bundled name): the replay uses it too unless --model
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterable

from ..core.hardware import HardwareGraph
from ..core.patterns import SHAPES
from ..errors import InputError, toml_text
from ..hardware.load import load_topology
from ..hardware.presets import PRESETS
from .directives import SiteRule, make_rules
from .simulate import Node


@dataclass
class Config:
    node_topologies: list[tuple[str, str]] = field(default_factory=list)
    cluster: list[tuple[str, str]] = field(default_factory=list)
    rules: list[SiteRule] = field(default_factory=list)
    ahead_sizes: dict[int, float] | None = None
    ahead_tolerance: float = 0.0
    default_shape: str = "ring"
    default_sensitive: bool = False
    model: str | None = None  # the hooks' `model` key: a model file or a bundled model name
    affinity: tuple[str, float] | None = None  # [affinity] (mode, max_loss); None: not configured
    source_dir: str | None = None  # the config file's folder: a relative `model` path is looked up there too


def _unknown_words(data: dict, unknown: list[str]) -> str:
    """"unknown key 'polcy'", "unknown section 'clustr'" (a table), or both kinds, as TOML has them."""
    tables = [name for name in unknown if isinstance(data[name], dict)]
    kind = ("section" if len(tables) == len(unknown) else "key" if not tables else "key or section")
    plural = {"section": "sections", "key": "keys", "key or section": "keys or sections"}[kind] if len(unknown) > 1 else kind
    return f"unknown {plural} {', '.join(repr(name) for name in unknown)}"


def parse_config(text: str, source: str = "config") -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{source}: not valid TOML: {exc}") from None
    from ..slurm.config import HOOK_KEYS, _line_of_key, closest_key_hint, config_from_text

    unknown = sorted(set(data) - set(_SECTIONS) - HOOK_KEYS)
    if unknown:
        raise InputError(f"{source}: {_unknown_words(data, unknown)}{_line_of_key(text, unknown[0])}"
                         f"{closest_key_hint(unknown, set(_SECTIONS) | HOOK_KEYS)} "
                         f"(accepted: {', '.join(_SECTIONS)}, model, and the hooks' keys: "
                         f"{', '.join(sorted(HOOK_KEYS - set(_SECTIONS) - {'model'}))})")
    config = config_from_dict(data, source)
    if set(data) & HOOK_KEYS - {"nodes", "preserve_ahead", "affinity", "model"}:
        config_from_text(text, source)  # the hooks' mapa.toml: its keys are checked as `mapa hooks` checks them
    return config


def _topology_name(value: Any, where: str) -> str:
    """A preset name or a topology file (the hooks' /etc/slurm/mapa.toml may name either)."""
    if not isinstance(value, str) or (value not in PRESETS and not os.path.isfile(value)):
        raise InputError(f"{where}: unknown topology {value!r} (accepted: a topology file or a preset: {', '.join(PRESETS)})")
    return value


_SECTIONS = ("nodes", "cluster", "defaults", "rules", "preserve_ahead", "affinity")


def _table(data: dict, key: str, source: str, accepted: str) -> dict:
    """``[key]`` of the config, {} when absent; InputError when it is not a table of ``accepted``."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise InputError(f"{source}: [{key}] must be a table of {accepted}; got {toml_text(value)}")
    return value


def config_from_dict(data: dict, source: str = "config") -> Config:
    # The same file can configure the Slurm hooks (/etc/slurm/mapa.toml): their keys are theirs
    # (checked by `mapa hooks`), and ignored here except model, [preserve_ahead] and [affinity].
    from ..slurm.config import HOOK_KEYS

    unknown = set(data) - set(_SECTIONS) - HOOK_KEYS
    if unknown:
        raise InputError(f"{source}: {_unknown_words(data, sorted(unknown))} "
                         f"(accepted: {', '.join(_SECTIONS)}, model, and the hooks' keys: "
                         f"{', '.join(sorted(HOOK_KEYS - set(_SECTIONS) - {'model'}))})")
    config = Config()
    for pattern, topo in _table(data, "nodes", source, 'node-name globs to topologies, e.g. "gpu*" = "pcie-8"').items():
        config.node_topologies.append((pattern, _topology_name(topo, f"{source}: [nodes] {pattern!r}")))
    cluster = _table(data, "cluster", source, 'nodes = ["n1:dgx1-v100", ...]')
    if set(cluster) - {"nodes"} or not isinstance(cluster.get("nodes", []), list):
        raise InputError(f'{source}: [cluster] takes nodes = ["NAME:PRESET", ...], e.g. ["n1:dgx1-v100"]; got {toml_text(cluster)}')
    for entry in cluster.get("nodes", []):
        config.cluster.append(parse_node_spec(entry, f"{source}: [cluster]"))
    defaults = _table(data, "defaults", source, "topology = a pattern and sensitive = true or false")
    if set(defaults) - {"topology", "sensitive"}:
        raise InputError(f"{source}: [defaults] takes topology ({', '.join(SHAPES)}) and sensitive (true or false), "
                         f"got {', '.join(sorted(set(defaults) - {'topology', 'sensitive'}))}")
    shape = defaults.get("topology", "ring")
    if not isinstance(shape, str) or shape not in SHAPES:
        raise InputError(f"{source}: [defaults] topology {shape!r} (accepted: {', '.join(SHAPES)})")
    config.default_shape = shape
    sensitive = defaults.get("sensitive", False)
    if not isinstance(sensitive, bool):
        raise InputError(f"{source}: [defaults] sensitive must be true or false, got {toml_text(sensitive)}")
    config.default_sensitive = sensitive
    rules = data.get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
        raise InputError(f'{source}: rules must be [[rules]] tables, each one of name, account, partition or user '
                         f'(a regular expression) and a directive, e.g. name = "^train-" directive = "topology=ring"')
    try:
        config.rules = make_rules(rules)
    except InputError as error:
        raise InputError(f"{source}: {error}") from None
    model = data.get("model")
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            raise InputError(f"{source}: model must be a model file path or a bundled model name, got {toml_text(model)}")
        config.model = model.strip()
    from ..core.ahead import settings_from_table

    config.ahead_sizes, config.ahead_tolerance = settings_from_table(data.get("preserve_ahead"), source)
    if "affinity" in data:
        from ..core.affinity import settings_from_table as affinity_settings

        config.affinity = affinity_settings(data["affinity"], source)
    return config


def parse_node_spec(text: str, where: str = "--cluster") -> tuple[str, str]:
    """``name:preset`` or ``COUNTxpreset`` handled by :func:`expand_cluster`."""
    if not isinstance(text, str) or ":" not in text:
        raise InputError(f"{where}: node {text!r} (accepted: NAME:PRESET, e.g. n1:dgx1-v100)")
    name, topo = text.split(":", 1)
    return name.strip(), _topology_name(topo.strip(), where)


def expand_cluster(spec: str) -> list[tuple[str, str]]:
    """``2xdgx1-v100,1xtorus2d-16`` or ``n1:dgx1-v100,n2:pcie-8`` -> [(name, preset)]."""
    out: list[tuple[str, str]] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if ":" in part:
            out.append(parse_node_spec(part))
            continue
        count, sep, topo = part.partition("x")
        if not sep or not count.isdigit():
            raise InputError(f"--cluster part {part!r} (accepted: COUNTxPRESET such as 2xdgx1-v100, or NAME:PRESET)")
        _topology_name(topo, "--cluster")
        for _ in range(int(count)):
            out.append((f"node{len(out) + 1}", topo))
    if not out:
        raise InputError("--cluster is empty (accepted: COUNTxPRESET or NAME:PRESET, comma-separated)")
    return out


_GRAPHS: dict[str, HardwareGraph] = {}


def graph_of(name: str) -> HardwareGraph:
    if name not in _GRAPHS:
        _GRAPHS[name] = load_topology(name)
    return _GRAPHS[name]


def nodes_for(names: Iterable[str], config: Config, topology: str | None) -> list[Node]:
    """Nodes named in a log, each with the topology of ``--topology`` or the first matching pattern."""
    out = []
    missing = []
    for name in names:
        topo = topology
        if topo is None:
            topo = next((t for pattern, t in config.node_topologies if fnmatchcase(name, pattern)), None)
        if topo is None:
            missing.append(name)
            continue
        out.append(Node(name, graph_of(topo)))
    if missing:
        raise InputError(
            f"no topology for node(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: "
            "give --topology PRESET for all nodes or map them in the config's [nodes] section"
        )
    return out
