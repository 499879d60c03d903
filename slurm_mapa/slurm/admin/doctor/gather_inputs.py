"""The I/O edge of mapa doctor: read the files, run Slurm's and the GPU tools' commands and ask
mapa-agent, each bounded in time and size, never raising; what cannot be read becomes an error
text in the Inputs record."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ....errors import MapaError
from ....hardware.topofile import Topology
from ... import trusted_files as trusted
from ...agent.client import DEFAULT_SOCKET, ISOLATE_SOCKET
from ...text.commands import Runner
from ...config import HookConfig, programs_root_may_run
from .lenient_config import parse_config
from .records import AGENT_TIMEOUT_S, HOOKS, MAX_TEXT_BYTES, PROBE, SLURM_TIMEOUT_S, TOOL_TIMEOUT_S, Inputs, PathFacts
from .slurm_text import gres_gpu_lines, parse_show_config, slurm_values, wrapper_client, wrapper_program

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


def health_summary(config: Any) -> str:
    """What mapa-agent's health passes read on this node (agent/health.py), by reading them once."""
    if config.health == "off":
        return 'off (health = "off" in mapa.toml): no source is read'
    from ...agent.health import HealthMonitor

    monitor = HealthMonitor()
    try:
        monitor.read_sources()
    finally:
        monitor.close()
    return monitor.summary()


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
    """``path`` judged by trusted_files.py's rules (``kind`` program: its symlinks followed, each judged)."""
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
        from ....hardware.nvidia_smi import parse_discovery, parse_gpu_list

        try:
            listed = run_command([smi, "-L"], env, TOOL_TIMEOUT_S)
            found = parse_discovery(run_command([smi, "topo", "-m"], env, TOOL_TIMEOUT_S), listed, name=name)
            uuids = tuple(entry.uuid for entry in parse_gpu_list(listed))
        except (RuntimeError, MapaError) as error:
            return None, "nvidia-smi", str(error)
        return Topology(graph=found.graph, uuids=uuids or None, vendor="nvidia"), "nvidia-smi", ""
    rocm = shutil.which("rocm-smi", path=search)
    if rocm:
        from ....hardware.rocm_smi import parse_amd_topology

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
        from ....hardware.nvml import discover, load_pynvml, nvml_session

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

    # Trust first: nothing the config names runs unless the hooks would run it too.
    refused = _safely(programs_root_may_run, config, config_path)
    scontrol = find_program(config.scontrol, environ)
    if refused[0] or refused[1]:
        got["show_config_error"] = got["show_node_error"] = f"not run: {refused[0] or refused[1]}"
    elif scontrol is None:
        named = "from mapa.toml" if got.get("mapa_toml") is not None else "the default"
        missing = f"scontrol not found ({config.scontrol}, {named}, is not there, and PATH has none)"
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
        from ....hardware.load import load_topology_file

        got["topology"], got["topology_error"] = _safely(load_topology_file, spec)
    found, failed = _safely(discover_live, environ, node)
    if found is not None:
        got["discovered"], got["discovery_tool"], got["discovery_error"] = found
    else:
        got["discovery_error"] = failed

    from ...isolation.isolator import effective_mode

    got["isolation"], got["isolation_error"] = _safely(effective_mode, config, node)
    from ...node_state import NodeState
    from ..gpu_hold import held_list

    held, got["held_error"] = _safely(held_list, NodeState.of(config))
    got["held_gpus"] = tuple(held or ())
    got["health_sources"], got["health_error"] = _safely(health_summary, config)

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
        from ....hardware.load import load_topology_file

        for entry in config.feature_fleet:
            _, error = _safely(load_topology_file, entry)
            if error:
                fleet_errors.append(f"{entry}: {error}")
    got["fleet_errors"] = tuple(fleet_errors)
    return Inputs(**{key: value for key, value in got.items() if value is not None})


def _job_submit_expected(config: HookConfig) -> str:
    from ..install import job_submit_text

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
    from ...isolation import spank_plugin

    try:
        plugstack, plugin_dirs = spank_plugin.spank_settings(_safely(read_text, slurm_conf)[0], slurm_conf)
        got["plugstack"] = str(plugstack)
        got["plugstack_exists"] = os.path.exists(plugstack)
        plugins = spank_plugin.installed_mapa_plugins(plugstack, plugin_dirs)
        got["spank_lines"] = tuple((plugin.kind, plugin.path, str(plugin.conf)) for plugin in plugins)
        running = spank_plugin.running_slurm_version_text() if plugins else None
        got["running_version"] = (running or "").strip()
        built = {}
        for plugin in plugins:
            number = spank_plugin.elf_u32_symbol(plugin.data, "plugin_version") if plugin.data else None
            if number is not None:
                built[plugin.path] = spank_plugin.release_text(number)
        got["spank_built"] = built
        got["spank_problems"] = tuple(spank_plugin.installed_plugin_problems(
            plugins, spank_plugin.parse_slurm_version(running) if running else None))
    except Exception as error:  # noqa: BLE001
        got["spank_error"] = _describe(error)


def _trusted_paths(config: HookConfig, config_path: str, spec: str | None, hook_texts: Mapping[str, str],
                   got: Mapping[str, Any], conf_dir: Path, agent_socket: str, isolate_socket: str) -> tuple[PathFacts, ...]:
    """Every path root trusts, other than the hooks (their own checks judge them); existing ones only."""
    from ....hardware.presets import PRESETS

    wanted: list[tuple[str, str, str, bool]] = [(config_path, "mapa.toml", "file", True)]
    for key, command in (("scontrol", config.scontrol), ("squeue", config.squeue)):
        program = trusted.command_path(command)
        if program is not None:
            wanted.append((str(program), f"mapa.toml's {key}", "program", True))
    if spec is not None and spec not in PRESETS:
        wanted.append((spec, "topology file", "file", True))
    for model in dict.fromkeys([config.model, *(setting for _, setting in config.models)]):
        if "/" in model or model.endswith(".toml"):  # else "auto" or a bundled model's name
            wanted.append((model, "model file", "file", True))
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
        client = wrapper_client(text)
        if client is not None:
            wanted.append((client, "the wrappers' client of mapa-agent", "program", True))
        program = wrapper_program(text)
        if program is not None:
            wanted += [(program[0], "the hooks' Python", "program", True),
                       (program[1], "slurm-mapa package directory", "dir", False)]
    seen, facts = set(), []
    for path, label, kind, required in wanted:
        if path in seen:
            continue
        seen.add(path)
        fact, _ = _safely(path_facts, path, label, kind, required)
        if fact is not None and fact.exists:
            facts.append(fact)
    return tuple(facts)


