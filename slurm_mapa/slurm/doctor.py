"""``mapa doctor``: check the live installation of slurm-mapa on this node, one line per check.

Run as root on a compute node or on the controller. Each check prints ``ok``, ``warn`` or ``FAIL``,
its name, what it found and, unless ok, what to do; the exit status is 1 if any check FAILs, else 0.
``--json`` prints the same as a list of ``{check, status, found, fix}``.

The design keeps the judgement pure: :func:`run_checks` takes an :class:`Inputs` record of plain
data (the texts of ``scontrol show config``, ``scontrol show node``, gres.conf, cgroup.conf,
mapa.toml and the hook files, the parsed topologies, path facts judged by the trust rules of
:mod:`slurm_mapa.slurm.paths`, the agent's answer) and returns :class:`Check` records. The one I/O
edge, :func:`gather`, reads and asks with bounded timeouts (each Slurm command at most
``SLURM_TIMEOUT_S``, no shell; the agent ``AGENT_TIMEOUT_S``) and never raises: what it cannot
read becomes an error text in the record, and the check that needs it a FAIL or warn line naming it.

The role decides what is checked. A compute node (slurmd runs here, or slurmctld knows the node)
gets every check; a controller (slurmctld runs here, or slurm.conf's SlurmctldHost names this
host) skips the node-only checks (hook files, SPANK plugin, topology, gres.conf, discovery,
isolation, mapa-agent, node features) and says so on its ``role`` line; the job_submit.lua
comparison runs only on a controller. When neither is clear, every node check runs.

docs/admin.md, "Checking an installation", lists the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..errors import MapaError
from ..hardware.topofile import Topology
from . import paths as trusted
from .agent_client import ANSWER_TIMEOUT_S, DEFAULT_SOCKET, ISOLATE_SOCKET
from .commands import Runner
from .config import DEFAULT_CONFIG_PATH, HookConfig, config_from_text
from .install import needed_hook_timeout
from .spankcheck import slurm_conf_value

OK, WARN, FAIL = "ok", "warn", "FAIL"
SLURM_TIMEOUT_S = 5.0  # each scontrol call
TOOL_TIMEOUT_S = 10.0  # each nvidia-smi / rocm-smi call, and NVML discovery
AGENT_TIMEOUT_S = 2.0  # the mapa-agent probe, connect and answer together
MAX_TEXT_BYTES = 1 << 20  # a config file; more is an error
UNLIMITED_TIMEOUT = 65534  # NO_VAL16, what Slurm prints for "no limit" (65535, INFINITE16, alike)
# A request the agent refuses at once and harmlessly: an unknown kind (it logs one line, "refused a
# request: unknown hook kind 'doctor'"). The protocol has no ping; this costs the agent a header parse.
PROBE = b"MAPA1 doctor 0\n"
HOOKS = (("Prolog", "prolog", "mapa-prolog-wrapper"), ("Epilog", "epilog", "mapa-epilog-wrapper"),
         ("TaskProlog", "taskprolog", "mapa-taskprolog"))
NODE_CHECKS = ("hook files", "hooks-current", "spank", "topology", "gres", "discovery", "isolation", "agent", "features")
ISOLATION_STRENGTH = {"off": 0, "fail-open": 1, "fail-closed": 2}


# --- records --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One line of the report."""

    check: str
    status: str  # ok | warn | FAIL
    found: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status, "found": self.found, "fix": self.fix}


@dataclass(frozen=True)
class PathFacts:
    """What the edge saw of one path root trusts (slurm_mapa.slurm.paths' rules)."""

    path: str
    label: str  # what it is, for the message: "Prolog wrapper", "mapa.toml", ...
    kind: str = "file"  # file | dir | program (symlinks followed, each judged) | socket
    exists: bool = True
    uid: int = 0  # owner of the file (a program: of the file its links lead to)
    mode: int = 0o644  # permission bits, likewise
    problem: str = ""  # paths.py's verdict ("" when root would trust it)
    required: bool = True  # an untrusted one is a FAIL (else a warn)


@dataclass(frozen=True)
class Inputs:
    """Everything the checks judge, as plain data (see :func:`gather`)."""

    node: str
    config_path: str = str(DEFAULT_CONFIG_PATH)
    euid: int = 0
    processes: frozenset[str] = frozenset()  # among slurmd, slurmctld: those running here
    show_config: str | None = None  # `scontrol show config`
    show_config_error: str = ""
    show_node: str | None = None  # `scontrol --oneliner show node NODE`
    show_node_error: str = ""
    slurm_conf_dir: str = "/etc/slurm"
    cgroup_conf: str | None = None  # this node's cgroup.conf, next to slurm.conf
    gres_conf: str | None = None
    gres_conf_error: str = ""
    devices: Mapping[str, str] = field(default_factory=dict)  # device file -> "char" | "missing" | what it is
    mapa_toml: str | None = None
    mapa_toml_error: str = ""
    topology: Topology | None = None  # the node's, from mapa.toml's [nodes]
    topology_error: str = ""
    discovered: Topology | None = None  # from nvidia-smi, rocm-smi or NVML, now
    discovery_tool: str = ""
    discovery_error: str = ""
    isolation: tuple[str, str] | None = None  # isolation.effective_mode: (mode, why)
    isolation_error: str = ""
    hooks: Mapping[str, PathFacts] = field(default_factory=dict)  # "Prolog" -> the MAPA hook slurm.conf names
    hook_texts: Mapping[str, str] = field(default_factory=dict)  # hook path -> its text
    plugstack: str = "/etc/slurm/plugstack.conf"
    spank_lines: tuple[tuple[str, str, str], ...] = ()  # MAPA's plugin lines: (required|optional, path, file)
    spank_built: Mapping[str, str] = field(default_factory=dict)  # plugin path -> the Slurm release it was built for
    spank_problems: tuple[str, ...] = ()  # spankcheck's lines
    spank_error: str = ""
    running_version: str = ""  # `slurmd -V` (or scontrol, sinfo): "slurm 26.05.5"
    job_submit_lua: str | None = None  # the installed job_submit.lua, next to slurm.conf
    job_submit_error: str = ""
    job_submit_expected: str | None = None  # what `mapa job-submit-lua` writes for this mapa.toml
    paths: tuple[PathFacts, ...] = ()  # every other path root trusts (existing ones)
    agent_socket: str = DEFAULT_SOCKET
    agent_answer: str | None = None
    agent_error: str = ""
    isolate_socket: PathFacts | None = None
    fleet_errors: tuple[str, ...] = ()  # [features] fleet topologies that do not load


# --- parsers of what Slurm prints -----------------------------------------------------------------
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


def _flag_list(value: str | None) -> list[str]:
    if value is None or value in ("", "(null)"):
        return []
    return [part.strip() for part in value.split(",") if part.strip()]


def _yes(value: str | None) -> bool:
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


def _script_value(text: str, name: str) -> str | None:
    """A ``NAME=value`` assignment line of a hook script (the value shell-unquoted)."""
    match = re.search(rf"^{name}=(.*)$", text, re.MULTILINE)
    if match is None:
        return None
    try:
        words = shlex.split(match.group(1))
    except ValueError:
        return match.group(1)
    return words[0] if words else ""


def wrapper_program(text: str) -> tuple[str, str] | None:
    """(python, package directory) of a wrapper `mapa hooks` wrote: its agent client line."""
    for line in text.splitlines():
        if "agent_client.py" in line and "-S" in line:
            try:
                words = shlex.split(line)
            except ValueError:
                return None
            client = next((word for word in words if word.endswith("/slurm_mapa/slurm/agent_client.py")), None)
            if client and words:
                return words[0], str(Path(client).parent.parent)
    return None


# --- the checks (pure) -----------------------------------------------------------------------------
def parse_config(text: str | None, source: str = "mapa.toml") -> tuple[HookConfig, str]:
    """mapa.toml as the checks use it, and its problem ("" when valid, strictly: with the engine's
    validation, as the Prolog reads it). An invalid one still yields what the Epilog's lenient read
    gives, or the defaults (what the hooks then run with)."""
    if text is None:
        return HookConfig(), "not read"
    try:
        return config_from_text(text, source=source, validate=True), ""
    except MapaError as error:
        problem = str(error)
    for candidate in (text, _without_unknown_keys(text)):
        if candidate is None:
            continue
        try:
            return config_from_text(candidate, source=source, validate=False), problem
        except MapaError:
            continue
    return HookConfig(), problem


def _without_unknown_keys(text: str) -> str | None:
    """``text`` less its unknown top-level keys and tables (a misspelled key), so that the other
    checks judge what the admin meant; None when that cannot be done simply."""
    import tomllib

    from .config import _KEYS, _OTHER_TOOLS_SECTIONS

    try:
        unknown = set(tomllib.loads(text)) - _KEYS - _OTHER_TOOLS_SECTIONS
    except tomllib.TOMLDecodeError:
        return None
    if not unknown:
        return None
    kept, table = [], None
    for line in text.splitlines(keepends=True):
        header = re.match(r"\s*\[+\s*\"?([A-Za-z0-9_-]+)", line)
        if header:
            table = header.group(1)
        key = re.match(r"\s*\"?([A-Za-z0-9_-]+)\"?\s*=", line)
        if (table in unknown) or (table is None and key and key.group(1) in unknown):
            continue
        kept.append(line)
    return "".join(kept)


@dataclass(frozen=True)
class Role:
    compute: bool
    controller: bool
    check: Check


def node_role(inputs: Inputs, conf: Mapping[str, str] | None) -> Role:
    """Compute node, controller, both, or unclear (then every node check runs)."""
    node = inputs.node
    slurmd, slurmctld = "slurmd" in inputs.processes, "slurmctld" in inputs.processes
    known = inputs.show_node is not None and f"NodeName={node} " in inputs.show_node + " "
    hosts = {value.split("(", 1)[0].split(".", 1)[0] for value in slurm_values(conf or {}, "SlurmctldHost")}
    named = node in hosts
    compute, controller = slurmd or known, slurmctld or named
    why = (["slurmd runs here"] if slurmd else []) + ([f"slurmctld knows node {node}"] if known else []) + \
          (["slurmctld runs here"] if slurmctld else []) + ([f"SlurmctldHost names {node}"] if named else [])
    if compute and controller:
        return Role(True, True, Check("role", OK, f"compute node {node} and controller ({'; '.join(why)}): every check runs"))
    if compute:
        return Role(True, False, Check("role", OK, f"compute node {node} ({'; '.join(why)}); job_submit.lua is "
                                                   "compared on the controller"))
    if controller:
        return Role(False, True, Check("role", OK, f"controller ({'; '.join(why)}); node checks skipped: not a compute node "
                                                   f"({', '.join(NODE_CHECKS)})"))
    return Role(True, False, Check(
        "role", WARN, f"neither slurmd nor slurmctld runs here and slurmctld does not know node {node}"
        + (f" ({inputs.show_node_error})" if inputs.show_node_error else "") + ": every node check runs",
        "run mapa doctor on a compute node or the controller; give --node NAME if slurm.conf knows this node by another name"))


def check_scontrol(inputs: Inputs, conf: Mapping[str, str] | None) -> Check:
    if conf is None:
        return Check("scontrol", FAIL, f"`scontrol show config` failed: {inputs.show_config_error or 'no output'}; "
                                       "the slurm.conf checks could not be made",
                     "install Slurm's commands (mapa.toml's scontrol = names the one the hooks run), start munge, "
                     "and check that slurmctld answers (`scontrol ping`)")
    version = conf.get("SLURM_VERSION", "unknown")
    return Check("scontrol", OK, f"`scontrol show config` answered: Slurm {version}")


def path_problems(facts: PathFacts) -> list[str]:
    """Why root should not trust ``facts.path`` (none: it may): missing, paths.py's verdict, and,
    stricter than paths.py (which also accepts the user running the check), an owner other than root."""
    if not facts.exists:
        return [f"{facts.path} does not exist"]
    problems = [facts.problem] if facts.problem else []
    if facts.uid < 0:  # it could not be looked at: the problem says why
        return problems
    if facts.uid != 0 and "belongs to uid" not in facts.problem:
        problems.append(f"{facts.path} belongs to uid {facts.uid}; accepted: owned by root (uid 0)")
    if facts.kind != "socket" and facts.mode & 0o022 and "writable by group or others" not in facts.problem:
        problems.append(f"{facts.path} is writable by group or others (mode {facts.mode:o})")
    return problems


def check_hook(key: str, name: str, wanted: str, conf: Mapping[str, str], facts: PathFacts | None, compute: bool) -> Check:
    values = slurm_values(conf, key)
    shown = ", ".join(values)
    fix_conf = (f"set {key}=DIR/{wanted} in slurm.conf (`mapa hooks DIR` writes it and prints the lines), "
                "then `scontrol reconfigure`")
    if not values:
        return Check(name, FAIL, f"slurm.conf sets no {key}: MAPA's {'TaskProlog binds no task' if key == 'TaskProlog' else key + ' never runs'}",
                     fix_conf)
    ours = [value for value in values if os.path.basename(value) == wanted]
    if not ours:
        return Check(name, FAIL, f"{key} = {shown}, not MAPA's {wanted}", fix_conf)
    others = [value for value in values if value not in ours]
    also = f" (and {', '.join(others)})" if others else ""
    if not compute:
        return Check(name, OK, f"{key} = {ours[0]}{also} (the file is checked on the compute nodes)")
    if facts is None:
        return Check(name, WARN, f"{key} = {ours[0]}: the file could not be looked at", f"look at {ours[0]} yourself")
    if not facts.exists:
        return Check(name, FAIL, f"{key} = {facts.path} does not exist on this node: slurmd fails the job's {key} "
                                 + ("and drains the node" if key != "TaskProlog" else "(the task does not start)"),
                     f"`mapa hooks {os.path.dirname(facts.path)}` on this node")
    problems = path_problems(facts)
    if problems:
        return Check(name, FAIL, f"{key} = {facts.path}: root runs it for every job, but {'; '.join(problems)}",
                     f"chown root:root {facts.path} && chmod 755 {facts.path} (and the directories above: root's, "
                     "not group/world-writable), or `mapa hooks DIR` again")
    if not facts.mode & 0o111:
        return Check(name, FAIL, f"{key} = {facts.path} is not executable (mode {facts.mode:o}): slurmd cannot run it",
                     f"chmod 755 {facts.path}, or `mapa hooks {os.path.dirname(facts.path)}` again")
    return Check(name, OK, f"{key} = {facts.path}{also}: root's, mode {facts.mode:o}")


def check_hooks_current(inputs: Inputs, config: HookConfig, mode: str | None) -> Check:
    """The files `mapa hooks` wrote hold this mapa.toml's settings: the config path and jobs_dir in
    the wrappers, jobs_dir and the isolation mode in the TaskProlog (it holds what "auto" came to)."""
    fails, warns, seen = [], [], []
    for key, _, _ in HOOKS:
        facts = inputs.hooks.get(key)
        text = inputs.hook_texts.get(facts.path) if facts is not None else None
        if text is None:
            continue
        seen.append(os.path.basename(facts.path))
        jobs_dir = _script_value(text, "JOBS_DIR")
        if jobs_dir is None:
            warns.append(f"{facts.path} sets no JOBS_DIR (written by an older `mapa hooks`)")
        elif jobs_dir != str(config.jobs_dir):
            fails.append(f"{facts.path} uses JOBS_DIR={jobs_dir}, mapa.toml's jobs_dir is {config.jobs_dir}")
        if key != "TaskProlog":
            config_path = _script_value(text, "MAPA_CONFIG")
            if config_path is not None and config_path != inputs.config_path:
                warns.append(f"{facts.path} reads {config_path}, this check read {inputs.config_path} "
                             f"(run mapa doctor --config {config_path})")
        elif mode is not None:
            written = _script_value(text, "ISOLATION") or "off"
            if written != mode:
                message = f"{facts.path} has ISOLATION={written}, mapa.toml's isolation comes to {mode} on this node"
                (fails if ISOLATION_STRENGTH.get(written, 0) < ISOLATION_STRENGTH.get(mode, 0) else warns).append(message)
    if not seen:
        return Check("hooks-current", WARN, "no hook file of MAPA's could be read", "see the prolog, epilog and taskprolog lines")
    fix = "`mapa hooks DIR --config CONFIG` again on this node (after every change of jobs_dir or isolation)"
    if fails:
        return Check("hooks-current", FAIL, "; ".join(fails + warns), fix)
    if warns:
        return Check("hooks-current", WARN, "; ".join(warns), fix)
    return Check("hooks-current", OK, f"{', '.join(seen)} match mapa.toml (jobs_dir {config.jobs_dir}"
                                      + (f", isolation {mode}" if mode else "") + ")")


def check_prolog_flags(conf: Mapping[str, str]) -> Check:
    value = conf.get("PrologFlags", "(null)")
    flags = {flag.lower() for flag in _flag_list(value)}
    if flags & {"alloc", "runinjob"}:
        return Check("prolog-flags", OK, f"PrologFlags = {value}")
    return Check("prolog-flags", FAIL, f"PrologFlags = {value}: without Alloc (or RunInJob) slurmd runs the Prolog only when "
                                       "a step first starts on the node, not when the job is allocated",
                 "PrologFlags=Alloc in slurm.conf (keep the flags you have), then `scontrol reconfigure`")


def check_timeouts(conf: Mapping[str, str], config: HookConfig) -> Check:
    needed = needed_hook_timeout(config)
    if "PrologTimeout" in conf or "EpilogTimeout" in conf:  # 25.05+: printed apart only when they differ
        shown = [("PrologTimeout", conf.get("PrologTimeout")), ("EpilogTimeout", conf.get("EpilogTimeout"))]
    else:
        shown = [("PrologEpilogTimeout", conf.get("PrologEpilogTimeout"))]
    why = (f"MAPA's wrappers need up to {needed} s (the agent client waits {ANSWER_TIMEOUT_S:g} s, the in-process hook "
           f"has prolog_budget {config.prolog_budget:g} s)")
    fix = f"PrologEpilogTimeout={needed} in slurm.conf, then `scontrol reconfigure`"
    short, unlimited, text = [], [], []
    for key, value in shown:
        if value is None:
            return Check("prolog-timeout", WARN, f"`scontrol show config` printed no {key}", fix)
        text.append(f"{key} = {value}")
        try:
            seconds = int(value.split()[0])
        except (ValueError, IndexError):
            return Check("prolog-timeout", WARN, f"{key} = {value} is no number of seconds", fix)
        if seconds >= UNLIMITED_TIMEOUT:
            unlimited.append(key)
        elif seconds < needed:
            short.append(f"{key} = {seconds} s")
    if short:
        return Check("prolog-timeout", FAIL, f"{', '.join(short)} is shorter than {needed} s: slurmd kills a slow hook "
                                             f"and drains the node; {why}", fix)
    if unlimited:
        return Check("prolog-timeout", WARN, f"{', '.join(unlimited)} unlimited ({UNLIMITED_TIMEOUT}): a hook that hangs "
                                             f"holds its job and node for ever; {why}", fix)
    return Check("prolog-timeout", OK, f"{', '.join(text)} s (needed: {needed} s)")


def check_job_submit(conf: Mapping[str, str], config: HookConfig, inputs: Inputs, controller: bool) -> Check:
    plugins = [plugin.lower() for plugin in _flag_list(conf.get("JobSubmitPlugins"))]
    has_lua = any(plugin in ("lua", "job_submit/lua") for plugin in plugins)
    path = os.path.join(inputs.slurm_conf_dir, "job_submit.lua")
    write = f"`mapa job-submit-lua {path} --config {inputs.config_path}` on the controller"
    if not has_lua:
        shown = conf.get("JobSubmitPlugins", "(null)")
        if config.job_submit_lua:
            return Check("job-submit", FAIL, f"JobSubmitPlugins = {shown} has no lua, but mapa.toml says job_submit_lua = true: "
                                             "#MAPA directives are neither checked at submission nor handed to the Prolog",
                         f"{write}, JobSubmitPlugins=lua in slurm.conf, `scontrol reconfigure`; or job_submit_lua = false")
        return Check("job-submit", WARN, f"JobSubmitPlugins = {shown} has no lua: bad directives are found only by the "
                                         "Prolog, and it asks slurmctld for every job's batch script",
                     f"{write}, JobSubmitPlugins=lua in slurm.conf, then job_submit_lua = true in mapa.toml")
    if not controller and inputs.job_submit_lua is None:
        note = "" if config.job_submit_lua else "; mapa.toml has job_submit_lua = false, so the Prolog still asks for batch scripts"
        return Check("job-submit", WARN if note else OK,
                     f"JobSubmitPlugins = {conf.get('JobSubmitPlugins')} (the script is checked on the controller){note}",
                     "job_submit_lua = true in mapa.toml" if note else "")
    if inputs.job_submit_lua is None:
        return Check("job-submit", FAIL, f"JobSubmitPlugins has lua but {path} cannot be read "
                                         f"({inputs.job_submit_error or 'missing'}): slurmctld cannot load it", write)
    if inputs.job_submit_expected is not None and inputs.job_submit_lua != inputs.job_submit_expected:
        return Check("job-submit", FAIL, f"{path} differs from what `mapa job-submit-lua` writes for {inputs.config_path} "
                                         "(another slurm-mapa release, a local edit, or [features] changed since)", write)
    if not config.job_submit_lua:
        return Check("job-submit", WARN, f"{path} is current, but mapa.toml has job_submit_lua = false: the Prolog still "
                                         "asks slurmctld for batch scripts", "job_submit_lua = true in mapa.toml")
    return Check("job-submit", OK, f"JobSubmitPlugins = {conf.get('JobSubmitPlugins')}; {path} is what "
                                   "`mapa job-submit-lua` writes for this mapa.toml")


def check_select_type(conf: Mapping[str, str]) -> Check:
    value = conf.get("SelectType", "(null)")
    if "cons_tres" in value:
        return Check("select-type", OK, f"SelectType = {value}")
    return Check("select-type", WARN, f"SelectType = {value}: not select/cons_tres, so jobs cannot share a node's GPUs "
                                      "and MAPA has little to choose", "SelectType=select/cons_tres in slurm.conf")


def check_task_plugin(conf: Mapping[str, str], isolation_on: bool) -> Check:
    value = conf.get("TaskPlugin", "(null)")
    if "cgroup" in value:
        return Check("task-plugin", OK, f"TaskPlugin = {value}")
    if isolation_on:
        return Check("task-plugin", WARN, f"TaskPlugin = {value} has no task/cgroup: device isolation finds each task in "
                                          "its Slurm task cgroup, which task/cgroup makes", "TaskPlugin=task/cgroup,task/affinity")
    return Check("task-plugin", WARN, f"TaskPlugin = {value} has no task/cgroup: jobs are not confined to their cores",
                 "TaskPlugin=task/cgroup,task/affinity (docs/admin.md, the production configuration)")


def check_constrain_devices(cgroup_conf: str | None, conf: Mapping[str, str] | None, slurm_conf_dir: str) -> Check:
    if cgroup_conf is not None:
        value, where = slurm_conf_value(cgroup_conf, "ConstrainDevices"), os.path.join(slurm_conf_dir, "cgroup.conf")
    elif conf is not None:
        value, where = conf.get("ConstrainDevices"), "`scontrol show config`"
    else:
        return Check("constrain-devices", WARN, "neither cgroup.conf nor `scontrol show config` could be read",
                     "make sure cgroup.conf has no ConstrainDevices=yes")
    if _yes(value):
        return Check("constrain-devices", FAIL, f"ConstrainDevices = {value} ({where}): Slurm confines each job to the GPUs "
                                                "*it* picked, and MAPA's choice is refused",
                     "ConstrainDevices=no in cgroup.conf on MAPA nodes (MAPA isolates its own choice: isolation in "
                     "mapa.toml), then restart slurmd")
    return Check("constrain-devices", OK, f"ConstrainDevices = {value or 'no (default)'} ({where})")


def check_spank(inputs: Inputs, mode: str | None) -> Check:
    on = mode not in (None, "off")
    severe = FAIL if on else WARN
    why = f"isolation is {mode}" if mode else "isolation unknown"
    if inputs.spank_error:
        return Check("spank", severe, f"could not check the SPANK plugins of {inputs.plugstack}: {inputs.spank_error}",
                     "check plugstack.conf by hand")
    if inputs.spank_problems:
        return Check("spank", severe, "; ".join(inputs.spank_problems) + f" ({why})",
                     "`mapa spank-plugin PATH` on this node (needs the running Slurm's headers), and fix plugstack.conf")
    if not inputs.spank_lines:
        if not on:
            return Check("spank", OK, f"no MAPA SPANK plugin in {inputs.plugstack} ({why}: none needed)")
        return Check("spank", WARN, f"no MAPA SPANK plugin in {inputs.plugstack} ({why}): only the TaskProlog asks for "
                                    "isolation, as the job's user; that stops mistakes, not a user who sets out to skip it",
                     "`mapa spank-plugin /usr/local/lib/slurm-mapa/spank_mapa_isolate.so` and the line it prints in "
                     "plugstack.conf (docs/isolation.md, \"SPANK plugin\")")
    described = []
    for kind, path, conf_file in inputs.spank_lines:
        built = inputs.spank_built.get(path)
        described.append(f"{kind} {path}" + (f" (built for Slurm {built})" if built else "") + f" in {conf_file}")
    running = f"; this node runs {inputs.running_version.split(chr(10))[0].strip()}" if inputs.running_version else ""
    return Check("spank", OK, "; ".join(described) + running)


def check_topology(inputs: Inputs, config: HookConfig) -> Check:
    spec = config.topology_for(inputs.node)
    if spec is None:
        return Check("topology", FAIL, f"no [nodes] entry of {inputs.config_path} matches node {inputs.node}: the Prolog "
                                       "falls back to Slurm's GPUs for every job",
                     f'add "{inputs.node}" = "/etc/slurm/mapa/{inputs.node}.toml" under [nodes] (a file from '
                     "`mapa topo discover -o FILE`, or a preset name)")
    if inputs.topology is None:
        return Check("topology", FAIL, f"{spec} (for node {inputs.node}) cannot be loaded: {inputs.topology_error or 'unknown error'}; "
                                       "the Prolog falls back to Slurm's GPUs for every job",
                     f"`mapa topo discover -o {spec}` on this node, or fix the file")
    topology = inputs.topology
    graph = topology.graph
    facts = [f"{graph.size} GPUs", topology.gpu_vendor]
    facts.append("device minors named" if topology.minor_numbers is not None else "no device minors")
    if graph.cpu_affinity:
        facts.append("CPU affinity")
    return Check("topology", OK, f"{spec}: {graph.name} ({', '.join(facts)})")


def check_gres(inputs: Inputs) -> Check:
    where = os.path.join(inputs.slurm_conf_dir, "gres.conf")
    fix = f"`mapa gres-conf --topology TOPOLOGY --cores N --sockets S` writes the lines for {where}; then restart slurmd"
    if inputs.gres_conf is None:
        return Check("gres", FAIL, f"cannot read {where}: {inputs.gres_conf_error or 'missing'}", fix)
    lines, autodetect = gres_gpu_lines(inputs.gres_conf, inputs.node)
    detected = [value for value in autodetect if value.lower() not in ("off", "")]
    if detected and not lines:
        return Check("gres", WARN, f"{where}: AutoDetect={detected[-1]} and no File= lines: Slurm finds the GPUs itself, "
                                   "so their order could not be compared with the topology's", fix)
    files = [path for line in lines for path in line.files]
    if any(not line.files for line in lines):
        bare = next(line for line in lines if not line.files)
        return Check("gres", FAIL, f"{where} line {bare.line}: a gpu line without File=: MAPA needs one device file per GPU "
                                   "(Slurm's GPU i must be the topology's GPU i)", fix)
    problems, notes = [], []
    topology = inputs.topology
    if topology is not None:
        size = topology.graph.size
        if len(files) != size:
            problems.append(f"{len(files)} GPU device files for node {inputs.node}, the topology has {size} GPUs")
        else:
            wrong = [(i, path, topology.device_file(i)) for i, path in enumerate(files) if path != topology.device_file(i)]
            if wrong:
                i, path, expected = wrong[0]
                problems.append(f"Slurm's GPU {i} is {path} but the topology's GPU {i} is {expected}"
                                + (f" ({len(wrong)} GPUs differ)" if len(wrong) > 1 else ""))
    missing = [path for path in files if inputs.devices.get(path, "char") != "char"]
    if missing:
        problems.append(", ".join(f"{path} {inputs.devices[path]}" for path in missing[:4])
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    if inputs.show_node is not None:
        count = node_gpu_count(inputs.show_node)
        if count is not None and count != len(files):
            problems.append(f"slurm.conf gives node {inputs.node} Gres=gpu:{count}, gres.conf {len(files)} device files")
    if topology is not None and not problems:
        notes += _gres_sanity(lines, topology)
    if problems:
        return Check("gres", FAIL, f"{where}: " + "; ".join(problems), fix)
    if notes:
        return Check("gres", WARN, f"{where}: {len(files)} GPUs as in the topology, but " + "; ".join(notes), fix)
    return Check("gres", OK, f"{where}: {len(files)} GPUs in the topology's order, device files present")


def _gres_sanity(lines: Sequence[GresLine], topology: Topology) -> list[str]:
    """Cores= alike for GPUs of one domain; Links= as the topology's links (Slurm's own pick uses them)."""
    from ..errors import InputError
    from ..hardware.gres import links_value, parse_cpu_list

    notes = []
    per_gpu = [line for line in lines for _ in line.files]
    graph = topology.graph
    if graph.domains and all(line.cores for line in per_gpu) and len(per_gpu) == graph.size:
        try:
            cores = [frozenset(parse_cpu_list(line.cores or "")) for line in per_gpu]
        except InputError as error:
            return [f"Cores= unreadable: {error}"]
        for a, b in graph.pairs():
            if graph.domains[a] == graph.domains[b] and cores[a] != cores[b]:
                notes.append(f"GPUs {a} and {b} share a domain (socket) but not their Cores= ({per_gpu[a].cores} vs {per_gpu[b].cores})")
                break
    for gpu, line in enumerate(per_gpu[:graph.size]):
        if line.links is not None and len(line.files) == 1 and line.links != links_value(graph, gpu):
            notes.append(f"GPU {gpu}'s Links={line.links} is not the topology's {links_value(graph, gpu)}")
            break
    return notes


def check_discovery(inputs: Inputs) -> Check:
    if inputs.topology is None:
        return Check("discovery", OK, "skipped: no topology file to compare")
    if inputs.discovered is None:
        if inputs.discovery_tool:
            return Check("discovery", WARN, f"{inputs.discovery_tool} failed: {inputs.discovery_error}",
                         f"run `mapa topo discover --source {inputs.discovery_tool}` by hand to see why")
        return Check("discovery", WARN, f"no discovery tool here ({inputs.discovery_error or 'nvidia-smi, rocm-smi, NVML'}): "
                                        "the topology file was not compared with the hardware", "")
    mine, live = inputs.topology.graph, inputs.discovered.graph
    tool = inputs.discovery_tool
    redo = "`mapa topo discover -o FILE` on this node (then `mapa hooks DIR` again if isolation is auto)"
    if mine.size != live.size:
        return Check("discovery", FAIL, f"{tool} sees {live.size} GPUs, the topology file has {mine.size}", redo)
    mine_uuids, live_uuids = inputs.topology.uuids, inputs.discovered.uuids
    if mine_uuids and live_uuids and tuple(mine_uuids) != tuple(live_uuids):
        gpu = next(i for i, (a, b) in enumerate(zip(mine_uuids, live_uuids)) if a != b)
        return Check("discovery", FAIL, f"GPU {gpu} is {live_uuids[gpu]} to {tool}, {mine_uuids[gpu]} in the topology file: "
                                        "the file is another machine's, or numbers the GPUs differently", redo)
    differ = [(a, b) for a, b in mine.pairs() if mine.link(a, b).token != live.link(a, b).token]
    if differ:
        a, b = differ[0]
        return Check("discovery", WARN, f"{len(differ)} of {mine.size * (mine.size - 1) // 2} GPU pairs differ, e.g. {a}-{b}: "
                                        f"{mine.link(a, b)} in the file, {live.link(a, b)} to {tool}", redo)
    return Check("discovery", OK, f"{tool} sees the same {live.size} GPUs and links")


def check_isolation(inputs: Inputs) -> Check:
    if inputs.isolation is None:
        return Check("isolation", WARN, f"could not tell what isolation comes to here: {inputs.isolation_error}", "")
    mode, why = inputs.isolation
    return Check("isolation", OK, f"{mode} ({why})")


def check_agent(inputs: Inputs, mode: str | None) -> Check:
    on = mode not in (None, "off")
    socket_path = inputs.agent_socket
    start = "start mapa-agent (`systemctl enable --now mapa-agent`, docs/admin.md section 5)"
    answer = inputs.agent_answer
    if answer is None:
        consequence = (f"tasks get no GPU isolation (isolation is {mode})" if on
                       else "every hook runs in-process, about 0.1 s slower per job")
        return Check("agent", FAIL if on else WARN, f"mapa-agent did not answer on {socket_path}: {inputs.agent_error or 'no answer'}; "
                                                    + consequence, start)
    if answer.startswith("error only root"):
        return Check("agent", WARN, f"mapa-agent answers on {socket_path} but only root may ask it", "run mapa doctor as root")
    if answer == "error busy":
        return Check("agent", WARN, f"mapa-agent on {socket_path} is busy (it runs its most requests at once)", "")
    extra = ""
    facts = inputs.isolate_socket
    if on and facts is not None:
        if not facts.exists:
            return Check("agent", FAIL, f"mapa-agent answers on {socket_path}, but its isolation socket {facts.path} is "
                                        f"missing: TaskPrologs cannot ask for isolation (isolation is {mode})",
                         "restart mapa-agent and read its log")
        if facts.kind != "socket" or facts.mode & 0o666 != 0o666:
            return Check("agent", FAIL, f"{facts.path} is no socket every user may open (mode {facts.mode:o}): TaskPrologs "
                                        "cannot ask for isolation", "restart mapa-agent (it makes the socket 666)")
        extra = f"; isolation socket {facts.path} open to tasks"
    return Check("agent", OK, f"mapa-agent answers on {socket_path}{extra}")


def check_features(inputs: Inputs, config: HookConfig) -> Check:
    from ..core.features import complement_name, feature_name, feature_names
    from .commands import CommandFailed, parse_active_features, parse_available_features

    sizes = config.feature_sizes
    if not sizes:
        return Check("features", OK, "mapa.toml has no [features]: nothing to publish")
    if inputs.fleet_errors:
        return Check("features", FAIL, "[features] fleet: " + "; ".join(inputs.fleet_errors) + ": mapa-agent publishes nothing",
                     "fix the fleet entries of [features] (presets or readable topology files)")
    if inputs.show_node is None:
        return Check("features", FAIL, f"`scontrol show node {inputs.node}` failed: {inputs.show_node_error}; mapa-agent "
                                       "cannot publish this node's features either", "give --node NAME as slurm.conf names this node")
    try:
        available = parse_available_features(inputs.show_node)
        active = parse_active_features(inputs.show_node)
    except CommandFailed as error:
        return Check("features", WARN, f"could not read the node's features: {error}", "")
    missing = [name for name in feature_names(sizes) if name not in available]
    if missing:
        return Check("features", FAIL, f"node {inputs.node}'s Features= in slurm.conf lacks {','.join(missing)}: "
                                       "slurmctld refuses them, mapa-agent publishes nothing",
                     f"add {','.join(feature_names(sizes))} to NodeName={inputs.node} Features= (`mapa hooks` prints the "
                     "line), then `scontrol reconfigure`")
    unsettled = [k for k in sizes if (feature_name(k) in active) + (complement_name(k) in active) != 1]
    mapa_active = [name for name in active if name.startswith("mapa_")]
    if unsettled:
        return Check("features", WARN, f"ActiveFeatures={','.join(active) or '(none)'}: not one of "
                                       + ", ".join(f"{feature_name(k)}/{complement_name(k)}" for k in unsettled)
                                       + " (not published yet: slurmctld restarted, or mapa-agent cannot publish)",
                     f"wait a reconcile pass ({config.reconcile_interval:g} s); if it stays, read mapa-agent's log")
    return Check("features", OK, f"active {','.join(mapa_active)}: one of each pair for sizes "
                                 f"{','.join(map(str, sizes))}; all {len(feature_names(sizes))} available")


def check_mapa_toml(inputs: Inputs, problem: str) -> Check:
    if inputs.mapa_toml is None:
        return Check("mapa.toml", FAIL, f"cannot read {inputs.config_path}: {inputs.mapa_toml_error or 'missing'}; the hooks "
                                        "fall back for every job", f"write {inputs.config_path} (docs/admin.md section 4)")
    if problem:
        return Check("mapa.toml", FAIL, f"{problem}; the hooks refuse it and fall back for every job",
                     f"fix {inputs.config_path} (docs/admin.md section 4 lists every key)")
    config, _ = parse_config(inputs.mapa_toml, inputs.config_path)
    facts = [f"policy {config.policy}", f"isolation {config.isolation}", f"{len(config.nodes)} [nodes] entr{'y' if len(config.nodes) == 1 else 'ies'}"]
    if config.feature_sizes:
        facts.append(f"[features] sizes {','.join(map(str, config.feature_sizes))}")
    return Check("mapa.toml", OK, f"{inputs.config_path} is valid: {', '.join(facts)}")


def check_trust(paths: Iterable[PathFacts]) -> list[Check]:
    """One line per path root should not trust; one ok line when none."""
    checks, judged = [], 0
    for facts in paths:
        if not facts.exists:
            continue
        judged += 1
        problems = path_problems(facts)
        if problems:
            status = FAIL if facts.required else WARN
            consequence = "root trusts it" if facts.required else "root imports or reads it"
            checks.append(Check("trust", status, f"{facts.label} {facts.path}: {'; '.join(problems)} ({consequence})",
                                f"chown root:root {facts.path} && chmod go-w {facts.path} (and every directory above it)"))
    if not checks:
        checks.append(Check("trust", OK, f"{judged} paths root trusts are root's and not group/world-writable"))
    return checks


def run_checks(inputs: Inputs) -> list[Check]:
    """Every check's line, in report order (pure)."""
    config, problem = parse_config(inputs.mapa_toml, inputs.config_path)
    conf = parse_show_config(inputs.show_config) if inputs.show_config is not None else None
    role = node_role(inputs, conf)
    compute = role.compute
    mode = inputs.isolation[0] if inputs.isolation is not None else None
    checks = [role.check, check_scontrol(inputs, conf), check_mapa_toml(inputs, problem)]
    if conf is not None:
        for key, name, wanted in HOOKS:
            checks.append(check_hook(key, name, wanted, conf, inputs.hooks.get(key), compute))
    if compute:
        checks.append(check_hooks_current(inputs, config, mode))
    if conf is not None:
        checks += [check_prolog_flags(conf), check_timeouts(conf, config),
                   check_job_submit(conf, config, inputs, role.controller or inputs.job_submit_lua is not None),
                   check_select_type(conf), check_task_plugin(conf, compute and mode not in (None, "off"))]
    checks.append(check_constrain_devices(inputs.cgroup_conf if compute else None, conf, inputs.slurm_conf_dir))
    if compute:
        checks += [check_spank(inputs, mode), check_topology(inputs, config), check_gres(inputs), check_discovery(inputs),
                   check_isolation(inputs), check_agent(inputs, mode), check_features(inputs, config)]
    checks += check_trust(inputs.paths)
    if inputs.euid != 0:
        checks.append(Check("user", WARN, f"running as uid {inputs.euid}, not root: root-only paths and the agent may not "
                                          "be readable, and files of this user pass as root's in paths.py's checks",
                            "run mapa doctor as root"))
    return checks


def exit_status(checks: Sequence[Check]) -> int:
    return 1 if any(check.status == FAIL for check in checks) else 0


def format_text(checks: Sequence[Check]) -> str:
    """``status  check  found => fix``, one line per check."""
    width = max((len(check.check) for check in checks), default=0)
    return "".join(f"{check.status:<4}  {check.check:<{width}}  {check.found}" + (f" => {check.fix}" if check.fix else "") + "\n"
                   for check in checks)


def format_json(checks: Sequence[Check]) -> str:
    return json.dumps([check.as_dict() for check in checks], indent=2) + "\n"


# --- the edge: files, commands, the agent -----------------------------------------------------------
def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}" + (f": {error.filename}" if error.filename else "")
    return str(error) or type(error).__name__


def _safely(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """(result, "") or (None, why it failed): nothing the edge does may raise."""
    try:
        return function(*args, **kwargs), ""
    except Exception as error:  # noqa: BLE001 - a failure to gather is a line of the report
        return None, _describe(error)


def read_text(path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A regular file's text (symlinks followed, as Slurm follows them), at most ``limit`` bytes."""
    data = trusted.read_bytes(Path(path), limit, follow_symlinks=True)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data.decode("utf-8", "replace")


def find_program(command: str, environ: Mapping[str, str]) -> str | None:
    """The program for ``command`` (mapa.toml's absolute path, else its name on PATH)."""
    if "/" in command and os.access(command, os.X_OK):
        return command
    return shutil.which(os.path.basename(command), path=environ.get("PATH", os.defpath))


def run_command(argv: Sequence[str], environ: Mapping[str, str], timeout: float) -> str:
    """stdout of ``argv`` (no shell) within ``timeout`` seconds, killed with all it started past
    that (commands.Runner); RuntimeError with the reason otherwise."""
    return Runner(timeout=timeout, env=environ)(argv)


def _slurm_env(environ: Mapping[str, str]) -> dict[str, str]:
    env = {"LC_ALL": "C", "PATH": environ.get("PATH", os.defpath)}
    if environ.get("SLURM_CONF"):
        env["SLURM_CONF"] = environ["SLURM_CONF"]
    return env


def path_facts(path: str | Path, label: str, kind: str = "file", required: bool = True) -> PathFacts:
    """``path`` judged by paths.py's rules (``kind`` program: its symlinks followed, each judged)."""
    path = str(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return PathFacts(path, label, kind, exists=False, required=required)
    except OSError as error:
        return PathFacts(path, label, kind, exists=True, uid=-1, mode=0, problem=f"cannot inspect {path}: {_describe(error)}",
                         required=required)
    problem = ""
    try:
        if kind == "dir":
            trusted.check_trusted_dir(Path(path))
        elif kind == "program":
            trusted.resolve_trusted_file(Path(path))
            info = os.stat(path)
        elif kind == "socket":
            trusted.check_ancestors(Path(path))
            if not stat.S_ISSOCK(info.st_mode):
                kind = "file"
        else:
            trusted.check_trusted_file(Path(path))
    except (trusted.UnsafePath, OSError) as error:
        problem = _describe(error)
    return PathFacts(path, label, kind, True, info.st_uid, stat.S_IMODE(info.st_mode), problem, required)


def running_processes(proc: Path = Path("/proc")) -> frozenset[str]:
    """Which of slurmd and slurmctld run here (by /proc/PID/comm), counting only processes of this
    mount namespace: on a host that runs Slurm in containers, theirs are not this node's."""
    found = set()
    try:
        own = os.readlink(proc / "self" / "ns" / "mnt")
        entries = list(os.scandir(proc))
    except OSError:
        return frozenset()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            name = (Path(entry.path) / "comm").read_text().strip()
            if name in ("slurmd", "slurmctld") and os.readlink(Path(entry.path) / "ns" / "mnt") == own:
                found.add(name)
        except OSError:
            continue  # gone, or another user's (only root may read its namespace): not counted
    return frozenset(found)


def ask_agent(path: str, timeout: float = AGENT_TIMEOUT_S) -> str:
    """The agent's answer line to the harmless PROBE, within ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(PROBE)
        answer = b""
        while b"\n" not in answer and len(answer) < 4096:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:g} s")
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    if b"\n" not in answer:
        raise ConnectionError("the agent closed the connection without an answer")
    return answer.split(b"\n", 1)[0].decode("utf-8", "replace")


def discover_live(environ: Mapping[str, str], name: str) -> tuple[Topology | None, str, str]:
    """(topology, tool, error) from nvidia-smi, else rocm-smi, else NVML; each bounded in time."""
    search = environ.get("PATH", os.defpath)
    env = {**environ, "LC_ALL": "C"}
    smi = shutil.which("nvidia-smi", path=search)
    if smi:
        from ..hardware.nvidia_smi import parse_discovery, parse_gpu_list

        try:
            listed = run_command([smi, "-L"], env, TOOL_TIMEOUT_S)
            found = parse_discovery(run_command([smi, "topo", "-m"], env, TOOL_TIMEOUT_S), listed, name=name)
            uuids = tuple(entry.uuid for entry in parse_gpu_list(listed))
        except (RuntimeError, MapaError) as error:
            return None, "nvidia-smi", str(error)
        return Topology(graph=found.graph, uuids=uuids or None, vendor="nvidia"), "nvidia-smi", ""
    rocm = shutil.which("rocm-smi", path=search)
    if rocm:
        from ..hardware.rocm_smi import parse_amd_topology

        try:
            amd = parse_amd_topology(run_command([rocm, "--showtopo", "--shownodesbw"], env, TOOL_TIMEOUT_S), name=name)
        except (RuntimeError, MapaError) as error:
            return None, "rocm-smi", str(error)
        return Topology(graph=amd.graph, pci_bus_ids=amd.pci_bus_ids, vendor="amd"), "rocm-smi", ""
    return _discover_nvml(name)


def _discover_nvml(name: str) -> tuple[Topology | None, str, str]:
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed (or broken): no such tool here
        return None, "", "nvidia-smi and rocm-smi not on PATH, no NVML bindings"
    box: dict[str, Any] = {}

    def work() -> None:
        from ..hardware.nvml import discover, load_pynvml, nvml_session

        try:
            with nvml_session(load_pynvml()) as nvml:
                box["found"] = discover(nvml, name=name)
        except Exception as error:  # noqa: BLE001
            box["error"] = _describe(error)

    thread = threading.Thread(target=work, daemon=True, name="mapa doctor NVML")
    thread.start()
    thread.join(TOOL_TIMEOUT_S)
    if "found" in box:
        return box["found"].topology, "nvml", ""
    if thread.is_alive():
        return None, "nvml", f"NVML did not answer within {TOOL_TIMEOUT_S:g} s"
    return None, "", f"nvidia-smi and rocm-smi not on PATH; NVML: {box.get('error', 'no answer')}"


def gather(config_path: str, node: str, environ: Mapping[str, str] | None = None, *, agent_socket: str = DEFAULT_SOCKET,
           isolate_socket: str = ISOLATE_SOCKET, proc: Path = Path("/proc")) -> Inputs:
    """Read and ask everything :func:`run_checks` judges. Never raises."""
    environ = dict(os.environ if environ is None else environ)
    got: dict[str, Any] = {"node": node, "config_path": config_path, "euid": os.geteuid(), "agent_socket": agent_socket}
    text, error = _safely(read_text, config_path)
    got["mapa_toml"], got["mapa_toml_error"] = text, error
    config, _ = parse_config(text, config_path)
    slurm_conf = Path(environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    conf_dir = slurm_conf.parent
    got["slurm_conf_dir"] = str(conf_dir)
    got["processes"] = _safely(running_processes, proc)[0] or frozenset()

    scontrol = find_program(config.scontrol, environ)
    if scontrol is None:
        missing = f"scontrol not found ({config.scontrol} from mapa.toml is not there, and PATH has none)"
        got["show_config_error"] = got["show_node_error"] = missing
    else:
        env = _slurm_env(environ)
        got["show_config"], got["show_config_error"] = _safely(run_command, [scontrol, "show", "config"], env, SLURM_TIMEOUT_S)
        got["show_node"], got["show_node_error"] = _safely(run_command, [scontrol, "--oneliner", "show", "node", node], env,
                                                           SLURM_TIMEOUT_S)
    conf = parse_show_config(got["show_config"]) if got.get("show_config") else {}

    got["cgroup_conf"] = _safely(read_text, conf_dir / "cgroup.conf")[0]
    got["gres_conf"], got["gres_conf_error"] = _safely(read_text, conf_dir / "gres.conf")
    if got["gres_conf"] is not None:
        parsed = _safely(gres_gpu_lines, got["gres_conf"], node)[0]
        gpu_lines = parsed[0] if parsed else []
        got["devices"] = {path: _device_kind(path) for line in gpu_lines for path in line.files[:1024]}

    spec = config.topology_for(node)
    if spec is not None:
        from ..hardware.load import load_topology_file

        got["topology"], got["topology_error"] = _safely(load_topology_file, spec)
    found, failed = _safely(discover_live, environ, node)
    if found is not None:
        got["discovered"], got["discovery_tool"], got["discovery_error"] = found
    else:
        got["discovery_error"] = failed

    from .isolation import effective_mode

    got["isolation"], got["isolation_error"] = _safely(effective_mode, config, node)

    hooks, texts = {}, {}
    for key, _, wanted in HOOKS:
        for value in slurm_values(conf, key):
            if os.path.basename(value) == wanted:
                hooks[key] = path_facts(value, f"{key} hook", "program")
                texts_value = _safely(read_text, value)[0]
                if texts_value is not None:
                    texts[value] = texts_value
                break
    got["hooks"], got["hook_texts"] = hooks, texts

    _gather_spank(got, environ, slurm_conf)
    got["job_submit_lua"], got["job_submit_error"] = _safely(read_text, conf_dir / "job_submit.lua")
    got["job_submit_expected"] = _safely(_job_submit_expected, config)[0]
    got["paths"] = _safely(_trusted_paths, config, config_path, spec, texts, got, conf_dir, agent_socket, isolate_socket)[0]

    try:
        got["agent_answer"] = ask_agent(agent_socket)
    except Exception as error:  # noqa: BLE001
        got["agent_error"] = _describe(error)
    got["isolate_socket"] = _safely(path_facts, isolate_socket, "isolation socket", "socket")[0]

    fleet_errors = []
    if config.feature_sizes:
        from ..hardware.load import load_topology_file

        for entry in config.feature_fleet:
            _, error = _safely(load_topology_file, entry)
            if error:
                fleet_errors.append(f"{entry}: {error}")
    got["fleet_errors"] = tuple(fleet_errors)
    return Inputs(**{key: value for key, value in got.items() if value is not None})


def _job_submit_expected(config: HookConfig) -> str:
    from .install import job_submit_text

    return job_submit_text(config.feature_sizes, config.feature_insensitive_jobs)


def _device_kind(path: str) -> str:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable ({_describe(error)})"
    return "char" if stat.S_ISCHR(info.st_mode) else "is no character device"


def _gather_spank(got: dict[str, Any], environ: Mapping[str, str], slurm_conf: Path) -> None:
    from . import spankcheck

    try:
        plugstack, plugin_dirs = spankcheck.spank_settings(_safely(read_text, slurm_conf)[0], slurm_conf)
        got["plugstack"] = str(plugstack)
        plugins = spankcheck.installed_mapa_plugins(plugstack, plugin_dirs)
        got["spank_lines"] = tuple((plugin.kind, plugin.path, str(plugin.conf)) for plugin in plugins)
        running = spankcheck.running_slurm_version_text() if plugins else None
        got["running_version"] = (running or "").strip()
        built = {}
        for plugin in plugins:
            number = spankcheck.elf_u32_symbol(plugin.data, "plugin_version") if plugin.data else None
            if number is not None:
                built[plugin.path] = spankcheck.release_text(number)
        got["spank_built"] = built
        got["spank_problems"] = tuple(spankcheck.installed_plugin_problems(
            plugins, spankcheck.parse_slurm_version(running) if running else None))
    except Exception as error:  # noqa: BLE001
        got["spank_error"] = _describe(error)


def _trusted_paths(config: HookConfig, config_path: str, spec: str | None, hook_texts: Mapping[str, str],
                   got: Mapping[str, Any], conf_dir: Path, agent_socket: str, isolate_socket: str) -> tuple[PathFacts, ...]:
    """Every path root trusts, other than the hooks (their own checks judge them); existing ones only."""
    from ..hardware.presets import PRESETS

    wanted: list[tuple[str, str, str, bool]] = [(config_path, "mapa.toml", "file", True)]
    for key, command in (("scontrol", config.scontrol), ("squeue", config.squeue)):
        program = trusted.command_path(command)
        if program is not None:
            wanted.append((str(program), f"mapa.toml's {key}", "program", True))
    if spec is not None and spec not in PRESETS:
        wanted.append((spec, "topology file", "file", True))
    if config.model:
        wanted.append((config.model, "model file", "file", True))
    wanted += [(str(config.jobs_dir), "jobs directory", "dir", True), (str(Path(config.ledger).parent), "ledger directory", "dir", True),
               (str(config.journal), "journal directory", "dir", True),
               (str(Path(agent_socket).parent), "mapa-agent's socket directory", "dir", True),
               (str(Path(isolate_socket).parent), "isolation socket directory", "dir", True)]
    if config.dcgm_job_mapping_dir is not None:
        wanted.append((str(config.dcgm_job_mapping_dir), "dcgm job mapping directory", "dir", True))
    for _, path, _ in got.get("spank_lines", ()):
        wanted.append((path, "SPANK plugin", "program", True))
    wanted.append((str(conf_dir / "job_submit.lua"), "job_submit.lua", "file", True))
    for text in hook_texts.values():
        program = wrapper_program(text)
        if program is not None:
            wanted += [(program[0], "the hooks' Python", "program", True),
                       (os.path.join(program[1], "slurm_mapa"), "slurm-mapa package directory", "dir", False)]
    seen, facts = set(), []
    for path, label, kind, required in wanted:
        if path in seen:
            continue
        seen.add(path)
        fact, _ = _safely(path_facts, path, label, kind, required)
        if fact is not None and fact.exists:
            facts.append(fact)
    return tuple(facts)


# --- the command ------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    node = args.node or os.uname().nodename.split(".")[0]
    try:
        checks = run_checks(gather(args.config, node))
    except Exception as error:  # noqa: BLE001 - a bug here must still end in a line, not a traceback
        checks = [Check("doctor", FAIL, f"internal error of mapa doctor: {error!r}", "report it with this line")]
    sys.stdout.write(format_json(checks) if args.json else format_text(checks))
    return exit_status(checks)


def add_commands(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check this node's slurm-mapa installation (slurm.conf, hooks, SPANK plugin, gres.conf, topology, agent)",
        description="Check the live installation on this compute node or controller, one line per check (ok, warn, "
        "FAIL); exit status 1 if any check FAILs. Run it as root.",
    )
    doctor.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), help="the hooks' config (default %(default)s)")
    doctor.add_argument("--node", help="this node's Slurm name (default: the host's short name)")
    doctor.add_argument("--json", action="store_true", help="a JSON list of {check, status, found, fix}")
    doctor.set_defaults(handler=cmd_doctor)
