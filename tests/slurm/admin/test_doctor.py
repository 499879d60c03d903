"""`mapa doctor` (slurm/doctor/): the pure checks on literal inputs, the JSON shape, and the
gatherer where Slurm is missing. The live cluster run is tests/cluster/test_doctor_on_nodes.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.core.hardware import HardwareGraph
from slurm_mapa.hardware.gres import CpuLayout, gres_conf_text
from slurm_mapa.hardware.load import load_topology_file
from slurm_mapa.hardware.presets import preset
from slurm_mapa.hardware.topofile import Topology
from slurm_mapa.slurm.admin import doctor
from slurm_mapa.slurm.admin.doctor import checks as doctor_checks, gather_inputs, records, slurm_text
from slurm_mapa.slurm.admin.doctor import FAIL, OK, WARN, Inputs, PathFacts, run_checks
from slurm_mapa.slurm.admin.install import job_submit_text, taskprolog_text, wrapper_text

ROOT = REPO
GRES_CONF = ROOT / "slurm_mapa" / "data" / "gres_conf"  # the gres.conf and topology file of every preset

# `scontrol show config` of the mini cluster's Slurm 26.05.5 (an excerpt), as it prints it:
# "%-23s = %s" (slurm_print_key_pairs, src/api/config_info.c); the cgroup.conf keys follow in a
# section of their own, sorted. 24.11.5 prints these keys the same way.
SHOW_CONFIG = """\
Configuration data as of 2026-11-25T10:00:00
AccountingStorageTRES   = cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu
AuthType                = auth/munge
ClusterName             = mapa
Epilog[0]               = /usr/local/sbin/mapa-epilog-wrapper
EpilogMsgTime           = 2000 usec
GresTypes               = gpu
JobSubmitPlugins        = lua
PluginDir               = /usr/lib/x86_64-linux-gnu/slurm-wlm
PlugStackConfig         = /etc/slurm/plugstack.conf
ProctrackType           = proctrack/cgroup
Prolog[0]               = /usr/local/sbin/mapa-prolog-wrapper
PrologEpilogTimeout     = 60
PrologFlags             = Alloc
SelectType              = select/cons_tres
SelectTypeParameters    = CR_CORE
SlurmctldHost[0]        = slurmctld
SLURM_CONF              = /etc/slurm/slurm.conf
SLURM_VERSION           = 26.05.5
TaskPlugin              = task/cgroup,task/affinity
TaskPluginParam         = (null type)
TaskProlog              = /usr/local/sbin/mapa-taskprolog

Cgroup Support Configuration:
AllowedRAMSpace         = 100.0%
CgroupJobIdPaths        = no
CgroupMountpoint        = /sys/fs/cgroup
CgroupPlugin            = cgroup/v1
ConstrainCores          = yes
ConstrainDevices        = no
ConstrainRAMSpace       = yes
"""

SHOW_NODE = (
    "NodeName=dgx1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.41 "
    "AvailableFeatures=mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4 ActiveFeatures=mapa_ring2,mapa_ring4 "
    "Gres=gpu:8(S:0-1) NodeAddr=dgx1 NodeHostName=dgx1 Version=26.05.5 OS=Linux 6.8.0 RealMemory=4000 "
    "AllocMem=0 FreeMem=3000 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "Partitions=gpu,dgx BootTime=2026-11-25T09:58:01 SlurmdStartTime=2026-11-25T09:58:03\n"
)

MAPA_TOML = """\
policy = "preserve"
job_submit_lua = true
isolation = "auto"
[nodes]
"dgx*" = "/etc/slurm/mapa-topology.toml"
[features]
sizes = [2, 4]
"""

CGROUP_CONF = "CgroupPlugin=cgroup/v1\nConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=no\n"
SBIN = "/usr/local/sbin"
PACKAGE_PARENT = "/usr/lib/python3/dist-packages"
SPANK = "/usr/local/lib/slurm-mapa/spank_mapa_isolate.so"
TOPOLOGY = Topology(graph=preset("dgx1-v100"), minor_numbers=tuple(range(8)))
GRES = gres_conf_text(TOPOLOGY, layout=CpuLayout(cores=40, threads_per_core=2, sockets=2))
WRAPPERS = {
    "Prolog": f"{SBIN}/mapa-prolog-wrapper",
    "Epilog": f"{SBIN}/mapa-epilog-wrapper",
    "TaskProlog": f"{SBIN}/mapa-taskprolog",
}


def _hook_texts(isolation: str = "fail-open", jobs_dir: str = "/run/slurm-mapa/jobs", scope: str = "step") -> dict[str, str]:
    return {
        WRAPPERS["Prolog"]: wrapper_text("prolog", "/usr/bin/python3", PACKAGE_PARENT, "/etc/slurm/mapa.toml", jobs_dir=jobs_dir),
        WRAPPERS["Epilog"]: wrapper_text("epilog", "/usr/bin/python3", PACKAGE_PARENT, "/etc/slurm/mapa.toml", jobs_dir=jobs_dir),
        WRAPPERS["TaskProlog"]: taskprolog_text(jobs_dir, "auto", isolation, "/usr/bin/python3", PACKAGE_PARENT, scope),
    }


def healthy(**changes) -> Inputs:
    """A compute node (dgx1) where everything is as docs/admin.md asks."""
    inputs = Inputs(
        node="dgx1",
        config_path="/etc/slurm/mapa.toml",
        processes=frozenset({"slurmd"}),
        show_config=SHOW_CONFIG,
        show_node=SHOW_NODE,
        cgroup_conf=CGROUP_CONF,
        gres_conf=GRES,
        devices={f"/dev/nvidia{i}": "char" for i in range(8)},
        mapa_toml=MAPA_TOML,
        topology=TOPOLOGY,
        discovered=Topology(graph=preset("dgx1-v100"), vendor="nvidia"),
        discovery_tool="nvidia-smi",
        isolation=("fail-open", "auto: node dgx1's topology /etc/slurm/mapa-topology.toml names each GPU's device file"),
        hooks={key: PathFacts(path, f"{key} hook", "program", mode=0o755) for key, path in WRAPPERS.items()},
        hook_texts=_hook_texts(),
        spank_lines=(("optional", SPANK, "/etc/slurm/plugstack.conf"),),
        spank_built={SPANK: "26.05"},
        running_version="slurm 26.05.5",
        paths=(
            PathFacts("/etc/slurm/mapa.toml", "mapa.toml"),
            PathFacts("/usr/bin/scontrol", "mapa.toml's scontrol", "program", mode=0o755),
            PathFacts("/etc/slurm/mapa-topology.toml", "topology file"),
            PathFacts("/run/slurm-mapa/jobs", "jobs directory", "dir", mode=0o755),
            PathFacts("/run/slurm-mapa-agent", "mapa-agent's socket directory", "dir", mode=0o700),
            PathFacts(SPANK, "SPANK plugin", "program"),
        ),
        agent_answer="done ping",
        isolate_socket=PathFacts("/run/slurm-mapa-isolate/isolate.sock", "isolation socket", "socket", mode=0o666),
        health_sources="nvml read (8 GPUs), dcgm not installed, amd-smi not used (no /dev/kfd)",
    )
    return dataclasses.replace(inputs, **changes)


def controller(**changes) -> Inputs:
    """The controller: slurmctld runs, no node of that name, job_submit.lua as `mapa job-submit-lua` writes it."""
    settings = dict(
        node="slurmctld", processes=frozenset({"slurmctld"}), show_node=None,
        show_node_error="`scontrol --oneliner show node slurmctld` exited 1: Node slurmctld not found",
        hooks={}, hook_texts={}, topology=None, discovered=None, discovery_tool="", isolation=None,
        job_submit_lua=job_submit_text((2, 4)), job_submit_expected=job_submit_text((2, 4)))
    return dataclasses.replace(healthy(), **{**settings, **changes})


def by_name(checks) -> dict[str, records.Check]:
    return {check.check: check for check in checks}


def test_a_healthy_compute_node_passes_every_check():
    checks = run_checks(healthy())
    report = doctor_checks.format_text(checks)
    assert [check.status for check in checks] == [OK] * len(checks), report
    assert doctor_checks.exit_status(checks) == 0
    assert [check.check for check in checks] == [
        "role", "scontrol", "mapa.toml", "prolog", "epilog", "taskprolog", "hooks-current", "prolog-flags",
        "prolog-timeout", "job-submit", "select-type", "task-plugin", "constrain-devices", "spank", "topology", "gres",
        "discovery", "isolation", "agent", "features", "held", "health", "trust"]
    found = by_name(checks)
    assert "Prolog = /usr/local/sbin/mapa-prolog-wrapper: root's, mode 755" in found["prolog"].found
    assert "PrologEpilogTimeout = 60 s (needed: 60 s)" in found["prolog-timeout"].found
    assert "built for Slurm 26.05" in found["spank"].found
    assert found["isolation"].found.startswith("fail-open (auto:")
    assert report.splitlines()[0].startswith("ok    role")


def test_docs_admin_shows_the_healthy_output():
    text = (ROOT / "docs" / "admin.md").read_text()
    start = text.index("A healthy DGX-1 node (the healthy case of tests/slurm/admin/test_doctor.py")
    block = text[start:].split("\n\n", 2)[1]
    assert block == "".join("    " + line + "\n" for line in doctor_checks.format_text(run_checks(healthy())).splitlines()).rstrip("\n")


def test_the_controller_skips_the_node_checks_and_compares_job_submit_lua():
    checks = run_checks(controller())
    assert doctor_checks.exit_status(checks) == 0, doctor_checks.format_text(checks)
    found = by_name(checks)
    assert "skipped: not a compute node" in found["role"].found
    for name in ("spank", "gres", "topology", "agent", "features", "hooks-current"):
        assert name not in found
    assert "is what `mapa job-submit-lua` writes" in found["job-submit"].found
    assert "checked on the compute nodes" in found["prolog"].found


def _replace_config(old: str, new: str):
    assert old in SHOW_CONFIG
    return {"show_config": SHOW_CONFIG.replace(old, new)}


FAULTS = [
    # (case, changes, check, words in what it found, words in the fix)
    ("prolog not MAPA's", _replace_config(f"{SBIN}/mapa-prolog-wrapper", "/etc/slurm/prolog.sh"),
     "prolog", "not MAPA's mapa-prolog-wrapper", "Prolog=DIR/mapa-prolog-wrapper"),
    ("no prolog", _replace_config(f"Prolog[0]               = {SBIN}/mapa-prolog-wrapper\n", ""),
     "prolog", "sets no Prolog", "mapa hooks DIR"),
    ("prolog wrapper group-writable",
     {"hooks": {**healthy().hooks, "Prolog": PathFacts(WRAPPERS["Prolog"], "Prolog hook", "program", mode=0o775,
                                                        problem=f"file {WRAPPERS['Prolog']} is writable by group or others (mode 775); "
                                                                "accepted: not group/world-writable")}},
     "prolog", "writable by group or others (mode 775)", "chmod 755"),
    ("epilog wrapper missing", {"hooks": {**healthy().hooks, "Epilog": PathFacts(WRAPPERS["Epilog"], "Epilog hook", "program", exists=False)}},
     "epilog", "does not exist on this node", "mapa hooks /usr/local/sbin"),
    ("taskprolog not executable",
     {"hooks": {**healthy().hooks, "TaskProlog": PathFacts(WRAPPERS["TaskProlog"], "TaskProlog hook", "program", mode=0o644)}},
     "taskprolog", "is not executable (mode 644)", "chmod 755"),
    ("prolog wrapper someone else's",
     {"hooks": {**healthy().hooks, "Prolog": PathFacts(WRAPPERS["Prolog"], "Prolog hook", "program", uid=1000, mode=0o755)}},
     "prolog", "belongs to uid 1000", "chown root:root"),
    ("taskprolog of another isolation", {"hook_texts": _hook_texts(isolation="off")},
     "hooks-current", "has ISOLATION=off, mapa.toml's isolation comes to fail-open", "mapa hooks DIR"),
    # Issue 41: a TaskProlog written for scope "step" skips its request after the SPANK plugin's.
    ("taskprolog of another isolation_scope", {"mapa_toml": MAPA_TOML.replace('isolation = "auto"\n', 'isolation = "auto"\nisolation_scope = "task"\n')},
     "hooks-current", "has ISOLATION_SCOPE=step, mapa.toml's isolation_scope is task", "isolation_scope"),
    ("hooks of another jobs_dir", {"hook_texts": _hook_texts(jobs_dir="/var/run/mapa-jobs")},
     "hooks-current", "uses JOBS_DIR=/var/run/mapa-jobs, mapa.toml's jobs_dir is /run/slurm-mapa/jobs", "mapa hooks DIR"),
    ("no PrologFlags", _replace_config("PrologFlags             = Alloc", "PrologFlags             = (null)"),
     "prolog-flags", "without Alloc (or RunInJob)", "PrologFlags=Alloc"),
    ("PrologEpilogTimeout too short", _replace_config("PrologEpilogTimeout     = 60", "PrologEpilogTimeout     = 30"),
     "prolog-timeout", "PrologEpilogTimeout = 30 s is shorter than 60 s", "PrologEpilogTimeout=60"),
    # Slurm 26.05 prints the two apart only when they differ (src/api/config_info.c).
    ("PrologTimeout too short", _replace_config("PrologEpilogTimeout     = 60",
                                                 "EpilogTimeout           = 60\nPrologTimeout           = 20"),
     "prolog-timeout", "PrologTimeout = 20 s is shorter than 60 s", "PrologEpilogTimeout=60"),
    ("no lua plugin", _replace_config("JobSubmitPlugins        = lua", "JobSubmitPlugins        = (null)"),
     "job-submit", "has no lua, but mapa.toml says job_submit_lua = true", "JobSubmitPlugins=lua"),
    ("ConstrainDevices=yes", {"cgroup_conf": CGROUP_CONF.replace("ConstrainDevices=no", "ConstrainDevices=yes")},
     "constrain-devices", "ConstrainDevices = yes", "ConstrainDevices=no"),
    ("SPANK plugin of another release",
     {"spank_problems": (f"SPANK plugin {SPANK} was built for Slurm 24.11 (24.11.5) but this node runs Slurm 26.05.5: "
                         "slurmstepd will not load it",)},
     "spank", "was built for Slurm 24.11", "mapa spank-plugin PATH"),
    ("no [nodes] entry", {"mapa_toml": MAPA_TOML.replace('"dgx*"', '"gpu*"')},
     "topology", "no [nodes] entry of /etc/slurm/mapa.toml matches node dgx1", "under [nodes]"),
    ("topology unreadable", {"topology": None, "topology_error": "topology file '/etc/slurm/mapa-topology.toml': not valid TOML"},
     "topology", "cannot be loaded: topology file", "mapa topo discover"),
    ("a GPU line short", {"gres_conf": GRES.replace("Name=gpu File=/dev/nvidia7", "# Name=gpu File=/dev/nvidia7")},
     "gres", "7 GPU device files for node dgx1, the topology has 8 GPUs", "mapa gres-conf"),
    ("GPUs out of order", {"gres_conf": GRES.replace("File=/dev/nvidia0 ", "File=/dev/nvidiaX ")
                                            .replace("File=/dev/nvidia1 ", "File=/dev/nvidia0 ")
                                            .replace("File=/dev/nvidiaX ", "File=/dev/nvidia1 ")},
     "gres", "Slurm's GPU 0 is /dev/nvidia1 but the topology's GPU 0 is /dev/nvidia0", "mapa gres-conf"),
    ("a device file missing", {"devices": {**{f"/dev/nvidia{i}": "char" for i in range(8)}, "/dev/nvidia3": "missing"}},
     "gres", "/dev/nvidia3 missing", "restart slurmd"),
    ("discovery sees fewer GPUs", {"discovered": Topology(graph=HardwareGraph(
        name="six", links=tuple(row[:6] for row in preset("dgx1-v100").links[:6])))},
     "discovery", "nvidia-smi sees 6 GPUs, the topology file has 8", "mapa topo discover"),
    ("mapa.toml misspelled", {"mapa_toml": 'polcy = "greedy"\n' + MAPA_TOML},
     "mapa.toml", "polcy", "fix /etc/slurm/mapa.toml"),
    ("mapa.toml group-writable",
     {"paths": (PathFacts("/etc/slurm/mapa.toml", "mapa.toml", mode=0o664,
                          problem="file /etc/slurm/mapa.toml is writable by group or others (mode 664); accepted: "
                                  "not group/world-writable"),)},
     "trust", "mapa.toml /etc/slurm/mapa.toml: file /etc/slurm/mapa.toml is writable by group", "chmod go-w"),
    ("topology file someone else's", {"paths": (PathFacts("/etc/slurm/mapa-topology.toml", "topology file", uid=1000),)},
     "trust", "belongs to uid 1000", "chown root:root /etc/slurm/mapa-topology.toml"),
    ("agent down", {"agent_answer": None, "agent_error": "No such file or directory: /run/slurm-mapa-agent/agent.sock"},
     "agent", "mapa-agent did not answer", "systemctl enable --now mapa-agent"),
    ("isolation socket missing",
     {"isolate_socket": PathFacts("/run/slurm-mapa-isolate/isolate.sock", "isolation socket", "socket", exists=False)},
     "agent", "isolation socket /run/slurm-mapa-isolate/isolate.sock is missing", "restart mapa-agent"),
    ("features not in slurm.conf", {"show_node": SHOW_NODE.replace(",mapa_ring4,mapa_noring4 ActiveFeatures", " ActiveFeatures")},
     "features", "lacks mapa_ring4,mapa_noring4", "NodeName=dgx1 Features="),
    ("scontrol missing", {"show_config": None, "show_config_error": "scontrol not found"},
     "scontrol", "`scontrol show config` failed: scontrol not found", "scontrol ping"),
]


def _checked(changes: dict, status: str) -> tuple[int, str, list]:
    """Exit status, text report and the checks of ``status`` for the healthy node with ``changes``."""
    checks = run_checks(healthy(**changes))
    return doctor_checks.exit_status(checks), doctor_checks.format_text(checks), [check for check in checks if check.status == status]


@pytest.mark.parametrize("changes, name, found, fix", [case[1:] for case in FAULTS], ids=[case[0] for case in FAULTS])
def test_each_fault_fails_its_check_and_says_what_to_do(changes, name, found, fix):
    status, report, failed = _checked(changes, FAIL)
    assert status == 1, report
    assert [check.check for check in failed] == [name], report
    assert found in failed[0].found, report
    assert fix in failed[0].fix, report
    assert f"FAIL  {name}" in report


def test_the_controller_fails_on_a_stale_job_submit_lua():
    checks = run_checks(controller(job_submit_lua=job_submit_text(())))
    failed = [check for check in checks if check.status == FAIL]
    assert [check.check for check in failed] == ["job-submit"], doctor_checks.format_text(checks)
    assert "differs from what `mapa job-submit-lua` writes" in failed[0].found
    assert "mapa job-submit-lua /etc/slurm/job_submit.lua --config /etc/slurm/mapa.toml" in failed[0].fix


WARNINGS = [
    ("unlimited timeout", _replace_config("PrologEpilogTimeout     = 60", "PrologEpilogTimeout     = 65534"),
     "prolog-timeout", "unlimited (65534)"),
    ("SPANK plugin of another release, isolation off",
     {"isolation": ("off", 'isolation = "off" in mapa.toml'), "hook_texts": _hook_texts(isolation="off"),
      "spank_problems": (f"SPANK plugin {SPANK} was built for Slurm 24.11 (24.11.5) but this node runs Slurm 26.05.5",)},
     "spank", "was built for Slurm 24.11"),
    ("no SPANK plugin, isolation on", {"spank_lines": (), "spank_built": {}}, "spank", "no MAPA SPANK plugin"),
    ("links differ", {"discovered": Topology(graph=preset("pcie-8"), vendor="nvidia")}, "discovery", "GPU pairs differ"),
    ("no discovery tool", {"discovered": None, "discovery_tool": "", "discovery_error": "nvidia-smi and rocm-smi not on PATH"},
     "discovery", "no discovery tool here"),
    ("features not yet published",
     {"show_node": SHOW_NODE.replace("ActiveFeatures=mapa_ring2,mapa_ring4", "ActiveFeatures=mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4")},
     "features", "not one of mapa_ring2/mapa_noring2, mapa_ring4/mapa_noring4"),
    ("slurmctld too slow to show the node",  # a busy controller is not a wrong node name (seen under CI's load)
     {"show_node": None, "show_node_error": "/usr/bin/scontrol timed out after 5 s"},
     "features", "did not answer (/usr/bin/scontrol timed out after 5 s)"),
    ("slurmctld too slow to show its config",  # CI's load: a FAIL told the admin to install Slurm's commands
     {"show_config": None, "show_config_error": "/usr/bin/scontrol timed out after 5 s"},
     "scontrol", "did not answer (/usr/bin/scontrol timed out after 5 s): slurmctld is busy or slow"),
    ("agent down, isolation off",
     {"isolation": ("off", 'isolation = "off" in mapa.toml'), "hook_texts": _hook_texts(isolation="off"),
      "agent_answer": None, "agent_error": "Connection refused"},
     "agent", "every hook runs in-process"),
    ("package directory others may change",
     {"paths": (PathFacts("/opt/slurm-mapa/slurm_mapa", "slurm-mapa package directory", "dir", uid=1000, mode=0o755,
                          required=False),)},
     "trust", "slurm-mapa package directory /opt/slurm-mapa/slurm_mapa"),
]


@pytest.mark.parametrize("changes, name, found", [case[1:] for case in WARNINGS], ids=[case[0] for case in WARNINGS])
def test_what_only_warns_keeps_the_exit_status_0(changes, name, found):
    status, report, warned = _checked(changes, WARN)
    assert status == 0, report
    assert [check.check for check in warned] == [name], report
    assert found in warned[0].found, report


def test_an_unclear_role_runs_every_node_check_and_says_so():
    checks = run_checks(healthy(processes=frozenset(), show_node=None, show_node_error="Node dgx1 not found"))
    found = by_name(checks)
    assert found["role"].status == WARN and "every node check runs" in found["role"].found
    assert "give --node NAME" in found["role"].fix
    assert "gres" in found and "agent" in found


def test_json_lists_check_status_found_fix():
    checks = run_checks(healthy(**FAULTS[0][1]))
    data = json.loads(doctor_checks.format_json(checks))
    assert isinstance(data, list) and len(data) == len(checks)
    assert all(set(entry) == {"check", "status", "found", "fix"} for entry in data)
    assert {"check": "prolog", "status": "FAIL"}.items() <= data[3].items()
    assert {entry["status"] for entry in data} <= {OK, WARN, FAIL}


def test_the_cli_prints_json_and_exits_1_on_a_fail(monkeypatch, capsys):
    from slurm_mapa.cli import main

    seen = {}

    def fake_gather(config, node, *args, **kwargs):
        seen.update(config=config, node=node)
        return healthy(**FAULTS[0][1])

    monkeypatch.setattr(doctor, "gather", fake_gather)
    assert main(["doctor", "--json", "--node", "dgx1", "--config", "/etc/slurm/mapa.toml"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert seen == {"config": "/etc/slurm/mapa.toml", "node": "dgx1"}
    assert [entry["check"] for entry in data if entry["status"] == FAIL] == ["prolog"]
    monkeypatch.setattr(doctor, "gather", lambda config, node, *a, **k: healthy())
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.startswith("ok    role")


# --- parsers --------------------------------------------------------------------------------------
def test_show_config_parsing_keeps_indexed_hooks_in_order():
    conf = slurm_text.parse_show_config(SHOW_CONFIG.replace(
        "Prolog[0]               = /usr/local/sbin/mapa-prolog-wrapper",
        "Prolog[0]               = /etc/slurm/site-prolog\nProlog[1]               = /usr/local/sbin/mapa-prolog-wrapper"))
    assert slurm_text.slurm_values(conf, "Prolog") == ["/etc/slurm/site-prolog", "/usr/local/sbin/mapa-prolog-wrapper"]
    assert slurm_text.slurm_values(conf, "TaskProlog") == ["/usr/local/sbin/mapa-taskprolog"]
    assert conf["ConstrainDevices"] == "no" and conf["SLURM_VERSION"] == "26.05.5"
    check = doctor_checks.check_hook("Prolog", "prolog", "mapa-prolog-wrapper", conf, healthy().hooks["Prolog"], True)
    assert check.status == OK and "(and /etc/slurm/site-prolog)" in check.found


def test_host_lists_and_gres_lines_for_one_node():
    assert slurm_text.expand_hostlist("dgx[1-3,7],gpu[08-10]") == ["dgx1", "dgx2", "dgx3", "dgx7", "gpu08", "gpu09", "gpu10"]
    text = ("AutoDetect=off\nNodeName=dgx[1-2] Name=gpu File=/dev/nvidia[0-3] Cores=0-19\n"
            "NodeName=other Name=gpu File=/dev/nvidia[0-7]\nName=gpu File=/dev/nvidia4,/dev/nvidia5 # both\n")
    lines, autodetect = slurm_text.gres_gpu_lines(text, "dgx2")
    assert [path for line in lines for path in line.files] == [f"/dev/nvidia{i}" for i in range(6)]
    assert autodetect == ["off"]
    assert slurm_text.node_gpu_count("NodeName=x Gres=gpu:v100:4(S:0),gpu:2 State=IDLE") == 6
    assert slurm_text.node_gpu_count("NodeName=x Gres=(null) State=IDLE") is None


@pytest.mark.parametrize("toml", sorted(GRES_CONF.glob("*.toml")), ids=lambda path: path.stem)
def test_every_shipped_gres_conf_agrees_with_its_topology(toml):
    topology = load_topology_file(str(toml))
    gres = toml.with_suffix(".gres.conf").read_text()
    files = [path for line in slurm_text.gres_gpu_lines(gres, "node1")[0] for path in line.files]
    inputs = healthy(topology=topology, gres_conf=gres, show_node=None, devices={path: "char" for path in files})
    check = doctor_checks.check_gres(inputs)
    assert check.status == OK, check


# --- the gatherer -----------------------------------------------------------------------------------
def test_the_gatherer_without_scontrol_reports_fail_lines(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    config = tmp_path / "mapa.toml"
    config.write_text('scontrol = "/nonexistent/scontrol"\nsqueue = "/nonexistent/squeue"\n[nodes]\n"node1" = "dgx1-v100"\n')
    inputs = gather_inputs.gather(str(config), "node1", {"PATH": str(empty), "SLURM_CONF": str(tmp_path / "slurm.conf")},
                           agent_socket=str(tmp_path / "agent" / "agent.sock"),
                           isolate_socket=str(tmp_path / "isolate" / "isolate.sock"), proc=tmp_path / "no-proc")
    assert inputs.show_config is None and "scontrol not found" in inputs.show_config_error
    checks = run_checks(inputs)
    found = by_name(checks)
    assert found["scontrol"].status == FAIL and "scontrol not found" in found["scontrol"].found
    assert found["gres"].status == FAIL and "cannot read" in found["gres"].found
    assert found["mapa.toml"].status == OK
    assert found["agent"].status in (WARN, FAIL) and "did not answer" in found["agent"].found
    assert doctor_checks.exit_status(checks) == 1


def test_the_command_without_slurm_prints_lines_not_a_traceback(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    config = tmp_path / "mapa.toml"
    config.write_text('scontrol = "/nonexistent/scontrol"\n[nodes]\n"node1" = "dgx1-v100"\n')
    env = {"PATH": str(empty), "SLURM_CONF": str(tmp_path / "slurm.conf"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "import sys; from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))",
                           "doctor", "--config", str(config), "--node", "node1"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert any(line.startswith("FAIL  scontrol") for line in lines), done.stdout
    assert all(line.split()[0] in (OK, WARN, FAIL) for line in lines), done.stdout


def test_path_facts_use_the_trust_rules(tmp_path):
    good = tmp_path / "hook"
    good.write_text("#!/bin/sh\n")
    good.chmod(0o755)
    facts = gather_inputs.path_facts(good, "hook", "program")
    assert facts.exists and facts.problem == "" and facts.mode == 0o755
    good.chmod(0o775)
    facts = gather_inputs.path_facts(good, "hook", "program")
    assert "writable by group or others" in facts.problem
    assert not gather_inputs.path_facts(tmp_path / "none", "hook").exists
    if os.geteuid() != 0:  # paths.py accepts this user's files; the doctor insists on root
        assert any("belongs to uid" in problem for problem in doctor_checks.path_problems(dataclasses.replace(facts, problem="")))


def test_the_wrappers_python_and_package_are_read_from_this_release_and_the_one_before():
    """A node upgraded with its old wrappers still in place (docs/admin.md, "Upgrading"): the
    client's path moved from slurm/agent_client.py (0.1.0) to slurm/agent/client.py."""
    new = wrapper_text("prolog", "/opt/mapa/bin/python3", "/opt/mapa/lib", "/etc/slurm/mapa.toml")
    assert slurm_text.wrapper_program(new) == ("/opt/mapa/bin/python3", "/opt/mapa/lib/slurm_mapa")
    old = "/opt/old/bin/python3 -I -S /opt/old/lib/slurm_mapa/slurm/agent_client.py prolog && exit 0\n"
    assert slurm_text.wrapper_program(old) == ("/opt/old/bin/python3", "/opt/old/lib/slurm_mapa")
    assert slurm_text.wrapper_program("#!/bin/sh\n/etc/slurm/site-prolog\n") is None


def test_doctor_and_explain_run_nothing_an_untrusted_config_names(tmp_path, capsys):
    """Issue 36: run as root, `mapa doctor` and `mapa explain` executed the scontrol a mapa.toml
    names before judging whether root may trust that file (the hooks refuse the same config)."""
    from slurm_mapa.cli import main as mapa_main

    marker = tmp_path / "ran"
    program = tmp_path / "scontrol"
    program.write_text(f"#!/bin/sh\ntouch {marker}\necho SLURM_VERSION = 24.11.5\n")
    program.chmod(0o755)
    config = tmp_path / "mapa.toml"
    config.write_text(f'scontrol = "{program}"\n[nodes]\n"node1" = "dgx1-v100"\n')
    os.chown(config, 1000, 1000)  # a user's file: the user chose the program
    os.chown(program, 1000, 1000)
    inputs = gather_inputs.gather(str(config), "node1", {"PATH": os.environ.get("PATH", ""), "SLURM_CONF": str(tmp_path / "slurm.conf")},
                                  agent_socket=str(tmp_path / "agent" / "agent.sock"),
                                  isolate_socket=str(tmp_path / "isolate" / "isolate.sock"), proc=tmp_path / "no-proc")
    assert not marker.exists()
    assert inputs.show_config_error.startswith("not run: ") and "belongs to uid 1000" in inputs.show_config_error
    found = by_name(run_checks(inputs))
    assert found["scontrol"].status == FAIL and "root's files" in found["scontrol"].fix
    assert mapa_main(["explain", "12", "--config", str(config)]) == 2
    assert not marker.exists() and "not running scontrol" in capsys.readouterr().err


# --- issue 39: every line true ------------------------------------------------------------------

def _line(checks, name):
    return next(check for check in checks if check.check == name)


def test_a_wrongly_typed_key_does_not_make_the_other_checks_misjudge_nodes():
    """`prolog_budget = "fast"` beside a correct [nodes]: mapa.toml fails, and the topology check
    judges the [nodes] the admin wrote (it said "no [nodes] entry matches")."""
    checks = run_checks(healthy(mapa_toml='prolog_budget = "fast"\n' + MAPA_TOML))
    assert _line(checks, "mapa.toml").status == FAIL and "prolog_budget" in _line(checks, "mapa.toml").found
    topology = _line(checks, "topology")
    assert topology.status == OK and "no [nodes] entry" not in topology.found, doctor_checks.format_text(checks)


def test_without_a_mapa_toml_nothing_is_said_of_its_contents():
    checks = run_checks(healthy(mapa_toml=None, mapa_toml_error="No such file or directory: /etc/slurm/mapa.toml"))
    report = doctor_checks.format_text(checks)
    assert _line(checks, "mapa.toml").status == FAIL, report
    # issue 52: the words `mapa hooks` and `mapa status` use for a missing file, the path once
    from slurm_mapa.slurm.config import missing_config

    assert _line(checks, "mapa.toml").found == missing_config("/etc/slurm/mapa.toml") + "; the hooks fall back for every job"
    other = run_checks(healthy(mapa_toml=None, mapa_toml_error="Permission denied: /etc/slurm/mapa.toml"))
    assert _line(other, "mapa.toml").found.startswith("cannot read /etc/slurm/mapa.toml: Permission denied; ")
    for name in ("features", "topology"):
        line = _line(checks, name)
        assert line.status == WARN and line.found == "not checked: /etc/slurm/mapa.toml could not be read", report
    assert "has no [features]" not in report and "no [nodes] entry" not in report


def test_a_missing_plugstack_conf_is_named_missing():
    checks = run_checks(healthy(spank_lines=(), plugstack_exists=False))
    assert "/etc/slurm/plugstack.conf (it does not exist)" in _line(checks, "spank").found


def test_when_scontrol_fails_hooks_current_points_at_the_scontrol_line():
    checks = run_checks(healthy(show_config=None, show_config_error="scontrol not found", hooks={}, hook_texts={}))
    line = _line(checks, "hooks-current")
    assert line.found.startswith("not checked: `scontrol show config` failed") and line.fix == "see the scontrol line"
    assert not [check for check in checks if check.check in ("prolog", "epilog", "taskprolog")]  # the lines it named before


def test_the_gres_fix_is_the_command_for_this_node_hyperthreads_included():
    show = SHOW_NODE.replace("CoresPerSocket=1 ", "CoresPerSocket=20 ").replace("ThreadsPerCore=1 ", "ThreadsPerCore=2 ")
    checks = run_checks(healthy(show_node=show, gres_conf=None, gres_conf_error="missing"))
    assert ("`mapa gres-conf --topology /etc/slurm/mapa-topology.toml --cores 40 --sockets 2 --threads-per-core 2`"
            in _line(checks, "gres").fix)
    assert doctor_checks.gres_conf_command(None, None) == "mapa gres-conf --topology TOPOLOGY --cores N --sockets S --threads-per-core T"


def test_a_wrapper_with_the_compiled_client_names_it_and_still_its_python_and_package():
    text = wrapper_text("epilog", "/opt/mapa/bin/python3", "/opt/mapa/lib", "/etc/slurm/mapa.toml",
                        "/var/cache/mapa", client="/usr/local/sbin/mapa-hook-client")
    assert slurm_text.wrapper_client(text) == "/usr/local/sbin/mapa-hook-client"
    assert slurm_text.wrapper_program(text) == ("/opt/mapa/bin/python3", "/opt/mapa/lib/slurm_mapa")
    assert slurm_text.wrapper_client(wrapper_text("epilog", "/opt/mapa/bin/python3", "/opt/mapa/lib", "/etc/slurm/mapa.toml")) is None
