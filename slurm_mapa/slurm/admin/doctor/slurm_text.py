"""Pure parsers of what Slurm prints or reads, as far as mapa doctor needs them: `scontrol show
config`, `scontrol show node`, gres.conf, hostlists and the hook wrappers' scripts."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

_SHOW_CONFIG_LINE = re.compile(r"([A-Za-z][A-Za-z0-9_]*(?:\[\d+\])?)\s*=\s?(.*)")


def parse_show_config(text: str) -> dict[str, str]:
    """``Key = value`` lines of `scontrol show config` (printed ``%-23s = %s``, src/api/config_info.c);
    the first occurrence of a key wins (the cgroup.conf section follows slurm.conf's keys)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _SHOW_CONFIG_LINE.fullmatch(line.strip())
        if match and match.group(1) not in values:
            values[match.group(1)] = match.group(2).strip()
    return values


def slurm_values(conf: Mapping[str, str], key: str) -> list[str]:
    """The values of ``key``: ``Prolog[0]``, ``Prolog[1]``... in order (24.11 and 26.05 print the
    hooks so), else plain ``Prolog``; unset ones (``(null)``) left out."""
    indexed = []
    for name, value in conf.items():
        match = re.fullmatch(re.escape(key) + r"\[(\d+)\]", name)
        if match:
            indexed.append((int(match.group(1)), value))
    values = [value for _, value in sorted(indexed)] or ([conf[key]] if key in conf else [])
    return [value for value in values if value not in ("", "(null)")]


def flag_list(value: str | None) -> list[str]:
    if value is None or value in ("", "(null)"):
        return []
    return [part.strip() for part in value.split(",") if part.strip()]


def is_yes(value: str | None) -> bool:
    return (value or "").strip().lower() in ("yes", "true", "1", "y")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list syntax: ``dgx[1-3,5],gpu07`` -> the names (zero padding kept)."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    names: list[str] = []
    for part in filter(None, parts):
        names += _expand_brackets(part)
    return names


def _expand_brackets(text: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", text)
    if match is None:
        return [text]
    head, tail = text[:match.start()], text[match.end():]
    names = []
    for item in match.group(1).split(","):
        bounds = item.split("-")
        if len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit() and int(bounds[1]) - int(bounds[0]) < 4096:
            width = len(bounds[0])
            middles = [str(n).zfill(width) for n in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            middles = [item]
        for middle in middles:
            names += [head + middle + rest for rest in _expand_brackets(tail)]
    return names


@dataclass(frozen=True)
class GresLine:
    files: tuple[str, ...]
    cores: str | None
    links: str | None
    count: str | None
    line: int


def gres_gpu_lines(text: str, node: str) -> tuple[list[GresLine], list[str]]:
    """The ``Name=gpu`` lines of gres.conf that apply to ``node`` (no NodeName=, or one naming it),
    with their File= lists expanded; and the AutoDetect= values that apply."""
    lines, autodetect = [], []
    for number, raw in enumerate(text.splitlines(), start=1):
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        fields = {}
        for token in body.split():
            key, _, value = token.partition("=")
            fields[key.lower()] = value
        if "nodename" in fields and node not in expand_hostlist(fields["nodename"]):
            continue
        if "autodetect" in fields:
            autodetect.append(fields["autodetect"])
        if fields.get("name", "").lower() != "gpu":
            continue
        files = tuple(expand_hostlist(fields["file"])) if fields.get("file") else ()
        lines.append(GresLine(files, fields.get("cores"), fields.get("links"), fields.get("count"), number))
    return lines, autodetect


def node_field(text: str, key: str) -> str | None:
    """``Key=value`` of `scontrol --oneliner show node` (the first such token)."""
    for token in text.split():
        if token.startswith(key + "="):
            return token[len(key) + 1:]
    return None


def node_gpu_count(text: str) -> int | None:
    """GPUs of the node's ``Gres=`` (``gpu:8``, ``gpu:v100:8(S:0-1)``), None when it names none."""
    gres = node_field(text, "Gres")
    if not gres or gres == "(null)":
        return None
    total, seen = 0, False
    for part in re.split(r",(?![^(]*\))", gres):
        match = re.fullmatch(r"gpu(?::[^:(]+)?:(\d+)(?:\(.*\))?", part.strip())
        if match:
            total, seen = total + int(match.group(1)), True
    return total if seen else None


def script_value(text: str, name: str) -> str | None:
    """A ``NAME=value`` assignment line of a hook script (the value shell-unquoted)."""
    match = re.search(rf"^{name}=(.*)$", text, re.MULTILINE)
    if match is None:
        return None
    try:
        words = shlex.split(match.group(1))
    except ValueError:
        return match.group(1)
    return words[0] if words else ""


def wrapper_client(text: str) -> str | None:
    """The compiled client of mapa-agent a wrapper runs (``mapa hooks`` built it), if it runs one."""
    for line in text.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if len(words) >= 2 and words[0].endswith("/mapa-hook-client") and words[1] in ("prolog", "epilog"):
            return words[0]
    return None


def wrapper_program(text: str) -> tuple[str, str] | None:
    """(python, package directory) of a wrapper `mapa hooks` wrote: its agent client line (the
    client's path as this release writes it, or as 0.1.0 did: ``slurm_mapa/slurm/agent_client.py``),
    else (a wrapper with the compiled client) its in-process line."""
    if wrapper_client(text) is not None:
        for line in text.splitlines():
            match = re.match(r"""^(/\S+) -I(?: -X pycache_prefix=\S+)? -c 'import sys; sys\.path\.insert\(0, "([^"]+)"\)""", line)
            if match:
                return match.group(1), str(Path(match.group(2)) / "slurm_mapa")
    for line in text.splitlines():
        if "-S" not in line or "client.py" not in line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            return None
        for word in words:
            for tail, depth in (("/slurm_mapa/slurm/agent/client.py", 3), ("/slurm_mapa/slurm/agent_client.py", 2)):
                if word.endswith(tail) and words:
                    return words[0], str(Path(word).parents[depth - 1])
    return None


