"""scripts/cluster's choice of Slurm release and cluster name, without starting anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cluster"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_a_release_no_image_is_built_for_is_refused_naming_the_accepted_ones():
    for release in ("25.11", "26.5", "latest"):
        proc = _run("build", MAPA_SLURM=release)
        assert proc.returncode == 2, (release, proc)
        assert f"MAPA_SLURM={release} is not a release" in proc.stderr and "accepted: 26.05, 24.11" in proc.stderr, proc.stderr


def test_help_names_the_release_and_cluster_settings():
    out = _run("help").stdout
    for name in ("MAPA_SLURM", "MAPA_CLUSTER", "MAPA_SUBNET_PREFIX", "MAPA_IMAGE"):
        assert re.search(rf"^  {name} ", out, re.M), (name, out)
    assert "26.05" in out and "24.11" in out


def test_every_container_name_and_address_follows_the_clusters_settings():
    """Two clusters side by side (one per release) must share no container name or address."""
    compose = (ROOT / "containers" / "compose.yml").read_text()
    names = re.findall(r"^\s*container_name:\s*(\S+)", compose, re.M)
    assert len(names) == 8 and all(name.startswith("${MAPA_CLUSTER:-mapa}-") for name in names), names
    addresses = set(re.findall(r"\d+\.\d+\.\d+\.\d+", compose)) - {"127.0.0.1"}  # a health check's own
    assert not addresses, addresses  # every cluster address is ${MAPA_SUBNET_PREFIX:-...}.N


def _mounts_of(compose: str, block_start: str) -> list[str]:
    """The volume entries of the compose block that starts with the line ``block_start``."""
    indent = " " * (len(block_start) - len(block_start.lstrip()) + 2)
    block = compose.split(f"\n{block_start}\n", 1)[1]
    entries = block.split(f"\n{indent}volumes:\n", 1)[1]
    listed = re.match(r"(?:[ ]+(?:- \S+|#.*)\n)*", entries).group(0)  # entries and comments
    return re.findall(r"- (\S+)\n", listed)


def test_the_controller_mounts_what_every_container_mounts_and_its_state_volume():
    """slurmctld lists its volumes in full (a service's list replaces the shared one): it must keep
    every shared mount, and StateSaveLocation must be a named volume (off fuse-overlayfs, kept
    across `docker restart`)."""
    compose = (ROOT / "containers" / "compose.yml").read_text()
    common = _mounts_of(compose, "x-common: &common")
    controller = _mounts_of(compose, "  slurmctld:")
    assert len(common) >= 5 and set(common) <= set(controller), (common, controller)
    conf = (ROOT / "containers" / "config" / "slurm.conf").read_text()
    state = re.search(r"^StateSaveLocation=(\S+)$", conf, re.M).group(1)
    assert f"slurmctld-state:{state}" in controller, (state, controller)


def _fake_tools(tmp_path: Path, slurmd_package: str, slurmd_v: str = "") -> dict[str, str]:
    """A PATH whose docker has every image already, whose base image holds ``slurmd_package``
    (empty: no slurmd in it), whose builds succeed and whose built image's ``slurmd -V`` prints
    ``slurmd_v``; anything else docker is asked is logged (tmp_path/docker.log) and fails. The
    build cache is tmp_path's, and the project's wheel an empty file."""
    bin_dir = tmp_path / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    log.unlink(missing_ok=True)
    (bin_dir / "docker").write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$1 $2" in
    "info "*|"image inspect"|"build -q") exit 0 ;;
esac
if [[ "$*" == *"--entrypoint dpkg-query"* ]]; then
    [[ -n "{slurmd_package}" ]] || {{ echo "dpkg-query: no packages found matching slurmd" >&2; exit 1; }}
    printf '%s' "{slurmd_package}"; exit 0
fi
if [[ "$*" == *"--entrypoint slurmd"* ]]; then echo "{slurmd_v}"; exit 0; fi
exit 99
""")
    (bin_dir / "docker-compose").write_text("#!/bin/sh\nexit 0\n")
    # build_wheel's `python3 -m pip wheel -q --no-deps -w DIR SRC`: an empty wheel in DIR
    (bin_dir / "python3").write_text('#!/bin/bash\n[[ "$*" == *" wheel "* ]] || exit 0\n'
                                     'while [[ $1 != -w ]]; do shift; done; touch "$2/slurm_mapa-0-py3-none-any.whl"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MAPA_CACHE_DIR": str(tmp_path / "cache")}


def test_a_suite_that_ships_another_slurm_stops_the_build_in_one_line_before_the_image_build(tmp_path):
    env = _fake_tools(tmp_path, "26.11.0-1")
    proc = _run("build", MAPA_SLURM="26.05", **env)
    assert proc.returncode == 1, proc
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["[cluster] error: MAPA_SLURM=26.05 asked for Slurm 26.05, but Debian forky now ships Slurm 26.11.0-1 "
                      "(slurmd 26.11.0-1 in debian:forky-slim); once the project supports Slurm 26.11 (docs/cluster.md, "
                      "\"Debian's Slurm releases\"), build it with MAPA_SLURM=26.11"], proc.stderr
    asked = (tmp_path / "docker.log").read_text()
    assert "build" not in asked.split(), asked  # stopped before `docker build`
    assert "### Debian's Slurm releases" in (ROOT / "docs" / "cluster.md").read_text()  # the section the line names


def test_the_built_images_slurm_is_printed_and_checked(tmp_path):
    """A registry's plain Debian image has no slurmd yet: the built image's slurmd -V decides."""
    proc = _run("build", MAPA_SLURM="24.11", **_fake_tools(tmp_path, "", "slurm 24.11.5"))
    assert proc.returncode == 0, proc.stderr
    assert "[cluster] slurm-mapa:slurm-24.11 runs Slurm 24.11.5 (Debian trixie)" in proc.stderr.splitlines(), proc.stderr
    assert "--entrypoint dpkg-query debian:trixie-slim" in (tmp_path / "docker.log").read_text()
    proc = _run("build", MAPA_SLURM="26.05", **_fake_tools(tmp_path, "", "slurm-wlm 26.11.0"))
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "[cluster] error: MAPA_SLURM=26.05 asked for Slurm 26.05, but Debian forky now ships Slurm 26.11.0 (slurmd -V in "
        "slurm-mapa:slurm-26.05); once the project supports Slurm 26.11 (docs/cluster.md, \"Debian's Slurm releases\"), "
        "build it with MAPA_SLURM=26.11"), proc.stderr
