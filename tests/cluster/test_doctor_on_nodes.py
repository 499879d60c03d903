"""`mapa doctor` on the mini cluster (issue 26): a healthy DGX node and the controller pass, and
each fault broken into dgx1 (one at a time, restored in a `finally`) fails its own check with exit
status 1. The checks themselves are unit-tested on literal inputs in tests/slurm/admin/test_doctor.py."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.cluster

# The mapa CLI from the mounted source, as the entrypoint runs it (docs/cluster.md).
CLI = ("import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; "
       "sys.exit(main(sys.argv[1:]))")
PYTHON = ["/usr/bin/python3", "-I", "-X", "pycache_prefix=/var/cache/slurm-mapa/pycache", "-c", CLI]
PROLOG = "/usr/local/sbin/mapa-prolog-wrapper"
SCRATCH = "/tmp/mapa-doctor-test"


def _doctor(cluster, node: str, *args: str, env: tuple[str, ...] = ()):
    argv = (["env", *env] if env else []) + PYTHON + ["doctor", *args]
    return cluster.exec(node, argv, check=False, timeout=180)


def _said(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"


def _lines(proc, status: str, check: str) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.split()[:2] == [status, check]]


def _fails(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]


def _doctor_answered(cluster, node: str, *args: str):
    """_doctor, asked again (3 tries) while slurmctld did not answer it in time: a busy controller
    (CI's load) is what doctor warns about, not what these tests check."""
    for _ in range(3):
        proc = _doctor(cluster, node, *args)
        if "did not answer" not in proc.stdout:
            return proc
        time.sleep(5)
    return proc


def test_a_healthy_dgx_node_passes(cluster):
    proc = _doctor_answered(cluster, "dgx1")
    assert proc.returncode == 0 and not _fails(proc), _said(proc)
    assert "Traceback" not in proc.stderr, _said(proc)
    report = _doctor_answered(cluster, "dgx1", "--json")
    assert report.returncode == 0, _said(report)
    checks = {entry["check"]: entry for entry in json.loads(report.stdout) if entry["check"] != "trust"}
    # What this cluster is sure to have right (docs/cluster.md): the rest may warn (features between
    # publications, the package directory bind-mounted from the host's checkout).
    for name in ("role", "scontrol", "mapa.toml", "prolog", "epilog", "taskprolog", "hooks-current", "prolog-flags",
                 "prolog-timeout", "job-submit", "constrain-devices", "spank", "topology", "gres", "discovery", "isolation",
                 "agent"):
        assert checks[name]["status"] == "ok", _said(proc)
    assert "compute node dgx1" in checks["role"]["found"], _said(proc)
    assert checks["isolation"]["found"].startswith("fail-open"), _said(proc)
    assert "spank_mapa_isolate.so" in checks["spank"]["found"], _said(proc)
    assert f"Slurm {cluster.release}" in checks["scontrol"]["found"], _said(proc)


def test_the_controller_passes_and_skips_the_node_checks(cluster):
    proc = _doctor(cluster, "slurmctld")
    assert proc.returncode == 0 and not _fails(proc), _said(proc)
    role = _lines(proc, "ok", "role")
    assert role and "controller" in role[0] and "skipped: not a compute node" in role[0], _said(proc)
    assert _lines(proc, "ok", "job-submit"), _said(proc)
    assert not [line for line in proc.stdout.splitlines() if line.split()[1:2] in (["gres"], ["agent"], ["spank"])], _said(proc)


def test_a_group_writable_prolog_wrapper_fails(cluster):
    mode = cluster.exec("dgx1", ["stat", "-c", "%a", PROLOG]).stdout.strip()
    cluster.exec("dgx1", ["chmod", "g+w", PROLOG])
    try:
        proc = _doctor(cluster, "dgx1")
    finally:
        cluster.exec("dgx1", ["chmod", mode, PROLOG])
    assert proc.returncode == 1, _said(proc)
    failed = _lines(proc, "FAIL", "prolog")
    assert failed and "writable by group or others" in failed[0] and PROLOG in failed[0], _said(proc)
    assert len(_fails(proc)) == 1, _said(proc)


def test_a_misspelled_key_in_mapa_toml_fails(cluster):
    base = cluster.exec("dgx1", ["cat", "/etc/slurm-mapa/config/mapa.toml"]).stdout
    try:
        cluster.exec("dgx1", ["sh", "-c", "cat > /etc/slurm/mapa.toml.new && chmod 644 /etc/slurm/mapa.toml.new && "
                                          "mv /etc/slurm/mapa.toml.new /etc/slurm/mapa.toml"], input='polcy = "greedy"\n' + base)
        proc = _doctor(cluster, "dgx1")
    finally:
        cluster.exec("dgx1", ["install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml"])
    assert proc.returncode == 1, _said(proc)
    failed = _lines(proc, "FAIL", "mapa.toml")
    assert failed and "polcy" in failed[0] and "fix /etc/slurm/mapa.toml" in failed[0], _said(proc)


def test_a_plugstack_conf_naming_a_missing_plugin_fails(cluster):
    # /etc/slurm/plugstack.conf is a link into the read-only config mount: a copy of slurm.conf
    # names another plugstack.conf (PlugStackConfig=), and SLURM_CONF points the doctor at it.
    setup = (f"rm -rf {SCRATCH} && mkdir -m 700 {SCRATCH} && "
             f"{{ echo 'PlugStackConfig={SCRATCH}/plugstack.conf'; cat /etc/slurm/slurm.conf; }} > {SCRATCH}/slurm.conf && "
             f"cp /etc/slurm/gres.conf /etc/slurm/cgroup.conf {SCRATCH}/ && "
             f"echo 'optional /usr/local/lib/slurm-mapa/spank_mapa_missing.so fail-open' > {SCRATCH}/plugstack.conf")
    try:
        cluster.exec("dgx1", ["sh", "-c", setup])
        proc = _doctor(cluster, "dgx1", env=(f"SLURM_CONF={SCRATCH}/slurm.conf",))
    finally:
        cluster.exec("dgx1", ["rm", "-rf", SCRATCH], check=False)
    assert proc.returncode == 1, _said(proc)
    failed = _lines(proc, "FAIL", "spank")
    assert failed and "spank_mapa_missing.so does not exist" in failed[0], _said(proc)
    assert [line.split()[1] for line in _fails(proc)] == ["spank"], _said(proc)
