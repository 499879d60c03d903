"""The ``#MAPA`` directive grammar: what a job says about its communication pattern.

Batch scripts carry ``#MAPA topology=ring sensitive=yes`` lines; srun/salloc jobs, which have no
script, carry the same text in their comment as ``--comment=mapa:topology=ring sensitive=yes``.
The job_submit plugin validates the text at submit time and stores :meth:`Directive.normalised`
in the job's AdminComment as ``mapa:<normalised>``; the Prolog (as root, on user text) parses it
again before it picks GPUs. Everything here is pure: no I/O, strictly bounded input, and every
failure is an :class:`~slurm_mapa.errors.InputError` whose message starts ``MAPA:``, quotes the
bad token and says what is accepted. docs/directives.md is the user-facing description, and
tests/data/directives/corpus.tsv is the conformance corpus shared with the Lua validator.

Grammar (one body, whitespace-separated tokens; keys and keyword values are case-insensitive)::

    body     := token*                     # a token starting with '#' ends the body (comment)
    token    := key '=' value
    key      := topology | sensitive | gpus | edges | weights | placement | wait
    topology := shape [':' R 'x' C]        # grid only for mesh2d / torus2d
    sensitive:= yes | no | true | false | 1 | 0
    gpus     := 1..64
    edges    := A '-' B (',' A '-' B)*     # topology=custom only; GPUs 0..63, A != B
    weights  := W (',' W)*                 # one per pattern edge; W = digits{1,6} ['.' digits{1,6}] > 0
    placement:= prefer | require | any     # node choice (docs/directives.md); require needs sensitive=yes
    wait     := 1..1440                    # minutes; placement=require only (default 30)

Scripts follow sbatch's rule for ``#SBATCH``: only the lines before the first command count
(see :func:`parse_directive_lines`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

from ...core.patterns import MAX_PATTERN_GPUS, SHAPES, make_pattern
from ...core.policies import Request
from ...errors import InputError

KEYWORD = "#MAPA"
COMMENT_PREFIX = "mapa:"
KEYS = ("topology", "sensitive", "gpus", "edges", "weights", "placement", "wait")
PLACEMENTS = ("prefer", "require", "any")
DEFAULT_REQUIRE_WAIT = 30  # minutes a placement=require job holds out for a good node
MAX_WAIT_MINUTES = 1440
GRID_SHAPES = ("mesh2d", "torus2d")
TRUE_WORDS = ("yes", "true", "1")
FALSE_WORDS = ("no", "false", "0")
DEFAULT_TOPOLOGY = "ring"
DEFAULT_SENSITIVE = False

MAX_LINE_CHARS = 8192  # one #MAPA line, or one mapa: comment / directive body
MAX_DIRECTIVE_LINES = 16  # #MAPA lines in one script
MAX_TOKENS = 64  # key=value tokens in one directive (all lines together)
MAX_LIST_ITEMS = 2048  # items in edges= or weights=
MAX_WEIGHT_DIGITS = 6  # digits before and after the decimal point of a weight

_KEY_LIST = ", ".join(KEYS)
_SHAPE_LIST = ", ".join(SHAPES)
_GRID_RE = re.compile(r"([0-9]{1,2})x([0-9]{1,2})")
_GPUS_RE = re.compile(r"[0-9]{1,4}")
_WAIT_RE = re.compile(r"[0-9]{1,5}")
_EDGE_RE = re.compile(r"([0-9]{1,2})-([0-9]{1,2})")
_WEIGHT_RE = re.compile(r"[0-9]{1,%d}(\.[0-9]{1,%d})?" % (MAX_WEIGHT_DIGITS, MAX_WEIGHT_DIGITS))
_WEIGHT_QUANTUM = Decimal(1).scaleb(-MAX_WEIGHT_DIGITS)
_WEIGHT_MAX = Decimal(10) ** MAX_WEIGHT_DIGITS - _WEIGHT_QUANTUM


def _fail(message: str, line: int | None = None) -> InputError:
    where = f"line {line}: " if line is not None else ""
    return InputError(f"MAPA: {where}{message}")


@dataclass(frozen=True)
class Directive:
    """A job's validated MAPA directive. ``Directive()`` is the default: an insensitive ring.

    Construction validates every field and every combination that does not need the node's GPU
    count (that check is :func:`to_request`'s), so a ``Directive`` always has a normalised text
    that parses back to an equal ``Directive``.
    """

    topology: str = DEFAULT_TOPOLOGY
    sensitive: bool = DEFAULT_SENSITIVE
    gpus: int | None = None
    grid: tuple[int, int] | None = None
    edges: tuple[tuple[int, int], ...] | None = None
    weights: tuple[float, ...] | None = None
    placement: str | None = None  # None: the site's default (a preference when features are on)
    wait: int | None = None  # minutes; only with placement=require, which defaults it

    def __post_init__(self) -> None:
        if self.topology not in SHAPES:
            raise _fail(f"unknown topology {_q(self.topology)} (accepted: {_SHAPE_LIST})")
        if not isinstance(self.sensitive, bool):
            raise _fail(f"sensitive must be a bool, got {self.sensitive!r} (accepted: yes, no)")
        if self.gpus is not None and not _is_int_in(self.gpus, 1, MAX_PATTERN_GPUS):
            raise _fail(f"bad value {_q(str(self.gpus))} for gpus (accepted: a whole number from 1 to {MAX_PATTERN_GPUS})")
        if self.grid is not None:
            grid = tuple(self.grid)
            if self.topology not in GRID_SHAPES:
                raise _fail(
                    f"a grid like ':{_grid_text(grid)}' is only accepted with mesh2d and torus2d, "
                    f"not topology={self.topology} (accepted: mesh2d:RxC, torus2d:RxC)"
                )
            if len(grid) != 2 or not all(_is_int_in(v, 1, MAX_PATTERN_GPUS) for v in grid) or grid[0] * grid[1] > MAX_PATTERN_GPUS:
                raise _fail(f"bad grid {_q(_grid_text(grid))} (accepted: RxC of positive whole numbers, at most {MAX_PATTERN_GPUS} GPUs)")
            object.__setattr__(self, "grid", grid)
        if self.edges is not None:
            if self.topology != "custom":
                raise _fail(f"edges= is only accepted with topology=custom, not topology={self.topology}")
            edges = tuple(tuple(e) for e in self.edges)
            if not 1 <= len(edges) <= MAX_LIST_ITEMS:
                raise _fail(f"edges= has {len(edges)} edges (accepted: 1 to {MAX_LIST_ITEMS})")
            for edge in edges:
                if len(edge) != 2 or not all(_is_int_in(v, 0, MAX_PATTERN_GPUS - 1) for v in edge):
                    raise _fail(f"bad edge {edge!r} (accepted: pairs of GPU numbers 0 to {MAX_PATTERN_GPUS - 1})")
                if edge[0] == edge[1]:
                    raise _fail(f"edge '{edge[0]}-{edge[1]}' links a GPU to itself (accepted: pairs of two different GPUs)")
            object.__setattr__(self, "edges", edges)
        elif self.topology == "custom":
            raise _fail("topology=custom needs edges=, e.g. edges=0-1,1-2 (accepted: comma-separated GPU pairs)")
        if self.weights is not None:
            weights = tuple(self.weights)
            if not 1 <= len(weights) <= MAX_LIST_ITEMS:
                raise _fail(f"weights= has {len(weights)} values (accepted: 1 to {MAX_LIST_ITEMS})")
            for value in weights:
                _format_weight(value)  # raises on a value the grammar cannot write
            object.__setattr__(self, "weights", tuple(float(w) for w in weights))
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise _fail(f"bad value {_q(str(self.placement))} for placement (accepted: {', '.join(PLACEMENTS)})")
        if self.placement == "require" and not self.sensitive:
            raise _fail("placement=require needs sensitive=yes: an insensitive job has no good node to wait for "
                        "(accepted: placement=prefer or placement=any without sensitive=yes)")
        if self.wait is not None:
            if self.placement != "require":
                raise _fail("wait= is only accepted with placement=require (accepted: placement=require wait=MINUTES)")
            if not _is_int_in(self.wait, 1, MAX_WAIT_MINUTES):
                raise _fail(f"bad value {_q(str(self.wait))} for wait (accepted: whole minutes from 1 to {MAX_WAIT_MINUTES})")
        elif self.placement == "require":
            object.__setattr__(self, "wait", DEFAULT_REQUIRE_WAIT)
        size = self.gpus if self.gpus is not None else (self.grid[0] * self.grid[1] if self.grid else None)
        if size is not None:
            _check_size(self, size)
        elif self.edges is not None and self.weights is not None and len(self.weights) != len(self.edges):
            raise _fail(_weights_count_message(len(self.weights), len(self.edges), "the custom edge list"))

    def normalised(self) -> str:
        """The canonical one-line text, e.g. ``topology=ring sensitive=yes``.

        Keys in the order topology, sensitive, gpus, edges, weights, placement, wait; topology and
        sensitive always (defaults included), the others only when given, and wait always with
        placement=require; lower case; ``sensitive`` as yes/no.
        """
        topology = self.topology + (f":{_grid_text(self.grid)}" if self.grid else "")
        parts = [f"topology={topology}", f"sensitive={'yes' if self.sensitive else 'no'}"]
        if self.gpus is not None:
            parts.append(f"gpus={self.gpus}")
        if self.edges is not None:
            parts.append("edges=" + ",".join(f"{a}-{b}" for a, b in self.edges))
        if self.weights is not None:
            parts.append("weights=" + ",".join(_format_weight(w) for w in self.weights))
        if self.placement is not None:
            parts.append(f"placement={self.placement}")
        if self.wait is not None:
            parts.append(f"wait={self.wait}")
        return " ".join(parts)

    def as_comment(self) -> str:
        """``mapa:<normalised>``, the form stored in AdminComment (and accepted in a job comment)."""
        return COMMENT_PREFIX + self.normalised()


# --- parsing --------------------------------------------------------------------------------


def parse_directive(text: str) -> Directive:
    """Parse a directive body such as ``topology=ring sensitive=yes`` (empty: the defaults)."""
    _check_line(text, None)
    return _build([(_tokens(text), None)])


def parse_comment(comment: str | None) -> Directive | None:
    """The directive in a job comment of the form ``mapa:<body>``, or None for any other comment.

    Leading and trailing blanks are ignored (they count towards the length limit) and the prefix
    is case-insensitive (``MAPA:`` works too); a comment that does not start with it is the
    user's own and is left alone.
    """
    if not comment:
        return None
    stripped = comment.lstrip(" \t")
    if stripped[: len(COMMENT_PREFIX)].lower() != COMMENT_PREFIX:
        return None
    _check_line(comment, None)  # the whole comment, surrounding blanks included, is bounded
    return parse_directive(stripped[len(COMMENT_PREFIX) :])


SUFFIX_OPEN = " [mapa:"  # the directive job_submit.lua adds after a user's own comment text
SUFFIX_CLOSE = "]"


def _split_suffix(comment: str) -> tuple[str, str] | None:
    """(the user's text, the directive body) of a comment ending in `` [mapa:BODY]``, else None.
    Only the comment's last MAX_LINE_CHARS + 8 characters are searched: a body is never longer."""
    if not comment.endswith(SUFFIX_CLOSE):
        return None
    start = comment.rfind(SUFFIX_OPEN, max(0, len(comment) - (MAX_LINE_CHARS + len(SUFFIX_OPEN) + 1)))
    if start < 0 or SUFFIX_CLOSE in comment[start + len(SUFFIX_OPEN) : -1]:
        return None
    return comment[:start], comment[start + len(SUFFIX_OPEN) : -1]


def directive_in_comment(comment: str | None) -> Directive | None:
    """The directive a job comment carries: a whole ``mapa:<body>`` comment, or the
    `` [mapa:<body>]`` job_submit.lua puts after the user's own text (so that the Prolog finds it
    in SLURM_JOB_COMMENT without asking slurmctld); None for a comment without either."""
    directive = parse_comment(comment)
    if directive is not None or not comment:
        return directive
    split = _split_suffix(comment)
    return None if split is None else parse_directive(split[1])


def comment_with_directive(comment: str | None, directive: Directive) -> str | None:
    """The comment job_submit.lua leaves on a job with ``directive``: ``mapa:<normalised>`` when
    the user gave none, the user's ``mapa:`` comment as it is, else the user's text with
    `` [mapa:<normalised>]`` after it (replacing one already there). None: leave the comment as
    it is (it would pass MAX_LINE_CHARS; the Prolog then reads the batch script)."""
    if not comment:
        return directive.as_comment()
    if parse_comment(comment) is not None:
        return None
    split = _split_suffix(comment)
    text = (split[0] if split is not None else comment) + SUFFIX_OPEN + directive.normalised() + SUFFIX_CLOSE
    return text if len(text) <= MAX_LINE_CHARS and text != comment else None


def parse_directive_lines(script_text: str | None) -> Directive | None:
    """The merged ``#MAPA`` lines of a batch script, or None when it has none.

    As sbatch does for ``#SBATCH``, only the lines before the first command count: reading stops
    at the first line that is neither blank nor a comment (its first non-blank character ``#``).
    Later ``#MAPA`` lines are ignored, as sbatch ignores a late ``#SBATCH`` (they may well be text
    of a here-document that writes another script). A directive line is ``#MAPA`` at the very
    start of the line followed by a space, a tab or the end of the line. Near misses before the
    first command (``#mapa ...``, `` #MAPA ...``, ``#MAPA:...``) are errors rather than silently
    ignored. Several lines merge; a key repeated with a different value is an error.
    """
    if not script_text:
        return None
    found: list[tuple[list[str], int]] = []
    for number, raw in enumerate(script_text.split("\n"), start=1):
        line = raw[:-1] if raw.endswith("\r") else raw
        stripped = line.lstrip(" \t")
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break  # the first command: sbatch stops reading directives here
        if line.startswith(KEYWORD) and (len(line) == len(KEYWORD) or line[len(KEYWORD)] in " \t"):
            if len(found) == MAX_DIRECTIVE_LINES:
                raise _fail(f"more than {MAX_DIRECTIVE_LINES} #MAPA lines (accepted: at most {MAX_DIRECTIVE_LINES})", number)
            _check_line(line, number)
            found.append((_tokens(line[len(KEYWORD) :]), number))
        elif _near_miss(stripped):
            raise _fail(
                f"{_q(stripped[:len(KEYWORD)])} here is not a directive "
                f"(accepted: '#MAPA' at the start of the line, then a space and key=value tokens)",
                number,
            )
    if not found:
        return None
    return _build(found)


def _near_miss(stripped: str) -> bool:
    head = stripped[: len(KEYWORD)]
    if head.upper() != KEYWORD:
        return False
    rest = stripped[len(KEYWORD) :]
    return rest == "" or rest[0] in " \t:="


def _check_line(text: str, line: int | None) -> None:
    if len(text) > MAX_LINE_CHARS:
        raise _fail(f"directive text is {len(text)} characters long (accepted: at most {MAX_LINE_CHARS})", line)
    for column, char in enumerate(text, start=1):
        if not (" " <= char <= "~" or char == "\t"):
            raise _fail(
                f"character {ascii(char)} at column {column} is not accepted (accepted: printable ASCII, spaces and tabs)",
                line,
            )


def _tokens(body: str) -> list[str]:
    tokens: list[str] = []
    for token in body.split():
        if token.startswith("#"):
            break  # the rest of the line is a comment
        tokens.append(token)
    return tokens


def _build(lines: list[tuple[list[str], int | None]]) -> Directive:
    seen: dict[str, tuple[str, str]] = {}  # key -> (normalised value, token as written)
    values: dict[str, object] = {}
    count = 0
    for tokens, line in lines:
        for token in tokens:
            count += 1
            if count > MAX_TOKENS:
                raise _fail(f"more than {MAX_TOKENS} key=value tokens (accepted: at most {MAX_TOKENS})", line)
            key, sep, value = token.partition("=")
            if not sep:
                raise _fail(f"token {_q(token)} is not key=value (accepted keys: {_KEY_LIST})", line)
            key = key.lower()
            if key not in KEYS:
                raise _fail(f"unknown key {_q(token.partition('=')[0])} in {_q(token)} (accepted: {_KEY_LIST})", line)
            if not value:
                raise _fail(f"empty value in {_q(token)} (accepted: key=value with a value)", line)
            try:
                parsed, canonical = _VALUE_PARSERS[key](value)
            except InputError as error:
                raise _fail(str(error), line) from None
            if key in seen:
                if seen[key][0] != canonical:
                    raise _fail(
                        f"{key} given twice: {_q(seen[key][1])} and {_q(token)} "
                        f"(accepted: each key once, or again with the same value)",
                        line,
                    )
                continue
            seen[key] = (canonical, token)
            values[key] = parsed
    topology, grid = values.get("topology", (DEFAULT_TOPOLOGY, None))  # type: ignore[misc]
    return Directive(
        topology=topology,
        sensitive=values.get("sensitive", DEFAULT_SENSITIVE),  # type: ignore[arg-type]
        gpus=values.get("gpus"),  # type: ignore[arg-type]
        grid=grid,
        edges=values.get("edges"),  # type: ignore[arg-type]
        weights=values.get("weights"),  # type: ignore[arg-type]
        placement=values.get("placement"),  # type: ignore[arg-type]
        wait=values.get("wait"),  # type: ignore[arg-type]
    )


# Value parsers: (parsed value, canonical text). Their errors lack the "MAPA: " prefix, which
# _build adds together with the line number.


def _parse_topology(value: str) -> tuple[tuple[str, tuple[int, int] | None], str]:
    lowered = value.lower()
    shape, colon, grid_text = lowered.partition(":")
    if shape not in SHAPES:
        raise InputError(f"unknown topology {_q(value)} (accepted: {_SHAPE_LIST})")
    if not colon:
        return (shape, None), shape
    if shape not in GRID_SHAPES:
        raise InputError(
            f"a grid like ':{grid_text}' is only accepted with mesh2d and torus2d, "
            f"not topology={value} (accepted: mesh2d:RxC, torus2d:RxC)"
        )
    match = _GRID_RE.fullmatch(grid_text)
    grid = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if min(grid) < 1 or grid[0] * grid[1] > MAX_PATTERN_GPUS:
        raise InputError(
            f"bad grid {_q(grid_text)} in topology={value} "
            f"(accepted: RxC of positive whole numbers, at most {MAX_PATTERN_GPUS} GPUs, e.g. {shape}:2x4)"
        )
    return (shape, grid), f"{shape}:{_grid_text(grid)}"


def _parse_sensitive(value: str) -> tuple[bool, str]:
    lowered = value.lower()
    if lowered in TRUE_WORDS:
        return True, "yes"
    if lowered in FALSE_WORDS:
        return False, "no"
    raise InputError(f"bad value {_q(value)} for sensitive (accepted: yes, no, true, false, 1, 0)")


def _parse_gpus(value: str) -> tuple[int, str]:
    if _GPUS_RE.fullmatch(value) and 1 <= int(value) <= MAX_PATTERN_GPUS:
        return int(value), str(int(value))
    raise InputError(f"bad value {_q(value)} for gpus (accepted: a whole number from 1 to {MAX_PATTERN_GPUS})")


def _parse_edges(value: str) -> tuple[tuple[tuple[int, int], ...], str]:
    items = _split_list(value, "edges")
    edges: list[tuple[int, int]] = []
    for item in items:
        match = _EDGE_RE.fullmatch(item)
        if not match or max(int(match.group(1)), int(match.group(2))) >= MAX_PATTERN_GPUS:
            raise InputError(
                f"bad edge {_q(item)} in edges= (accepted: comma-separated pairs like 0-1 of GPU numbers 0 to {MAX_PATTERN_GPUS - 1})"
            )
        a, b = int(match.group(1)), int(match.group(2))
        if a == b:
            raise InputError(f"edge {_q(item)} links a GPU to itself (accepted: pairs of two different GPUs)")
        edges.append((a, b))
    return tuple(edges), ",".join(f"{a}-{b}" for a, b in edges)


def _parse_weights(value: str) -> tuple[tuple[float, ...], str]:
    items = _split_list(value, "weights")
    weights: list[float] = []
    for item in items:
        if not _WEIGHT_RE.fullmatch(item) or Decimal(item) == 0:
            raise InputError(
                f"bad weight {_q(item)} in weights= (accepted: positive decimal numbers like 4 or 0.5, "
                f"at most {MAX_WEIGHT_DIGITS} digits before and after the point)"
            )
        weights.append(float(item))
    return tuple(weights), ",".join(_format_weight(w) for w in weights)


def _parse_placement(value: str) -> tuple[str, str]:
    lowered = value.lower()
    if lowered in PLACEMENTS:
        return lowered, lowered
    raise InputError(f"bad value {_q(value)} for placement (accepted: {', '.join(PLACEMENTS)})")


def _parse_wait(value: str) -> tuple[int, str]:
    if _WAIT_RE.fullmatch(value) and 1 <= int(value) <= MAX_WAIT_MINUTES:
        return int(value), str(int(value))
    raise InputError(f"bad value {_q(value)} for wait (accepted: whole minutes from 1 to {MAX_WAIT_MINUTES})")


_VALUE_PARSERS = {
    "topology": _parse_topology,
    "sensitive": _parse_sensitive,
    "gpus": _parse_gpus,
    "edges": _parse_edges,
    "weights": _parse_weights,
    "placement": _parse_placement,
    "wait": _parse_wait,
}


def _split_list(value: str, key: str) -> list[str]:
    count = value.count(",") + 1
    if count > MAX_LIST_ITEMS:
        raise InputError(f"{key}= has {count} items (accepted: at most {MAX_LIST_ITEMS})")
    return value.split(",")


# --- from a directive to a request ----------------------------------------------------------


def to_request(directive: Directive, gpus_on_node: int) -> Request:
    """The core :class:`Request` for a job with ``gpus_on_node`` GPUs on this node.

    Errors (all ``InputError``, ``MAPA: ...``): ``gpus=`` differs from ``gpus_on_node``, a grid
    or hypercube that does not fit the count, a custom edge naming a GPU beyond it, a weights
    count that differs from the pattern's edge count.
    """
    if not _is_int_in(gpus_on_node, 1, MAX_PATTERN_GPUS):
        raise _fail(f"a pattern needs 1 to {MAX_PATTERN_GPUS} GPUs, got {gpus_on_node!r}")
    if directive.gpus is not None and directive.gpus != gpus_on_node:
        raise _fail(
            f"gpus={directive.gpus} but the job has {gpus_on_node} GPUs on this node "
            f"(accepted: gpus= equal to the job's GPU count on the node, or no gpus=)"
        )
    _check_size(directive, gpus_on_node)
    try:
        pattern = make_pattern(
            directive.topology, gpus_on_node, grid=directive.grid, edges=directive.edges, weights=directive.weights
        )
    except InputError as error:  # _check_size should have caught it; keep the MAPA: form anyway
        raise _fail(str(error)) from None
    return Request(pattern=pattern, sensitive=directive.sensitive)


def _check_size(directive: Directive, size: int) -> None:
    """Checks of ``directive`` against a GPU count, with the same messages at parse and at Prolog time."""
    shape = directive.topology
    if directive.grid is not None and directive.grid[0] * directive.grid[1] != size:
        raise _fail(f"topology={shape}:{_grid_text(directive.grid)} needs {directive.grid[0] * directive.grid[1]} GPUs, got {size}")
    if shape == "hypercube" and size & (size - 1):
        raise _fail(f"a hypercube needs a power-of-two GPU count (accepted: 1, 2, 4, 8, 16, 32, 64), got {size}")
    if directive.edges is not None:
        for a, b in directive.edges:
            if max(a, b) >= size:
                raise _fail(f"edge '{a}-{b}' names GPU {max(a, b)}, outside 0..{size - 1} for {size} GPUs")
    if directive.weights is not None:
        try:
            edge_count = len(make_pattern(shape, size, grid=directive.grid, edges=directive.edges).edges)
        except InputError as error:
            raise _fail(str(error)) from None
        if edge_count != len(directive.weights):
            raise _fail(_weights_count_message(len(directive.weights), edge_count, f"{shape} over {size} GPUs"))


def _weights_count_message(given: int, edges: int, what: str) -> str:
    return f"{given} weights given for the {edges} edges of {what} (accepted: one weight per edge, in the pattern's edge order)"


# --- small helpers --------------------------------------------------------------------------


def _format_weight(value: object) -> str:
    """The canonical text of a weight: shortest decimal, no exponent, no trailing zeros."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _fail(f"bad weight {value!r} (accepted: positive numbers)")
    try:
        number = Decimal(repr(float(value)))
    except (ArithmeticError, ValueError):  # overflow; nan and inf become non-finite Decimals below
        number = Decimal(0)
    ok = number.is_finite() and 0 < number <= _WEIGHT_MAX and number == number.quantize(_WEIGHT_QUANTUM)
    if not ok:
        raise _fail(
            f"bad weight {value!r} (accepted: positive decimal numbers like 4 or 0.5, "
            f"at most {MAX_WEIGHT_DIGITS} digits before and after the point)"
        )
    text = format(number, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _grid_text(grid: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in grid)


def _is_int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _q(text: str) -> str:
    """Quote user text in messages as 'text' (plain quotes, as the Lua validator writes them)."""
    return f"'{text}'"
