"""End-to-end smoke tests: the dockerized cluster is a real Slurm with mock GPUs and accounting."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster

SHOW_GPUS = """#!/bin/bash
echo "node=$(uname -n)"
echo "user=$(id -un)"
echo "cuda_visible_devices=$CUDA_VISIBLE_DEVICES"
for i in ${CUDA_VISIBLE_DEVICES//,/ }; do
    if [ -c "/dev/nvidia$i" ]; then echo "device=/dev/nvidia$i"; fi
done
"""


def _parse(output: str) -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            parsed.setdefault(key, []).append(value)
    return parsed


def test_every_mock_node_is_idle_with_its_gpus(cluster):
    for name in cluster.nodes:
        cluster.wait_node(name, lambda state: state == {"IDLE"}, timeout=60, what="idle")
    sinfo = cluster.run("sinfo", "-h", "-N", "-o", "%N %t %G")
    # GRES prints as gpu:8, or gpu:8(S:0-1) when gres.conf gives Cores=.
    rows = {name: [state, gres.split("(")[0]] for name, state, gres in map(str.split, sinfo.splitlines())}
    assert rows == {name: ["idle", f"gpu:{count}"] for name, (_, count) in cluster.nodes.items()}, sinfo
    for name, (_, count) in cluster.nodes.items():
        shown = cluster.run("scontrol", "show", "node", name)
        gres = [word.split("(")[0] for word in shown.split() if word.startswith("Gres=")]
        assert gres == [f"Gres=gpu:{count}"], shown
        node = cluster.node(name)
        assert f"gres/gpu={count}" in node["tres"].split(","), node["tres"]


def test_nodes_carry_their_preset_and_gpu_device_files(cluster):
    for name, (preset, count) in cluster.nodes.items():
        env = cluster.exec(name, ["printenv", "MAPA_PRESET"]).stdout.strip()
        assert env == preset
        # NVIDIA nodes: /dev/nvidiaN; the AMD node: render nodes /dev/dri/renderD(128+N), as gres.conf names them.
        amd = preset.startswith("mi")
        pattern, expected = (("/dev/dri/renderD[0-9]*", [f"/dev/dri/renderD{128 + i}" for i in range(count)]) if amd
                             else ("/dev/nvidia[0-9]*", [f"/dev/nvidia{i}" for i in range(count)]))
        devices = cluster.exec(name, ["bash", "-c", f"for f in {pattern}; do [ -c $f ] && echo $f; done"])
        assert sorted(devices.stdout.split()) == sorted(expected)


def test_gpu_job_on_dgx_sees_two_gpu_devices_and_is_in_sacct(cluster):
    jobid = cluster.sbatch(SHOW_GPUS, "--gres=gpu:2", "--nodelist=dgx1", "--job-name=smoke-gpu2", "--comment=smoke two gpus")
    cluster.wait_state(jobid, "COMPLETED", timeout=90)

    out = _parse(cluster.output(jobid))
    assert out["node"] == ["dgx1"]
    assert out["user"] == ["alice"]
    indices = out["cuda_visible_devices"][0].split(",")
    assert len(indices) == 2 and len(set(indices)) == 2, out
    assert out["device"] == [f"/dev/nvidia{i}" for i in indices]

    rec = cluster.wait_sacct(
        jobid,
        fields=("JobID", "JobName", "User", "NodeList", "AllocTRES", "Comment"),
        State="COMPLETED",
        timeout=60,
    )
    assert rec["JobID"] == str(jobid)
    assert rec["JobName"] == "smoke-gpu2"
    assert rec["User"] == "alice"
    assert rec["NodeList"] == "dgx1"
    assert "gres/gpu=2" in rec["AllocTRES"].split(","), rec
    assert rec["Comment"] == "smoke two gpus"


def test_job_larger_than_any_node_is_refused_by_slurm(cluster):
    # No node has 17 GPUs: Slurm refuses the job at submission instead of queueing it forever.
    with pytest.raises(cluster.Error, match="Requested node configuration is not available"):
        cluster.sbatch(SHOW_GPUS, "--gres=gpu:17", "--job-name=smoke-too-big")


def test_job_larger_than_the_free_gpus_stays_pending_with_slurms_reason(cluster):
    holder = cluster.sbatch("#!/bin/bash\nsleep 600\n", "--gres=gpu:6", "--nodelist=summit1", "--job-name=smoke-holder")
    cluster.wait_state(holder, "RUNNING", timeout=90)
    waiting = cluster.sbatch(SHOW_GPUS, "--gres=gpu:1", "--nodelist=summit1", "--job-name=smoke-waiting")
    # Once the scheduler has looked at it, the job waits for Resources.
    job = cluster.wait_job(waiting, lambda job: job["state_reason"] != "None", timeout=60, what="scheduled")
    assert job["job_state"] == ["PENDING"]
    assert job["state_reason"] == "Resources"

    cluster.cancel(holder)
    cluster.wait_state(waiting, "COMPLETED", timeout=90)
    assert _parse(cluster.output(waiting))["node"] == ["summit1"]


def test_killed_node_comes_back(cluster):
    cluster.kill_node("summit1")
    cluster.wait_node(
        "summit1",
        lambda state: bool(state & {"DOWN", "NOT_RESPONDING"}),
        timeout=90,
        what="noticed as not responding",
    )
    cluster.start_node("summit1")
    cluster.wait_node("summit1", lambda state: state == {"IDLE"}, timeout=120, what="idle again")

    jobid = cluster.sbatch(SHOW_GPUS, "--gres=gpu:6", "--nodelist=summit1", "--job-name=smoke-back")
    cluster.wait_state(jobid, "COMPLETED", timeout=90)
    out = _parse(cluster.output(jobid))
    assert out["node"] == ["summit1"]
    assert len(out["device"]) == 6
