"""A held GPU told to Slurm (issue 50, item 3): `mapa gpu hold` on dgx1 reserves one GPU of the
node in slurmctld (reservation mapa_held_dgx1) and names it in the node's Comment, so Slurm
stops scheduling jobs that would need it: an 8-GPU job pends, a 7-GPU job runs and MAPA gives it
every GPU but the held one. mapa-agent puts back a reservation someone deleted. After `mapa gpu
release` the 8-GPU job starts within a minute and Slurm's view is as before."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.cluster

NODE = "dgx1"
HELD = 3
RESERVATION = f"mapa_held_{NODE}"
SLEEPING_JOB = "#!/bin/bash\nsleep 600\n"


def _reservations(cluster) -> dict[str, dict]:
    return {r["name"]: r for r in cluster.scontrol_json("show", "reservation")["reservations"]}


def _eventually(what: str, check, timeout: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        seen = check()
        if seen:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(poll)


def test_a_held_gpu_is_reserved_in_slurm_named_on_the_node_and_given_back(cluster):
    out = cluster.exec(NODE, ["mapa", "gpu", "hold", str(HELD), "--reason", "XID 79 twice"]).stdout
    try:
        assert f"reservation {RESERVATION} holds 1 GPU(s) of {NODE}" in out, out
        reservation = _reservations(cluster)[RESERVATION]
        assert reservation["node_list"] == NODE and "gres/gpu=1" in reservation["tres"], reservation
        assert f"mapa-held: GPU {HELD} (XID 79 twice)" in cluster.node(NODE)["comment"]

        # slurmctld lost it (a hand-deleted reservation): mapa-agent's next pass makes it again.
        cluster.run("scontrol", "delete", f"ReservationName={RESERVATION}")
        _eventually("mapa-agent re-creates the reservation", lambda: RESERVATION in _reservations(cluster), timeout=45)

        eight = cluster.sbatch(SLEEPING_JOB, "-w", NODE, "--gres=gpu:8", "-J", "hold-8")
        seven = cluster.sbatch(SLEEPING_JOB, "-w", NODE, "--gres=gpu:7", "-J", "hold-7")
        # The pending 8-GPU job keeps the node for itself until the backfill scheduler sees it
        # cannot start while the GPU is reserved (bf_interval, 30 s by default).
        cluster.wait_state(seven, "RUNNING", timeout=120)
        gpus = _eventually("the 7-GPU job in MAPA's ledger", lambda: cluster.ledger_jobs(NODE).get(str(seven), {}).get("gpus"), 30)
        assert sorted(gpus) == [g for g in range(8) if g != HELD], gpus
        assert cluster.state(eight) == "PENDING"
        cluster.cancel(seven)
        cluster.wait_state(seven, "CANCELLED", timeout=60)
        time.sleep(15)  # every other GPU is free now: the 8-GPU job still must not start
        assert cluster.state(eight) == "PENDING", cluster.job(eight)
    finally:
        out = cluster.exec(NODE, ["mapa", "gpu", "release", str(HELD)]).stdout
    released = time.monotonic()
    assert f"deleted reservation {RESERVATION}" in out, out
    cluster.wait_state(eight, "RUNNING", timeout=60)
    assert time.monotonic() - released < 60
    assert RESERVATION not in _reservations(cluster)
    assert "mapa-held" not in (cluster.node(NODE).get("comment") or "")
    cluster.cancel(eight)


def test_a_gpu_held_under_a_running_job_never_touches_it_and_slurm_catches_up_when_it_ends(cluster):
    """Held while an 8-GPU job runs: 24.11 reserves a GPU at once (IGNORE_JOBS overlooks the job's
    GPUs there), 26.05 refuses ("Requested nodes are busy") and MAPA drains the node, naming the
    GPU, until it can; the job runs on either way. Once it ends, the reservation is there and the
    node is not drained."""
    job = cluster.sbatch(SLEEPING_JOB, "-w", NODE, "--gres=gpu:8", "-J", "hold-busy")
    cluster.wait_state(job, "RUNNING", timeout=60)
    try:
        out = cluster.exec(NODE, ["mapa", "gpu", "hold", str(HELD), "--reason", "XID 48"]).stdout
        node = cluster.node(NODE)
        if cluster.release == "24.11":
            assert RESERVATION in _reservations(cluster), out
        else:
            assert "DRAIN" in node["state"] and f"GPU {HELD} (XID 48)" in node["reason"], (out, node["state"], node["reason"])
        assert cluster.state(job) == "RUNNING"
        cluster.cancel(job)
        _eventually("the reservation made and the node not drained by MAPA",
                    lambda: RESERVATION in _reservations(cluster) and "DRAIN" not in cluster.node(NODE)["state"], timeout=60)
    finally:
        cluster.exec(NODE, ["mapa", "gpu", "release", str(HELD)])
    assert RESERVATION not in _reservations(cluster) and "DRAIN" not in cluster.node(NODE)["state"]
