"""Every command of the repository's own scripts in README.md and docs/*.md (issue 37):
`.venv/bin/python benchmarks/bench_X.py ...`, `scripts/X ...`, `bash scripts/X`, in a code block or
inline, and the inline fragments that continue one (`memory --sizes 100000,1000000` after
`benchmarks/bench_replay_scale.py` was named). tests/test_doc_commands.py does the same for `mapa`
and `mapa-replay`.

For every one: the file exists, and every option it uses is in its `--help` (its subcommand's,
where it has them; for scripts/cluster, the subcommand is in `scripts/cluster help`).

A command either runs as written on a fresh clone, or the document marks it as needing Slurm,
Docker, root or a GPU (NEEDS, in its own line or comment, its paragraph or the one before, the
paragraphs around its code block, or the document's first paragraph for all of the document).
Each benchmark command not so marked is run here, from the repository root, with its sizes made
small (SMALL: the same subcommand, options and code paths, seconds instead of minutes or hours)
and every file it writes put in a temporary directory; it must exit 0. A script command that is
not marked must be one of NOT_RUN, which says why it is not run here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
if not (ROOT / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not here (an unpacked sdist carries tests/ and docs/ only)", allow_module_level=True)

_PREFIX = r"(?:\$ )?(?:sudo )?(?:\.venv/bin/python3? |python3? |bash )?"
_SCRIPT = re.compile(rf"^{_PREFIX}((?:benchmarks/)?bench_\w+\.py|scripts/[\w.-]+)(?=\s|$)")
_INLINE = re.compile(r"`([^`]+)`")
# How a document says that a command needs more than a fresh clone.
NEEDS = re.compile(r"needs? (?:the |a |its )?(?:mini cluster|Docker|Slurm|GPU|root)|mini cluster up|\bas root\b|"
                   r"real GPU|dockerized|\bin Docker\b", re.I)
# Script commands that are not run here although nothing marks them, and why.
NOT_RUN = {
    "scripts/test": "it runs the whole test suite, this file included (and installs the test extras)",
    "scripts/ring-rate-tables": "it rewrites the shipped ring-rate tables; tests/core/test_ring_rate_tables.py runs its --check",
}


@dataclass(frozen=True)
class Documented:
    where: str
    text: str  # the command, from the script's name on
    script: str  # benchmarks/bench_X.py or scripts/X
    marked: bool  # the document says it needs Slurm, Docker, root or a GPU
    fragment: bool = False  # an inline continuation of the last script named (options checked only)

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _chunks(lines: list[str]) -> list[tuple[int, list[str], bool]]:
    """(first line number, lines, is code) of each run of non-blank lines; a fenced block is one."""
    chunks: list[tuple[int, list[str], bool]] = []
    fenced, current, start = False, [], 0
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            if not fenced and current:
                chunks.append((start, current, False))
                current = []
            fenced = not fenced
            if not fenced:
                chunks.append((start, current, True))
                current = []
            else:
                start = number + 1
            continue
        if fenced:
            current.append(line)
        elif not line.strip():
            if current:
                chunks.append((start, current, all(c.startswith(("    ", "\t")) for c in current)))
            current = []
        else:
            if not current:
                start = number
            current.append(line)
    if current:
        chunks.append((start, current, not fenced and all(c.startswith(("    ", "\t")) for c in current)))
    return chunks


def _script_of(text: str) -> tuple[str, str] | None:
    """(the script's path from the root, the command from the script on), or None."""
    match = _SCRIPT.match(text)
    if not match:
        return None
    name = match.group(1)
    script = name if "/" in name else f"benchmarks/{name}"
    return script, script + text[match.end():]


@functools.lru_cache(maxsize=None)
def _subcommands(script: str) -> tuple[str, ...]:
    if script == "scripts/cluster":
        text = subprocess.run(["bash", str(ROOT / script), "help"], capture_output=True, text=True, timeout=60).stdout
        return tuple(sorted(set(re.findall(r"^  scripts/cluster (\w+)", text, re.M))))
    if not script.startswith("benchmarks/"):
        return ()
    usage = _help(script, "")
    found = re.search(r"\{([\w,-]+)\}", usage)
    return tuple(found.group(1).split(",")) if found else ()


@functools.lru_cache(maxsize=None)
def _help(script: str, subcommand: str) -> str:
    argv = [sys.executable, str(ROOT / script), *([subcommand] if subcommand else []), "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(argv[1:])} fails: {done.stderr[-2000:]}"
    return done.stdout


def documented() -> list[Documented]:
    found: list[Documented] = []
    for document in DOCUMENTS:
        chunks = _chunks(document.read_text(encoding="utf-8").splitlines())
        # A document whose first paragraph says what all of it needs marks every command in it.
        intro = next((" ".join(lines) for _, lines, code in chunks if not code and not lines[0].startswith("#")), "")
        everywhere = bool(NEEDS.search(intro))
        last_script = None  # the benchmark a fragment such as `memory --sizes ...` continues
        for index, (start, lines, code) in enumerate(chunks):
            if code:
                around = " ".join(" ".join(chunks[i][1]) for i in range(max(0, index - 1), min(len(chunks), index + 2)))
                for offset, line in enumerate(lines):
                    for part in re.split(r"\s&&\s|\s;\s", line.strip()):
                        resolved = _script_of(part.strip())
                        if resolved:
                            script, text = resolved
                            found.append(Documented(f"{document.name}:{start + offset}", re.sub(r"\s+#\s.*$", "", text),
                                                    script, everywhere or bool(NEEDS.search(around))))
                            last_script = script if script.startswith("benchmarks/") else last_script
                continue
            prose = " ".join(" ".join(lines).split())
            before = " ".join(chunks[index - 1][1]) if index else ""
            marked = everywhere or bool(NEEDS.search(prose)) or bool(NEEDS.search(before))
            for match in _INLINE.finditer(prose):
                span = match.group(1).strip()
                resolved = _script_of(span)
                if resolved:
                    script, text = resolved
                    last_script = script if script.startswith("benchmarks/") else last_script
                    command = text != script or span != script  # a bare path is a mention, not a command
                    if command:
                        found.append(Documented(f"{document.name}:{start} (inline)", text, script, marked))
                elif last_script and span.split()[0] in _subcommands(last_script) and len(span.split()) > 1:
                    found.append(Documented(f"{document.name}:{start} (inline)", f"{last_script} {span}", last_script,
                                            marked, fragment=True))
    return found


COMMANDS = documented()


def _words(command: Documented) -> list[str]:
    try:
        return shlex.split(command.text)
    except ValueError:
        return command.text.split()


def test_the_documents_have_script_commands():
    scripts = {c.script for c in COMMANDS}
    assert len(COMMANDS) >= 30 and {"scripts/cluster", "benchmarks/bench_replay_scale.py"} <= scripts, COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_script_command_names_what_the_script_has(command):
    words = _words(command)
    assert (ROOT / command.script).is_file(), f"{command}: no {command.script}"
    subcommands = _subcommands(command.script)
    subcommand = words[1] if len(words) > 1 and words[1] in subcommands else ""
    if command.script == "scripts/cluster":
        assert subcommand, f"{command}: scripts/cluster has no such subcommand (it has {', '.join(subcommands)})"
        return
    if not command.script.startswith("benchmarks/"):
        return
    if subcommands and len(words) > 1 and not words[1].startswith("-"):
        assert subcommand, f"{command}: {command.script} has no subcommand {words[1]!r} (it has {', '.join(subcommands)})"
    text = _help(command.script, subcommand)
    known = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))
    unknown = [w.split("=", 1)[0] for w in words[1:] if re.match(r"^--?[a-zA-Z]", w) and w.split("=", 1)[0] not in known]
    assert not unknown, f"{command}: {command.script} {subcommand} has no {', '.join(unknown)}"


def test_every_script_command_that_is_not_run_is_marked():
    unmarked = [str(c) for c in COMMANDS
                if not c.marked and not c.script.startswith("benchmarks/") and c.script not in NOT_RUN]
    assert not unmarked, "mark these as needing Docker, Slurm, root or a GPU, or make them run here:\n" + "\n".join(unmarked)


# --- running the benchmarks, small --------------------------------------------------------------

# (script, subcommand or "") -> option values that make the run small; "+" options are added
# when the command does not give them (a smaller set of topologies, a quick mode).
SMALL: dict[tuple[str, str], dict[str, str | None]] = {
    ("bench_decision.py", ""): {"--repeat": "1", "+--max-gpus": "4"},
    ("bench_ahead.py", "timing"): {"--decisions": "3"},
    ("bench_ahead.py", "tail"): {"--seeds": "1", "--seeds16": "1", "+--topologies": "dgx1-v100"},
    ("bench_ahead.py", "ceiling"): {"--seeds": "1", "+--topologies": "dgx1-v100"},
    ("bench_ahead.py", "plot"): {},
    ("bench_nodechoice.py", "study"): {"--seeds": "1", "+--quick": None, "+--jobs-per-node": "5"},
    ("bench_nodechoice.py", "plot"): {},
    ("bench_nodechoice.py", "insensitive"): {"--seeds": "1", "+--seeds": "1", "+--jobs-per-node": "5"},
    ("bench_nodechoice.py", "threshold"): {"--seeds": "1", "+--seeds": "1", "+--jobs-per-node": "5"},
    ("bench_nodechoice.py", "fleet"): {"--seeds": "1", "+--jobs-per-node": "5", "+--rows": "4xdgx1-paper-poisson"},
    ("bench_affinity.py", ""): {"--seeds": "1", "--jobs": "100"},
    ("bench_replay.py", "figures"): {"--seeds": "1", "+--out": "OUT"},
    ("bench_replay.py", "judged"): {"--seeds": "1", "+--jobs": "300", "+--nodes": "1", "+--loads": "1"},
    ("bench_replay.py", "trade"): {"+--seeds": "1", "+--jobs": "300"},
    ("bench_replay.py", "speed"): {"--jobs": "300", "--topologies": "dgx1-v100",
                                   "+--jobs": "300", "+--topologies": "dgx1-v100", "+--policies": "preserve"},
    ("bench_replay.py", "memory"): {"--jobs": "1000"},
    ("bench_bignode.py", ""): {"--before-cap": "0.2", "+--quick": None, "+--budget-ms": "20"},
    ("bench_policies_bignode.py", ""): {"+--cap": "0.05"},
    ("bench_replay_scale.py", "nodes"): {"--nodes": "16,64", "+--jobs": "500"},
    ("bench_replay_scale.py", "memory"): {"--sizes": "2000"},
    ("bench_replay_scale.py", "rate"): {"--long": "1000", "--topologies": "dgx1-v100", "+--jobs": "300"},
    ("bench_replay_scale.py", "big"): {"--jobs": "2000", "--nodes": "16"},
    ("bench_ring_rates.py", ""): {"--fresh": "1", "--jobs": "300", "+--fresh": "1", "+--jobs": "300", "+--topologies": "torus2d-16"},
}
OUTPUTS = {"--json", "--out", "--png", "-o", "--output", "--output-dir"}


def small(command: Documented, out: Path) -> list[str]:
    words = _words(command)
    name = Path(command.script).name
    subcommand = words[1] if len(words) > 1 and words[1] in _subcommands(command.script) else ""
    rule = SMALL.get((name, subcommand))
    assert rule is not None, f"{command}: add how to run it small to SMALL in {Path(__file__).name}"
    argv, i = [str(ROOT / command.script)], 1
    while i < len(words):
        word = words[i]
        value_follows = word.startswith("-") and "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("-")
        if word in OUTPUTS and value_follows:
            argv += [word, str(out / Path(words[i + 1]).name)]
            i += 2
            continue
        if word in rule and value_follows:
            argv += [word, rule[word]]
            i += 2
            continue
        argv.append(word)
        i += 1
    for option, value in rule.items():
        if option.startswith("+") and option[1:] not in words:
            argv += [option[1:]] + ([] if value is None else [str(out) if value == "OUT" else value])
    return argv


RUN: list[Documented] = []
for _command in COMMANDS:  # each command once, where it is first written
    if _command.script.startswith("benchmarks/") and not _command.marked and not _command.fragment \
            and all(_command.text != c.text for c in RUN):
        RUN.append(_command)
_HISTORY = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                          text=True).stdout.strip() == "false"


def test_the_benchmarks_run_here_are_many():
    assert len(RUN) >= 15, [str(c) for c in RUN]


@pytest.mark.parametrize("command", RUN, ids=str)
def test_a_documented_benchmark_runs(command, tmp_path):
    if ("--before" in command.text or "bench_replay_scale.py" in command.text or "bench_ring_rates.py" in command.text) \
            and not _HISTORY:
        pytest.skip("compares with an old revision: needs the repository's history (a full clone)")
    if _words(command)[1:2] in (["plot"], ["figures"]) and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("draws with matplotlib, the plot extra (scripts/test installs it)")
    argv = small(command, tmp_path)
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{command} (run as {' '.join(argv)}) exits {done.returncode}: {done.stderr[-3000:]}"


@pytest.mark.parametrize("argv", [["bench_nodechoice.py", "plot", "benchmarks/results/nodechoice.json", "--png", "x.png"],
                                  ["bench_ahead.py", "plot", "benchmarks/results/ahead-tail.json", "--png", "x.png"]],
                         ids=lambda argv: " ".join(argv[:2]))
def test_a_plot_without_matplotlib_says_in_one_line_how_to_get_it(argv, tmp_path):
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, done
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert f"{argv[0]} plot needs matplotlib" in line and "plot extra" in line, line
    assert f"-m pip install -e {shlex.quote(str(ROOT) + '[plot]')}" in line and "python3-matplotlib" in line, line
    assert not (tmp_path / "x.png").exists()
