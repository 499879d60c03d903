"""CPU affinity in the Prolog's decision, in a real Slurm (issue 14): with `[affinity] mode =
"strict"` in the node's mapa.toml and `--gres-flags=enforce-binding`, a job's GPUs (MAPA's) lie
on the socket of the cores Slurm bound its tasks to. The mini cluster's DGX-1 nodes have one core
per socket: core 0 is socket 0 (GPUs 0-3), core 1 socket 1 (GPUs 4-7) (docs/cluster.md)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.cluster

NODE = "dgx1"
JOB = """#!/bin/bash
#MAPA topology=ring sensitive=yes
echo "cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2) mapa=$MAPA_GPUS"
for _ in $(seq 600); do [ -e /shared/jobs/release-$SLURM_JOB_ID ] && exit 0; sleep 0.2; done
"""
SOCKET_GPUS = {0: set(range(4)), 1: set(range(4, 8))}


@pytest.fixture
def strict_affinity(cluster):
    base = cluster.exec(NODE, ["cat", "/etc/slurm-mapa/config/mapa.toml"]).stdout
    assert "[affinity]" not in base
    cluster.exec(NODE, ["sh", "-c", "cat > /etc/slurm/mapa.toml"], input=base + '\n[affinity]\nmode = "strict"\n')
    yield
    cluster.exec(NODE, ["install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml"])


def _seen(cluster, jobid: int) -> tuple[set[int], set[int]]:
    cluster.wait_state(jobid, "RUNNING", timeout=90)
    for _ in range(300):
        out = cluster.exec("slurmctld", ["cat", f"{cluster.job_dir}/{jobid}.out"], check=False).stdout
        match = re.search(r"^cpus=(\S+) mapa=(\S+)$", out, re.M)
        if match:
            cpus = set()
            for part in match.group(1).split(","):
                low, _, high = part.partition("-")
                cpus |= set(range(int(low), int(high or low) + 1))
            return cpus, {int(g) for g in match.group(2).split(",")}
        import time

        time.sleep(0.2)
    raise cluster.Error(f"job {jobid} printed nothing: {out!r}")


def test_with_enforce_binding_the_gpus_lie_on_the_socket_of_the_jobs_cores(cluster, strict_affinity):
    jobs = []
    for gpus in (2, 2, 1, 2):
        jobid = cluster.sbatch(JOB, "-w", NODE, f"--gres=gpu:{gpus}", "--gres-flags=enforce-binding", "-c", "1")
        cpus, mapa = _seen(cluster, jobid)
        assert len(cpus) == 1, cpus  # one core, on one socket
        socket = cpus.pop()
        assert mapa <= SOCKET_GPUS[socket], (jobid, socket, mapa)
        jobs.append(jobid)
    for jobid in jobs:
        cluster.run("touch", f"{cluster.job_dir}/release-{jobid}")
    for jobid in jobs:
        cluster.wait_state(jobid, "COMPLETED", timeout=60)
