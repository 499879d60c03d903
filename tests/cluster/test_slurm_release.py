"""What differs between the Slurm releases the mini cluster runs (26.05 and 24.11), checked on
each: the release itself, the SPANK plugin built for it, the job's SLUID in the Prolog's mark,
`--gres=gpu:N` with `--gpus-per-node`, and the `sacct --json` the replay reads. docs/admin.md,
"Slurm releases", states these facts; each is asserted here on the release it names."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time

import pytest

from test_mapa import HOLDING_JOB, _gpus, _release

pytestmark = pytest.mark.cluster

#: Each release's default data_parser for --json (Slurm's RELEASE_NOTES.md of 25.05, 25.11, 26.05).
DATA_PARSER = {"24.11": "data_parser/v0.0.42", "26.05": "data_parser/v0.0.45"}
SLUID = re.compile(r"s[0-9A-HJKMNP-TV-Z]{13}")
RUN_MAPA = ("/usr/bin/python3", "-I", "-c",
            "import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))")


def test_every_daemon_and_client_runs_the_release_asked_for(cluster):
    assert cluster.run("sinfo", "-V").strip().startswith(f"slurm-wlm {cluster.release}.")
    for node in ("dgx1", "mi250x1"):
        version = cluster.exec(node, ["slurmd", "-V"]).stdout.strip()
        assert version.startswith(f"slurm-wlm {cluster.release}."), (node, version)
    config = cluster.run("scontrol", "show", "config")
    assert re.search(rf"^SLURM_VERSION\s*=\s*{re.escape(cluster.release)}\.", config, re.M), config[-2000:]
    # The Prolog has a bound on both releases (26.05 also accepts PrologTimeout/EpilogTimeout and
    # prints them apart only when they differ).
    assert re.search(r"^PrologEpilogTimeout\s*=\s*60$", config, re.M), config[-2000:]


def test_the_nodes_spank_plugin_is_built_for_the_running_release_and_a_foreign_one_is_reported(cluster):
    check = ("import os, sys, json; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.slurm.isolation import spank_plugin as spankcheck; "
             "print(json.dumps(spankcheck.check_this_node(os.environ, spankcheck.running_slurm_version_text)))")
    assert json.loads(cluster.exec("dgx1", ["/usr/bin/python3", "-I", "-c", check]).stdout) == []
    # A copy whose plugin_version names the other release, in a plugstack.conf of its own: the
    # 4 bytes of the version the headers gave it, found by value, replaced by the other's.
    other = "24.11" if cluster.release == "26.05" else "26.05"
    patch = ("import struct, sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.slurm.isolation import spank_plugin as spankcheck; "
             "data = open(sys.argv[1], 'rb').read(); own = struct.pack('<I', spankcheck.elf_u32_symbol(data, 'plugin_version')); "
             "assert data.count(own) == 1, data.count(own); major, minor = map(int, sys.argv[2].split('.')); "
             "open(sys.argv[3], 'wb').write(data.replace(own, struct.pack('<I', major << 16 | minor << 8 | 5)))")
    script = f"""set -e
mkdir -p /opt/foreign && chmod 755 /opt/foreign
python3 -I -c "{patch}" /usr/local/lib/slurm-mapa/spank_mapa_isolate.so {other} /opt/foreign/spank_mapa_isolate.so
printf 'optional /opt/foreign/spank_mapa_isolate.so fail-open\\n' > /opt/foreign/plugstack.conf
sed '/^PlugStackConfig/d' /etc/slurm/slurm.conf > /opt/foreign/slurm.conf
echo PlugStackConfig=/opt/foreign/plugstack.conf >> /opt/foreign/slurm.conf
"""
    cluster.exec("dgx1", ["sh", "-c", script])
    try:
        out = cluster.exec("dgx1", ["env", "SLURM_CONF=/opt/foreign/slurm.conf", "/usr/bin/python3", "-I", "-c", check]).stdout
        problems = json.loads(out)
        assert len(problems) == 1, problems
        assert f"built for Slurm {other}" in problems[0] and f"runs Slurm {cluster.release}." in problems[0], problems
        # mapa hooks says it too, on stderr, and still writes the hooks.
        hooks = cluster.exec("dgx1", ["env", "SLURM_CONF=/opt/foreign/slurm.conf", *RUN_MAPA, "hooks", "/opt/foreign",
                                      "--python", "/usr/bin/python3", "--config", "/etc/slurm/mapa.toml"])
        assert re.search(rf"^WARNING: SPANK plugin /opt/foreign/spank_mapa_isolate.so was built for Slurm {other}", hooks.stderr, re.M), hooks.stderr
    finally:
        cluster.exec("dgx1", ["rm", "-rf", "/opt/foreign"], check=False)
    # The agent's own start check found nothing wrong with the plugin the node really loads.
    log = cluster.exec("dgx1", ["sh", "-c", "cat /var/log/slurm-mapa.log 2>/dev/null || true"]).stdout
    assert "WARNING: SPANK plugin" not in log, log[-3000:]


def test_the_prologs_mark_carries_the_sluid_where_slurm_has_one(cluster):
    """Slurm 26.05 names a job's cgroup v2 directory by its SLUID, and gives the Prolog
    SLURM_JOB_SLUID (from 25.11): the Prolog's mark keeps it, so mapa-agent can map the directory
    the kernel reports to the job. 24.11 has no SLUID."""
    jobid = cluster.sbatch(HOLDING_JOB.format(gpus=1, sensitive="no"), "-w", "dgx2")
    cluster.wait_state(jobid, "RUNNING")
    _gpus(cluster, jobid)
    try:
        mark = cluster.exec("dgx2", ["cat", f"/run/slurm-mapa/jobs/.prolog-{jobid}"]).stdout
        sacct = json.loads(cluster.run("sacct", "--json", "-X", "-j", str(jobid)))
        assert sacct["meta"]["plugin"]["data_parser"] == DATA_PARSER[cluster.release], sacct["meta"]
        (job,) = sacct["jobs"]
        if cluster.release == "24.11":
            assert "sluid=" not in mark and "sluid" not in job, (mark, sorted(job))
        else:
            assert SLUID.fullmatch(job["sluid"]), job["sluid"]
            assert mark.rstrip("\n").endswith(f" sluid={job['sluid']}"), (mark, job["sluid"])
    finally:
        _release(cluster, jobid)


def test_gres_with_gpus_per_node_on_each_release(cluster):
    """26.05 refuses `--gres=gpu:N` together with `--gpus-per-node` (sbatch, srun, salloc); 24.11
    takes both. docs/users.md and docs/admin.md say to use one of them."""
    proc = cluster.exec("slurmctld", ["sbatch", "--test-only", "--gres=gpu:2", "--gpus-per-node=2", "-w", "dgx1", "--wrap", "true"],
                        user="alice", check=False)
    if cluster.release == "26.05":
        assert proc.returncode != 0 and "--gpus-per-node and --gres=gpu are mutually exclusive" in proc.stderr, proc
    else:
        assert proc.returncode == 0, proc
    # Either one alone is the same request to Slurm (tres_per_node gres/gpu:2), and to MAPA.
    for option in ("--gres=gpu:2", "--gpus-per-node=2"):
        proc = cluster.exec("slurmctld", ["sbatch", "--test-only", option, "-w", "dgx1", "--wrap", "true"], user="alice", check=False)
        assert proc.returncode == 0, (option, proc)


def test_the_replay_reads_this_releases_sacct_json_and_re_makes_its_decisions(cluster, tmp_path):
    from slurm_mapa.replay.cli import main as replay_main

    ids = []
    for gpus, sensitive in [(2, "yes"), (3, "no")]:
        ids.append(cluster.sbatch(HOLDING_JOB.format(gpus=gpus, sensitive=sensitive), "-w", "dgx1"))
        cluster.wait_state(ids[-1], "RUNNING")
        _gpus(cluster, ids[-1])
    for jobid in ids:
        _release(cluster, jobid)
    for jobid in ids:
        cluster.wait_sacct(jobid, ("AdminComment", "State"), State="COMPLETED", AdminComment=lambda v: " # dgx1=" in v)
    text = cluster.run("sacct", "--json", "-a", "-j", ",".join(map(str, ids)))
    assert json.loads(text)["meta"]["plugin"]["data_parser"] == DATA_PARSER[cluster.release]
    path = tmp_path / f"sacct-{cluster.release}.json"
    path.write_text(text)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert replay_main(["run", str(path), "--cluster", "dgx1:dgx1-v100", "--policies", "preserve", "--json"]) == 0
    audit = json.loads(buffer.getvalue())["recorded_decisions"]
    assert audit["compared"] == len(ids) and audit["policies"]["preserve"]["same_set"] == len(ids), audit


def _active_features(cluster, partition: str) -> dict[str, set[str]]:
    out = cluster.run("sinfo", "-h", "-N", "-p", partition, "-o", "%N %b")
    return {name: set(features.split(",")) - {"(null)"} for name, features in (line.split() for line in out.splitlines())}


def test_a_constraint_no_node_has_active_fails_at_submission_and_an_unmet_preference_does_not_wait(cluster):
    """Why MAPA never adds a hard constraint, and what `--prefer` costs (docs/admin.md, "Choosing
    the node"), on this release: with every DGX node able to give a good 2-GPU ring, mapa_noring2
    is available but active on no node of the partition."""
    deadline = time.monotonic() + 60
    while any("mapa_noring2" in features for features in _active_features(cluster, "dgx").values()):
        assert time.monotonic() < deadline, _active_features(cluster, "dgx")
        time.sleep(1)
    proc = cluster.exec("slurmctld", ["sbatch", "-p", "dgx", "--gres=gpu:1", "--constraint=mapa_noring2", "-o", "/dev/null",
                                      "--wrap", "true"], user="alice", check=False)
    assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr, proc
    # The same feature as a preference: the job starts at once (measured: within 1 to 3 s on both
    # releases; the bound leaves room for a busy host), not at the backfill pass (bf_interval, 30 s).
    submitted = time.monotonic()
    jobid = cluster.sbatch("#!/bin/bash\nsleep 2\n", "-p", "dgx", "--gres=gpu:1", "--prefer=mapa_noring2")
    cluster.wait_state(jobid, ("RUNNING", "COMPLETED"), timeout=60, poll=0.2)
    assert time.monotonic() - submitted < 20, "a job whose preference no node meets waited for the backfill pass"
