"""Every `mapa` and `mapa-replay` command written in README.md and docs/ (issue 27).

Each one, in a code block or inline, must name subcommands and options the program has (a
renamed or removed option makes its example fail here). Those that need no node, cluster, GPU or
site file (concrete commands of topo show, select, gres-conf, calibrate plan/default, contrib list
and show, and the replay's demo, generate, policies and runs of bundled or generated workloads)
are also run, from an empty directory, and must exit 0. Commands of a node or controller (status,
explain, doctor, hooks, spank-plugin, job-submit-lua, release, contrib write) and those whose
input files are a site's own (node01-topo.txt, jobs.sacct) are checked for their options only;
the cluster suite runs the node commands in the mini cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_mapa.cli import build_parser as mapa_parser
from slurm_mapa.cli import main as mapa_main
from slurm_mapa.replay.cli import build_parser as replay_parser
from slurm_mapa.replay.cli import main as replay_main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"mapa": (mapa_parser, mapa_main), "mapa-replay": (replay_parser, replay_main)}
_COMMAND_START = re.compile(r"^(?:\$ )?(?:sudo )?(?:\.venv/bin/|/opt/\S*/bin/)?(mapa|mapa-replay)(?=\s|$)")
_INLINE = re.compile(r"`((?:\.venv/bin/)?mapa(?:-replay)?(?: [^`]*)?)`")
# Words that stand for a value the reader fills in, and the marks of a synopsis.
_PLACEHOLDER = re.compile(r"(^|[\s=,])([A-Z][A-Z_]+|T|N|S|F)(?=$|[\s,:|\]])|\.\.\.|\[|\]|\||<|>|\*")
OFFLINE = {("mapa", "topo", "show"), ("mapa", "select"), ("mapa", "gres-conf"), ("mapa", "calibrate", "plan"),
           ("mapa", "calibrate", "default"), ("mapa", "contrib", "list"), ("mapa", "contrib", "show"), ("mapa-replay",), ("mapa-replay", "demo"), ("mapa-replay", "generate"),
           ("mapa-replay", "policies"), ("mapa-replay", "run")}


@dataclass(frozen=True)
class Documented:
    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def documented_commands() -> list[Documented]:
    found: list[Documented] = []
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        fenced = False
        number = 0
        while number < len(lines):
            line = lines[number]
            if line.strip().startswith("```"):
                fenced = not fenced
            elif fenced or line.startswith(("    ", "\t")):
                text = line.strip()
                if _COMMAND_START.match(text):
                    while text.endswith("\\") and number + 1 < len(lines):
                        number += 1
                        text = text[:-1].rstrip() + " " + lines[number].strip()
                    found.append(Documented(f"{document.name}:{number + 1}", text))
            number += 1
        prose = "\n".join(line for line in lines if not line.startswith(("    ", "\t")))
        for match in _INLINE.finditer(" ".join(prose.split())):
            found.append(Documented(f"{document.name} (inline)", match.group(1)))
    return found


def words(text: str) -> list[str]:
    text = re.sub(r"\s#\s.*$", "", text)  # a trailing comment
    try:
        tokens = shlex.split(text)
    except ValueError:
        tokens = text.split()
    tokens[0] = _COMMAND_START.match(tokens[0] if not tokens[0].startswith("$") else text).group(1) if tokens else ""
    return tokens


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its tree here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def resolve(tokens: list[str]) -> tuple[tuple[str, ...], argparse.ArgumentParser, list[str]]:
    """The subcommand chain the tokens name, its parser, and the options the tokens use."""
    program = tokens[0]
    parser = PROGRAMS[program][0]()
    chain = [program]
    rest = tokens[1:]
    while rest and subcommands(parser) and not rest[0].startswith("-"):
        name = rest[0]
        assert name in subcommands(parser), f"{' '.join(chain)} has no subcommand {name!r} (it has {sorted(subcommands(parser))})"
        parser = subcommands(parser)[name]
        chain.append(name)
        rest = rest[1:]
    used = [token.split("=", 1)[0] for token in rest if re.match(r"^--?[a-z]", token)]
    return tuple(chain), parser, used


COMMANDS = documented_commands()


def test_the_documents_have_commands_of_both_programs():
    programs = {words(c.text)[0] for c in COMMANDS}
    assert programs == {"mapa", "mapa-replay"} and len(COMMANDS) >= 60, len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_names_what_the_program_has(command):
    chain, parser, used = resolve(words(command.text))
    unknown = [option for option in used if option not in options(parser)]
    assert not unknown, f"{command}: {' '.join(chain)} has no {', '.join(unknown)}"


def runnable(command: Documented) -> bool:
    tokens = words(command.text)
    if _PLACEHOLDER.search(" ".join(tokens[1:])):
        return False
    try:
        chain, parser, _ = resolve(tokens)
    except AssertionError:
        return False  # test_a_documented_command_names_what_the_program_has says what is wrong
    if chain not in OFFLINE:
        return False
    if len(tokens) == len(chain) and command.where.endswith("(inline)"):
        return False  # a command named in prose (`mapa select`), not an invocation
    required = [action.option_strings for action in parser._actions if action.required and action.option_strings]
    if any(not set(names) & set(tokens) for names in required):
        return False  # an option named in prose (`mapa select --explain`)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            PROGRAMS[tokens[0]][0]().parse_args(tokens[1:])
        except (SystemExit, argparse.ArgumentError, ValueError, Exception):  # noqa: BLE001 - the programs' parsers raise their own errors
            return False  # an option named in prose without its value (`mapa-replay run --node-choice`)
    if chain == ("mapa-replay", "run") and "--generate" not in tokens and len(tokens) == len(chain) + len(used_options(tokens)):
        return False  # a replay needs its input: `mapa-replay run --policies preserve-ahead` names options only
    # A site's own input (a saved topology, a sacct log): not in the repository.
    inputs = [t for t in tokens[1:] if not t.startswith("-") and re.search(r"\.(txt|toml|sacct|csv|jobs|json)$", t)]
    outputs = {tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t in ("-o", "--output", "--csv", "--output-dir", "--plot")}
    return all((ROOT / t).exists() for t in inputs if t not in outputs)


def used_options(tokens: list[str]) -> list[str]:
    """The option tokens and their values (every token after the chain that is not a bare input)."""
    taken: list[str] = []
    for i, token in enumerate(tokens):
        if token.startswith("-") or (i and tokens[i - 1].startswith("--") and "=" not in tokens[i - 1]):
            taken.append(token)
    return taken


RUNNABLE = [command for command in COMMANDS if runnable(command)]


def test_the_offline_commands_are_many():
    """A rule that ran nothing would pass everything: at least these many run."""
    assert len(RUNNABLE) >= 12, [str(c) for c in RUNNABLE]


@pytest.mark.parametrize("command", RUNNABLE, ids=str)
def test_a_documented_offline_command_runs(command, tmp_path, monkeypatch):
    tokens = words(command.text)
    tokens = [str(ROOT / t) if (ROOT / t).exists() and "/" in t else t for t in tokens]
    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = PROGRAMS[tokens[0]][1](tokens[1:])
        except SystemExit as stop:
            code = stop.code
    assert code == 0, f"{command} exits {code}: {err.getvalue()[-1500:]}"
    assert os.listdir(tmp_path) is not None
