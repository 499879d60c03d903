"""The checks of mapa doctor: pure functions of an Inputs record, each returning Check lines."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ....hardware.topofile import Topology
from ...agent.client import ANSWER_TIMEOUT_S
from ...config import HookConfig, missing_config
from ..install import needed_hook_timeout
from ...isolation.spank_plugin import slurm_conf_value
from .held_check import check_health, check_held
from .lenient_config import parse_config
from .records import FAIL, HOOKS, ISOLATION_STRENGTH, NODE_CHECKS, OK, UNLIMITED_TIMEOUT, WARN, Check, Inputs, PathFacts
from .slurm_text import GresLine, flag_list, gres_gpu_lines, is_yes, node_gpu_count, parse_show_config, script_value, slurm_values

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
    from ...text.commands import timed_out

    if conf is None and (inputs.show_config_error or "").startswith("not run: "):
        return Check("scontrol", FAIL, f"`scontrol show config` was {inputs.show_config_error}; "
                                       "the slurm.conf checks could not be made",
                     "make mapa.toml and the scontrol/squeue it names root's files that only root may change "
                     "(as the hooks require), then run mapa doctor again")
    if conf is None and timed_out(inputs.show_config_error or ""):
        return Check("scontrol", WARN, f"`scontrol show config` did not answer ({inputs.show_config_error}): slurmctld is "
                                       "busy or slow, the slurm.conf checks were not made",
                     "run mapa doctor again; if it stays, see slurmctld's load (`sdiag`) and log")
    if conf is None:
        return Check("scontrol", FAIL, f"`scontrol show config` failed: {inputs.show_config_error or 'no output'}; "
                                       "the slurm.conf checks could not be made",
                     "install Slurm's commands (mapa.toml's scontrol = names the one the hooks run), start munge, "
                     "and check that slurmctld answers (`scontrol ping`)")
    version = conf.get("SLURM_VERSION", "unknown")
    return Check("scontrol", OK, f"`scontrol show config` answered: Slurm {version}")


def path_problems(facts: PathFacts) -> list[str]:
    """Why root should not trust ``facts.path`` (none: it may): missing, trusted_files.py's verdict, and,
    stricter than trusted_files.py (which also accepts the user running the check), an owner other than root."""
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
    the wrappers, jobs_dir, the isolation mode (what "auto" came to) and isolation_scope in the TaskProlog."""
    fails, warns, seen = [], [], []
    for key, _, _ in HOOKS:
        facts = inputs.hooks.get(key)
        text = inputs.hook_texts.get(facts.path) if facts is not None else None
        if text is None:
            continue
        seen.append(os.path.basename(facts.path))
        jobs_dir = script_value(text, "JOBS_DIR")
        if jobs_dir is None:
            warns.append(f"{facts.path} sets no JOBS_DIR (written by an older `mapa hooks`)")
        elif jobs_dir != str(config.jobs_dir):
            fails.append(f"{facts.path} uses JOBS_DIR={jobs_dir}, mapa.toml's jobs_dir is {config.jobs_dir}")
        if key != "TaskProlog":
            config_path = script_value(text, "MAPA_CONFIG")
            if config_path is not None and config_path != inputs.config_path:
                warns.append(f"{facts.path} reads {config_path}, this check read {inputs.config_path} "
                             f"(run mapa doctor --config {config_path})")
        elif mode is not None:
            written = script_value(text, "ISOLATION") or "off"
            if written != mode:
                message = f"{facts.path} has ISOLATION={written}, mapa.toml's isolation comes to {mode} on this node"
                (fails if ISOLATION_STRENGTH.get(written, 0) < ISOLATION_STRENGTH.get(mode, 0) else warns).append(message)
            # A TaskProlog without the line (an older `mapa hooks`) always asks the agent: fine.
            scope = script_value(text, "ISOLATION_SCOPE")
            if mode != "off" and scope is not None and scope != config.isolation_scope:
                message = (f"{facts.path} has ISOLATION_SCOPE={scope}, mapa.toml's isolation_scope is {config.isolation_scope}"
                           + (" (tasks the SPANK plugin isolated keep their whole step's GPUs)" if scope == "step" else ""))
                (fails if scope == "step" else warns).append(message)
    if not seen:
        if inputs.show_config is None:  # the hook lines are not printed then
            return Check("hooks-current", WARN, "not checked: `scontrol show config` failed, so which hook files slurm.conf "
                                                "names is unknown", "see the scontrol line")
        return Check("hooks-current", WARN, "no hook file of MAPA's could be read", "see the prolog, epilog and taskprolog lines")
    fix = "`mapa hooks DIR --config CONFIG` again on this node (after every change of jobs_dir, isolation or isolation_scope)"
    if fails:
        return Check("hooks-current", FAIL, "; ".join(fails + warns), fix)
    if warns:
        return Check("hooks-current", WARN, "; ".join(warns), fix)
    return Check("hooks-current", OK, f"{', '.join(seen)} match mapa.toml (jobs_dir {config.jobs_dir}"
                                      + (f", isolation {mode}" if mode else "") + ")")


def check_prolog_flags(conf: Mapping[str, str]) -> Check:
    value = conf.get("PrologFlags", "(null)")
    flags = {flag.lower() for flag in flag_list(value)}
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
    plugins = [plugin.lower() for plugin in flag_list(conf.get("JobSubmitPlugins"))]
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
    if is_yes(value):
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
        where = inputs.plugstack if inputs.plugstack_exists else f"{inputs.plugstack} (it does not exist)"
        if not on:
            return Check("spank", OK, f"no MAPA SPANK plugin in {where} ({why}: none needed)")
        return Check("spank", WARN, f"no MAPA SPANK plugin in {where} ({why}): only the TaskProlog asks for "
                                    "isolation, as the job's user; that stops mistakes, not a user who sets out to skip it",
                     "`mapa spank-plugin /usr/local/lib/slurm-mapa/spank_mapa_isolate.so` and the line it prints in "
                     "plugstack.conf (docs/isolation.md, \"SPANK plugin\")")
    described = []
    for kind, path, conf_file in inputs.spank_lines:
        built = inputs.spank_built.get(path)
        described.append(f"{kind} {path}" + (f" (built for Slurm {built})" if built else "") + f" in {conf_file}")
    running = f"; this node runs {inputs.running_version.split(chr(10))[0].strip()}" if inputs.running_version else ""
    return Check("spank", OK, "; ".join(described) + running)


def _config_unread(inputs: Inputs, name: str) -> Check | None:
    """The line of a check that reads mapa.toml when there is none to read: not checked (the
    defaults it would judge are not what the admin wrote; the mapa.toml line says what is wrong)."""
    if inputs.mapa_toml is not None:
        return None
    return Check(name, WARN, f"not checked: {inputs.config_path} could not be read", "see the mapa.toml line")


def check_topology(inputs: Inputs, config: HookConfig) -> Check:
    unread = _config_unread(inputs, "topology")
    if unread is not None:
        return unread
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


def gres_conf_command(show_node: str | None, topology: str | None) -> str:
    """The `mapa gres-conf` command for this node, with the CPU layout slurmctld has for it
    (`scontrol show node`: Sockets, CoresPerSocket, ThreadsPerCore; a hyperthreaded node needs
    --threads-per-core) where it is known, else placeholders."""
    def number(field: str) -> int | None:
        found = re.search(rf"(?:^|\s){field}=(\d+)(?=\s|$)", show_node or "")
        return int(found.group(1)) if found else None

    sockets, cores, threads = number("Sockets"), number("CoresPerSocket"), number("ThreadsPerCore")
    words = ["mapa gres-conf", f"--topology {topology or 'TOPOLOGY'}"]
    if sockets and cores:
        words += [f"--cores {sockets * cores}", f"--sockets {sockets}", f"--threads-per-core {threads or 1}"]
    else:
        words += ["--cores N", "--sockets S", "--threads-per-core T"]
    return " ".join(words)


def check_gres(inputs: Inputs, config: HookConfig | None = None) -> Check:
    where = os.path.join(inputs.slurm_conf_dir, "gres.conf")
    topology = config.topology_for(inputs.node) if config is not None else None
    fix = f"`{gres_conf_command(inputs.show_node, topology)}` writes the lines for {where}; then restart slurmd"
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
    from ....errors import InputError
    from ....hardware.gres import links_value, parse_cpu_list

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
    from ....core.features import complement_name, feature_name, feature_names
    from ...text.commands import CommandFailed, parse_active_features, parse_available_features, timed_out

    unread = _config_unread(inputs, "features")
    if unread is not None:
        return unread
    sizes = config.feature_sizes
    if not sizes:
        return Check("features", OK, f"{inputs.config_path} has no [features]: nothing to publish")
    if inputs.fleet_errors:
        return Check("features", FAIL, "[features] fleet: " + "; ".join(inputs.fleet_errors) + ": mapa-agent publishes nothing",
                     "fix the fleet entries of [features] (presets or readable topology files)")
    if inputs.show_node is None and timed_out(inputs.show_node_error):
        return Check("features", WARN, f"`scontrol show node {inputs.node}` did not answer ({inputs.show_node_error}): "
                                       "slurmctld is busy or slow, the node's features were not checked",
                     "run mapa doctor again; if it stays, see slurmctld's load (`sdiag`) and log")
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
        why = (inputs.mapa_toml_error or "missing").removesuffix(f": {inputs.config_path}")  # the path once
        # a missing file in the words `mapa hooks` and `mapa status` use (config.missing_config)
        found = (missing_config(inputs.config_path) if why in ("missing", "No such file or directory")
                 else f"cannot read {inputs.config_path}: {why}")
        return Check("mapa.toml", FAIL, f"{found}; the hooks fall back for every job",
                     f"write {inputs.config_path} (docs/admin.md section 4)")
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
        checks += [check_spank(inputs, mode), check_topology(inputs, config), check_gres(inputs, config), check_discovery(inputs),
                   check_isolation(inputs), check_agent(inputs, mode), check_features(inputs, config), check_held(inputs),
                   check_health(inputs)]
    checks += check_trust(inputs.paths)
    if inputs.euid != 0:
        checks.append(Check("user", WARN, f"running as uid {inputs.euid}, not root: root-only paths and the agent may not "
                                          "be readable, and files of this user pass as root's in trusted_files.py's checks",
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


