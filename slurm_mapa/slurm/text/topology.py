"""Slurm's block topology as written in topology.conf or topology.yaml (issue 51), pure text in, blocks out.

topology.conf (https://slurm.schedmd.com/topology.conf.html, section topology/block): one
``BlockName=NAME Nodes=HOSTLIST`` line per block and an optional ``BlockSizes=N[,N...]`` line (the
planning base block size, then the larger levels to enforce, each a power of two times the one
before). Parameter names are case-insensitive; ``#`` starts a comment.

topology.yaml (Slurm 25.05 and later, https://slurm.schedmd.com/topology.yaml.html; when it
exists topology.conf is ignored): a list of topologies, each ``topology: NAME`` first, optionally
``cluster_default: true``, and for a block topology ``block:`` with ``block_sizes:`` (a list) and
``blocks:`` (a list of ``block: NAME`` / ``nodes: HOSTLIST``). This reader knows that subset,
written in block style or with ``[a, b]`` flow lists; it takes the cluster default block topology,
else the first block topology, or the one named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import InputError


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list syntax: ``nvl1-[01-18],gb7`` -> the names, zero padding kept."""
    names: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text.strip()):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            names.append(part)
            continue
        head, tail = part[:match.start()], part[match.end():]
        for item in match.group(1).split(","):
            low, sep, high = item.partition("-")
            if sep and low.isdigit() and high.isdigit() and int(high) - int(low) < 4096:
                middles = [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
            else:
                middles = [item]
            names += [head + middle + rest for middle in middles for rest in (expand_hostlist(tail) if tail else [""])]
    return names


@dataclass(frozen=True)
class BlockTopology:
    """The blocks in file order, each (name, node names), and BlockSizes (empty when not given)."""

    blocks: tuple[tuple[str, tuple[str, ...]], ...]
    block_sizes: tuple[int, ...] = ()

    def domain_of(self) -> dict[str, int]:
        """Node name -> the index of its block."""
        return {node: i for i, (_, nodes) in enumerate(self.blocks) for node in nodes}


def _sizes(text: str, where: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.strip().strip("[]").split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"{where}: BlockSizes {text.strip()!r} (accepted: node counts of 1 or more, comma-separated)")
    sizes = tuple(int(p) for p in parts)
    for low, high in zip(sizes, sizes[1:]):
        ratio = high // low
        if high % low or ratio < 2 or ratio & (ratio - 1):
            raise InputError(f"{where}: BlockSizes {','.join(map(str, sizes))}: each size must be a power of two "
                             f"larger than the one before (topology.conf(5))")
    return sizes


def _check(blocks: list[tuple[str, tuple[str, ...]]], sizes: tuple[int, ...], where: str) -> BlockTopology:
    if not blocks:
        raise InputError(f"{where}: no blocks (accepted: BlockName=NAME Nodes=HOSTLIST lines, or a topology.yaml block topology)")
    seen: dict[str, str] = {}
    for name, nodes in blocks:
        if not nodes:
            raise InputError(f"{where}: block {name} has no nodes")
        for node in nodes:
            if node in seen:
                raise InputError(f"{where}: node {node} is in blocks {seen[node]} and {name}")
            seen[node] = name
    return BlockTopology(tuple(blocks), sizes)


def parse_topology_conf(text: str, where: str = "topology.conf") -> BlockTopology:
    """The block topology of a topology.conf text; InputError when it has none or a line is malformed."""
    blocks: list[tuple[str, tuple[str, ...]]] = []
    sizes: tuple[int, ...] = ()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep:
                raise InputError(f"{where} line {number}: {token!r} is not KEY=VALUE")
            fields[key.lower()] = value
        if "blockname" in fields:
            if "nodes" not in fields:
                raise InputError(f"{where} line {number}: BlockName={fields['blockname']} has no Nodes=")
            blocks.append((fields["blockname"], tuple(expand_hostlist(fields["nodes"]))))
        elif "blocksizes" in fields:
            sizes = _sizes(fields["blocksizes"], f"{where} line {number}")
        elif "switchname" in fields:
            raise InputError(f"{where} line {number}: SwitchName is topology/tree; MAPA's domains come from "
                             "topology/block (BlockName=NAME Nodes=HOSTLIST)")
    return _check(blocks, sizes, where)


_ITEM = re.compile(r"^(\s*)(-\s+)?([A-Za-z_]+)\s*:\s*(.*)$")


def parse_topology_yaml(text: str, where: str = "topology.yaml", name: str | None = None) -> BlockTopology:
    """The block topology of a topology.yaml text (the subset described above)."""
    topologies: list[dict] = []
    current: dict | None = None
    in_sizes = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        bare = re.match(r"^\s*-\s+([0-9]+)\s*$", line)
        if bare and in_sizes and current is not None:
            current["sizes"].append(int(bare.group(1)))
            continue
        match = _ITEM.match(line)
        if not match:
            raise InputError(f"{where} line {number}: {line.strip()!r} is not a key: value line of a block topology")
        key, value = match.group(3).lower(), match.group(4).strip().strip("'\"")
        in_sizes = False
        if key == "topology":
            current = {"name": value, "default": False, "block": False, "sizes": [], "blocks": []}
            topologies.append(current)
        elif current is None:
            raise InputError(f"{where} line {number}: {key} before the first 'topology:'")
        elif key == "cluster_default":
            current["default"] = value.lower() == "true"
        elif key == "block" and not value:
            current["block"] = True
        elif key == "block_sizes":
            in_sizes = True
            if value:
                current["sizes"] = list(_sizes(value, f"{where} line {number}"))
        elif key == "block":
            current["blocks"].append([value, ()])
        elif key == "nodes":
            if not current["blocks"]:
                raise InputError(f"{where} line {number}: nodes: outside a block")
            current["blocks"][-1][1] = tuple(expand_hostlist(value))
    blocky = [t for t in topologies if t["block"]]
    if name is not None:
        chosen = next((t for t in blocky if t["name"] == name), None)
        if chosen is None:
            raise InputError(f"{where}: no block topology named {name!r} (found: {', '.join(t['name'] for t in blocky) or 'none'})")
    else:
        chosen = next((t for t in blocky if t["default"]), blocky[0] if blocky else None)
    if chosen is None:
        raise InputError(f"{where}: no block topology (accepted: a topology with block: block_sizes: and blocks:)")
    sizes = _sizes(",".join(map(str, chosen["sizes"])), where) if chosen["sizes"] else ()
    return _check([(b, tuple(nodes)) for b, nodes in chosen["blocks"]], sizes, where)


def parse_block_topology(text: str, where: str) -> BlockTopology:
    """topology.yaml when ``where`` ends in .yaml/.yml or the text starts a YAML list, else topology.conf."""
    first = next((line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")), "")
    if where.endswith((".yaml", ".yml")) or first.startswith("-"):
        return parse_topology_yaml(text, where)
    return parse_topology_conf(text, where)
