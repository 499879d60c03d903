"""Is MAPA's SPANK plugin one the running Slurm loads? The plugin compiled against this host's
Slurm headers (scripts/test installs gcc and libslurm-dev) and read back, copies of it patched to
other releases, hand-made ELF files of both classes and byte orders, the parsers on literal text,
and the three places that report a mismatch: `mapa spank-plugin`, `mapa hooks` and mapa-agent."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.slurm.isolation import spank_plugin as spankcheck
from slurm_mapa.slurm.admin.install import SPANK_SOURCE, spank_build_argv
from slurm_mapa.slurm.isolation.spank_plugin import (
    check_installed_spank_plugins,
    elf_u32_symbol,
    parse_slurm_version,
    plugstack_conf_path,
    plugstack_includes,
    plugstack_plugins,
    slurm_conf_value,
    spank_plugin_problem,
    version_text,
)

SLURM_VERSION_H = Path("/usr/include/slurm/slurm_version.h")


def _headers_version() -> int:
    if not SLURM_VERSION_H.exists():
        pytest.fail("the Slurm headers are missing: apt-get install -y libslurm-dev (scripts/test does)")
    match = re.search(r"^#define SLURM_VERSION_NUMBER (0x[0-9a-fA-F]+)$", SLURM_VERSION_H.read_text(), re.M)
    assert match, f"no SLURM_VERSION_NUMBER in {SLURM_VERSION_H}"
    return int(match.group(1), 16)


def _another_release(version: int) -> int:
    """A release whose slurmstepd would not load a plugin of ``version``."""
    return 0x1A0505 if version & 0xFFFF00 != 0x1A0500 else 0x180B05


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    """The bundled plugin compiled as `mapa spank-plugin` compiles it, against the host's headers."""
    _headers_version()
    built = tmp_path_factory.mktemp("spank") / "spank_mapa_isolate.so"
    done = subprocess.run(spank_build_argv("cc", SPANK_SOURCE, built), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return built


def _patched(plugin: Path, target: Path, version: int) -> Path:
    """A copy of ``plugin`` whose plugin_version says ``version``; the 4 bytes are found by their
    value, not by the reader under test."""
    data = plugin.read_bytes()
    headers = _headers_version().to_bytes(4, sys.byteorder)
    assert data.count(headers) == 1, "the headers' version should occur once in the plugin, as plugin_version"
    target.write_bytes(data.replace(headers, version.to_bytes(4, sys.byteorder)))
    return target


# --- the real plugin ------------------------------------------------------------------------------
def test_the_built_plugin_says_the_release_of_the_headers_it_was_compiled_against(plugin):
    data = plugin.read_bytes()
    assert elf_u32_symbol(data, "plugin_version") == _headers_version()
    assert elf_u32_symbol(data, "spank_plugin_version") == 1  # SPANK_PLUGIN(mapa_isolate, 1)
    assert elf_u32_symbol(data, "no_such_symbol") is None
    assert elf_u32_symbol(data, "slurm_spank_task_init_privileged") is None  # a function, no data
    assert spank_plugin_problem(data, str(plugin), _headers_version()) is None


def test_a_plugin_of_another_release_is_named_with_both_releases(plugin, tmp_path):
    other = _another_release(_headers_version())
    patched = _patched(plugin, tmp_path / "spank_mapa_isolate.so", other)
    assert elf_u32_symbol(patched.read_bytes(), "plugin_version") == other
    problem = spank_plugin_problem(patched.read_bytes(), str(patched), _headers_version())
    assert problem is not None and "\n" not in problem
    assert f"{patched} was built for Slurm {version_text(other)[:5]} ({version_text(other)})" in problem
    assert f"this node runs Slurm {version_text(_headers_version())}" in problem
    assert f"run `mapa spank-plugin {patched}` again on this node after every Slurm upgrade" in problem
    assert "no root-side GPU isolation" in problem


def test_the_same_major_minor_of_another_micro_release_loads(plugin, tmp_path):
    headers = _headers_version()
    micro = (headers & 0xFFFF00) | ((headers & 0xFF) + 1) % 256
    patched = _patched(plugin, tmp_path / "spank_mapa_isolate.so", micro)
    assert spank_plugin_problem(patched.read_bytes(), str(patched), headers) is None
    assert spank_plugin_problem(plugin.read_bytes(), str(plugin), micro) is None


def test_what_cannot_be_checked_or_loaded_is_said(plugin):
    assert "could not check SPANK plugin /p/spank_mapa_isolate.so (built for Slurm" in spank_plugin_problem(
        plugin.read_bytes(), "/p/spank_mapa_isolate.so", None)
    assert "/p/x.so does not exist or cannot be read" in spank_plugin_problem(None, "/p/x.so", 0x1A0505)
    for data in (b"", b"#!/bin/sh\n", plugin.read_bytes()[:64]):
        assert "/p/x.so is no plugin Slurm can load" in spank_plugin_problem(data, "/p/x.so", 0x1A0505)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512), name=st.sampled_from(["plugin_version", "", "x" * 40]))
def test_the_reader_never_raises_on_arbitrary_bytes(data, name):
    for candidate in (data, b"\x7fELF\x02\x01" + data, b"\x7fELF\x01\x02" + data):
        value = elf_u32_symbol(candidate, name)
        assert value is None or 0 <= value < 1 << 32


def _elf_regions(data: bytes) -> list[tuple[int, int]]:
    """The ELF header, the section header table and every symbol and string table of a 64-bit
    little-endian file: where a mutation reaches the reader."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    regions = [(0, 64), (shoff, shoff + shentsize * shnum)]
    for i in range(shnum):
        _, kind, _, _, offset, size, *_ = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        if kind in (2, 3, 11):
            regions.append((offset, offset + size))
    return regions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 20), edits=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=8),
       region_picks=st.lists(st.integers(0, 1 << 30), max_size=8))
def test_truncated_or_mutated_plugins_never_raise(plugin, cut, edits, region_picks):
    original = plugin.read_bytes()
    assert original[4:6] == b"\x02\x01", "this test mutates a 64-bit little-endian plugin"
    regions = _elf_regions(original)
    mutated = bytearray(original)
    for i, (where, value) in enumerate(edits):
        if i < len(region_picks):  # most edits land where the reader looks
            start, end = regions[region_picks[i] % len(regions)]
            where = start + where % max(1, end - start)
        mutated[where % len(mutated)] = value
    for candidate in (original[: cut % (len(original) + 1)], bytes(mutated), bytes(mutated)[: cut % (len(original) + 1)]):
        value = elf_u32_symbol(candidate, "plugin_version")
        assert value is None or 0 <= value < 1 << 32
        spank_plugin_problem(candidate, "/p/spank_mapa_isolate.so", 0x1A0505)


# --- hand-made ELF files: both classes, both byte orders -----------------------------------------
def _elf(wide: bool, little: bool, symbols: list[tuple[str, int, int, int]], table: int = 11, entsize: int | None = None) -> bytes:
    """An ELF file with sections null, .rodata (at address 0x1000, holding 0xdeadbeef then
    0x01020304), .bss (NOBITS at 0x2000), a string table and a symbol table of ``table``'s type
    holding ``symbols`` as (name, section index, address, size), all global data objects."""
    o = "<" if little else ">"
    header_size = 64 if wide else 52
    rodata = struct.pack(o + "II", 0xDEADBEEF, 0x01020304)
    names, name_at = b"\0", {}
    for name, *_ in symbols:
        name_at[name] = len(names)
        names += name.encode() + b"\0"
    sym_fmt = o + ("IBBHQQ" if wide else "IIIBBH")
    syms = struct.pack(sym_fmt, *([0] * 6))
    for name, section, address, size in symbols:
        info = (1 << 4) | 1  # STB_GLOBAL, STT_OBJECT
        fields = (name_at[name], info, 0, section, address, size) if wide else (name_at[name], address, size, info, 0, section)
        syms += struct.pack(sym_fmt, *fields)
    rodata_at = header_size
    names_at = rodata_at + len(rodata)
    syms_at = names_at + len(names)
    sections_at = syms_at + len(syms)
    section_fmt = o + ("IIQQQQIIQQ" if wide else "IIIIIIIIII")
    sections = [
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        (0, 1, 2, 0x1000, rodata_at, len(rodata), 0, 0, 4, 0),
        (0, 8, 3, 0x2000, sections_at, 8, 0, 0, 4, 0),
        (0, 3, 2, 0, names_at, len(names), 0, 0, 1, 0),
        (0, table, 2, 0, syms_at, len(syms), 3, 1, 8, struct.calcsize(sym_fmt) if entsize is None else entsize),
    ]
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1 if little else 2, 1]) + bytes(9)
    header_fmt = o + ("16sHHIQQQIHHHHHH" if wide else "16sHHIIIIIHHHHHH")
    header = struct.pack(header_fmt, ident, 3, 0, 1, 0, 0, sections_at, 0, header_size, 0, 0,
                         struct.calcsize(section_fmt), len(sections), 0)
    return header + rodata + names + syms + b"".join(struct.pack(section_fmt, *s) for s in sections)


@pytest.mark.parametrize("wide", [True, False], ids=["elf64", "elf32"])
@pytest.mark.parametrize("little", [True, False], ids=["little", "big"])
def test_hand_made_elf_files_of_each_class_and_byte_order(wide, little):
    symbols = [("first", 1, 0x1000, 4), ("plugin_version", 1, 0x1004, 4), ("in_bss", 2, 0x2000, 4), ("undefined", 0, 0, 4),
               ("past_the_end", 1, 0x1006, 4), ("before", 1, 0x0FFE, 4), ("too_small", 1, 0x1000, 2), ("no_size", 1, 0x1004, 0)]
    data = _elf(wide, little, symbols)
    assert elf_u32_symbol(data, "plugin_version") == 0x01020304  # in the file's own byte order
    assert elf_u32_symbol(data, "first") == 0xDEADBEEF
    assert elf_u32_symbol(data, "no_size") == 0x01020304
    for name in ("in_bss", "undefined", "past_the_end", "before", "too_small", "absent", "plugin"):
        assert elf_u32_symbol(data, name) is None, name
    assert elf_u32_symbol(_elf(wide, little, symbols, table=2), "plugin_version") == 0x01020304  # .symtab when no .dynsym
    assert elf_u32_symbol(_elf(wide, little, symbols, table=1), "plugin_version") is None  # no symbol table at all
    assert elf_u32_symbol(_elf(wide, little, symbols, entsize=7), "plugin_version") is None
    assert elf_u32_symbol(data[:-1], "plugin_version") is None  # the section header table cut short
    for cut in range(len(data)):
        assert elf_u32_symbol(data[:cut], "plugin_version") in (None, 0x01020304)


@settings(max_examples=300, deadline=None)
@given(wide=st.booleans(), little=st.booleans(), cut=st.integers(0, 1024),
       edits=st.lists(st.tuples(st.integers(0, 1023), st.integers(0, 255)), min_size=1, max_size=6))
def test_mutated_hand_made_elf_files_never_raise(wide, little, cut, edits):
    mutated = bytearray(_elf(wide, little, [("plugin_version", 1, 0x1004, 4), ("x", 2, 0x2000, 4)]))
    for where, value in edits:
        mutated[where % len(mutated)] = value
    for candidate in (bytes(mutated), bytes(mutated)[:cut]):
        value = elf_u32_symbol(candidate, "plugin_version")
        assert value is None or 0 <= value < 1 << 32


# --- the parsers ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, number",
    [
        ("slurm 24.11.5\n", 0x180B05),
        ("slurm-wlm 26.05.5\n", 0x1A0505),
        ("slurm-wlm 22.05.8", 0x160508),
        ("slurm 25.11.0-0rc1\n", 0x190B00),
        ("slurm 26.05.3\nsomething else\n", 0x1A0503),
        ("  slurm 24.11.5  \r\n", 0x180B05),
        ("slurm 24.11\n", None),
        ("slurmd: error: cannot read slurm.conf\nslurm 24.11.5\n", None),
        ("slurm 256.1.1\n", None),
        ("slurm 24.11.5 extra\n", None),
        ("", None),
        ("24.11.5\n", None),
    ],
)
def test_parse_slurm_version(text, number):
    assert parse_slurm_version(text) == number


def test_version_text_writes_the_minor_release_with_two_digits():
    assert version_text(0x1A0505) == "26.05.5"
    assert version_text(0x180B05) == "24.11.5"
    assert spankcheck.release_text(0x160508) == "22.05"


def test_plugstack_plugins_and_includes():
    text = (
        "# MAPA's isolation trigger\n"
        "optional /usr/local/lib/slurm-mapa/spank_mapa_isolate.so fail-open timeout_ms=5000\n"
        "\n"
        "required\t/usr/lib/slurm/spank_pyxis.so   # containers\n"
        "   include /etc/slurm/plugstack.conf.d/*.conf\n"
        "include plugstack.d/*\n"
        "#optional /commented/out.so\n"
        "optional spank_mapa_isolate.so\n"
        "optional\n"
        "bogus /x.so\n"
        "required /a/b.so#no blank before the comment\n"
    )
    assert plugstack_plugins(text) == [
        ("optional", "/usr/local/lib/slurm-mapa/spank_mapa_isolate.so"),
        ("required", "/usr/lib/slurm/spank_pyxis.so"),
        ("optional", "spank_mapa_isolate.so"),
        ("required", "/a/b.so"),
    ]
    assert plugstack_includes(text) == ["/etc/slurm/plugstack.conf.d/*.conf", "plugstack.d/*"]
    assert plugstack_plugins("") == [] and plugstack_plugins("\ufffd\x00 junk\n") == []


def test_the_plugstack_path_comes_from_slurm_conf():
    conf = Path("/etc/slurm/slurm.conf")
    assert plugstack_conf_path(None, conf) == Path("/etc/slurm/plugstack.conf")
    assert plugstack_conf_path("ClusterName=x\n", conf) == Path("/etc/slurm/plugstack.conf")
    assert plugstack_conf_path("plugstackconfig = /opt/slurm/etc/plugstack.conf  # here\n", conf) == Path("/opt/slurm/etc/plugstack.conf")
    assert plugstack_conf_path('PlugStackConfig="/a/p.conf"\n#PlugStackConfig=/b/p.conf\n', conf) == Path("/a/p.conf")
    assert slurm_conf_value("PluginDir=/usr/lib64/slurm:/opt/plugins\nNodeName=a Gres=gpu:8\n", "PluginDir") == "/usr/lib64/slurm:/opt/plugins"
    assert slurm_conf_value("NodeName=a PluginDir=/x\n", "PluginDir") is None  # not a line of its own


# --- the files of a node --------------------------------------------------------------------------
def _node(tmp_path: Path, plugstack: str) -> Path:
    (tmp_path / "etc").mkdir(exist_ok=True)
    (tmp_path / "etc" / "slurm.conf").write_text(f"ClusterName=c\nPlugStackConfig={tmp_path}/etc/plugstack.conf\n")
    (tmp_path / "etc" / "plugstack.conf").write_text(plugstack)
    return tmp_path / "etc" / "slurm.conf"


def test_check_installed_spank_plugins_follows_includes_and_plugin_dir(plugin, tmp_path):
    other = _another_release(_headers_version())
    old = _patched(plugin, tmp_path / "spank_mapa_old.so", other)
    (tmp_path / "etc" / "plugstack.conf.d").mkdir(parents=True)
    (tmp_path / "etc" / "plugstack.conf.d" / "mapa.conf").write_text(f"required {old} fail-closed\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "spank_mapa_isolate.so").write_bytes(plugin.read_bytes())
    plugstack = tmp_path / "etc" / "plugstack.conf"
    plugstack.write_text(f"optional /usr/lib/slurm/spank_pyxis.so\noptional spank_mapa_isolate.so\n"
                         f"optional {tmp_path}/gone/spank_mapa_isolate.so\ninclude plugstack.conf.d/*.conf\n")
    running = f"slurm {version_text(_headers_version())}\n"
    problems = check_installed_spank_plugins(plugstack, lambda: running, plugin_dirs=f"/nonexistent:{tmp_path}/plugins")
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"SPANK plugin {tmp_path}/gone/spank_mapa_isolate.so does not exist")
    assert problems[0].endswith(f"(optional in {plugstack}: slurmstepd skips it without an error)")
    assert f"SPANK plugin {old} was built for Slurm {version_text(other)[:5]}" in problems[1]
    assert problems[1].endswith(f"(required in {plugstack.parent}/plugstack.conf.d/mapa.conf: every job step on this node fails)")


def test_no_mapa_plugin_configured_is_no_problem_and_asks_no_slurm_command(tmp_path):
    def never() -> str | None:
        raise AssertionError("no Slurm command is needed")

    assert check_installed_spank_plugins(tmp_path / "missing.conf", never) == []
    (tmp_path / "plugstack.conf").write_text("optional /usr/lib/slurm/spank_pyxis.so\ninclude /nonexistent/*\n")
    assert check_installed_spank_plugins(tmp_path / "plugstack.conf", never) == []
    (tmp_path / "loop.conf").write_text("include loop.conf\n")  # Slurm would recurse for ever; we stop
    assert check_installed_spank_plugins(tmp_path / "loop.conf", never) == []


def _fake_slurm_commands(directory: Path, answers: dict[str, str]) -> str:
    """Scripts named after Slurm's commands printing ``answers``; the PATH that finds them first."""
    directory.mkdir(exist_ok=True)
    for command, script in answers.items():
        (directory / command).write_text(f"#!/bin/sh\n{script}\n")
        os.chmod(directory / command, 0o755)
    return f"{directory}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def test_running_slurm_version_text_asks_slurmd_then_scontrol(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_slurm_commands(tmp_path / "a", {"slurmd": "echo slurm-wlm 26.05.5"}))
    assert spankcheck.running_slurm_version_text() == "slurm-wlm 26.05.5\n"
    monkeypatch.setenv("PATH", _fake_slurm_commands(tmp_path / "b", {"slurmd": "exit 1", "scontrol": "echo slurm 24.11.5"}))
    assert spankcheck.running_slurm_version_text() == "slurm 24.11.5\n"
    monkeypatch.setattr(spankcheck, "VERSION_COMMANDS", (("mapa-test-no-such-slurmd", "-V"),))
    assert spankcheck.running_slurm_version_text() is None


# --- where it is said: mapa spank-plugin, mapa hooks, mapa-agent ---------------------------------
def test_mapa_spank_plugin_says_which_release_it_built_for_and_warns_on_a_mismatch(tmp_path, capsys, monkeypatch):
    from slurm_mapa.cli import main as mapa_main

    headers = _headers_version()
    target = tmp_path / "lib" / "spank_mapa_isolate.so"
    built_line = f"built for Slurm {version_text(headers)[:5]} (SLURM_VERSION_NUMBER {headers:#08x} of the installed headers)"
    for running, warned in ((version_text(headers), False), (version_text(_another_release(headers)), True)):
        monkeypatch.setattr(spankcheck, "running_slurm_version_text", lambda running=running: f"slurm {running}\n")
        assert mapa_main(["spank-plugin", str(target)]) == 0  # installed either way
        out, err = capsys.readouterr()
        assert out.splitlines()[-1] == f"optional {target} fail-open"
        assert built_line in err.splitlines()
        assert ("WARNING: the Slurm headers installed are of Slurm " in err) == warned, err
        if warned:
            assert f"this node runs Slurm {running}, whose slurmstepd will not load {target}" in err
        assert elf_u32_symbol(target.read_bytes(), "plugin_version") == headers
    monkeypatch.setattr(spankcheck, "running_slurm_version_text", lambda: None)
    assert mapa_main(["spank-plugin", str(target)]) == 0
    assert f"check that this node runs Slurm {version_text(headers)[:5]}" in capsys.readouterr().err


def test_mapa_hooks_warns_of_a_plugin_built_for_another_release(plugin, tmp_path, capsys, monkeypatch):
    from slurm_mapa.cli import main as mapa_main

    installed = tmp_path / "lib" / "spank_mapa_isolate.so"
    installed.parent.mkdir()
    installed.write_bytes(plugin.read_bytes())
    monkeypatch.setenv("SLURM_CONF", str(_node(tmp_path, f"optional {installed} fail-open\n")))
    config = tmp_path / "mapa.toml"
    config.write_text(f'jobs_dir = "{tmp_path}/jobs"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    other = version_text(_another_release(_headers_version()))
    monkeypatch.setenv("PATH", _fake_slurm_commands(tmp_path / "bin", {"slurmd": f"echo slurm {other}"}))
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "dgx1"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING:")]
    assert warnings == [f"WARNING: SPANK plugin {installed} was built for Slurm {version_text(_headers_version())[:5]} "
                        f"({version_text(_headers_version())}) but this node runs Slurm {other}: slurmstepd will not load "
                        f"it (\"Incompatible Slurm plugin\", logged at info level only); run `mapa spank-plugin {installed}` "
                        f"again on this node after every Slurm upgrade; without it tasks get no root-side GPU isolation "
                        f"(docs/isolation.md, \"After a Slurm upgrade\") (optional in {tmp_path}/etc/plugstack.conf: "
                        f"slurmstepd skips it without an error)"]
    # Rebuilt for the running release: nothing to say.
    monkeypatch.setenv("PATH", _fake_slurm_commands(tmp_path / "bin", {"slurmd": f"echo slurm {version_text(_headers_version())}"}))
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config), "--node", "dgx1"]) == 0
    assert "WARNING:" not in capsys.readouterr().err


def test_mapa_agent_logs_the_problem_once_at_start(plugin, tmp_path):
    from slurm_mapa.slurm.agent.service import log_spank_plugin_problems

    installed = _patched(plugin, tmp_path / "spank_mapa_isolate.so", _another_release(_headers_version()))
    slurm_conf = _node(tmp_path, f"optional {installed}\n")
    config = tmp_path / "mapa.toml"
    config.write_text(f'log = "{tmp_path}/mapa.log"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    running = f"slurm {version_text(_headers_version())}\n"
    log_spank_plugin_problems(str(config), {"SLURM_CONF": str(slurm_conf)}, lambda: running)
    logged = (tmp_path / "mapa.log").read_text()
    assert re.search(rf"mapa\[\d+\] WARNING: SPANK plugin {re.escape(str(installed))} was built for Slurm ", logged)

    def broken() -> str | None:
        raise RuntimeError("a check that informs must not stop the agent")

    log_spank_plugin_problems(str(config), {"SLURM_CONF": str(slurm_conf)}, broken)  # does not raise


def test_building_against_an_untested_release_says_so(tmp_path):
    """Issue 39: the plugin built against Slurm 22.05 headers (this machine's) without a word."""
    from slurm_mapa import TESTED_SLURM_RELEASES
    from slurm_mapa.slurm.admin.install import spank_build_report

    headers = _headers_version()
    plugin = tmp_path / "p.so"
    built = subprocess.run(spank_build_argv("cc", SPANK_SOURCE, plugin), capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    lines = spank_build_report(plugin.read_bytes(), plugin, None)
    noted = [line for line in lines if line.startswith("note: slurm-mapa is tested with Slurm")]
    assert bool(noted) == (version_text(headers)[:5] not in TESTED_SLURM_RELEASES), lines
