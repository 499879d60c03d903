"""The site configuration of the hooks: /etc/slurm/mapa.toml.

    policy = "preserve"                        # the policy the Prolog uses
    default_directive = "topology=ring sensitive=no"   # for jobs that say nothing
    ledger = "/var/lib/slurm-mapa/ledger.json"
    jobs_dir = "/run/slurm-mapa/jobs"          # per-job files the TaskProlog reads
    log = "/var/log/slurm-mapa.log"
    command_timeout = 5.0                      # seconds, for every scontrol/squeue call
    prolog_budget = 15.0                       # seconds: the Prolog's whole wall time, whatever Slurm's latency
    scontrol = "/usr/bin/scontrol"
    squeue = "/usr/bin/squeue"
    model = "auto"                             # effective-bandwidth model: "auto" (or ""): the topology's own;
                                               # a bundled model's name or a model file (docs/engine.md)
    health = "auto"                            # "off": do not ask NVML which GPUs are sick
    isolation = "auto"                         # | "off" | "fail-open" | "fail-closed": tasks open only their GPUs;
                                               # auto: fail-open where the topology names the device files (docs/isolation.md)
    isolation_scope = "step"                   # | "task": what the tasks of one step may open (docs/isolation.md)
    dcgm_job_mapping_dir = "/run/dcgm-job-mapping"   # none by default: which job uses each GPU, for dcgm-exporter

    [metrics]                                  # mapa-agent's Prometheus endpoint (agent/metrics.py); off by default
    listen = "127.0.0.1:9786"                  # HOST:PORT, [IPv6]:PORT, PORT (on 127.0.0.1), or "" (off)

    [preserve_ahead]                           # only for policy = "preserve-ahead"
    sizes = { 1 = 0.2, 2 = 0.2, 3 = 0.2, 4 = 0.2, 5 = 0.2 }   # GPUs -> weight (default: the paper's)
    tolerance = 0.0                            # fraction of a sensitive job's best it may give up

    [affinity]                                 # CPU affinity in the decision (core/affinity.py)
    mode = "prefer"                            # the default; "strict" | "ignore"
    max_loss = 0.1                             # prefer: the bandwidth fraction a local choice may give up

    [nodes]                                    # node-name glob -> preset or topology file
    "dgx*" = "dgx1-v100"
    "gpu[0-9]*" = "/etc/slurm/mapa/gpu-node.toml"

    [models]                                   # node-name glob -> model (overrides `model` there)
    "gpu[0-9]*" = "/etc/slurm/mapa/gpu-node-model.toml"

The first matching [nodes] (and [models]) entry wins. Other sections (used by mapa-replay) are
ignored here.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import time
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import InputError, MapaError, toml_text
from . import trusted_files

DEFAULT_CONFIG_PATH = Path("/etc/slurm/mapa.toml")
_KEYS = {"health", "policy", "default_directive", "ledger", "jobs_dir", "log", "command_timeout", "scontrol", "squeue", "model", "models", "nodes",
         "preserve_ahead", "prolog_budget", "job_submit_lua", "journal_dir", "reconcile_interval", "admin_comment_rate", "features",
         "affinity", "isolation", "isolation_scope", "dcgm_job_mapping_dir", "metrics"}
HOOK_KEYS = frozenset(_KEYS)  # the top-level keys of the hooks' config (mapa-replay accepts and ignores them)
# The agent answers within the budget and its client gives up after 25 s; the wrapper then runs
# the Prolog in-process with the same budget: 25 + 20 s stays inside the 60 s PrologEpilogTimeout
# Slurm's docs suggest.
MAX_PROLOG_BUDGET_S = 20.0
_OTHER_TOOLS_SECTIONS = {"cluster", "defaults", "rules", "replay"}


@dataclass(frozen=True)
class HookConfig:
    policy: str = "preserve"
    default_directive: str = "topology=ring sensitive=no"
    ledger: Path = Path("/var/lib/slurm-mapa/ledger.json")
    jobs_dir: Path = Path("/run/slurm-mapa/jobs")
    log: Path = Path("/var/log/slurm-mapa.log")
    command_timeout: float = 5.0
    prolog_budget: float = 15.0
    scontrol: str = "/usr/bin/scontrol"
    squeue: str = "/usr/bin/squeue"
    model: str = ""
    health: str = "auto"
    # Device isolation of tasks by mapa-agent (slurm/isolation/): "auto" is fail-open on nodes
    # whose topology file names each GPU's device minor, off elsewhere (isolation.effective_mode).
    isolation: str = "auto"
    # "step": every task of a step may open all of the step's GPUs (ranks need CUDA/ROCm IPC to each
    # other's); "task": each task only its own (a site's choice; it breaks such IPC).
    isolation_scope: str = "step"
    nodes: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    models: tuple[tuple[str, str], ...] = ()  # [models]: node-name glob -> model, before `model`
    ahead_sizes: tuple[tuple[int, float], ...] = ()  # empty: preserve-ahead's default (uniform 1..5)
    ahead_tolerance: float = 0.0
    # job_submit.lua is installed: every directive reaches the Prolog in the job comment, so the
    # Prolog asks slurmctld nothing (without it, the Prolog reads the batch script: one call).
    job_submit_lua: bool = False
    journal_dir: Path | None = None  # AdminComment records not yet written; None: "journal" next to the ledger
    reconcile_interval: float = 60.0  # seconds between mapa-agent's listings of the node's jobs
    admin_comment_rate: float = 20.0  # AdminComment writes per second at most, per node
    dcgm_job_mapping_dir: Path | None = None  # mapa-agent writes dcgm-exporter's job mapping there (slurm/dcgm.py)
    # [features]: node features mapa-agent publishes for node choice (none without sizes).
    feature_sizes: tuple[int, ...] = ()
    feature_threshold: float = 0.9
    feature_fleet: tuple[str, ...] = ()  # topologies of the fleet's node types (presets or files)
    feature_outlook: bool = False  # publish the ring outlook (text/outlook.py) in the node's Extra
    feature_weights: bool = False  # publish core.features.node_weight as the node's Slurm Weight
    feature_weight_base: int = 0  # added to that weight: a site's own tiers of nodes stay in order
    # [affinity]: CPU affinity in the Prolog's decision (core/affinity.py); "prefer" unless the
    # table says otherwise ("ignore": the policy alone, as before issue 14).
    affinity_mode: str = "prefer"
    affinity_max_loss: float = 0.1  # core.affinity.DEFAULT_MAX_LOSS
    feature_insensitive_jobs: str = "none"  # what job_submit.lua has insensitive jobs prefer: none | noring
    # [metrics] listen: where mapa-agent serves Prometheus metrics, (host, port); None: off.
    metrics_listen: tuple[str, int] | None = None

    def configured_policies(self) -> dict:
        """Policies built with this config's settings, for :func:`~slurm_mapa.core.policies.select`."""
        if self.policy != "preserve-ahead" or (not self.ahead_sizes and not self.ahead_tolerance):
            return {}
        from ..core.ahead import make_preserve_ahead

        return {"preserve-ahead": make_preserve_ahead(dict(self.ahead_sizes) or None, self.ahead_tolerance)}

    @property
    def journal(self) -> Path:
        """Where AdminComment records wait to be written (on disk, like the ledger)."""
        return self.journal_dir if self.journal_dir is not None else Path(self.ledger).with_name("journal")

    @property
    def ring_rates_dir(self) -> Path:
        """Where the hooks keep the ring-rate tables of topologies with none shipped (ring_rate_cache.py), beside the ledger."""
        return Path(self.ledger).with_name("ring-rates")

    def topology_for(self, node: str) -> str | None:
        entry = self.nodes_entry_for(node)
        return entry[1] if entry is not None else None

    def nodes_entry_for(self, node: str) -> tuple[str, str] | None:
        """The first ``[nodes]`` entry (pattern, topology) that matches ``node``, None if none does."""
        return next(((pattern, topology) for pattern, topology in self.nodes if fnmatchcase(node, pattern)), None)

    def model_for(self, node: str) -> str:
        """The model setting for ``node``: its first matching [models] entry, else `model`; "" or
        "auto" mean the topology's own (hardware.load.resolve_model turns it into a model)."""
        for pattern, model in self.models:
            if fnmatchcase(node, pattern):
                return model
        return self.model


def _check_model_setting(value: str, where: str, source: str) -> None:
    """A model setting is "auto", "", a bundled model's name or a model file (anything with a / or
    ending in .toml, checked when it is used, like a topology file)."""
    from ..core.model_files import bundled_model_names, is_bundled_model

    if value in ("", "auto") or "/" in value or value.endswith(".toml") or is_bundled_model(value):
        return
    names = bundled_model_names()
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InputError(f"{source}: {where}: no bundled model {value!r}{hint} (accepted: \"auto\", a model file path, "
                     f"or one of {', '.join(names)})")


def _validate_with_engine(values: dict[str, Any], source: str) -> None:
    from ..core.policies import all_policies
    from .text.directive import parse_directive

    if values.get("policy", "preserve") not in all_policies():
        raise InputError(f"{source}: unknown policy {values['policy']!r} (accepted: {', '.join(all_policies())})")
    if "default_directive" in values:
        try:
            parse_directive(values["default_directive"])  # a bad default is the admin's error, found at load
        except InputError as error:
            raise InputError(f"{source}: default_directive {values['default_directive']!r}: {error}") from None
    if "model" in values:
        _check_model_setting(values["model"], "model", source)
    for pattern, model in values.get("models", ()):
        _check_model_setting(model, f"[models] {pattern!r}", source)


def _line_of_key(text: str, key: str) -> str:
    """`` (line 3: 'polcy = "preserve"')``: where a top-level key is first set or opened as a table."""
    pattern = re.compile(r'\s*\[*\s*(?:' + re.escape(key) + r'|"' + re.escape(key) + r'"|\'' + re.escape(key) + r"')\s*[=.\]]")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return f" (line {number}: {line.strip()[:80]!r})"
    return ""


def _line_in_table(text: str, table: str, key: str) -> str:
    """`` (line 12: 'size = [2, 4]')``: where ``key`` is set inside ``[table]`` (or as table.key)."""
    inside = False
    key_pattern = re.compile(r'\s*(?:' + re.escape(key) + r'|"' + re.escape(key) + r'")\s*=')
    dotted = re.compile(r'\s*' + re.escape(table) + r'\s*\.\s*' + re.escape(key) + r'\s*=')
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[\s*([A-Za-z0-9_\"-]+)\s*\]", line)
        if header:
            inside = header.group(1).strip('"') == table
            continue
        if (inside and key_pattern.match(line)) or (not inside and dotted.match(line)):
            return f" (line {number}: {line.strip()[:80]!r})"
    return ""


def _unknown_in_table(table_value: Any, table: str, known: set[str], text: str, source: str, accepted: str) -> None:
    """InputError for ``[table]`` when it is no table or holds a key outside ``known``: the key,
    its line, the closest known key and what is accepted, as for the top-level keys."""
    if not isinstance(table_value, dict):
        raise InputError(f"{source}: [{table}] must be a table ([{table}] on a line of its own, then its keys); "
                         f"got {toml_text(table_value)[:80]} (accepted: {accepted})")
    unknown = sorted(set(table_value) - known)
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        raise InputError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {names} in [{table}]"
                         f"{_line_in_table(text, table, unknown[0])}{closest_key_hint(unknown, known)} (accepted: {accepted})")


def _nul_in(value: Any, where: str = "") -> str:
    """The first key or value holding a NUL character (TOML's \\u0000: no file name can), or ""."""
    if isinstance(value, str):
        return where if "\0" in value else ""
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if "\0" in str(key):
                return repr(inner)
            found = _nul_in(item, inner)
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _nul_in(item, f"{where}[{i}]")
            if found:
                return found
    return ""


def closest_key_hint(unknown: list[str], accepted) -> str:
    """`` (did you mean 'policy'?)`` for the first unknown key that is a likely misspelling, else ""."""
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]!r} for {key!r}?)" if len(unknown) > 1 else f" (did you mean {close[0]!r}?)"
    return ""


def config_from_text(text: str, source: str = "mapa.toml", *, validate: bool = True) -> HookConfig:
    """Parse the config; ``validate=False`` skips the checks that need the engine (for the Epilog).

    Parsed once per text (a pure function of it; HookConfig is frozen): mapa-agent reads mapa.toml
    afresh on every request, so that an edit applies to the next job, and parsing is the costly part."""
    return _config_from_text(text, source, validate)


@lru_cache(maxsize=16)
def _config_from_text(text: str, source: str, validate: bool) -> HookConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{source}: not valid TOML: {error}; {_ACCEPTED_FILE}") from None
    nul = _nul_in(data)
    if nul:
        raise InputError(f"{source}: {nul} contains a NUL character (\\u0000), which no path or name may hold")
    unknown = sorted(set(data) - _KEYS - _OTHER_TOOLS_SECTIONS)
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        raise InputError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {names}{_line_of_key(text, unknown[0])}"
                         f"{closest_key_hint(unknown, _KEYS | _OTHER_TOOLS_SECTIONS)} (accepted: {', '.join(sorted(_KEYS))}; mapa-replay's sections {', '.join(sorted(_OTHER_TOOLS_SECTIONS))} "
                         "are ignored here)")
    values: dict[str, Any] = {}
    for key in ("policy", "default_directive", "scontrol", "squeue", "model", "health", "isolation", "isolation_scope"):
        if key in data:
            if not isinstance(data[key], str):
                raise InputError(f"{source}: {key} must be a string (in quotes), got {toml_text(data[key])}")
            values[key] = data[key]
    if values.get("model") == "auto":
        values["model"] = ""  # the topology's own model, as the default (hardware.load.resolve_model)
    if values.get("health", "auto") not in ("auto", "off"):
        raise InputError(f"{source}: health must be \"auto\" (leave out GPUs NVML reports sick) or \"off\", got {toml_text(values['health'])}")
    if values.get("isolation", "auto") not in ("auto", "off", "fail-open", "fail-closed"):
        raise InputError(f"{source}: isolation must be \"auto\" (fail-open where the topology names the GPUs' device files), "
                         f"\"off\", \"fail-open\" (a task runs, logged, when its GPUs cannot be isolated) or \"fail-closed\" "
                         f"(the task fails then), got {toml_text(values['isolation'])}")
    if values.get("isolation_scope", "step") not in ("step", "task"):
        raise InputError(f"{source}: isolation_scope must be \"step\" (the tasks of a step may open all of the step's GPUs) "
                         f"or \"task\" (each task only its own), got {toml_text(values['isolation_scope'])}")
    if "models" in data:
        models = data["models"]
        if not isinstance(models, dict) or not all(isinstance(v, str) and v for v in models.values()):
            raise InputError(f'{source}: [models] maps node-name globs to a model ("auto", a bundled model\'s name or a model '
                             f'file), e.g. "gpu*" = "nccl-tests-hgx-h100"; got {toml_text(models)}')
        values["models"] = tuple(models.items())
    if validate:
        _validate_with_engine(values, source)
    for key in ("ledger", "jobs_dir", "log", "journal_dir", "dcgm_job_mapping_dir"):
        if key in data:
            if not isinstance(data[key], str) or not data[key].startswith("/"):
                raise InputError(f"{source}: {key} must be an absolute path, got {toml_text(data[key])}")
            values[key] = Path(data[key])
    if "command_timeout" in data:
        timeout = data["command_timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
            raise InputError(f"{source}: command_timeout must be seconds in (0, 60], got {toml_text(timeout)}")
        values["command_timeout"] = float(timeout)
    if "prolog_budget" in data:
        budget = data["prolog_budget"]
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 2 <= budget <= MAX_PROLOG_BUDGET_S:
            raise InputError(f"{source}: prolog_budget must be seconds in [2, {MAX_PROLOG_BUDGET_S:g}], got {toml_text(budget)}")
        values["prolog_budget"] = float(budget)
    if "job_submit_lua" in data:
        if not isinstance(data["job_submit_lua"], bool):
            raise InputError(f"{source}: job_submit_lua must be true or false, got {toml_text(data['job_submit_lua'])}")
        values["job_submit_lua"] = data["job_submit_lua"]
    for key, low, high in (("reconcile_interval", 5, 3600), ("admin_comment_rate", 0.1, 1000)):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise InputError(f"{source}: {key} must be a number in [{low:g}, {high:g}], got {toml_text(value)}")
            values[key] = float(value)
    if "features" in data:
        values.update(_features_table(data["features"], source, text))
    if "metrics" in data:
        values["metrics_listen"] = _metrics_table(data["metrics"], source)
    if "affinity" in data:
        from ..core.affinity import settings_from_table

        values["affinity_mode"], values["affinity_max_loss"] = settings_from_table(data["affinity"], source)
    nodes = data.get("nodes", {})
    if not isinstance(nodes, dict) or not all(isinstance(v, str) for v in nodes.values()):
        raise InputError(f'{source}: [nodes] maps node-name globs to a preset or a topology file, e.g. "dgx*" = "dgx1-v100"; '
                         f'got {toml_text(nodes)}')
    values["nodes"] = tuple(nodes.items())
    if "preserve_ahead" in data:
        from ..core.ahead import settings_from_table

        sizes, values["ahead_tolerance"] = settings_from_table(data["preserve_ahead"], source)
        values["ahead_sizes"] = tuple(sorted(sizes.items())) if sizes else ()
    return HookConfig(**values)


def _features_table(table: Any, source: str, text: str = "") -> dict[str, Any]:
    """``[features]``: sizes = [2, 4, 8], threshold = 0.9, fleet = ["dgx1-v100", ...]."""
    accepted = ("sizes (GPU counts 2-64), threshold (a fraction in (0, 1]), fleet (topologies of the fleet's node types), "
                "insensitive_jobs (none or noring), outlook (true or false), weights (true or false), "
                f"weight_base (a whole number 0-{WEIGHT_BASE_MAX})")
    _unknown_in_table(table, "features", {"sizes", "threshold", "fleet", "insensitive_jobs", "outlook", "weights", "weight_base"},
                      text, source, accepted)
    sizes = table.get("sizes", [])
    if not isinstance(sizes, list) or not sizes or not all(isinstance(k, int) and not isinstance(k, bool) and 2 <= k <= 64 for k in sizes):
        raise InputError(f"{source}: [features] sizes must be a list of GPU counts 2-64, e.g. [2, 4, 8]; got {toml_text(sizes)}")
    threshold = table.get("threshold", 0.9)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise InputError(f"{source}: [features] threshold must be a fraction in (0, 1], got {toml_text(threshold)}")
    fleet = table.get("fleet", [])
    if not isinstance(fleet, list) or not all(isinstance(spec, str) and spec for spec in fleet):
        raise InputError(f"{source}: [features] fleet must be a list of presets or topology files, got {toml_text(fleet)}")
    insensitive = table.get("insensitive_jobs", "none")
    if insensitive not in ("noring", "none"):
        raise InputError(f"{source}: [features] insensitive_jobs must be \"none\" (no preference) or \"noring\" (insensitive "
                         f"jobs and jobs without a directive prefer mapa_noring<k>), got {toml_text(insensitive)}")
    outlook = table.get("outlook", False)
    if not isinstance(outlook, bool):
        raise InputError(f"{source}: [features] outlook must be true (publish the ring outlook mapa release --wait-rule cost "
                         f"reads, in the node's Extra) or false, got {toml_text(outlook)}")
    weights = table.get("weights", False)
    if not isinstance(weights, bool):
        raise InputError(f"{source}: [features] weights must be true (publish the node's Slurm Weight: its free GPUs' preserved "
                         f"bandwidth, so jobs fill the nodes worth least to rings first) or false, got {toml_text(weights)}")
    base = table.get("weight_base", 0)
    if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= WEIGHT_BASE_MAX:
        raise InputError(f"{source}: [features] weight_base must be a whole number 0-{WEIGHT_BASE_MAX} (added to the "
                         f"weight MAPA publishes, to keep a site's tiers of nodes in order), got {toml_text(base)}")
    return {"feature_sizes": tuple(sorted(set(sizes))), "feature_threshold": float(threshold), "feature_fleet": tuple(fleet),
            "feature_insensitive_jobs": insensitive, "feature_outlook": outlook, "feature_weights": weights,
            "feature_weight_base": base}


WEIGHT_BASE_MAX = 2_000_000_000  # with MAPA's part (below 2^27 for 64 GPUs) still under core.features.MAX_NODE_WEIGHT


_METRICS_ACCEPTED = ('a table with one key, listen = "HOST:PORT" (an IPv4 address or host name, or [IPv6], and a port '
                     '1-65535; e.g. "127.0.0.1:9786"), "PORT" (on 127.0.0.1) or "" (off)')
METRICS_DEFAULT_HOST = "127.0.0.1"  # a bare port listens on loopback only: the endpoint has no authentication
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]")


def _metrics_table(table: Any, source: str) -> tuple[str, int] | None:
    """``[metrics]``: listen = "HOST:PORT" -> (host, port); "PORT" -> (127.0.0.1, port); "" -> None (off)."""
    if not isinstance(table, dict) or set(table) - {"listen"}:
        raise InputError(f"{source}: [metrics] takes {_METRICS_ACCEPTED}; got {toml_text(table)[:80]}")
    listen = table.get("listen", "")
    if not isinstance(listen, str):
        raise InputError(f"{source}: [metrics] listen must be a string, {_METRICS_ACCEPTED}; got {toml_text(listen)}")
    if listen == "":
        return None
    host, colon, port = listen.rpartition(":")
    if not colon:
        host = METRICS_DEFAULT_HOST
    number = _port_number(port)
    if not _HOST.fullmatch(host) or number is None:
        raise InputError(f"{source}: [metrics] listen {listen[:80]!r} is not HOST:PORT or PORT; accepted: {_METRICS_ACCEPTED}")
    return (host[1:-1] if host.startswith("[") else host), number


def _port_number(text: str) -> int | None:
    """``text`` as a TCP port 1-65535 (ASCII digits only), or None."""
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        return None
    return int(text)


# A config is a few lines; bounding the read keeps a huge or endless file from stalling every hook.
MAX_CONFIG_BYTES = 1 << 20


# mapa-agent loads the config for every request (an edit applies at once): several times per job.
# A load is kept this long while the file's identity, size, times, mode and owner are unchanged, so
# an edit, a chmod or a chown of the file is seen at once; what could go unseen this long is a
# change to a directory above it or to a program it names (each root's own doing).
CONFIG_REUSE_S = 1.0
_recent_loads: dict[tuple[str, bool], tuple[tuple[int, ...], float, tuple[HookConfig, str]]] = {}


def load_hook_config(env: Mapping[str, str], *, validate: bool = True) -> tuple[HookConfig, str]:
    """The hooks' config (``$MAPA_CONFIG`` or /etc/slurm/mapa.toml) and, if it is unusable, why:
    :func:`read_hook_config`'s answer, or that of a read within CONFIG_REUSE_S of the same file."""
    path = env.get("MAPA_CONFIG", str(DEFAULT_CONFIG_PATH))
    try:
        st = os.stat(path)
        signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid)
    except OSError:
        signature = None
    key, now = (path, validate), time.monotonic()
    recent = _recent_loads.get(key)
    if signature is not None and recent is not None and recent[0] == signature and 0 <= now - recent[1] < CONFIG_REUSE_S:
        return recent[2]
    loaded = read_hook_config(env, validate=validate)
    if signature is not None and not loaded[1]:  # an unusable config is read afresh each time
        _recent_loads[key] = (signature, now, loaded)
    return loaded


def read_hook_config(env: Mapping[str, str], *, validate: bool = True) -> tuple[HookConfig, str]:
    """The hooks' config (``$MAPA_CONFIG`` or /etc/slurm/mapa.toml) and, if it is unusable, why.

    An unusable config never stops a hook: the defaults still find the ledger, and the Prolog
    falls back for every job, saying so. Like sshd's StrictModes, a config that anyone but root
    could have written is unusable (it names programs root runs), and so is one naming a
    scontrol or squeue that anyone but root could replace; a program that does not exist only
    fails when it is run.
    """
    path = Path(env.get("MAPA_CONFIG", str(DEFAULT_CONFIG_PATH)))
    try:
        trusted_files.check_trusted_file(path)
    except trusted_files.UnsafePath as error:
        if not os.path.lexists(path):
            return HookConfig(), f"bad-config: {path} does not exist"
        return HookConfig(), f"bad-config: refused the config, as sshd's StrictModes would: {error}"
    try:
        text = _config_text(trusted_files.read_bytes(path, MAX_CONFIG_BYTES), str(path))
        config = config_from_text(text, source=str(path), validate=validate)
    except (OSError, MapaError) as error:
        return HookConfig(), f"bad-config: {error}"
    problem = _untrusted_program(config, f" in {path}")
    if problem:
        return HookConfig(), f"bad-config: {problem}"
    return config, ""


def _config_text(raw: bytes, source: str) -> str:
    """The text of a config read as at most MAX_CONFIG_BYTES + 1 bytes (InputError if it is not)."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"{source} is larger than {MAX_CONFIG_BYTES} bytes; accepted: a config up to 1 MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{source}: byte {raw[error.start]:#04x} at offset {error.start} is not UTF-8; accepted: UTF-8 text") from None


def _untrusted_program(config: HookConfig, where: str = "") -> str:
    """Why the hooks refuse the scontrol or squeue a config names (root runs them), or ""."""
    for key, command in (("scontrol", config.scontrol), ("squeue", config.squeue)):
        program = trusted_files.command_path(command)
        if program is None:
            continue  # not there: the call fails when it is made, like a missing scontrol on any node
        try:
            trusted_files.resolve_trusted_file(program)
        except trusted_files.UnsafePath as error:
            return f"refused {key} = {command!r}{where}, as sshd's StrictModes would: {error}"
    return ""


def programs_root_may_run(config: HookConfig, path: str | os.PathLike[str]) -> str:
    """Why root must not run the scontrol or squeue that the config at ``path`` names, or "":
    the file itself or the program is one another user could have chosen or changed (the hooks'
    own rules, trusted_files.py). Read-only admin commands (`mapa doctor`, `mapa explain`) read any
    config, but judge this before they run anything it names."""
    try:
        trusted_files.check_trusted_file(Path(path))
    except (trusted_files.UnsafePath, OSError) as error:
        if (config.scontrol, config.squeue) != (HookConfig.scontrol, HookConfig.squeue):
            return f"{os.fspath(path)} names the programs to run, and is not a file root may trust: {error}"
    return _untrusted_program(config, f" in {os.fspath(path)}")


_ACCEPTED_FILE = "accepted: a UTF-8 TOML file of the keys in docs/admin.md, section 4 (an empty file means every default)"


def missing_config(path: str | os.PathLike[str], option: str = "--config") -> str:
    """The one message for a mapa.toml that does not exist (`mapa hooks`, `mapa status`,
    `mapa explain`, `mapa doctor`): the option and file, and what is accepted."""
    source = f"{option} {os.fspath(path)}" if option else os.fspath(path)
    return f"{source}: no such file; {_ACCEPTED_FILE}"


def load_admin_config(path: str | os.PathLike[str], *, option: str = "--config", trusted: bool = True,
                      validate: bool = True) -> HookConfig:
    """The config an admin command was given, or InputError: one line naming the file, what is
    wrong in it and what is accepted (the `mapa` handler prints it and exits with status 2).

    Where the hooks fall back on a config they cannot use (:func:`load_hook_config`: a hook
    never fails), `mapa hooks`, `mapa job-submit-lua`, `mapa status` and `mapa explain` refuse
    it, so that a misspelled key is seen when the hooks are written rather than at the first job:
    a missing file, a directory, bytes that are not UTF-8, bad TOML, an unknown key, a value of
    the wrong type or range. An empty file is the defaults, as for the hooks. ``trusted``: also
    refuse what the hooks would refuse for its owner and mode or for the scontrol and squeue it
    names (sshd's StrictModes); without it (read-only commands) the file is read as it is.
    """
    source = f"{option} {os.fspath(path)}" if option else os.fspath(path)
    where = Path(path)
    if not os.path.lexists(where):
        raise InputError(missing_config(path, option))
    if os.path.isdir(where):
        raise InputError(f"{source}: is a directory; {_ACCEPTED_FILE}")
    try:
        if trusted:
            try:
                trusted_files.check_trusted_file(where)
            except trusted_files.UnsafePath as error:
                raise InputError(f"{source}: the hooks would refuse it and fall back for every job: {error}") from None
            raw = trusted_files.read_bytes(where, MAX_CONFIG_BYTES)
        else:
            if not os.path.isfile(where):
                raise InputError(f"{source}: not a regular file; {_ACCEPTED_FILE}")
            with open(where, "rb") as handle:
                raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise InputError(f"{source}: cannot read it: {error.strerror or error}") from None
    config = config_from_text(_config_text(raw, source), source=source, validate=validate)
    if trusted:
        problem = _untrusted_program(config)
        if problem:
            raise InputError(f"{source}: the hooks would fall back for every job: {problem}")
    return config


def hook_logger(path: Path) -> Callable[[str], None]:
    """Appends timestamped lines to the hooks' log file, never through a symlink, FIFO or hard
    link and never making it writable by others (trusted_files.append_log_line); to stderr if it cannot."""
    failed: list[str] = []

    def log(message: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} mapa[{os.getpid()}] {message}\n"
        try:
            trusted_files.append_log_line(path, line)
        except (OSError, MapaError) as error:
            if not failed:  # say once per hook why the log is not where the config says
                failed.append(str(error))
                sys.stderr.write(f"mapa: cannot log to {path} ({error}); logging here\n")
            sys.stderr.write(line)

    return log
