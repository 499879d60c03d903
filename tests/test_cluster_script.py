"""scripts/cluster's choice of Slurm release and cluster name, without starting anything."""

from __future__ import annotations

import os
import re
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
