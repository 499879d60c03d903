"""Is MAPA's SPANK plugin one the running Slurm will load?

A SPANK plugin carries ``plugin_version``, the SLURM_VERSION_NUMBER (0xMMmmuu) of the headers it
was compiled against (the ``SPANK_PLUGIN`` macro, slurm/spank.h). slurmstepd loads it only if its
major.minor is the running Slurm's (``_verify_syms``, src/common/plugin.c, since 21.08); otherwise
it logs ``Incompatible Slurm plugin ... version`` at info level and, for an ``optional`` line of
plugstack.conf, goes on without it. So after a Slurm upgrade without a rebuild the root-side
isolation trigger disappears without a word. These functions say so instead.

Everything but the last three functions is pure: the ELF reader, the parsers and the messages take
bytes and text. ``check_installed_spank_plugins`` and ``check_this_node`` read the files (bounded),
``running_slurm_version_text`` asks Slurm's commands.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .. import trusted_files as trusted

MAX_PLUGIN_BYTES = 16 << 20
MAX_CONF_BYTES = 1 << 20
MAX_CONF_FILES = 64  # plugstack.conf and what its include lines name, in all
VERSION_TIMEOUT_S = 5.0
VERSION_COMMANDS = (("slurmd", "-V"), ("scontrol", "-V"), ("sinfo", "-V"))
MAPA_PLUGIN_PREFIX = "spank_mapa"
SLURM_MAJOR_MINOR = 0xFFFF00  # what slurmstepd compares for a SPANK plugin

_SHT_SYMTAB, _SHT_DYNSYM, _SHT_NOBITS = 2, 11, 8
_STT_OBJECT = 1
_SHN_LORESERVE = 0xFF00


# --- the ELF reader -------------------------------------------------------------------------------
def _unpack(fmt: str, data: bytes, offset: int) -> tuple[int, ...] | None:
    """The fields of ``fmt`` at ``offset``, or None when they do not lie wholly inside ``data``."""
    if offset < 0 or offset + struct.calcsize(fmt) > len(data):
        return None
    return struct.unpack_from(fmt, data, offset)


def _inside(data: bytes, offset: int, size: int) -> bool:
    return 0 <= offset and 0 <= size and offset + size <= len(data)


def elf_u32_symbol(data: bytes, name: str) -> int | None:
    """The 4-byte unsigned value of the defined data symbol ``name`` of an ELF file (32 or 64 bit,
    either byte order), looked up in .dynsym (what dlsym sees) and else in .symtab; None when the
    data is no ELF file, has no such symbol, or any offset or size points outside it."""
    if len(data) < 16 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    wide = data[4] == 2
    order = "<" if data[5] == 1 else ">"
    header = _unpack(order + ("40xQ10xHHH" if wide else "32xI10xHHH"), data, 0)
    if header is None:
        return None
    section_table, entry_size, count, _ = header
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    section_fmt = order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII")
    if count == 0 or entry_size != struct.calcsize(section_fmt) or not _inside(data, section_table, count * entry_size):
        return None  # 0 sections: none, or more than 0xff00 (extended numbering), which no plugin has
    sections = [struct.unpack_from(section_fmt, data, section_table + i * entry_size) for i in range(count)]
    wanted = name.encode()
    for table_type in (_SHT_DYNSYM, _SHT_SYMTAB):
        for _, kind, _, _, offset, size, link, _, _, sym_size in sections:
            if kind != table_type:
                continue
            value = _symbol_value(data, order, wide, sections, offset, size, link, sym_size, wanted)
            if value is not None:
                return value
    return None


def _symbol_value(data: bytes, order: str, wide: bool, sections: list[tuple[int, ...]], offset: int, size: int,
                  link: int, sym_size: int, wanted: bytes) -> int | None:
    """The value of ``wanted`` in one symbol table (at ``offset``, ``size`` bytes, names in section ``link``)."""
    # Symbol: 64-bit name, info, other, shndx, value, size; 32-bit name, value, size, info, other, shndx.
    sym_fmt = order + ("IBBHQQ" if wide else "IIIBBH")
    if sym_size != struct.calcsize(sym_fmt) or not _inside(data, offset, size) or not 0 <= link < len(sections):
        return None
    names = sections[link]
    names_start, names_end = names[4], names[4] + names[5]
    if names[1] == _SHT_NOBITS or not _inside(data, names_start, names[5]):
        return None
    for start in range(offset, offset + size - sym_size + 1, sym_size):
        fields = struct.unpack_from(sym_fmt, data, start)
        if wide:
            name_at, info, _, holder, address, length = fields
        else:
            name_at, address, length, info, _, holder = fields
        name_start = names_start + name_at
        if (info & 0xF) != _STT_OBJECT or not 0 < holder < min(len(sections), _SHN_LORESERVE) or name_start >= names_end:
            continue
        name_end = data.find(b"\0", name_start, names_end)
        if name_end < 0 or data[name_start:name_end] != wanted:
            continue
        if 0 < length < 4:
            return None  # the symbol is smaller than the 4 bytes asked for
        # The address lies in the section that holds the symbol (for a relocatable object its
        # address is 0 and the value an offset into it): file offset = section offset + distance.
        _, kind, _, section_address, section_offset, section_size, *_ = sections[holder]
        distance = address - section_address
        if kind == _SHT_NOBITS or distance < 0 or distance + 4 > section_size:
            return None
        value = _unpack(order + "I", data, section_offset + distance)
        return None if value is None else value[0]
    return None


# --- versions, plugstack.conf, slurm.conf ---------------------------------------------------------
_VERSION_LINE = re.compile(r"\s*slurm(?:-[a-z]+)?\s+(\d{1,3})\.(\d{1,2})\.(\d{1,3})(?:-\S*)?\s*")


def parse_slurm_version(text: str) -> int | None:
    """SLURM_VERSION_NUMBER of ``slurmd -V``'s first line: ``slurm 24.11.5``, Debian's
    ``slurm-wlm 26.05.5``, a release candidate's ``slurm 25.11.0-0rc1``; None otherwise."""
    match = _VERSION_LINE.fullmatch(text.split("\n", 1)[0])
    if match is None:
        return None
    major, minor, micro = (int(part) for part in match.groups())
    if max(major, minor, micro) > 0xFF:
        return None
    return major << 16 | minor << 8 | micro


def version_text(number: int) -> str:
    """26.05.5 for 0x1a0505, as Slurm prints it (``%d.%02d.%d``)."""
    return f"{number >> 16 & 0xFF}.{number >> 8 & 0xFF:02d}.{number & 0xFF}"


def release_text(number: int) -> str:
    """26.05 for 0x1a0505: the major.minor that decides whether a SPANK plugin loads."""
    return version_text(number).rsplit(".", 1)[0]


def _plugstack_words(text: str) -> list[list[str]]:
    # As Slurm's _plugin_stack_parse_line (src/common/spank.c): "#" starts a comment anywhere,
    # words are separated by blanks and tabs only.
    lines = text.split("\n")
    return [words for words in (re.split(r"[ \t]+", line.split("#", 1)[0].strip(" \t")) for line in lines) if words != [""]]


def plugstack_plugins(text: str) -> list[tuple[str, str]]:
    """(required|optional, path) of each plugin line of a plugstack.conf; arguments after the path,
    comments, blank lines, include lines and lines Slurm would reject are left out."""
    return [(words[0], words[1]) for words in _plugstack_words(text) if words[0] in ("required", "optional") and len(words) > 1]


def plugstack_includes(text: str) -> list[str]:
    """The glob patterns of a plugstack.conf's ``include`` lines."""
    return [words[1] for words in _plugstack_words(text) if words[0] == "include" and len(words) > 1]


def slurm_conf_value(text: str, key: str) -> str | None:
    """The value of ``key`` (case-insensitive, as Slurm reads keys) on the last line setting it."""
    found = None
    for line in text.split("\n"):
        match = re.fullmatch(r"\s*([A-Za-z]+)\s*=\s*(\"[^\"]*\"|\S+)\s*", line.split("#", 1)[0])
        if match and match.group(1).lower() == key.lower():
            found = match.group(2).strip('"')
    return found


def plugstack_conf_path(slurm_conf_text: str | None, slurm_conf: Path) -> Path:
    """Where slurmstepd reads plugstack.conf: slurm.conf's PlugStackConfig=, else next to slurm.conf."""
    configured = slurm_conf_value(slurm_conf_text, "PlugStackConfig") if slurm_conf_text else None
    return slurm_conf.parent / (configured or "plugstack.conf")  # an absolute value replaces the directory


def spank_settings(slurm_conf_text: str | None, slurm_conf: Path) -> tuple[Path, str]:
    """(plugstack.conf's path, slurm.conf's PluginDir or "") of the slurm.conf at ``slurm_conf``."""
    plugin_dirs = (slurm_conf_value(slurm_conf_text, "PluginDir") if slurm_conf_text else None) or ""
    return plugstack_conf_path(slurm_conf_text, slurm_conf), plugin_dirs


# --- the messages ---------------------------------------------------------------------------------
def _rebuild(path: str) -> str:
    return (f"run `mapa spank-plugin {path}` again on this node after every Slurm upgrade; "
            "without it tasks get no root-side GPU isolation (docs/isolation.md, \"After a Slurm upgrade\")")


def spank_plugin_problem(plugin_bytes: bytes | None, plugin_path: str, running: int | None) -> str | None:
    """None when the running Slurm (SLURM_VERSION_NUMBER ``running``) loads the plugin whose file
    holds ``plugin_bytes`` (None: missing or unreadable); else one line saying why not and what to do.
    With ``running`` None (no Slurm command answered) the line says the check could not be made."""
    if plugin_bytes is None:
        return f"SPANK plugin {plugin_path} does not exist or cannot be read, so slurmstepd cannot load it: {_rebuild(plugin_path)}"
    built = elf_u32_symbol(plugin_bytes, "plugin_version")
    if built is None:
        return (f"SPANK plugin {plugin_path} is no plugin Slurm can load (no ELF shared object with a plugin_version "
                f"symbol): {_rebuild(plugin_path)}")
    if running is None:
        return (f"could not check SPANK plugin {plugin_path} (built for Slurm {release_text(built)}) against the running "
                f"Slurm (none of slurmd, scontrol, sinfo answered -V): slurmstepd loads it only if it runs Slurm "
                f"{release_text(built)}; if not, {_rebuild(plugin_path)}")
    if built & SLURM_MAJOR_MINOR != running & SLURM_MAJOR_MINOR:
        return (f"SPANK plugin {plugin_path} was built for Slurm {release_text(built)} ({version_text(built)}) but this node "
                f"runs Slurm {version_text(running)}: slurmstepd will not load it (\"Incompatible Slurm plugin\", "
                f"logged at info level only); {_rebuild(plugin_path)}")
    return None


# --- the edge: files and commands -----------------------------------------------------------------
def _read_at_most(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file, symlinks followed as dlopen follows them."""
    return trusted.read_bytes(path, limit, follow_symlinks=True)[:limit]


def _plugin_lines(plugstack: Path) -> list[tuple[str, str, Path]]:
    """(kind, path, file it is in) of every plugin line of ``plugstack`` and of the files its include
    lines name (a relative pattern is relative to the including file's directory, as in Slurm's
    _spank_conf_include)."""
    found: list[tuple[str, str, Path]] = []
    pending, read = [plugstack], 0
    while pending and read < MAX_CONF_FILES:
        current = pending.pop(0)
        read += 1
        try:
            text = _read_at_most(current, MAX_CONF_BYTES).decode(errors="replace")
        except OSError:
            continue  # slurmstepd takes a missing plugstack.conf for an empty one
        found += [(kind, path, current) for kind, path in plugstack_plugins(text)]
        for pattern in plugstack_includes(text):
            pending += [Path(p) for p in sorted(glob.glob(str(current.parent / pattern)))]
    return found


@dataclass(frozen=True)
class InstalledPlugin:
    """One of MAPA's plugin lines of plugstack.conf, with the plugin it names."""

    kind: str  # required | optional
    path: str  # as found through slurm.conf's PluginDir when the line names no directory
    conf: Path  # the plugstack file with the line
    data: bytes | None  # the plugin's first MAX_PLUGIN_BYTES bytes; None when it cannot be read


def installed_mapa_plugins(plugstack: Path, plugin_dirs: str = "") -> list[InstalledPlugin]:
    """MAPA's SPANK plugins that ``plugstack`` configures, each read once; none configured, or no
    plugstack.conf, is an empty list. ``plugin_dirs``: slurm.conf's PluginDir, where Slurm looks
    for a plugin named without a directory."""
    plugins = []
    for kind, path, conf in _plugin_lines(plugstack):
        if not os.path.basename(path).startswith(MAPA_PLUGIN_PREFIX):
            continue
        candidates = [Path(path)] if path.startswith("/") else [Path(d) / path for d in plugin_dirs.split(":") if d]
        data = None
        for candidate in candidates:
            try:
                data = _read_at_most(candidate, MAX_PLUGIN_BYTES)
                path = str(candidate)
                break
            except OSError:
                continue
        plugins.append(InstalledPlugin(kind, path, conf, data))
    return plugins


def installed_plugin_problems(plugins: list[InstalledPlugin], running: int | None) -> list[str]:
    """One line for each plugin the running Slurm (SLURM_VERSION_NUMBER ``running``) would not load."""
    problems = []
    for plugin in plugins:
        problem = spank_plugin_problem(plugin.data, plugin.path, running)
        if problem:
            # A required plugin slurmstepd cannot load fails every step; an optional one is skipped.
            consequence = ("every job step on this node fails" if plugin.kind == "required"
                           else "slurmstepd skips it without an error")
            problems.append(f"{problem} ({plugin.kind} in {plugin.conf}: {consequence})")
    return problems


def check_installed_spank_plugins(plugstack: Path, running_version_text: Callable[[], str | None],
                                  plugin_dirs: str = "") -> list[str]:
    """The problems (one line each) of MAPA's SPANK plugins that ``plugstack`` configures; none
    configured, or no plugstack.conf, is no problem (and no Slurm command is run)."""
    plugins = installed_mapa_plugins(plugstack, plugin_dirs)
    if not plugins:
        return []
    answer = running_version_text()
    return installed_plugin_problems(plugins, parse_slurm_version(answer) if answer else None)


def running_slurm_version_text() -> str | None:
    """What ``slurmd -V`` (else ``scontrol -V``, ``sinfo -V``) prints, or None if none answers."""
    for command, flag in VERSION_COMMANDS:
        # A service's or sudo's PATH may lack sbin, where slurmd lives.
        fallbacks = (f"/usr/sbin/{command}", f"/usr/bin/{command}")
        program = shutil.which(command) or next((p for p in fallbacks if os.access(p, os.X_OK)), None)
        if program is None:
            continue
        try:
            done = subprocess.run([program, flag], capture_output=True, timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            continue
        text = done.stdout[:4096].decode(errors="replace")
        if done.returncode == 0 and parse_slurm_version(text) is not None:
            return text
    return None


def check_this_node(environ: Mapping[str, str],
                    running_version_text: Callable[[], str | None] = running_slurm_version_text) -> list[str]:
    """The problems of MAPA's SPANK plugins in the plugstack.conf of this node's slurm.conf
    ($SLURM_CONF, else /etc/slurm/slurm.conf)."""
    slurm_conf = Path(environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    try:
        text: str | None = _read_at_most(slurm_conf, MAX_CONF_BYTES).decode(errors="replace")
    except OSError:
        text = None
    plugstack, plugin_dirs = spank_settings(text, slurm_conf)
    return check_installed_spank_plugins(plugstack, running_version_text, plugin_dirs)
