"""The #MAPA directive grammar: the shared conformance corpus, unit tests and property tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_paths import TEST_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.core.patterns import SHAPES, make_pattern
from slurm_mapa.errors import InputError
from slurm_mapa.slurm.text.directive import (
    MAX_DIRECTIVE_LINES,
    MAX_LINE_CHARS,
    Directive,
    parse_comment,
    parse_directive,
    parse_directive_lines,
    to_request,
)

CORPUS = TEST_DATA / "directives" / "corpus.tsv"
PARSERS = {"body": parse_directive, "comment": parse_comment, "script": parse_directive_lines}


def _unescape(text: str) -> str:
    """The corpus escapes: \\n, \\t, \\r first, then \\xHH (one byte, read here as U+00HH)."""
    text = text.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), text)


def _corpus() -> list[tuple[int, str, str, str, str]]:
    cases = []
    raw = CORPUS.read_bytes()
    assert raw.isascii() and b"\r" not in raw, "the corpus is ASCII with LF line ends"
    for number, line in enumerate(raw.decode("ascii").split("\n"), start=1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        assert len(fields) == 4, f"corpus line {number}: {len(fields)} fields, expected 4"
        kind, text, verdict, expected = fields
        assert kind in PARSERS and verdict in ("ok", "none", "error"), f"corpus line {number}"
        assert not re.search(r"\\(?![ntr]|x[0-9a-fA-F]{2})", text), f"corpus line {number}: stray backslash"
        cases.append((number, kind, _unescape(text), verdict, expected))
    return cases


CASES = _corpus()


def test_corpus_is_large_and_covers_every_kind_and_verdict() -> None:
    assert len(CASES) >= 60
    assert {c[1] for c in CASES} == set(PARSERS)
    assert {c[3] for c in CASES} == {"ok", "none", "error"}
    normalised = " ".join(c[4] for c in CASES if c[3] == "ok")
    for shape in SHAPES:
        assert f"topology={shape}" in normalised
    for key in ("gpus=", "edges=", "weights=", "sensitive=yes"):
        assert key in normalised


@pytest.mark.parametrize("number,kind,text,verdict,expected", CASES, ids=[f"L{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_corpus(number: int, kind: str, text: str, verdict: str, expected: str) -> None:
    parse = PARSERS[kind]
    if verdict == "error":
        with pytest.raises(InputError) as caught:
            parse(text)
        message = str(caught.value)
        assert message.startswith("MAPA: ")
        assert expected in message
        return
    result = parse(text)
    if verdict == "none":
        assert result is None
        return
    assert result is not None
    assert result.normalised() == expected
    assert parse_directive(expected) == result  # the normalised text is itself a valid, equal body
    assert parse_comment(result.as_comment()) == result


# --- unit tests -----------------------------------------------------------------------------


def test_defaults() -> None:
    assert parse_directive("") == Directive() == Directive("ring", False)
    assert Directive().normalised() == "topology=ring sensitive=no"
    assert Directive().as_comment() == "mapa:topology=ring sensitive=no"


def test_fields() -> None:
    d = parse_directive("topology=custom gpus=4 edges=0-1,1-2 weights=4,0.5 sensitive=yes")
    assert d == Directive("custom", True, 4, None, ((0, 1), (1, 2)), (4.0, 0.5))
    assert parse_directive("topology=torus2d:4x4").grid == (4, 4)


def test_directive_constructor_validates() -> None:
    with pytest.raises(InputError, match="unknown topology 'rnig'"):
        Directive("rnig")
    with pytest.raises(InputError, match="needs 8 GPUs, got 6"):
        Directive("mesh2d", gpus=6, grid=(2, 4))
    with pytest.raises(InputError, match="bad weight"):
        Directive(weights=(0.1234567,))
    with pytest.raises(InputError, match="bad weight"):
        Directive(weights=(float("nan"),))
    with pytest.raises(InputError, match="bad weight"):
        Directive(weights=(float("inf"),))
    with pytest.raises(InputError, match="sensitive must be a bool"):
        Directive(sensitive="yes")  # type: ignore[arg-type]
    # lists become tuples, ints become floats: equal to the parsed form
    assert Directive("custom", edges=[[0, 1]], weights=[2]) == parse_directive("topology=custom edges=0-1 weights=2")  # type: ignore[arg-type]


def test_duplicate_error_names_both_and_the_line() -> None:
    with pytest.raises(InputError) as caught:
        parse_directive_lines("#!/bin/sh\n#MAPA sensitive=yes\n#MAPA sensitive=no\n")
    assert str(caught.value) == (
        "MAPA: line 3: sensitive given twice: 'sensitive=yes' and 'sensitive=no' "
        "(accepted: each key once, or again with the same value)"
    )


def test_stop_rule_follows_sbatch() -> None:
    script = "#!/bin/bash\n#SBATCH --gres=gpu:2\n#MAPA topology=chain\nhostname\n#MAPA sensitive=yes\n"
    assert parse_directive_lines(script) == Directive("chain")
    assert parse_directive_lines("hostname\n#MAPA topology=chain\n") is None


def test_errors_in_late_lines_are_ignored_like_sbatch() -> None:
    assert parse_directive_lines("#!/bin/bash\nexit 0\n#MAPA topology=rnig\n#mapa x\n") is None


def test_limits_in_python() -> None:
    assert parse_directive_lines("\n".join(["#MAPA"] * MAX_DIRECTIVE_LINES)) == Directive()
    with pytest.raises(InputError, match="more than 16 #MAPA lines"):
        parse_directive_lines("\n".join(["#MAPA"] * (MAX_DIRECTIVE_LINES + 1)))
    with pytest.raises(InputError, match=f"at most {MAX_LINE_CHARS}"):
        parse_comment("mapa:" + " " * MAX_LINE_CHARS)
    # a huge script before the directive is fine: only #MAPA lines are bounded
    assert parse_directive_lines("#" * 100_000 + "\n#MAPA topology=star\n") == Directive("star")


def test_comment_returns_none_for_other_comments() -> None:
    assert parse_comment(None) is None
    assert parse_directive_lines(None) is None
    assert parse_comment("") is None
    assert parse_comment("run 3 of the sweep") is None


@pytest.mark.parametrize(
    "body,gpus,shape,edges",
    [
        ("topology=ring", 4, "ring", 4),
        ("topology=ring", 2, "ring", 2),
        ("topology=ring", 1, "ring", 0),
        ("topology=chain sensitive=yes", 3, "chain", 2),
        ("topology=ring+tree", 8, "ring+tree", 15),
        ("topology=all", 8, "all", 28),
        ("topology=mesh2d", 8, "mesh2d", 10),
        ("topology=torus2d:4x4", 16, "torus2d", 32),
        ("topology=hypercube gpus=8", 8, "hypercube", 12),
        ("topology=custom edges=0-1,1-2 weights=4,1", 3, "custom", 2),
        ("topology=custom edges=0-1,1-2", 8, "custom", 2),
        ("topology=ring gpus=4 weights=4,1,1,4", 4, "ring", 4),
    ],
)
def test_to_request(body: str, gpus: int, shape: str, edges: int) -> None:
    directive = parse_directive(body)
    request = to_request(directive, gpus)
    assert request.pattern.shape == shape
    assert request.pattern.size == gpus
    assert len(request.pattern.edges) == edges
    assert request.sensitive == directive.sensitive
    if directive.weights:
        assert request.pattern.weights == directive.weights


@pytest.mark.parametrize(
    "body,gpus,message",
    [
        ("gpus=4", 2, "MAPA: gpus=4 but the job has 2 GPUs on this node"),
        ("topology=hypercube", 6, "MAPA: a hypercube needs a power-of-two GPU count (accepted: 1, 2, 4, 8, 16, 32, 64), got 6"),
        ("topology=mesh2d:2x4", 6, "MAPA: topology=mesh2d:2x4 needs 8 GPUs, got 6"),
        ("topology=custom edges=0-5", 4, "MAPA: edge '0-5' names GPU 5, outside 0..3 for 4 GPUs"),
        ("weights=1,1,1,1", 3, "MAPA: 4 weights given for the 3 edges of ring over 3 GPUs"),
        ("topology=custom edges=0-1 weights=1", 1, "MAPA: edge '0-1' names GPU 1, outside 0..0 for 1 GPUs"),
        ("topology=ring", 0, "MAPA: a pattern needs 1 to 64 GPUs, got 0"),
        ("topology=ring", 65, "MAPA: a pattern needs 1 to 64 GPUs, got 65"),
    ],
)
def test_to_request_errors(body: str, gpus: int, message: str) -> None:
    with pytest.raises(InputError) as caught:
        to_request(parse_directive(body), gpus)
    assert str(caught.value).startswith(message)


# --- property tests -------------------------------------------------------------------------

WEIGHT = st.builds(
    lambda whole, frac, digits: float(f"{whole}.{frac:06d}"[: len(str(whole)) + 1 + digits] if digits else whole) or 1.0,
    st.integers(0, 999_999),
    st.integers(0, 999_999),
    st.integers(0, 6),
)


@st.composite
def directives(draw: st.DrawFn) -> Directive:
    shape = draw(st.sampled_from(SHAPES))
    sensitive = draw(st.booleans())
    grid = None
    if shape in ("mesh2d", "torus2d") and draw(st.booleans()):
        rows = draw(st.integers(1, 8))
        grid = (rows, draw(st.integers(1, 64 // rows)))
    if grid is not None:
        gpus = draw(st.sampled_from([None, grid[0] * grid[1]]))
    elif shape == "hypercube":
        gpus = draw(st.sampled_from([None, 1, 2, 4, 8, 16, 32, 64]))
    else:
        gpus = draw(st.none() | st.integers(1, 64))
    edges = None
    if shape == "custom":
        top = (gpus or 64) - 1
        if top < 1:
            gpus, top = None, 63
        pair = st.tuples(st.integers(0, top), st.integers(0, top)).filter(lambda e: e[0] != e[1])
        edges = tuple(draw(st.lists(pair, min_size=1, max_size=20)))
    size = gpus if gpus is not None else (grid[0] * grid[1] if grid else None)
    count = None
    if edges is not None:
        count = len(edges)
    elif size is not None:
        count = len(make_pattern(shape, size, grid=grid).edges)
    weights = None
    if count and count <= 200 and draw(st.booleans()):
        weights = tuple(draw(st.lists(WEIGHT, min_size=count, max_size=count)))
    placement = draw(st.sampled_from([None, "prefer", "any"] + (["require"] if sensitive else [])))
    wait = draw(st.none() | st.integers(1, 1440)) if placement == "require" else None
    return Directive(shape, sensitive, gpus, grid, edges, weights, placement, wait)


@given(directives())
def test_normalised_round_trips(directive: Directive) -> None:
    text = directive.normalised()
    assert parse_directive(text) == directive
    assert parse_comment(directive.as_comment()) == directive
    assert parse_directive_lines(f"#!/bin/bash\n#SBATCH -N1\n#MAPA {text}\nsrun ./app\n") == directive
    assert parse_directive(text).normalised() == text


@given(directives(), st.randoms(use_true_random=False), st.integers(1, 5))
def test_order_case_and_line_splits_do_not_matter(directive: Directive, rnd, pieces: int) -> None:
    tokens = directive.normalised().split(" ")
    rnd.shuffle(tokens)
    tokens = [t.upper() if rnd.random() < 0.5 and not t.startswith(("edges", "weights")) else t for t in tokens]
    assert parse_directive("\t ".join(tokens)) == directive
    lines = [tokens[i::pieces] for i in range(pieces)]
    script = "#!/bin/sh\n" + "".join(f"#MAPA {' '.join(line)}\n\n" for line in lines) + "true\n"
    assert parse_directive_lines(script) == directive


@given(directives(), st.integers(1, 64))
def test_to_request_raises_only_input_error(directive: Directive, gpus: int) -> None:
    try:
        request = to_request(directive, gpus)
    except InputError as error:
        assert str(error).startswith("MAPA: ")
        return
    assert request.gpus == gpus and request.sensitive == directive.sensitive
    if directive.gpus is not None:
        assert gpus == directive.gpus


def _only_input_errors(parse, text: str) -> None:
    try:
        parse(text)
    except InputError as error:
        assert str(error).startswith("MAPA: ")


VOCAB = st.sampled_from(
    ["topology", "sensitive", "gpus", "edges", "weights", "=", "ring", "mesh2d", ":", "x", "custom", "hypercube",
     "0", "1", "4", "64", "99999", "-", ",", ".", "yes", " ", "\t", "#", "#MAPA ", "\n", "mapa:", "\x00", "\u00e9", "e9"]
)


@settings(max_examples=300)
@given(st.text(max_size=200) | st.lists(VOCAB, max_size=40).map("".join))
def test_arbitrary_text_raises_only_input_error(text: str) -> None:
    _only_input_errors(parse_directive, text)
    _only_input_errors(parse_comment, text)
    _only_input_errors(parse_comment, "mapa:" + text)
    _only_input_errors(parse_directive_lines, text)
    _only_input_errors(parse_directive_lines, "#MAPA " + text)
