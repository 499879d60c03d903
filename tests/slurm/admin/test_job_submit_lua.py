"""job_submit.lua against the Python directive parser, under a real Lua 5.1 interpreter.

Every line of tests/data/directives/corpus.tsv, plus generated inputs, goes through the plugin
(tests/lua/run_cases.lua loads it with a mocked ``slurm`` table) and through
:mod:`slurm_mapa.slurm.text.directive`; both must give the same verdict and the same text: the same
normalised directive (stored as ``admin_comment = "mapa:<normalised>"``), or the same error
message (sent with ``slurm.log_user``), or no directive at all.

Needs ``lua5.1`` and ``luac5.1`` (Debian/Ubuntu: ``apt-get install -y lua5.1``). Without them
these tests fail, unless ``MAPA_SKIP_LUA=1`` is set, which skips them.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo_paths import REPO, TESTS, TEST_DATA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.core.patterns import SHAPES, make_pattern
from slurm_mapa.errors import InputError
from slurm_mapa.slurm.text.decision import MAX_ADMIN_COMMENT_CHARS, split_admin_comment
from slurm_mapa.slurm.text.directive import MAX_LINE_CHARS, comment_with_directive, directive_in_comment, parse_comment, parse_directive, parse_directive_lines

ROOT = REPO
PLUGIN = ROOT / "slurm_mapa" / "data" / "slurm" / "job_submit.lua"
DRIVER = TESTS / "lua" / "run_cases.lua"
CORPUS = TEST_DATA / "directives" / "corpus.tsv"

INSTALL_HINT = (
    "install Lua 5.1 (it provides lua5.1 and luac5.1): `apt-get update && apt-get install -y lua5.1` "
    "on Debian/Ubuntu; or set MAPA_SKIP_LUA=1 to skip the job_submit.lua tests"
)

SUCCESS, ERROR, INVALID, INTERNAL = 0, -1, 2072, 2090  # the mock's slurm.SUCCESS, ERROR, ESLURM_INVALID_GRES, ESLURM_INTERNAL


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path:
        return path
    if os.environ.get("MAPA_SKIP_LUA") == "1":
        pytest.skip(f"{tool} not found and MAPA_SKIP_LUA=1 is set")
    pytest.fail(f"{tool} not found: {INSTALL_HINT}", pytrace=False)


# --- running the plugin -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One call of the plugin: job_desc.script and job_desc.comment (None: the field is nil)."""

    script: str | None = None
    comment: str | None = None
    mode: str = "submit"  # see tests/lua/run_cases.lua


@dataclass(frozen=True)
class Result:
    rc: int
    messages: tuple[str, ...]
    admin_comment: str | None
    comment: str | None = None  # job_desc.comment when the plugin changed it
    prefer: str | None = None  # job_desc.prefer after the call
    placement: str = "features= begin="  # job_desc.features and begin_time (seconds from now) after it


@dataclass(frozen=True)
class Load:
    rc: str
    globals: tuple[str, ...]
    info: tuple[str, ...]


def _bytes(text: str | None) -> bytes | None:
    # The corpus reads \xHH as the character U+00HH; the plugin sees the byte HH.
    return None if text is None else text.encode("latin-1")


def _run(cases: list[Case], tmp: Path, plugin: Path = PLUGIN) -> tuple[Load, list[Result]]:
    lua = _require("lua5.1")
    blob = bytearray()
    for case in cases:
        script, comment = _bytes(case.script), _bytes(case.comment)
        blob += f"{case.mode} {-1 if script is None else len(script)} {-1 if comment is None else len(comment)}\n".encode()
        blob += (script or b"") + (comment or b"")
    cases_file = tmp / "cases.bin"
    cases_file.write_bytes(bytes(blob))
    done = subprocess.run([lua, str(DRIVER), str(plugin), str(cases_file)], capture_output=True, timeout=120)
    assert done.returncode == 0, f"the Lua driver failed:\n{done.stderr.decode(errors='replace')}"
    data, pos = done.stdout, 0

    def line() -> str:
        nonlocal pos
        end = data.index(b"\n", pos)
        text = data[pos:end].decode("latin-1")
        pos = end + 1
        return text

    def take(count: int) -> str:
        nonlocal pos
        text = data[pos : pos + count].decode("latin-1")
        assert len(text) == count, "truncated driver output"
        pos += count
        return text

    load_rc = line().removeprefix("LOAD ")
    globals_ = tuple(filter(None, line().removeprefix("GLOBALS ").split(",")))
    info = tuple(take(int(line())) for _ in range(int(line().removeprefix("INFO "))))
    results = []
    for _ in cases:
        rc, count, admin_len, comment_len, prefer_len, place_len = (int(v) for v in line().split(" "))
        messages = tuple(take(int(line())) for _ in range(count))
        admin = take(admin_len) if admin_len >= 0 else None
        comment = take(comment_len) if comment_len >= 0 else None
        prefer = take(prefer_len) if prefer_len >= 0 else None
        results.append(Result(rc, messages, admin, comment, prefer, take(place_len)))
    assert pos == len(data), "the driver wrote more results than cases"
    return Load(load_rc, globals_, info), results


def _verdict(result: Result) -> tuple[str, str | None]:
    """The plugin's answer as (ok, normalised) / (none, None) / (error, message)."""
    if result.rc == SUCCESS and not result.messages:
        if result.admin_comment is None:
            return ("none", None)
        assert result.admin_comment.startswith("mapa:"), result
        return ("ok", result.admin_comment.removeprefix("mapa:"))
    if result.rc == INVALID and len(result.messages) == 1 and result.admin_comment is None:
        return ("error", result.messages[0])
    return ("unexpected", repr(result))


def _python(case: Case) -> tuple[str, str | None]:
    """What the Python parser says about the same job: the comment first, then the script."""
    try:
        from_comment = directive_in_comment(case.comment) if case.comment is not None else None
        from_script = parse_directive_lines(case.script) if case.script is not None else None
    except InputError as error:
        return ("error", str(error))
    directive = from_comment if from_comment is not None else from_script
    return ("none", None) if directive is None else ("ok", directive.normalised())


# --- the corpus ---------------------------------------------------------------------------------


def _unescape(text: str) -> str:
    text = text.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), text)


def _corpus() -> list[tuple[int, str, str, str, str]]:
    cases = []
    for number, line in enumerate(CORPUS.read_text(encoding="ascii").split("\n"), start=1):
        if not line or line.startswith("#"):
            continue
        kind, text, verdict, expected = line.split("\t")
        cases.append((number, kind, _unescape(text), verdict, expected))
    return cases


CORPUS_CASES = _corpus()


def _forms(kind: str, text: str) -> list[Case]:
    """The plugin inputs for one corpus line: comments and scripts as they are; a body both as a
    ``mapa:`` comment and as a ``#MAPA`` line (alone and inside a typical script)."""
    if kind == "comment":
        return [Case(comment=text)]
    if kind == "script":
        return [Case(script=text)]
    return [
        Case(comment="mapa:" + text),
        Case(script="#MAPA " + text),
        Case(script="#!/bin/bash\n#SBATCH --gres=gpu:4\n#MAPA " + text + "\nsrun ./app\n"),
    ]


@functools.lru_cache(maxsize=None)
def _corpus_results(tmp: Path) -> dict[Case, Result]:
    cases = list(dict.fromkeys(case for _, kind, text, _, _ in CORPUS_CASES for case in _forms(kind, text)))
    _, results = _run(cases, tmp)
    return dict(zip(cases, results))


@pytest.fixture(scope="module")
def lua_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the cases file of the cached runs (each run rewrites it before Lua reads it)."""
    return tmp_path_factory.mktemp("lua")


@pytest.mark.parametrize("number,kind,text,verdict,expected", CORPUS_CASES, ids=[f"L{c[0]}-{c[1]}-{c[3]}" for c in CORPUS_CASES])
def test_corpus_line_lua_matches_python(lua_tmp: Path, number: int, kind: str, text: str, verdict: str, expected: str) -> None:
    results = _corpus_results(lua_tmp)
    for case in _forms(kind, text):
        lua = _verdict(results[case])
        assert lua == _python(case), f"corpus line {number}, {case!r}: Lua and Python disagree"
        if kind != "body":  # the corpus's own expectation, for the inputs used as they are
            assert lua[0] == verdict, f"corpus line {number}"
            if verdict == "ok":
                assert lua[1] == expected
            elif verdict == "error":
                assert lua[1] is not None and lua[1].startswith("MAPA: ") and expected in lua[1]


# --- generated inputs ---------------------------------------------------------------------------

VOCAB = [
    "topology", "sensitive", "gpus", "edges", "weights", "Topology", "SENSITIVE", "=", "==", "ring", "Ring", "chain",
    "tree", "ring+tree", "all", "star", "mesh2d", "torus2d", "hypercube", "custom", "rnig", ":", "x", "X", "2x4", "0x4",
    "8x8", "9x9", "0", "00", "1", "2", "4", "6", "8", "16", "63", "64", "65", "0064", "-", "0-1", "1-2", "1-1", "0-63",
    ",", ".", ".5", "4.", "0.5", "010.50", "1234567", "0.000001", "999999.999999", "1e3", "yes", "no", "true", "maybe",
    " ", "  ", "\t", "#", "# x", "#MAPA ", "#MAPA", "#mapa ", " #MAPA ", "#SBATCH -N1", "srun ./app", "\n", "\r\n", "\r",
    "mapa:", "MAPA:", "%", "%s", "'", "\\", "\x00", "\x07", "\x7f", "\xc3\xa9", "\xff",
]


VALUES = {
    "topology": ["ring", "chain", "tree", "ring+tree", "all", "star", "mesh2d", "torus2d", "hypercube", "custom", "Ring",
                 "mesh2d:2x4", "torus2d:4x4", "torus2d:2x2", "MESH2D:1X8", "mesh2d:02x4", "mesh2d:0x4", "torus2d:9x9",
                 "mesh2d:", "mesh2d:2x4:1", "ring:2x4", "chain:2X4", "rnig", "ring,chain"],
    "sensitive": ["yes", "no", "true", "false", "1", "0", "YES", "False", "maybe", "y"],
    "gpus": ["1", "2", "3", "4", "6", "7", "8", "16", "64", "04", "0064", "0", "65", "00004", "2.0", "-1"],
    "placement": ["prefer", "require", "any", "REQUIRE", "Prefer", "anywhere", "require,any"],
    "wait": ["1", "30", "0030", "1440", "1441", "0", "00000", "000001", "99999", "1.5", "-5", "10m"],
}
WEIGHTS = ["1", "2", "0.5", "4.000", "010.50", "000.000100", "999999.999999", "0.000001", "0", "0.000", "1e3", ".5", "4.", "1234567", ""]
KEY_SPELLINGS = (["topology", "sensitive", "gpus", "edges", "weights", "placement", "wait"] * 4
                 + ["Topology", "GPUS", "Weights", "Placement", "WAIT", "topo", ""])


def _value(rnd: random.Random, key: str) -> str:
    if key in VALUES:
        return rnd.choice(VALUES[key])
    if key == "edges":
        top = rnd.choice([3, 8, 64, 65])
        return ",".join(rnd.choice([f"{rnd.randrange(top)}-{rnd.randrange(top)}", "0-1", "1-2", "01-2", ""]) for _ in range(rnd.randint(1, 6)))
    return ",".join(rnd.choice(WEIGHTS) for _ in range(rnd.randint(1, 9)))


def _sized_body(rnd: random.Random) -> str:
    """A directive whose GPU count is known (gpus= or a grid), with a weights count near the right one."""
    shape = rnd.choice(SHAPES)
    size = rnd.choice([1, 2, 3, 4, 6, 8, 9, 16, 64])
    grid = rnd.choice([None, (2, size // 2), (1, size)]) if shape in ("mesh2d", "torus2d") and size % 2 == 0 else None
    edges = None
    if shape == "custom":
        edges = tuple((rnd.randrange(size + 1), rnd.randrange(size + 1)) for _ in range(rnd.randint(1, 5)))
        edges = tuple(e for e in edges if e[0] != e[1]) or ((0, 1),)
    try:
        count = len(make_pattern(shape, size, grid=grid, edges=edges).edges)
    except InputError:
        count = rnd.randint(1, 8)
    tokens = [f"topology={shape}" + (f":{grid[0]}x{grid[1]}" if grid else "")]
    if grid is None or rnd.random() < 0.5:
        tokens.append(f"gpus={rnd.choice([size, size, size + 1])}")
    if edges is not None:
        tokens.append("edges=" + ",".join(f"{a}-{b}" for a, b in edges))
    if count + 1 <= 2048 and rnd.random() < 0.8:
        tokens.append("weights=" + ",".join(rnd.choice(["1", "2.5", "0.25"]) for _ in range(max(1, count + rnd.choice([-1, 0, 0, 0, 1])))))
    rnd.shuffle(tokens)
    return " ".join(tokens)


def _body(rnd: random.Random) -> str:
    """Mostly well-formed key=value tokens with plausible, sometimes wrong, values."""
    tokens = []
    for _ in range(rnd.randint(0, 5)):
        spelled = rnd.choice(KEY_SPELLINGS)
        token = spelled + rnd.choice(["="] * 20 + ["", "=="]) + _value(rnd, spelled.lower())
        if rnd.random() < 0.05:
            cut = rnd.randint(0, len(token))
            token = token[:cut] + rnd.choice(VOCAB) + token[cut:]
        tokens.append(token)
    if rnd.random() < 0.1:
        tokens.append(rnd.choice(["#", "# comment", "#topology=chain"]))
    return "".join(rnd.choice([" ", "\t", "  "]) + t for t in tokens)


def _random_cases(seed: int, count: int) -> list[Case]:
    rnd = random.Random(seed)
    cases = []
    for _ in range(count):
        roll = rnd.random()
        if roll < 0.3:
            text = _sized_body(rnd)
        elif roll < 0.7:
            text = _body(rnd)
        else:
            text = "".join(rnd.choice(VOCAB) for _ in range(rnd.randint(0, 24)))
        pick = rnd.randrange(6)
        if pick == 0:
            cases.append(Case(comment="mapa:" + text))
        elif pick == 1:
            cases.append(Case(comment=text))
        elif pick == 2:
            cases.append(Case(script="#MAPA " + text))
        elif pick == 3:
            cases.append(Case(script=text))
        elif pick == 4:
            lines = ["#!/bin/bash"] + [rnd.choice(["#MAPA ", "#MAPA\t", "#SBATCH ", "", "# "]) + _body(rnd) for _ in range(rnd.randint(1, 4))]
            cases.append(Case(script="\n".join(lines) + "\nsrun ./app\n"))
        else:
            cases.append(Case(script="#MAPA " + text, comment=rnd.choice(["mapa:" + _body(rnd), "notes", "mapa:sensitive=yes"])))
    return cases


def test_generated_inputs_lua_matches_python(tmp_path: Path) -> None:
    cases = _random_cases(seed=5, count=6000)
    _, results = _run(cases, tmp_path)
    verdicts = {"ok": 0, "none": 0, "error": 0}
    for case, result in zip(cases, results):
        lua = _verdict(result)
        assert lua == _python(case), f"Lua and Python disagree on {case!r}"
        verdicts[lua[0]] += 1
    assert min(verdicts.values()) >= 100, verdicts  # the generator reaches every verdict


# --- the plugin as Slurm uses it ----------------------------------------------------------------

SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:4\n\n# set-up\n#MAPA topology=ring\n#SBATCH -t 10\n#MAPA sensitive=yes gpus=4 # best ring\nsrun ./app\n#MAPA topology=chain\n"

EXTRA = [
    ("multi-line script", Case(script=SCRIPT), ("ok", "topology=ring sensitive=yes gpus=4")),
    ("sbatch stop rule", Case(script="#!/bin/bash\n#SBATCH -N1\nhostname\n#MAPA topology=rnig\n"), ("none", None)),
    ("directive after #SBATCH", Case(script="#!/bin/bash\n#SBATCH -N1\n#MAPA topology=star\n"), ("ok", "topology=star sensitive=no")),
    ("here-document", Case(script="#!/bin/sh\ncat > x.sh <<EOF\n#MAPA topology=rnig\nEOF\n"), ("none", None)),
    ("windows line ends", Case(script="#!/bin/bash\r\n#MAPA topology=tree\r\n"), ("ok", "topology=tree sensitive=no")),
    ("no directive", Case(script="#!/bin/bash\n#SBATCH -N1\nsrun ./app\n", comment="run 3 of 5"), ("none", None)),
    ("no script, no comment", Case(), ("none", None)),
    ("empty script and comment", Case(script="", comment=""), ("none", None)),
    ("srun comment", Case(comment="mapa:topology=all gpus=4"), ("ok", "topology=all sensitive=no gpus=4")),
    ("comment wins over script", Case(script="#MAPA topology=star\n", comment="mapa:topology=chain"), ("ok", "topology=chain sensitive=no")),
    ("other comment, script used", Case(script="#MAPA topology=star\n", comment="sweep 7"), ("ok", "topology=star sensitive=no")),
    (
        "bad script rejected even with a good comment",
        Case(script="#!/bin/bash\n#MAPA topology=rnig\n", comment="mapa:topology=chain"),
        ("error", "MAPA: line 2: unknown topology 'rnig' (accepted: ring, chain, tree, ring+tree, all, star, mesh2d, torus2d, hypercube, custom)"),
    ),
    (
        "bad comment reported first",
        Case(script="#MAPA topology=rnig\n", comment="mapa:sensitive=maybe"),
        ("error", "MAPA: bad value 'maybe' for sensitive (accepted: yes, no, true, false, 1, 0)"),
    ),
    (
        "percent signs reach the user unformatted",
        Case(comment="mapa:topology=50%d%s%%"),
        ("error", "MAPA: unknown topology '50%d%s%%' (accepted: ring, chain, tree, ring+tree, all, star, mesh2d, torus2d, hypercube, custom)"),
    ),
    ("the issue's example", Case(script="#MAPA topology=rnig\n"), ("error", "MAPA: line 1: unknown topology 'rnig' (accepted: ring, chain, tree, ring+tree, all, star, mesh2d, torus2d, hypercube, custom)")),
]


@functools.lru_cache(maxsize=None)
def _extra_results(tmp: Path) -> dict[str, Result]:
    _, results = _run([case for _, case, _ in EXTRA], tmp)
    return {name: result for (name, _, _), result in zip(EXTRA, results)}


@pytest.mark.parametrize("name,case,expected", EXTRA, ids=[e[0] for e in EXTRA])
def test_extra_cases(lua_tmp: Path, name: str, case: Case, expected: tuple[str, str | None]) -> None:
    lua = _verdict(_extra_results(lua_tmp)[name])
    assert lua == expected
    assert _python(case) == expected


def test_plugin_loads_like_slurm_expects(tmp_path: Path) -> None:
    load, _ = _run([], tmp_path)
    assert load.rc == str(SUCCESS)
    assert load.globals == ("slurm_job_modify", "slurm_job_submit"), "helpers must be local"
    assert len(load.info) == 1 and load.info[0].endswith("initialized")


def test_syntax_with_luac() -> None:
    luac = _require("luac5.1")
    done = subprocess.run([luac, "-p", str(PLUGIN), str(DRIVER)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_runtime_error_rejects_the_job(tmp_path: Path) -> None:
    # In Slurm 24.11 a Lua error escaping slurm_job_submit would ACCEPT the job.
    _, (result,) = _run([Case(mode="boom")], tmp_path)
    assert result.rc == INTERNAL
    assert len(result.messages) == 1 and result.messages[0].startswith("MAPA: internal error")
    assert result.admin_comment is None


def test_return_codes_fall_back_to_slurm_error(tmp_path: Path) -> None:
    cases = [Case(comment="mapa:topology=rnig", mode="noeslurm"), Case(comment="mapa:", mode="noeslurm")]
    _, (bad, good) = _run(cases, tmp_path)
    assert (bad.rc, len(bad.messages)) == (ERROR, 1)
    assert (good.rc, good.admin_comment) == (SUCCESS, "mapa:topology=ring sensitive=no")


def test_non_string_fields_are_ignored(tmp_path: Path) -> None:
    _, (result,) = _run([Case(mode="number")], tmp_path)
    assert result == Result(SUCCESS, (), None)


def test_modify_validates_a_changed_comment_without_touching_admin_comment(tmp_path: Path) -> None:
    cases = [
        Case(comment="mapa:topology=chain sensitive=yes", mode="modify"),
        Case(comment="mapa:topology=chain sensitive=perhaps", mode="modify"),
        Case(comment="just notes", mode="modify"),
        Case(mode="modify"),  # e.g. the Prolog's `scontrol update AdminComment=...`
        Case(script="#MAPA topology=rnig\n", mode="modify"),  # a script is not re-read on modify
    ]
    _, results = _run(cases, tmp_path)
    assert results[0] == Result(SUCCESS, (), None)
    assert results[1] == Result(INVALID, ("MAPA: bad value 'perhaps' for sensitive (accepted: yes, no, true, false, 1, 0)",), None)
    assert results[2:] == [Result(SUCCESS, (), None)] * 3


def test_large_inputs_stay_fast(tmp_path: Path) -> None:
    """Bounded work on hostile sizes: a 4 MB script (Slurm's default max_script_size), huge lines."""
    big_header = "#!/bin/bash\n" + "# a comment line of the kind long scripts have\n" * 85_000
    cases = [
        Case(script=big_header + "#MAPA topology=star\nsrun ./app\n"),
        Case(script="#" * 4_000_000 + "\n#MAPA topology=chain\n"),
        Case(script="#MAPA " + "x=" * 2_000_000),
        Case(comment="mapa:" + "sensitive=yes " * 300_000),
        Case(comment="mapa:topology=all gpus=64 weights=" + "1," * 2015 + "1"),  # 2016 edges
        Case(script="#MAPA topology=custom edges=" + ",".join(["0-1"] * 2048) + " weights=" + "," * 2048),
        Case(script="\n" * 1_000_000 + "#MAPA\n"),
        Case(script="#MAPA " + " " * 8180 + "gpus=4"),  # exactly at the line limit
        Case(script="#MAPA " + " " * 8181 + "gpus=4"),  # one over
    ]
    started = time.monotonic()
    _, results = _run(cases, tmp_path)
    elapsed = time.monotonic() - started
    for case, result in zip(cases, results):
        assert _verdict(result) == _python(case)
    assert [_verdict(r)[0] for r in results] == ["ok", "ok", "error", "error", "ok", "error", "ok", "ok", "error"]
    assert [len(c.script or "") for c in cases[-2:]] == [MAX_LINE_CHARS, MAX_LINE_CHARS + 1]
    assert elapsed < 10, f"the plugin took {elapsed:.1f} s on large inputs"


# --- the directive in the job comment, for a Prolog that asks slurmctld nothing -------------------


def _python_comment(case: Case) -> str | None:
    """The comment Python's rule leaves on the job (None: unchanged, or no directive, or an error)."""
    try:
        from_comment = directive_in_comment(case.comment) if case.comment is not None else None
        from_script = parse_directive_lines(case.script) if case.script is not None else None
    except InputError:
        return None
    directive = from_comment if from_comment is not None else from_script
    if directive is None:
        return None
    new = comment_with_directive(case.comment, directive)
    return None if new == case.comment else new


COMMENT_CASES = [
    Case(script="#MAPA topology=ring sensitive=yes\n"),
    Case(script="#MAPA topology=ring sensitive=yes\n", comment="nightly sweep 3"),
    Case(script="#MAPA topology=star\n", comment="nightly sweep 3 [mapa:topology=ring sensitive=yes]"),  # a resubmitted comment
    Case(script="#MAPA topology=star\n", comment="mapa:topology=chain"),  # the user's mapa: comment wins and stays
    Case(comment="notes [mapa:topology=all sensitive=yes]"),  # srun with the suffix form: validated, kept
    Case(comment="notes [mapa:topology=rnig]"),  # a bad suffix is rejected like a bad mapa: comment
    Case(comment="a ] b [mapa:topology=tree] c"),  # not at the end: the user's text
    Case(comment="x [mapa:topology=tree]]"),
    Case(script="#MAPA topology=ring\n", comment="y" * (MAX_LINE_CHARS - 10)),  # would not fit: left as it is
    Case(script="#MAPA topology=ring\n", comment="z" * 20000),  # long user text without a directive is fine
    Case(script="#!/bin/bash\nsrun ./app\n", comment="no directive at all"),
    Case(script="#MAPA topology=ring\n", comment="caf\xe9 [mapa:gpus=2"),
]


def test_the_directive_reaches_the_job_comment_as_python_says(tmp_path: Path) -> None:
    _, results = _run(COMMENT_CASES, tmp_path)
    for case, result in zip(COMMENT_CASES, results):
        assert _verdict(result) == _python(case), case
        assert result.comment == _python_comment(case), case
    assert results[0].comment == "mapa:topology=ring sensitive=yes"
    assert results[1].comment == "nightly sweep 3 [mapa:topology=ring sensitive=yes]"
    assert results[2].comment is None and results[2].admin_comment == "mapa:topology=ring sensitive=yes"  # its suffix wins over the script
    assert results[3].comment is None and results[4].comment is None
    assert _verdict(results[5])[0] == "error"
    assert results[8].comment is None and _verdict(results[9])[0] == "ok"
    assert directive_in_comment(results[1].comment).normalised() == "topology=ring sensitive=yes"


def test_generated_comments_lua_matches_python(tmp_path: Path) -> None:
    rnd = random.Random(11)
    cases = []
    for _ in range(2000):
        body = _body(rnd)
        comment = rnd.choice([None, "", "notes", "mapa:" + body, "run [mapa:" + body + "]", "[mapa:" + body + "]",
                              "x [mapa:" + body, "a [mapa:b] [mapa:" + body + "]", body + " [mapa:topology=ring]"])
        script = rnd.choice([None, "#MAPA " + _body(rnd) + "\n", "#!/bin/sh\nsrun x\n"])
        cases.append(Case(script=script, comment=comment))
    _, results = _run(cases, tmp_path)
    changed = 0
    for case, result in zip(cases, results):
        assert _verdict(result) == _python(case), case
        assert result.comment == _python_comment(case), case
        changed += result.comment is not None
    assert changed >= 200


def _configured_plugin(tmp_path: Path, sizes: tuple[int, ...], insensitive_jobs: str = "none") -> Path:
    from slurm_mapa.slurm.admin.install import job_submit_text

    plugin = tmp_path / "job_submit.lua"
    plugin.write_text(job_submit_text(sizes, insensitive_jobs), encoding="latin-1")
    return plugin


def test_node_choice_preferences_are_added_only_where_configured_and_never_over_the_users(tmp_path: Path) -> None:
    plugin = _configured_plugin(tmp_path, (2, 4, 8), "noring")
    sensitive, insensitive = "#MAPA topology=ring sensitive=yes\n", "#MAPA topology=ring\n"
    plain = "#!/bin/sh\nsrun x\n"
    cases = [
        Case(script=sensitive, mode="gpus4"), Case(script=insensitive, mode="gpus4"), Case(script=sensitive, mode="gpus4typed"),
        Case(script=sensitive, mode="gpus3"),  # 3 is not a published size
        Case(script=sensitive, mode="gpus4user"),  # the user's own --prefer stays
        Case(script=plain, mode="gpus4"),  # no directive: an insensitive job's preference (with "noring")
        Case(script=sensitive, mode="submit"),  # no GPUs per node asked for
        Case(script=sensitive, mode="gpus4and"),  # a plain AND constraint: kept, and preferred with the feature
        Case(script=sensitive, mode="gpus4or"),  # any other constraint: left alone
        Case(script="#MAPA sensitive=yes placement=any\n", mode="gpus4"),  # no preference asked for
        Case(script=sensitive, mode="gpus4pinned"),  # the user chose the node (-w)
        # Issue 39: the user's constraint names the MAPA feature already: left alone (it gave
        # Prefer=mapa_ring2&mapa_ring2), for an insensitive job too.
        Case(script=sensitive, mode="gpus4mapa"), Case(script=insensitive, mode="gpus4mapa"),
    ]
    _, results = _run(cases, tmp_path, plugin)
    assert [r.prefer for r in results] == ["mapa_ring4", "mapa_noring4", "mapa_ring4", None, "bigmem", "mapa_noring4", None,
                                           "bigmem&ib&mapa_ring4", None, None, None, None, None]
    assert all(r.rc == SUCCESS for r in results)
    # Never a constraint (Slurm fails a job whose constraint no node has active), never a delay.
    assert [r.placement for r in results] == ["features= begin="] * 7 + ["features=bigmem&ib begin=", "features=bigmem|ib begin=",
                                                                          "features= begin=", "features= begin="] \
        + ["features=ib&mapa_ring4 begin="] * 2
    _, off = _run(cases, tmp_path)  # as shipped: no sizes, no preference
    assert [r.prefer for r in off] == [None, None, None, None, "bigmem", None, None, None, None, None, None, None, None]
    _, alone = _run(cases, tmp_path, _configured_plugin(tmp_path, (2, 4, 8)))  # insensitive_jobs = "none": only sensitive jobs
    assert [r.prefer for r in alone] == ["mapa_ring4", None, "mapa_ring4", None, "bigmem", None, None, "bigmem&ib&mapa_ring4", None, None,
                                         None, None, None]


def _delay(result: Result) -> int | None:
    begin = result.placement.partition(" begin=")[2]
    return int(begin) if begin else None


def test_placement_require_delays_the_start_by_its_wait_and_prefers_the_good_feature(tmp_path: Path) -> None:
    plugin = _configured_plugin(tmp_path, (2, 4))
    require = "#MAPA sensitive=yes placement=require wait=7\n"
    cases = [
        Case(script=require, mode="gpus4"),
        Case(script="#MAPA sensitive=yes placement=require\n", mode="gpus4"),  # the default wait, 30 minutes
        Case(script=require, mode="gpus4and"),
        Case(script=require, mode="gpus4begin"),  # the user's own --begin: only the preference
        Case(script=require, mode="gpus4user"),  # the user's own --prefer: nothing
        Case(script=require, mode="gpus3"),  # no feature for 3 GPUs: nothing
        Case(script=require, comment="mine\x1fx", mode="gpus4"),  # `mapa release` could not read it: no delay
        Case(comment="mapa:sensitive=yes placement=require wait=2", mode="gpus4"),
    ]
    _, results = _run(cases, tmp_path, plugin)
    assert all(r.rc == SUCCESS for r in results), results
    assert [r.prefer for r in results] == ["mapa_ring4", "mapa_ring4", "bigmem&ib&mapa_ring4", "mapa_ring4", "bigmem", None,
                                           "mapa_ring4", "mapa_ring4"]
    delays = [_delay(r) for r in results]
    assert 7 * 60 - 5 <= delays[0] <= 7 * 60 and 30 * 60 - 5 <= delays[1] <= 30 * 60 and 7 * 60 - 5 <= delays[2] <= 7 * 60
    assert delays[3] > 7000  # the user's own begin time, untouched
    assert delays[4:7] == [None, None, None]
    assert 2 * 60 - 5 <= delays[7] <= 2 * 60
    assert results[2].placement.startswith("features=bigmem&ib ")
    assert [r.admin_comment for r in results[:2]] == ["mapa:topology=ring sensitive=yes placement=require wait=7",
                                                      "mapa:topology=ring sensitive=yes placement=require wait=30"]


# --- MAPA's record behind foreign `mapa:` words in admin_comment (issue #31) ---------------------

# Loads the plugin like run_cases.lua, then per record "MODE SCRIPT_LEN ADMIN_LEN\n" + bytes runs
# "submit" (slurm_job_submit with job_desc.script and job_desc.admin_comment; answers rc and
# job_desc.admin_comment after it) or "admin" (the plugin's local _admin_text on ADMIN, found among
# the upvalues of slurm_job_submit; answers 0 and its result). Answer: "RC LEN\n" + LEN bytes.
ADMIN_DRIVER = r"""
slurm = { SUCCESS = 0, ERROR = -1, ESLURM_INVALID_GRES = 2072, ESLURM_INTERNAL = 2090 }
for _, name in ipairs({ "log_user", "log_info", "log_debug", "log_error" }) do
    slurm[name] = function(fmt, ...) string.format(fmt, ...) end
end
assert(loadfile(arg[1]))()

local function upvalue(fn, name, seen)
    if seen[fn] then
        return nil
    end
    seen[fn] = true
    local index = 1
    while true do
        local found, value = debug.getupvalue(fn, index)
        if found == nil then
            return nil
        elseif found == name then
            return value
        elseif type(value) == "function" then
            local inner = upvalue(value, name, seen)
            if inner ~= nil then
                return inner
            end
        end
        index = index + 1
    end
end
local admin_text = assert(upvalue(slurm_job_submit, "_admin_text", {}), "no _admin_text in the plugin")

local file = assert(io.open(arg[2], "rb"))
local data = file:read("*a")
file:close()
local position, out = 1, {}
local function take(count)
    if count < 0 then
        return nil
    end
    local text = string.sub(data, position, position + count - 1)
    position = position + count
    return text
end
while position <= #data do
    local stop = assert(string.find(data, "\n", position, true))
    local mode, script_len, admin_len = string.match(string.sub(data, position, stop - 1), "^(%a+) (%-?%d+) (%-?%d+)$")
    position = stop + 1
    local script, admin = take(tonumber(script_len)), take(tonumber(admin_len))
    local rc, result
    if mode == "submit" then
        local job_desc = { script = script, admin_comment = admin }
        rc = slurm_job_submit(job_desc, {}, 1000)
        result = rawget(job_desc, "admin_comment") or ""
    else
        rc, result = 0, admin_text(admin)
    end
    out[#out + 1] = string.format("%d %d\n", rc, #result) .. result
end
io.write(table.concat(out))
"""


def _run_admin(tmp: Path, cases: list[tuple[str, str | None, str | None]], plugin: Path = PLUGIN) -> list[tuple[int, str]]:
    """(mode, script, admin_comment) cases through ADMIN_DRIVER: (rc, admin_comment after / admin text)."""
    lua = _require("lua5.1")
    blob = bytearray()
    for mode, script, admin in cases:
        raw, admin_raw = _bytes(script), _bytes(admin)
        blob += f"{mode} {-1 if raw is None else len(raw)} {-1 if admin_raw is None else len(admin_raw)}\n".encode()
        blob += (raw or b"") + (admin_raw or b"")
    (tmp / "admin_driver.lua").write_text(ADMIN_DRIVER)
    (tmp / "admin_cases.bin").write_bytes(bytes(blob))
    done = subprocess.run([lua, str(tmp / "admin_driver.lua"), str(plugin), str(tmp / "admin_cases.bin")],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, f"the Lua driver failed:\n{done.stderr.decode(errors='replace')}"
    data, pos, results = done.stdout, 0, []
    for _ in cases:
        end = data.index(b"\n", pos)
        rc, length = map(int, data[pos:end].split())
        results.append((rc, data[end + 1 : end + 1 + length].decode("latin-1")))
        pos = end + 1 + length
    assert pos == len(data), "the driver wrote more results than cases"
    return results


_BLANKS = " \t\r\n\f\v"  # what the plugin strips around the admin's text (Python's str.strip, for ASCII)
# Foreign `mapa:` words: an admin's notes, another tool's, a user's rejected directive; none a directive.
_FOREIGN_MAPA_WORDS = ["mapa:checked", "MAPA: checked", "Mapa:topology=blob", "mapa:ticket#12", "mapa:see-docs", "mapa:gpus=0 ok",
                       "mapa:topology=ring x"]
_OLD_RECORD = "mapa:topology=tree sensitive=no # n1=0,3 policy=preserve free=0-3 eff=58.900 # checked by ops"
_SUBMIT_SCRIPT = "#!/bin/sh\n#MAPA topology=ring sensitive=yes\nsrun x\n"
_NEW_RECORD = "mapa:topology=ring sensitive=yes"


def _foreign_mapa_words(count: int) -> str:
    return " ".join(_FOREIGN_MAPA_WORDS[i % len(_FOREIGN_MAPA_WORDS)] for i in range(count))


def _python_admin_text(text: str) -> str:
    """The admin's text by decision.py's rule, stripped as the plugin strips it."""
    from slurm_mapa.slurm.text.decision import find_record

    start = find_record(text)
    return (text if start is None else text[:start]).strip(_BLANKS)


@pytest.mark.parametrize("count", [32, 33, 100, 1000, 2600])
def test_many_foreign_mapa_words_do_not_hide_an_older_record_from_the_plugin(tmp_path: Path, count: int) -> None:
    """Issue #31: the record after 32 or more foreign `mapa:` words was taken for the admin's text,
    and a second record appended. Only texts within _MAX_ADMIN_COMMENT_CHARS (16 KB) are rewritten:
    2600 words fit as `mapa: MAPA: ...`, 1000 of the longer ones."""
    variants = [_foreign_mapa_words(count), " ".join(["mapa:", "MAPA:"] * (count // 2)), _foreign_mapa_words(count).replace(" ", "\t")]
    variants = [admin for admin in variants if len(admin) + 1 + len(_OLD_RECORD) <= 16384]
    assert len(variants) >= (1 if count > 1000 else 3)
    cases = [("submit", _SUBMIT_SCRIPT, f"{admin} {_OLD_RECORD}") for admin in variants]
    results = _run_admin(tmp_path, cases)
    for (_, _, admin_comment), admin, (rc, after) in zip(cases, variants, results):
        assert len(admin_comment) <= 16384
        assert rc == SUCCESS
        assert after == f"{admin} {_NEW_RECORD}", admin_comment[-200:]
        assert after.lower().count("mapa:topology=") == admin.lower().count("mapa:topology=") + 1  # one record, not two
        assert _python_admin_text(admin_comment) == admin


@pytest.mark.parametrize("count", [32, 100, 10_000])
def test_the_plugins_admin_text_finds_the_record_behind_any_number_of_foreign_mapa_words(tmp_path: Path, count: int) -> None:
    """_admin_text itself, past what slurm_job_submit reads (an admin_comment over 16 KB is left as it was)."""
    foreign = " ".join(["mapa:", "MAPA:"] * (count // 2))  # 10,000 words: 60,000 bytes
    mixed = _foreign_mapa_words(min(count, 4000))  # other words, some with a `#`: 4000 fill MAX_RECORD_SCAN_CHARS
    texts = [f"{foreign} {_OLD_RECORD}", f"{mixed} {_OLD_RECORD}", f" \t{foreign}\n{_OLD_RECORD} "]
    started = time.monotonic()
    results = _run_admin(tmp_path, [("admin", None, text) for text in texts])
    elapsed = time.monotonic() - started
    assert [admin for _, admin in results] == [foreign, mixed, foreign]
    assert [admin for _, admin in results] == [_python_admin_text(text) for text in texts]
    assert elapsed < 10, f"the plugin took {elapsed:.1f} s"
    if count == 10_000:  # through slurm_job_submit: too long to rewrite, left as it was
        (rc, after), = _run_admin(tmp_path, [("submit", _SUBMIT_SCRIPT, texts[0])])
        assert (rc, after) == (SUCCESS, texts[0])


def test_the_plugin_and_find_record_agree_on_admin_comments_full_of_mapa_words(tmp_path: Path) -> None:
    """The rule of decision.py's find_record, hostile texts and the scan bound included; linear time."""
    scan = 65536  # decision.py's MAX_RECORD_SCAN_CHARS
    record = "mapa:topology=ring sensitive=yes # n1=0,3 policy=preserve"
    texts = [
        "x" * (scan - 1) + " " + record,  # the record starts at MAX_RECORD_SCAN_CHARS: not looked at
        "x" * (scan - 2) + " " + record,  # one before: found
        " ".join(["mapa:"] * 200_000),  # no `#`: one segment, its last word's text far too long to parse
        " ".join(["mapa:x#"] * 200_000),  # a segment per word
        " ".join(["mapa:topology=ring sensitive=yes" + " gpus=2" * 70 + " #"] * 20_000),  # each too many tokens
        ("mapa:" + "topology=ring " * 580 + "# ") * 200,  # each one 8 Ki characters, parsed up to its length check
        ("mapa:" + "x" * 8000 + "\xe9 #") * 200,  # each one long, with a character no directive has
        ("mapa:" + "x" * 8000 + " ") * 200 + record,  # the record beyond the bound
        " ".join(["mapa:", "mapa:topology=ring", "MAPA:gpus=2"] * 1000) + " # n1=0 policy=p",  # the last word before `#` parses
        "re MAPA: bug #7 mapa: is fine, mapa:topology=tree sensitive=yes # n1=2 policy=preserve",
        "mapa:topology=blob mapa:gpus=2 # x",
        "xmapa:topology=ring mapa:topology=ring\tgpus=2",
        "ops: mapa:" + "y" * 8188 + " #",  # exactly at the line limit: parsed, refused for its token
        "ops: mapa:" + " " * 8187 + "#",  # exactly at the line limit: a directive (the defaults)
        "ops: mapa:" + " " * 8188 + "#",  # one over: not a record
        "",
        "   ",
    ]
    rnd = random.Random(31)
    words = ["mapa:", "MAPA:", "mapa:topology=ring", "mapa:gpus=2", "mapa:topology=blob", "sensitive=yes", "gpus=2", "mapa:x",
             "#", " # ", " ", "\t", "\n", "n1=0 policy=p", "x", "=", "mapa:topology=ring\tgpus=2", "\xe9", "mapa:gpus=2 gpus=3"]
    texts += ["".join(rnd.choice(words) for _ in range(rnd.randint(0, 60))) for _ in range(2000)]
    started = time.monotonic()
    results = _run_admin(tmp_path, [("admin", None, text) for text in texts])
    elapsed = time.monotonic() - started
    for text, (rc, admin) in zip(texts, results):
        assert (rc, admin) == (0, _python_admin_text(text)), text[:200]
    assert results[0][1] == texts[0].strip() and results[1][1] == "x" * (scan - 2)
    assert results[8][1] == " ".join(["mapa:", "mapa:topology=ring", "MAPA:gpus=2"] * 1000)[: -len(" MAPA:gpus=2")]
    assert results[13][1] == "ops:" and results[14][1] == texts[14].strip()
    assert elapsed < 10, f"the plugin took {elapsed:.1f} s"


def test_a_directive_whose_gpu_count_cannot_be_the_jobs_is_refused_at_submit(tmp_path: Path) -> None:
    """Issue 39: gpus=8 on a 4-GPU-per-node job, a 2x4 grid or a hypercube of 3 were accepted and
    then fell back at the job's start (bad-directive-or-model). Where the submission fixes the GPUs
    per node (--gres=gpu:N, --gpus-per-node), they are refused with what is accepted."""
    cases = [
        Case(script="#MAPA topology=ring gpus=8\n", mode="gpus4"),
        Case(script="#MAPA topology=mesh2d:2x4\n", mode="gpus4"),
        Case(script="#MAPA topology=hypercube\n", mode="gpus3"),
        Case(script="#MAPA topology=ring gpus=3 sensitive=yes\n", mode="gpus4typed"),
        Case(script="#MAPA topology=ring gpus=4\n", mode="gpus4"),  # matches
        Case(script="#MAPA topology=mesh2d:2x2\n", mode="gpus4"),  # matches
        Case(script="#MAPA topology=hypercube gpus=8\n", mode="submit"),  # the job's count is unknown here: the directive alone
        Case(script="#MAPA topology=ring gpus=3\n", mode="gpus2job"),  # --gpus=2 over any number of nodes: unknown per node
        Case(script="#MAPA topology=ring gpus=3\n", mode="gpus2job1"),  # --gpus=2 -N 1: 2 on the node
    ]
    _, results = _run(cases, tmp_path)
    outcomes = [_verdict(result) for result in results]
    assert outcomes[0] == ("error", "MAPA: gpus=8 but the job asks for 4 GPUs per node (accepted: gpus=4, or no gpus=: the job's own count)")
    assert outcomes[1] == ("error", "MAPA: topology=mesh2d:2x4 needs 8 GPUs, got 4")
    assert outcomes[2][0] == "error" and "a hypercube needs a power-of-two GPU count" in outcomes[2][1] and outcomes[2][1].endswith("got 3")
    assert outcomes[3][0] == "error" and "gpus=3 but the job asks for 4 GPUs per node" in outcomes[3][1]
    assert [result.rc for result in results[4:8]] == [SUCCESS] * 4, outcomes[4:8]
    assert outcomes[8][0] == "error" and "gpus=3 but the job asks for 2 GPUs per node" in outcomes[8][1]


# --- job_submit.lua keeps an admin_comment already set ----------------------------------------
# Words of admins' texts and of MAPA's records, ASCII (what the plugin's byte-wise scan and
# Python's reader must agree on).
_ADMIN_WORDS = ["mapa:", "MAPA:", "mapa:topology=ring", "mapa:topology=blob", "#", " # ", " ", "\t", "\n", "n1=0", "n2=1,2",
                "policy=preserve", "policy=x", "free=0-3", "checked", "ops", "=", "ticket=12", "sensitive=yes",
                "topology=tree", "x"]

def run_lua_submit(tmp_path: Path, cases: list[tuple[str, str | None]]) -> list[str]:
    """(batch script, admin_comment) cases through slurm_job_submit: the admin_comment after each,
    by this file's driver of the plugin."""
    results = _run_admin(tmp_path, [("submit", body, admin) for body, admin in cases])
    assert all(rc == 0 for rc, _ in results), results
    return [admin for _, admin in results]


def test_job_submit_lua_keeps_the_admins_text(tmp_path):
    body = "#!/bin/sh\n#MAPA topology=ring sensitive=yes\nsrun x\n"
    record = "mapa:topology=ring sensitive=yes"
    cases = [
        (body, None),
        (body, "checked by ops"),
        (body, "  ops: ok \t"),
        (body, "ops: ok mapa:topology=tree sensitive=no # n1=0 policy=preserve # checked"),
        (body, "MAPA: checked"),
        (body, "re MAPA: bug mapa:topology=tree"),
        (body, "x" * (MAX_ADMIN_COMMENT_CHARS - len(record))),
        ("#!/bin/sh\nsrun x\n", "no directive: untouched"),
    ]
    assert run_lua_submit(tmp_path, cases) == [
        record,
        "checked by ops " + record,
        "ops: ok " + record,
        "ops: ok " + record,
        "MAPA: checked " + record,
        "re MAPA: bug " + record,
        "x" * (MAX_ADMIN_COMMENT_CHARS - len(record)),  # it would pass the bound: left as it was
        "no directive: untouched",
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(_ADMIN_WORDS + ["mapa:gpus=2", "mapa:sensitive=no"]),
                         max_size=10).map("".join), min_size=20, max_size=20))
def test_job_submit_lua_and_python_agree_on_the_admins_text(tmp_path, texts):
    body = "#!/bin/sh\n#MAPA topology=tree\n"
    results = run_lua_submit(tmp_path, [(body, text) for text in texts])
    for text, result in zip(texts, results):
        kept = split_admin_comment(text)[0]
        assert result == (f"{kept} " if kept else "") + "mapa:topology=tree sensitive=no", text
