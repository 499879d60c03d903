"""``mapa hooks DIR``: write the hook wrappers Slurm runs, for this installation of slurm-mapa.

Slurm runs hooks with no PATH and a bare environment, and a hook that fails drains the node, so
the wrappers name every path absolutely and always exit 0. Each tries the node's mapa-agent first
(a client that imports only built-in modules) and runs the hook in-process when there is none.
The text is built by pure functions (tested on literal output); only ``cmd_hooks`` writes files.

Root runs what the wrappers name, so ``mapa hooks`` refuses an interpreter, a config or a
directory that anyone but root could change (the checks of :mod:`slurm_mapa.slurm.trusted_files`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InputError
from .. import trusted_files as trusted
from ..isolation import spank_plugin
from . import c_build, hook_client

if TYPE_CHECKING:
    from ..config import HookConfig

PACKAGE_DIR = Path(__file__).resolve().parents[2]
TASKPROLOG = PACKAGE_DIR / "data" / "hooks" / "mapa-taskprolog"
ENTRY = {"prolog": ("slurm_mapa.slurm.hooks.prolog", "prolog_main"), "epilog": ("slurm_mapa.slurm.hooks.epilog", "epilog_main")}
WRAPPER_NAMES = {"prolog": "mapa-prolog-wrapper", "epilog": "mapa-epilog-wrapper"}


# A hook killed by a signal is run once more only if the wrapper started less than this long ago:
# the retry then ends within the 60 s PrologEpilogTimeout the docs recommend (a Prolog's budget is
# at most config.MAX_PROLOG_BUDGET_S), where a hook past the timeout would drain the node.
RETRY_WINDOW_S = 30


# The Prolog wrapper marks the job before any Python starts (the format of node_state.mark_text; the
# wrapper's own pid and start time, field 22 of /proc/PID/stat: its name, "mapa-prolog-wra",
# has no blank), so a job whose every Python run is killed still tells later Prologs its GPUs.
_MARK_JOB = r"""mark_job() {
    case "$SLURM_JOB_ID" in ''|*[!0-9]*) return 0 ;; esac
    case "$SLURM_JOB_GPUS" in *[!0-9,]*) return 0 ;; esac
    [ -d "$JOBS_DIR" ] && [ ! -h "$JOBS_DIR" ] && [ -O "$JOBS_DIR" ] || return 0
    read -r _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ start _ < /proc/$$/stat || return 0
    # A requeued job's earlier Epilog said it ended; rm only then (a program start less per job).
    ended="$JOBS_DIR/.ended-$SLURM_JOB_ID"
    if [ -e "$ended" ] || [ -h "$ended" ]; then /bin/rm -f "$ended"; fi
    tmp="$JOBS_DIR/.prolog-$SLURM_JOB_ID.$$.tmp"
    sluid=
    case "$SLURM_JOB_SLUID" in s[0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z][0-9A-HJKMNP-TV-Z]) sluid=" sluid=$SLURM_JOB_SLUID" ;; esac
    if (set -C; umask 077; printf 'pid=%s start=%s slurm=%s%s\n' "$$" "$start" "$SLURM_JOB_GPUS" "$sluid" > "$tmp") 2>/dev/null; then
        /bin/mv -f "$tmp" "$JOBS_DIR/.prolog-$SLURM_JOB_ID" 2>/dev/null || /bin/rm -f "$tmp"
    fi
    return 0
}
mark_job
"""

# The Epilog wrapper says the job has ended before any Python starts (node_state.ended_path): if
# every Python run is killed, the next Prolog still drops the job's ledger entry and files.
_END_JOB = r"""end_job() {
    case "$SLURM_JOB_ID" in ''|*[!0-9]*) return 0 ;; esac
    [ -d "$JOBS_DIR" ] && [ ! -h "$JOBS_DIR" ] && [ -O "$JOBS_DIR" ] || return 0
    (set -C; : > "$JOBS_DIR/.ended-$SLURM_JOB_ID") 2>/dev/null
    return 0
}
end_job
"""


def wrapper_text(kind: str, python: str, package_parent: str, config: str, pycache_prefix: str | None = None,
                 retry_window_s: int = RETRY_WINDOW_S, jobs_dir: str | None = None, client: str | None = None) -> str:
    """The POSIX shell wrapper for ``kind`` (prolog or epilog) of an installation.

    ``pycache_prefix``: where the in-process hook keeps byte code when the package directory is
    read-only (compiling on every job costs about 50 ms). The wrapper exports
    MAPA_WRAPPER_STARTED (seconds since boot, from /proc/uptime, 0 if unreadable) for the hooks'
    budget, and MAPA_HOOK_RETRY_AFTER_SIGNAL (the signal number) to a retried hook. ``jobs_dir``
    (the config's): where the Prolog wrapper marks the job, and the Epilog wrapper says it has
    ended, before Python starts. ``client``: the compiled client of mapa-agent (hook_client.py),
    else the Python one.
    """
    paths = [("python", python), ("package directory", package_parent), ("config", config)]
    if client is not None:
        paths.append(("client", client))
    if jobs_dir is not None:
        paths.append(("jobs directory", jobs_dir))
    if pycache_prefix is not None:
        paths.append(("pycache prefix", pycache_prefix))
    for what, path in paths:
        if not os.path.isabs(path) or any(c in path for c in "\n'\"\\$`"):
            raise InputError(f"the {what} path {path!r} must be absolute and free of quotes, backslashes, $ and newlines")
    module, function = ENTRY[kind]
    fast_path = (f"{shlex.quote(client)} {kind} && exit 0\n" if client is not None else
                 f"{shlex.quote(python)} -I -S {shlex.quote(os.path.join(package_parent, 'slurm_mapa', 'slurm', 'agent', 'client.py'))}"
                 f" {kind} && exit 0\n")
    code = f'import sys; sys.path.insert(0, "{package_parent}"); from {module} import {function}; sys.exit({function}())'
    in_process = (f"{shlex.quote(python)} -I{' -X pycache_prefix=' + shlex.quote(pycache_prefix) if pycache_prefix else ''}"
                  f" -c {shlex.quote(code)}")
    return (
        "#!/bin/sh\n"
        f"# slurm-mapa {kind} wrapper, written by `mapa hooks`. Slurm gives hooks no PATH, and a hook that\n"
        "# fails drains the node: absolute paths only, no programs but ours and Python, and exit 0 whatever happens.\n"
        "# Whatever umask slurmd has: nothing root writes here (log, byte code) may be writable by others.\n"
        "umask 022\n"
        "read -r MAPA_WRAPPER_STARTED rest < /proc/uptime || MAPA_WRAPPER_STARTED=0\n"
        f"MAPA_CONFIG={shlex.quote(config)}\n"
        "export MAPA_CONFIG MAPA_WRAPPER_STARTED\n"
        + (f"JOBS_DIR={shlex.quote(jobs_dir)}\n{_MARK_JOB if kind == 'prolog' else _END_JOB}" if jobs_dir is not None else "")
        + "# Fast path: the node's mapa-agent runs the hook; otherwise (no agent, killed, refused) in-process.\n"
        + fast_path +
        f"{in_process}\n"
        "# Killed by a signal (the OOM killer, say) early enough to stay inside Slurm's timeout: once more;\n"
        "# that run finds what the first one left and finishes it.\n"
        "status=$?\n"
        "read -r now rest < /proc/uptime || now=0\n"
        f'if [ "$status" -gt 128 ] && [ $(( ${{now%.*}} - ${{MAPA_WRAPPER_STARTED%.*}} )) -lt {int(retry_window_s)} ]; then\n'
        f"  MAPA_HOOK_RETRY_AFTER_SIGNAL=$((status - 128)) {in_process}\n"
        "fi\n"
        "exit 0\n"
    )


# MAPA's wrappers finish within 60 s (the agent client gives up after ANSWER_TIMEOUT_S, the in-process
# hook has prolog_budget, at most MAX_PROLOG_BUDGET_S, and a retry after a signal starts only within
# RETRY_WINDOW_S of the wrapper's start): docs/admin.md asks for PrologEpilogTimeout=60 or more.
MIN_HOOK_TIMEOUT_S = 60


def needed_hook_timeout(config: HookConfig) -> int:
    """Seconds slurm.conf must give MAPA's Prolog: 60, or more for a budget that would need it."""
    from ..agent.client import ANSWER_TIMEOUT_S
    from ..config import MAX_PROLOG_BUDGET_S

    return max(MIN_HOOK_TIMEOUT_S, math.ceil(ANSWER_TIMEOUT_S + min(config.prolog_budget, MAX_PROLOG_BUDGET_S) + 10),
               math.ceil(RETRY_WINDOW_S + config.prolog_budget))


def slurm_conf_lines(directory: str, timeout: int = MIN_HOOK_TIMEOUT_S) -> str:
    """The slurm.conf lines MAPA needs, as `mapa hooks DIR` prints them (docs/admin.md, section 2,
    shows them for /usr/local/sbin; a test checks the two agree). ``timeout``: the
    PrologEpilogTimeout the wrappers need (needed_hook_timeout: 60 unless prolog_budget
    asks for more)."""

    def line(setting: str, comment: str = "") -> str:
        return f"{setting + ' ':<40}# {comment}\n" if comment else f"{setting}\n"

    return (
        line("JobSubmitPlugins=lua")
        + line("PrologFlags=Alloc", "the Prolog runs when the job is allocated")
        + line(f"Prolog={os.path.join(directory, WRAPPER_NAMES['prolog'])}", "written by `mapa hooks`")
        + line(f"Epilog={os.path.join(directory, WRAPPER_NAMES['epilog'])}")
        + line(f"TaskProlog={os.path.join(directory, 'mapa-taskprolog')}")
        + line(f"PrologEpilogTimeout={timeout}", "the Prolog stays within prolog_budget (twice, with the agent's fallback)")
        + line("AccountingStorageTRES=gres/gpu", "sacct shows GPU counts")
        + line("AccountingStoreFlags=job_comment", "sacct shows comments")
    )


def feature_conf_lines(sizes: tuple[int, ...]) -> str:
    """The slurm.conf lines node choice needs when mapa.toml has ``[features]``: every name a node
    may publish among its Features= (``scontrol update ... ActiveFeatures=`` takes only those), and
    ignore_prefer_validation (a --prefer naming a feature active on no node would hold the job)."""
    if not sizes:
        return ""
    from ...core.features import feature_names

    return ("# node choice ([features] in mapa.toml): add to each GPU node's NodeName= line, next to its own features,\n"
            f"#   Features={','.join(feature_names(sizes))}\n"
            "# and to SchedulerParameters= (comma-separated with what is there):\n"
            "#   ignore_prefer_validation\n")


def check_interpreter(python: str) -> Path:
    """The file ``python`` runs, if root may run it for every job: a regular executable that only
    root can change, reached through symlinks in directories only root can change. Raises InputError."""
    accepted = "accepted: an executable owned by root, not writable by group or others, in directories only root can change"
    if not os.path.isabs(python):
        raise InputError(f"--python {python!r} is not an absolute path; {accepted}")
    try:
        resolved = trusted.resolve_trusted_file(Path(python))
    except trusted.UnsafePath as error:
        raise InputError(f"--python {python}: root would run it for every job, refused: {error} "
                         "(symlinks such as /usr/bin/python3 -> python3.X are followed, and each is judged)") from None
    if not os.access(resolved, os.X_OK):
        raise InputError(f"--python {python}: {resolved} is not executable; {accepted}")
    return resolved


def check_client(client: str) -> Path:
    """A client of mapa-agent built elsewhere (`--client`), if root may run it for every job: as
    --python, an executable only root can change."""
    accepted = "accepted: a mapa-hook-client built from data/client/mapa_hook_client.c, owned by root, not writable by others"
    if not os.path.isabs(client) or any(c in client for c in "\n'\"\\$`"):
        raise InputError(f"--client {client!r}: give an absolute path free of quotes, backslashes, $ and newlines; {accepted}")
    try:
        resolved = trusted.resolve_trusted_file(Path(client))
    except trusted.UnsafePath as error:
        raise InputError(f"--client {client}: root would run it for every job, refused: {error}") from None
    if not os.access(resolved, os.X_OK):
        raise InputError(f"--client {client}: {resolved} is not executable; {accepted}")
    return Path(client)


def check_config(config: str) -> HookConfig:
    """The config as the hooks will read it; InputError for one they would refuse or could not use
    (they would fall back for every job), missing included: its jobs_dir, isolation and
    [features] go into the files written."""
    from ..config import load_admin_config

    return load_admin_config(config)


def check_node_topology(config: "HookConfig", node: str, config_path: str) -> None:
    """InputError when the [nodes] entry matching ``node`` names a topology the Prolog could not
    load (a file that does not exist, or one it cannot read or parse, or a misspelled preset):
    every job on the node would get Slurm's GPUs (its record says no-topology), so `mapa hooks`
    refuses before writing anything, as it does for a bad config. No entry: a WARNING later."""
    from ...errors import MapaError
    from ...hardware.load import load_topology_file
    from ...hardware.presets import PRESETS

    entry = config.nodes_entry_for(node)
    if entry is None or entry[1] in PRESETS:
        return
    pattern, spec = entry
    where = f"--config {config_path}: [nodes] entry {json.dumps(pattern)} = {json.dumps(spec)} (node {node})"
    consequence = f"every job on {node} would get Slurm's GPUs (its record says no-topology)"
    accepted = (f"accepted: a preset ({', '.join(PRESETS)}) or a topology file on this node, e.g. from "
                f"`mapa topo discover -o {spec if ('/' in spec or spec.endswith('.toml')) else 'FILE'}`")
    if ("/" in spec or spec.endswith(".toml")) and not os.path.lexists(spec):
        raise InputError(f"{where}: topology file {spec} does not exist; {consequence}; {accepted}")
    try:
        load_topology_file(spec)
    except (OSError, MapaError) as error:
        reason = " ".join(str(error).split())  # one line
        said = "accepted" in reason or "neither a preset" in reason  # what is accepted, said already
        raise InputError(f"{where}: {reason}; {consequence}" + ("" if said else f"; {accepted}")) from None


def prepare_ring_rates(config: "HookConfig", node: str) -> str | None:
    """Compute and store the ring-rate table of the node's topology where none ships (ring_rate_cache.py),
    so no Prolog on the node solves one; the line saying so, None where there was nothing to do."""
    from ...hardware.load import load_topology_file
    from ..ring_rate_cache import prepare_table

    spec = config.topology_for(node)
    if spec is None:
        return None  # the WARNING about the missing [nodes] entry comes later
    try:
        return prepare_table(load_topology_file(spec).graph, config.ring_rates_dir,
                             lambda line: print(f"WARNING: {line}", file=sys.stderr))
    except Exception as error:  # noqa: BLE001 - the Prolog computes it on first use instead
        return f"WARNING: ring rates: could not compute the table of {spec} ({error}); the first Prolog will"


def package_warning(package_dir: Path) -> str | None:
    """A warning line when root would import slurm-mapa from a directory others can change."""
    try:
        trusted.check_trusted_dir(package_dir)
    except trusted.UnsafePath as error:
        return (f"WARNING: root will import slurm-mapa from {package_dir}, which others could change: {error}; "
                f"install it where only root can write (`chown -R root:root` and `chmod -R go-w` it, or a venv of root's: "
                f"docs/admin.md, section 1)")
    return None


GPU_VENDORS = ("auto", "nvidia", "amd")


JOB_SUBMIT_LUA = PACKAGE_DIR / "data" / "slurm" / "job_submit.lua"


def job_submit_text(sizes: tuple[int, ...], insensitive_jobs: str = "none") -> str:
    """job_submit.lua with its node-choice settings from mapa.toml's ``[features]``."""
    if insensitive_jobs not in ("noring", "none"):
        raise InputError(f"insensitive_jobs {insensitive_jobs!r}: expected noring or none")
    text = JOB_SUBMIT_LUA.read_text()
    wanted = {
        "local _NODE_FEATURE_SIZES = {}\n": "local _NODE_FEATURE_SIZES = {" + (" " + ", ".join(map(str, sizes)) + " " if sizes else "") + "}\n",
        'local _INSENSITIVE_JOBS = "none"\n': f'local _INSENSITIVE_JOBS = "{insensitive_jobs}"\n',
    }
    for default, line in wanted.items():
        if text.count(default) != 1:
            raise InputError(f"{JOB_SUBMIT_LUA} has no single line {default.strip()!r} to set")
        text = text.replace(default, line)
    return text


ISOLATION_MODES = ("off", "fail-open", "fail-closed")
ISOLATION_SCOPES = ("step", "task")  # mapa.toml's isolation_scope


def taskprolog_text(jobs_dir: str, gpu_vendor: str = "auto", isolation: str = "off", python: str | None = None,
                    package_parent: str | None = None, isolation_scope: str = "step") -> str:
    """The TaskProlog, reading the per-job files where the config puts them. ``gpu_vendor``
    "auto" tells AMD nodes by the amdgpu driver's /dev/kfd; "nvidia" or "amd" fixes it.
    ``isolation`` (mapa.toml's) other than "off", with ``python`` and ``package_parent``: each task
    first asks mapa-agent to isolate its GPUs (agent/client.py isolate), and with "fail-closed"
    the task fails when there is no agent to ask; unless the SPANK plugin has isolated it to its
    step's GPUs already and ``isolation_scope`` is "step" (the request would change nothing)."""
    if gpu_vendor not in GPU_VENDORS:
        raise InputError(f"GPU vendor {gpu_vendor!r}: expected one of {', '.join(GPU_VENDORS)}")
    if isolation not in ISOLATION_MODES:
        raise InputError(f"isolation {isolation!r}: expected one of {', '.join(ISOLATION_MODES)}")
    if isolation_scope not in ISOLATION_SCOPES:
        raise InputError(f"isolation_scope {isolation_scope!r}: expected one of {', '.join(ISOLATION_SCOPES)}")
    settings = [("JOBS_DIR=/run/slurm-mapa/jobs\n", f"JOBS_DIR={shlex.quote(jobs_dir)}\n"),
                ("GPU_VENDOR=auto\n", f"GPU_VENDOR={gpu_vendor}\n"),
                ("ISOLATION_SCOPE=step\n", f"ISOLATION_SCOPE={isolation_scope}\n")]
    if isolation != "off":
        if python is None or package_parent is None:
            raise InputError(f"isolation {isolation!r} needs the Python and the package directory the TaskProlog runs")
        client = os.path.join(package_parent, "slurm_mapa", "slurm", "agent", "client.py")
        for what, path in (("python", python), ("package directory", package_parent)):
            if not os.path.isabs(path) or any(c in path for c in "\n'\"\\$`"):
                raise InputError(f"the {what} path {path!r} must be absolute and free of quotes, backslashes, $ and newlines")
        settings += [("ISOLATION=off\n", f"ISOLATION={isolation}\n"), ("MAPA_PYTHON=\n", f"MAPA_PYTHON={shlex.quote(python)}\n"),
                     ("MAPA_CLIENT=\n", f"MAPA_CLIENT={shlex.quote(client)}\n")]
    text = TASKPROLOG.read_text()
    for default, wanted in settings:
        if default not in text:
            raise InputError(f"{TASKPROLOG} has no line {default.strip()!r} to set")
        text = text.replace(default, wanted)
    return text


def cmd_hooks(args: argparse.Namespace) -> int:
    directory = Path(args.directory).resolve()
    python = args.python or sys.executable
    check_interpreter(python)
    config = check_config(args.config)
    node = args.node or os.uname().nodename.split(".")[0]
    check_node_topology(config, node, args.config)
    said = prepare_ring_rates(config, node)
    if said:
        print(said, file=sys.stderr)
    warning = package_warning(PACKAGE_DIR)
    if warning:
        print(warning, file=sys.stderr)
    jobs_dir = str(config.jobs_dir)
    try:
        trusted.ensure_trusted_dir(directory)  # slurmd runs what is in it, as root
    except trusted.UnsafePath as error:
        raise InputError(f"cannot write the hooks into {directory}: {error}") from None

    def wrappers(client: Path | None) -> dict[str, str]:
        return {WRAPPER_NAMES[kind]: wrapper_text(kind, python, str(PACKAGE_DIR.parent), args.config, args.pycache_prefix,
                                                  jobs_dir=jobs_dir, client=None if client is None else str(client))
                for kind in ENTRY}

    texts = wrappers(None)  # refuses bad paths before anything is built
    if args.client is not None:
        texts = wrappers(check_client(args.client))
        print(f"the wrappers ask mapa-agent through {args.client}", file=sys.stderr)
    elif args.cc != "none":
        client, said = hook_client.build_into(directory, args.cc)
        print(said, file=sys.stderr)
        if client is not None:
            texts = wrappers(client)
    from ..isolation.isolator import effective_mode

    # "auto" comes to a mode on this node (the TaskProlog holds it and the scope: run `mapa hooks`
    # again after changing isolation, isolation_scope or the node's topology file).
    isolation, why = effective_mode(config, node)
    print(f"isolation: {isolation} ({why})", file=sys.stderr)
    texts["mapa-taskprolog"] = taskprolog_text(jobs_dir, args.gpu_vendor, isolation, python, str(PACKAGE_DIR.parent),
                                               config.isolation_scope)
    for name, text in texts.items():
        target = directory / name
        # A fresh unpredictable name renamed over the target: slurmd sees the old hook or the new, never
        # half of one, and a planted symlink is replaced, not followed.
        trusted.replace_file(target, text.encode(), mode=0o755)
        print(f"wrote {target}", file=sys.stderr)
    print(slurm_conf_lines(str(directory), needed_hook_timeout(config)), end="")
    print(feature_conf_lines(config.feature_sizes), end="")
    if config.topology_for(node) is None:
        # The hooks work, but the Prolog falls back to Slurm's GPUs for every job here (doctor: FAIL).
        print(f"WARNING: no [nodes] entry of {args.config} matches node {node}: every job on it gets Slurm's GPUs "
              f"(its record says no-topology); add \"{node}\" = \"/etc/slurm/mapa/{node}.toml\" under [nodes] (a file from "
              f"`mapa topo discover -o FILE`, or a preset name), or give --node NAME as slurm.conf names this node",
              file=sys.stderr)
    # Last on stderr, where it is seen: a SPANK plugin the running Slurm would skip without a word.
    try:
        problems = spank_plugin.check_this_node(os.environ, spank_plugin.running_slurm_version_text)
    except Exception as error:  # noqa: BLE001 - the hooks are written; the check only informs
        problems = [f"could not check the SPANK plugin in plugstack.conf: {error}"]
    for problem in problems:
        print(f"WARNING: {problem}", file=sys.stderr)
    return 0


def cmd_job_submit_lua(args: argparse.Namespace) -> int:
    """Write job_submit.lua for the controller with mapa.toml's node-choice settings."""
    loaded = check_config(args.config)
    target = Path(args.path)
    try:
        trusted.ensure_trusted_dir(target.resolve().parent)  # slurmctld runs it, as SlurmUser
    except trusted.UnsafePath as error:
        raise InputError(f"cannot write {target}: {error}") from None
    trusted.replace_file(target.resolve(), job_submit_text(loaded.feature_sizes, loaded.feature_insensitive_jobs).encode(), mode=0o644)
    print(f"wrote {target}", file=sys.stderr)
    print("JobSubmitPlugins=lua\n", end="")
    print(feature_conf_lines(loaded.feature_sizes), end="")
    return 0


SPANK_SOURCE = PACKAGE_DIR / "data" / "spank" / "spank_mapa_isolate.c"
SPANK_MODES = ("fail-open", "fail-closed")
MAX_PLUGIN_BYTES = 16 << 20


def spank_build_argv(cc: str, source: Path, output: Path) -> list[str]:
    """The compiler command for MAPA's SPANK plugin (it needs the Slurm headers: libslurm-dev)."""
    return [cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(output), str(source)]


def plugstack_line(plugin: Path, mode: str) -> str:
    """The plugstack.conf line that loads it (``optional``: srun and sbatch read the file too)."""
    if mode not in SPANK_MODES:
        raise InputError(f"SPANK plugin mode {mode!r} (accepted: {', '.join(SPANK_MODES)})")
    return f"optional {plugin} {mode}\n"


def spank_build_report(plugin: bytes, target: Path, running_text: str | None) -> list[str]:
    """What to tell the admin about a freshly built plugin: the release of the headers it was
    compiled against and, when a Slurm command answered ``running_text``, whether the running
    Slurm will load it.

    A mismatch is a WARNING, and the plugin is installed all the same: the command that answered
    may not be the Slurm slurmstepd runs (two installations, or new packages whose daemons restart
    later), and refusing would leave the node with whatever plugin it had. ``mapa hooks`` and
    mapa-agent's start check the installed plugin against the running Slurm again."""
    built = spank_plugin.elf_u32_symbol(plugin, "plugin_version")
    if built is None:
        return [f"WARNING: {target} has no plugin_version symbol: Slurm will not load it"]
    lines = [f"built for Slurm {spank_plugin.release_text(built)} (SLURM_VERSION_NUMBER {built:#08x} of the installed headers)"]
    from ... import TESTED_SLURM_RELEASES

    if spank_plugin.release_text(built) not in TESTED_SLURM_RELEASES:
        lines.append(f"note: slurm-mapa is tested with Slurm {' and '.join(TESTED_SLURM_RELEASES)}, not "
                     f"{spank_plugin.release_text(built)}: the plugin builds against these headers, but its behaviour on "
                     "that release is untested")
    running = spank_plugin.parse_slurm_version(running_text) if running_text else None
    if running is None:
        lines.append(f"no slurmd, scontrol or sinfo answered -V: check that this node runs Slurm {spank_plugin.release_text(built)}, "
                     "the only release whose slurmstepd loads it")
    elif spank_plugin.spank_plugin_problem(plugin, str(target), running):
        lines.append(f"WARNING: the Slurm headers installed are of Slurm {spank_plugin.version_text(built)} but this node runs "
                     f"Slurm {spank_plugin.version_text(running)}, whose slurmstepd will not load {target} (it loads only plugins "
                     f"of its own major.minor): install the matching headers (Debian: libslurm-dev, RHEL: slurm-devel, "
                     f"of Slurm {spank_plugin.release_text(running)}) and run this command again")
    return lines


def cmd_spank_plugin(args: argparse.Namespace) -> int:
    """Compile the SPANK plugin into PATH (replaced whole: slurmstepd loads it at every step) and
    print its plugstack.conf line."""
    import tempfile

    target = Path(args.path)
    if not target.is_absolute() or target.suffix != ".so":
        raise InputError(f"{args.path!r}: give an absolute path ending in .so, e.g. /usr/local/lib/slurm-mapa/spank_mapa_isolate.so")
    line = plugstack_line(target, args.mode)
    try:
        trusted.ensure_trusted_dir(target.parent)  # slurmstepd loads it as root
    except trusted.UnsafePath as error:
        raise InputError(f"cannot write {target}: {error}") from None
    with tempfile.TemporaryDirectory(prefix="mapa-spank-") as scratch:
        built = Path(scratch) / target.name
        try:
            data = c_build.build(spank_build_argv(args.cc, SPANK_SOURCE, built), built, MAX_PLUGIN_BYTES)
        except c_build.BuildFailed as error:
            raise InputError({
                "missing": f"cannot run the compiler {args.cc!r}: {error.detail}; accepted: --cc naming an installed C "
                           "compiler (Debian: apt install gcc libslurm-dev; RHEL: dnf install gcc slurm-devel)",
                "unrunnable": f"cannot run the compiler {args.cc!r}: {error.detail}",
                "failed": f"{args.cc} failed on {SPANK_SOURCE} (it needs the Slurm headers: Debian's libslurm-dev, "
                          f"RHEL's slurm-devel):\n{error.detail}",
                "too-large": f"{args.cc} made a plugin of {error.detail}; not installed",
            }[error.stage]) from None
        trusted.replace_file(target, data, mode=0o644)
    print(f"wrote {target}", file=sys.stderr)
    for report in spank_build_report(data, target, spank_plugin.running_slurm_version_text()):
        print(report, file=sys.stderr)
    print("# /etc/slurm/plugstack.conf on every compute node (and mapa.toml's isolation on):")
    print(line, end="")
    return 0


def add_commands(commands: Any) -> None:
    spank = commands.add_parser(
        "spank-plugin",
        help="compile the SPANK plugin that asks mapa-agent, as root, to isolate each task (docs/isolation.md)",
        description="Compile the bundled spank_mapa_isolate.c into PATH and print the plugstack.conf line that loads it.",
    )
    spank.add_argument("path", help="where to write it, e.g. /usr/local/lib/slurm-mapa/spank_mapa_isolate.so")
    spank.add_argument("--cc", default="cc", help="the C compiler (default %(default)s)")
    spank.add_argument("--mode", choices=SPANK_MODES, default="fail-open",
                       help="when the agent cannot be asked: the task runs (fail-open, default) or fails (fail-closed)")
    spank.set_defaults(handler=cmd_spank_plugin)
    lua = commands.add_parser(
        "job-submit-lua",
        help="write job_submit.lua (the directive validator) for slurmctld, with mapa.toml's [features]",
        description="Write the job_submit.lua plugin to PATH (next to slurm.conf, e.g. /etc/slurm/job_submit.lua) with "
        "the node-choice settings of mapa.toml's [features], and print the slurm.conf lines it needs.",
    )
    lua.add_argument("path", help="where to write it, e.g. /etc/slurm/job_submit.lua")
    lua.add_argument("--config", default="/etc/slurm/mapa.toml", help="the config with [features] (default %(default)s)")
    lua.set_defaults(handler=cmd_job_submit_lua)
    hooks = commands.add_parser(
        "hooks",
        help="write the Prolog/Epilog wrappers and the TaskProlog for this installation",
        description="Write mapa-prolog-wrapper, mapa-epilog-wrapper and mapa-taskprolog into DIRECTORY (mode 755) "
        "and print the slurm.conf lines that use them.",
    )
    hooks.add_argument("directory", help="where to write them, e.g. /usr/local/sbin")
    hooks.add_argument("--python", help="the Python that has slurm-mapa installed (default: this one); root runs it, so it "
                                        "must be root's and not writable by others, in directories only root can change")
    hooks.add_argument("--config", default="/etc/slurm/mapa.toml", help="the hooks' config (default %(default)s)")
    hooks.add_argument("--node", help="the node the hooks are for, as in mapa.toml's [nodes] (default: this host's short name)")
    hooks.add_argument("--pycache-prefix", help="byte-code cache for the in-process hooks, when the package directory is read-only")
    hooks.add_argument("--gpu-vendor", choices=GPU_VENDORS, default="auto",
                       help="what the TaskProlog exports: auto (default; AMD variables where /dev/kfd exists), nvidia "
                            "(CUDA_VISIBLE_DEVICES) or amd (ROCR_VISIBLE_DEVICES and 0..k-1 HIP lists)")
    hooks.add_argument("--cc", default="cc",
                       help="the C compiler that builds the wrappers' client of mapa-agent into DIRECTORY (default "
                            "%(default)s; 'none': the Python client, about 15 ms more CPU per Prolog and Epilog)")
    hooks.add_argument("--client", metavar="PATH",
                       help="a mapa-hook-client built elsewhere (nodes without a compiler: build it once with `mapa hooks "
                            "DIR` on a node that has one, then copy it); nothing is compiled")
    hooks.set_defaults(handler=cmd_hooks)
