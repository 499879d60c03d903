"""What mapa doctor judges and says: the plain-data inputs of the checks and the check records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ....hardware.topofile import Topology
from ...agent.client import DEFAULT_SOCKET
from ...config import DEFAULT_CONFIG_PATH

OK, WARN, FAIL = "ok", "warn", "FAIL"
SLURM_TIMEOUT_S = 5.0  # each scontrol call
TOOL_TIMEOUT_S = 10.0  # each nvidia-smi / rocm-smi call, and NVML discovery
AGENT_TIMEOUT_S = 2.0  # the mapa-agent probe, connect and answer together
MAX_TEXT_BYTES = 1 << 20  # a config file; more is an error
UNLIMITED_TIMEOUT = 65534  # NO_VAL16, what Slurm prints for "no limit" (65535, INFINITE16, alike)
# The agent's ping: answered "done ping", nothing run or logged. An agent older than the ping
# refuses it as an unknown kind (one line in its log), which still shows that it answers.
PROBE = b"MAPA1 ping 0\n"
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
    """What the edge saw of one path root trusts (slurm_mapa.slurm.trusted_files' rules)."""

    path: str
    label: str  # what it is, for the message: "Prolog wrapper", "mapa.toml", ...
    kind: str = "file"  # file | dir | program (symlinks followed, each judged) | socket
    exists: bool = True
    uid: int = 0  # owner of the file (a program: of the file its links lead to)
    mode: int = 0o644  # permission bits, likewise
    problem: str = ""  # trusted_files.py's verdict ("" when root would trust it)
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
    plugstack_exists: bool = True
    spank_lines: tuple[tuple[str, str, str], ...] = ()  # MAPA's plugin lines: (required|optional, path, file)
    spank_built: Mapping[str, str] = field(default_factory=dict)  # plugin path -> the Slurm release it was built for
    spank_problems: tuple[str, ...] = ()  # spank_plugin's lines
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
    held_gpus: tuple[Mapping[str, Any], ...] = ()  # `mapa gpu list --json`'s entries (gpu_hold.held_list)
    held_error: str = ""  # why the held GPUs could not be read
    health_sources: str | None = None  # what the agent's health passes read (gather_inputs.health_summary)
    health_error: str = ""  # why that could not be told


