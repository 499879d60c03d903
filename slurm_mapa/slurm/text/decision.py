"""The decision record the Prolog writes into a job's AdminComment, and its parser.

    mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve free=0,1,2,3,4,5,6,7 slurm=0,1 affinity=prefer:0.1 eff=58.925 agg=100.000 pres=422.000

MAPA's record is the directive as ``mapa:<normalised>`` (what the job_submit plugin stored), then
one segment per node of the job, ``# NODE=GPUS key=value...``, GPUs in pattern order. `free=` is
what the Prolog chose from and `running=0,1/4,5` the GPUs of each job running on the node then
(jobs separated by `/`), so a replay can make the same decision again; with the CPU affinity rule
on, ``slurm=`` (the GPUs Slurm picked, whose CPUs the job's cores are taken to be, unless
``cpus=`` gives the job's CPUs as its cgroup held them) and ``affinity=prefer:0.1`` (or
``strict``) say under which rule it was made. When mapa-agent could not
isolate the job's devices on the node (docs/isolation.md), it adds ``isolation=failed-open`` (the
job ran without) or ``isolation=refused`` (fail-closed: its task failed) and ``why=<reason>``.
``model=NAME`` names the effective-bandwidth model that priced ``eff=``, and ``extrapolated=yes``
says that ``eff=`` lies outside that model's fitted range; ``held=3`` names GPUs an admin held out
of new jobs (``mapa gpu hold``) that the job still had to be given, too few others being free; records written before these keys
existed have neither (model unknown, not marked) and parse as before.
The directive grammar ends a body at `#`, so the record's text up to the first `#` parses as the
directive. sacct keeps it; mapa-replay and mapa explain read it.

The AdminComment is also the admins' field, and other job_submit plugins may write to it, so
MAPA's record shares it (:func:`read_admin_comment`):

* The record starts at the first ``mapa:`` (any case) that begins the text or follows
  whitespace and whose text up to the next ``#`` parses as a directive, however many other
  ``mapa:`` words come before it; only a ``mapa:`` within the first MAX_RECORD_SCAN_CHARS
  characters is taken (:func:`find_record`). Text before it is the admin's, kept verbatim in
  front. With no such record the whole text is the admin's, and MAPA's record goes after it,
  one space apart.
  A ``mapa:`` in the admin's note that does not parse (``MAPA: checked``) is therefore not taken
  for the record; one whose text does parse would be: an admin should not write a directive in
  a note.
* After the record's directive, a segment between two ``#`` is a node's decision when its first
  token is ``NODE=GPUS`` (a readable GPU list) and it has a ``policy=`` token; any other segment
  is the admin's (``... # checked by ops``) and is kept, in order, after the decisions. Tokens an
  admin appended to a decision that MAPA rewrites (``policy=preserve checked``) are kept the same
  way, as a segment of their own.
* Outer blanks of each part are dropped, and an empty segment (``##``) is; the text within each
  part is kept as written. A record rewrite never makes the whole text longer than
  MAX_ADMIN_COMMENT_CHARS (see :func:`with_decision`).

Older records (``mapa:...`` first, decisions after) are the case with no admin text.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ...errors import InputError
from .commands import parse_gpu_indices
from .directive import COMMENT_PREFIX, MAX_LINE_CHARS, Directive, parse_comment

# 16 Ki characters stay within the 64 KiB TEXT column slurmdbd keeps the AdminComment in, even
# at 4 bytes a character, and hold about 150 decisions of 8-GPU nodes.
MAX_ADMIN_COMMENT_CHARS = 16384
# Where MAPA's record is looked for: the first 64 Ki characters, all that slurmdbd's 64 KiB TEXT
# column can hold, so what sacct returns is read whole; with_decision and job_submit.lua write at
# most MAX_ADMIN_COMMENT_CHARS. Bounds the work on any text, however many `mapa:` words it has.
MAX_RECORD_SCAN_CHARS = 65536
DECISION_KEYS = ("policy", "free", "running", "slurm", "cpus", "affinity", "eff", "agg", "pres", "model", "extrapolated", "fallback",
                 "held", "isolation", "why")
MAX_MODEL_TOKEN_CHARS = 64
_MODEL_TOKEN = re.compile(r"[A-Za-z0-9._+-]{1,64}")  # what model_token writes
ISOLATION_STATES = ("failed-open", "refused")  # what a node's record says when device isolation was not applied
MAX_WHY_CHARS = 200
_CPU_LIST = re.compile(r"[0-9]{1,5}(?:-[0-9]{1,5})?(?:,[0-9]{1,5}(?:-[0-9]{1,5})?)*")  # the form format_cpu_list writes
_MARKER = re.compile(r"(?:^|(?<=[ \t\r\n\f\v]))mapa:", re.IGNORECASE)
_DIRECTIVE_CHARS = re.compile(r"[ -~\t]*")  # what directive._check_line accepts, checked at C speed first


@dataclass(frozen=True)
class Decision:
    """What one node chose for one job, as recorded in the AdminComment and the ledger."""

    node: str
    gpus: tuple[int, ...]
    policy: str
    effective: float | None = None
    aggregated: float | None = None
    preserved: float | None = None
    fallback: str = ""
    free: tuple[int, ...] = ()
    running: tuple[tuple[int, ...], ...] = ()
    slurm_gpus: tuple[int, ...] = ()  # the GPUs Slurm picked (its job CPUs follow them)
    affinity: str = ""  # the CPU affinity rule the choice was made under: "strict", "prefer:0.1"; "": none
    job_cpus: str = ""  # the job's CPUs as its cpuset cgroup held them (hooks/job_cpus.py); "": Slurm's GPUs' CPUs
    isolation: str = ""  # "" (applied, or off) or one of ISOLATION_STATES, written by mapa-agent
    why: str = ""  # why isolation was not applied: one token (why_token)
    model: str = ""  # the effective-bandwidth model that priced `effective` (model_token); "": not recorded
    extrapolated: bool = False  # `effective` lies outside that model's fitted range
    gap: float | None = None  # the search ran out of time: the optimum is at most this much better (None: proven)
    held: tuple[int, ...] = ()  # GPUs held out of new jobs (`mapa gpu hold`) that the job had to be given: too few others were free

    def text(self) -> str:
        parts = [f"{self.node}={','.join(map(str, self.gpus))}", f"policy={self.policy}"]
        if self.free:
            parts.append(f"free={','.join(map(str, self.free))}")
        if self.running:
            parts.append("running=" + "/".join(",".join(map(str, group)) for group in self.running))
        if self.slurm_gpus:
            parts.append(f"slurm={','.join(map(str, self.slurm_gpus))}")
        if self.job_cpus:
            parts.append(f"cpus={self.job_cpus}")
        if self.affinity:
            parts.append(f"affinity={self.affinity}")
        for name, value in (("eff", self.effective), ("agg", self.aggregated), ("pres", self.preserved)):
            if value is not None:
                parts.append(f"{name}={value:.3f}")
        if self.model:
            parts.append(f"model={model_token(self.model)}")
        if self.extrapolated:
            parts.append("extrapolated=yes")
        if self.gap is not None:
            parts.append(f"gap={self.gap:.3f}")
        if self.fallback:
            parts.append(f"fallback={self.fallback}")
        if self.held:
            parts.append(f"held={','.join(map(str, self.held))}")
        if self.isolation:
            parts.append(f"isolation={self.isolation}")
        if self.why:
            parts.append(f"why={why_token(self.why)}")
        return " ".join(parts)


def model_token(name: str) -> str:
    """A model's name as one token of a record: characters other than letters, digits and ``._+-``
    become ``_``; at most MAX_MODEL_TOKEN_CHARS characters."""
    token = re.sub(r"[^A-Za-z0-9._+-]", "_", name)[:MAX_MODEL_TOKEN_CHARS]
    return token or "_"


def why_token(reason: str) -> str:
    """A reason as one token of a record: blanks become ``_``, ``#`` (which ends a segment) ``-``;
    at most MAX_WHY_CHARS characters (the log has the whole text)."""
    token = "_".join(reason.replace("#", "-").split())
    return token if len(token) <= MAX_WHY_CHARS else token[: MAX_WHY_CHARS - 3] + "..."


@dataclass(frozen=True)
class AdminComment:
    """An AdminComment split into the admin's text and MAPA's record (see the module docstring)."""

    before: str = ""  # the admin's text in front of the record
    directive: str | None = None  # the record's ``mapa:<body>`` as written; None: the text has no record
    decisions: tuple[str, ...] = ()  # the nodes' decision segments as written, in order
    after: tuple[str, ...] = ()  # the admin's segments after the record's directive, in order

    def text(self) -> str:
        """The AdminComment these parts make (the form :func:`with_decision` writes)."""
        if self.directive is None:
            return " # ".join(filter(None, [self.before, *self.after]))
        record = " # ".join([self.directive, *self.decisions, *self.after])
        return f"{self.before} {record}" if self.before else record


def find_record(admin_comment: str) -> int | None:
    """Where MAPA's record starts in an AdminComment, or None when it has none.

    Linear in the text, whatever it holds: only ``mapa:`` words starting in the first
    MAX_RECORD_SCAN_CHARS characters are candidates, and of the candidates before one ``#`` only
    the last is parsed. An earlier one's text up to the ``#`` holds the later ``mapa:`` word after
    a blank, and no directive has a token starting with ``mapa:`` (its key would hold a ``:``), so
    it could not parse; the texts parsed are therefore disjoint, and each at most MAX_LINE_CHARS
    long (parse_comment refuses a longer one). Other ``mapa:`` words in front, however many, cannot
    hide the record.
    """
    limit = MAX_RECORD_SCAN_CHARS + len(COMMENT_PREFIX) - 1  # a marker starting before MAX_RECORD_SCAN_CHARS fits
    segment_end = -1  # where the text of the current `#` segment ends: its `#`, or the end of the text
    pending = None  # the last marker seen in the current segment
    for marker in _MARKER.finditer(admin_comment, 0, limit):
        start = marker.start()
        if start > segment_end:  # a new segment: the pending marker is the last of its own
            if pending is not None and _is_record(admin_comment, pending, segment_end):
                return pending
            segment_end = admin_comment.find("#", start)
            if segment_end < 0:
                segment_end = len(admin_comment)
        pending = start
    if pending is not None and _is_record(admin_comment, pending, segment_end):
        return pending
    return None


def _is_record(admin_comment: str, start: int, end: int) -> bool:
    """Whether ``admin_comment[start:end]`` (``mapa:`` up to the next ``#``) parses as a directive."""
    if end - start > MAX_LINE_CHARS or not _DIRECTIVE_CHARS.fullmatch(admin_comment, start, end):
        return False  # parse_comment refuses it (too long, or a character no directive has)
    try:
        parse_comment(admin_comment[start:end])
    except InputError:
        return False
    return True


def read_admin_comment(admin_comment: str) -> AdminComment:
    """The admin's text and MAPA's record of an AdminComment; never raises on any text."""
    start = find_record(admin_comment)
    if start is None:
        return AdminComment(before=admin_comment.strip())
    directive, *segments = admin_comment[start:].split("#")
    decisions, after = [], []
    for segment in segments:
        segment = segment.strip()
        if segment:
            (decisions if _decision_in(segment) is not None else after).append(segment)
    return AdminComment(admin_comment[:start].strip(), directive.strip(), tuple(decisions), tuple(after))


def split_admin_comment(admin_comment: str) -> tuple[str, str]:
    """(the admin's text in front of MAPA's record, the record from ``mapa:`` to the end); ("text", "") without a record."""
    start = find_record(admin_comment)
    if start is None:
        return admin_comment.strip(), ""
    return admin_comment[:start].strip(), admin_comment[start:].strip()


def record_directive(admin_comment: str) -> Directive | None:
    """The directive of MAPA's record in an AdminComment, None when it has none; never raises."""
    start = find_record(admin_comment)
    if start is None:
        return None
    end = admin_comment.find("#", start)
    return parse_comment(admin_comment[start : end if end >= 0 else len(admin_comment)])


def parse_decisions(admin_comment: str) -> dict[str, Decision]:
    """The per-node decisions in MAPA's record of an AdminComment (the last one wins for a node)."""
    decisions: dict[str, Decision] = {}
    for segment in read_admin_comment(admin_comment).decisions:
        decision = _decision_in(segment)
        if decision is not None:
            decisions[decision.node] = decision
    return decisions


def _decision_in(segment: str) -> Decision | None:
    """The decision one `#` segment records, or None when it is not one (then it is the admin's)."""
    tokens = segment.split()
    if not tokens or "=" not in tokens[0] or not any(t.startswith("policy=") for t in tokens[1:]):
        return None
    node, _, gpu_text = tokens[0].partition("=")
    if not node:
        return None
    try:
        gpus = parse_gpu_indices(gpu_text)
    except ValueError:
        return None
    fields = dict(token.partition("=")[::2] for token in tokens[1:])

    def number(key: str) -> float | None:
        try:
            return float(fields[key]) if key in fields else None
        except ValueError:
            return None

    try:
        free = parse_gpu_indices(fields.get("free", ""))
    except ValueError:
        free = ()
    try:
        running = tuple(parse_gpu_indices(group) for group in fields["running"].split("/")) if "running" in fields else ()
    except ValueError:
        running = ()
    try:
        slurm_gpus = parse_gpu_indices(fields.get("slurm", ""))
    except ValueError:
        slurm_gpus = ()
    affinity = fields.get("affinity", "")
    job_cpus = fields.get("cpus", "")
    if len(job_cpus) > 4096 or not _CPU_LIST.fullmatch(job_cpus):
        job_cpus = ""
    isolation = fields.get("isolation", "")
    model = fields.get("model", "")
    try:
        held = parse_gpu_indices(fields.get("held", ""))
    except ValueError:
        held = ()
    return Decision(
        node, gpus, fields.get("policy", ""), number("eff"), number("agg"), number("pres"), fields.get("fallback", ""), free,
        tuple(group for group in running if group), slurm_gpus, affinity if parse_affinity(affinity) else "", job_cpus,
        isolation if isolation in ISOLATION_STATES else "", fields.get("why", "")[:MAX_WHY_CHARS],
        model if _MODEL_TOKEN.fullmatch(model) else "", fields.get("extrapolated") == "yes",
        gap if (gap := number("gap")) is not None and gap >= 0 else None, held,
    )


def affinity_token(mode: str, max_loss: float) -> str:
    """How a record names the CPU affinity rule of a choice: ``strict``, ``prefer:0.25``."""
    return f"prefer:{max_loss:g}" if mode == "prefer" else mode


def parse_affinity(token: str) -> tuple[str, float] | None:
    """(mode, max_loss) of an ``affinity=`` token; None for anything else (an old or foreign record)."""
    mode, _, loss = token.partition(":")
    if mode == "strict" and not loss:
        return "strict", 0.0
    if mode == "prefer":
        try:
            value = float(loss)
        except ValueError:
            return None
        return ("prefer", value) if 0 <= value <= 1 else None
    return None


def with_decision(admin_comment: str, directive: Directive, decision: Decision) -> str:
    """The AdminComment with this node's decision added, replacing an older one of the same node.

    The admin's text (before the record and in segments after it) is kept; the record's
    directive becomes ``directive``. When the result would pass MAX_ADMIN_COMMENT_CHARS, this
    node's decision is written without ``free=``/``running=``; ValueError when even that is too
    long, or when the node name cannot be written in the record (blanks, ``#``, ``=``).
    """
    if not decision.node or re.search(r"[\s#=]", decision.node):
        raise ValueError(f"node name {decision.node[:60]!r} cannot be recorded (accepted: a name without blanks, '#' or '=')")
    parts = read_admin_comment(admin_comment)
    kept, after = [], []
    for segment in parts.decisions:
        tokens = segment.split()
        if tokens[0].partition("=")[0] != decision.node:
            kept.append(segment)
            continue
        extra = [t for t in tokens[1:] if t.partition("=")[0] not in DECISION_KEYS]
        if extra:  # an admin's words appended to the decision we replace
            after.append(" ".join(extra))
    after.extend(parts.after)
    compact = dataclasses.replace(decision, free=(), running=())
    for mine in (decision, compact):
        text = AdminComment(parts.before, directive.as_comment(), (*kept, mine.text()), tuple(after)).text()
        if len(text) <= MAX_ADMIN_COMMENT_CHARS:
            return text
    raise ValueError(
        f"the AdminComment would be {len(text)} characters with node {decision.node}'s decision "
        f"(accepted: at most {MAX_ADMIN_COMMENT_CHARS}); not recorded"
    )
