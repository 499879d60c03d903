"""Every step and every task on its own MAPA GPUs (issue 24), in a real Slurm with isolation on
(the mini cluster's default: each GPU node's topology file names its device minors).

Each task of the jobs below prints one line: the step and rank, the GPUs Slurm gave it
(MAPA_SLURM_STEP_GPUS: Slurm's own SLURM_STEP_GPUS, which Slurm narrows to the task's under a GPU
binding), MAPA's GPUs it uses (SLURM_STEP_GPUS as the TaskProlog rewrote it), what CUDA is told,
what the agent isolated it to, and which /dev/nvidiaN it can open (a mock GPU opened without
permission fails with EPERM, with permission ENXIO: there is no driver). The checks hold each line
against the job's decision in the AdminComment and the pairing of Slurm's GPUs with MAPA's
(core/order.py): a step's GPUs, a task's, what it may open and what it is told all follow from it.
"""

from __future__ import annotations

import re
import time

import pytest

from slurm_mapa.core.order import prefix_order
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.text.decision import parse_decisions

pytestmark = pytest.mark.cluster

DGX = preset("dgx1-v100")

# One line per task: what it got and what it can open.
PROBE = r"""#!/bin/bash
opened=$(for i in 0 1 2 3 4 5 6 7; do python3 -c "
import errno, os, sys
try:
    os.open('/dev/nvidia$i', os.O_RDWR)
except OSError as e:
    sys.exit(0 if e.errno == errno.ENXIO else 1)
" && printf '%s,' "$i"; done)
echo "T $(hostname) job=$SLURM_JOB_ID step=${SLURM_STEP_ID:-batch} rank=${SLURM_PROCID:-0} on_node=${SLURM_GPUS_ON_NODE:-} slurm=$MAPA_SLURM_STEP_GPUS mine=$SLURM_STEP_GPUS job_slurm=$MAPA_SLURM_JOB_GPUS job_mapa=$MAPA_GPUS cvd=$CUDA_VISIBLE_DEVICES iso=$MAPA_ISOLATION isogpus=$MAPA_ISOLATED_GPUS open=${opened%,} tag=$1"
[ -n "$2" ] && sleep "$2"
exit 0
"""

LINE = re.compile(r"^T (?P<host>\S+) job=(?P<job>\d+) step=(?P<step>\S+) rank=(?P<rank>\d+) on_node=(?P<on_node>\d*) "
                  r"slurm=(?P<slurm>[0-9,-]*) mine=(?P<mine>[0-9,]*) job_slurm=(?P<job_slurm>[0-9,]*) "
                  r"job_mapa=(?P<job_mapa>[0-9,]*) cvd=(?P<cvd>[0-9,]*) iso=(?P<iso>\S*) isogpus=(?P<isogpus>[0-9,]*) "
                  r"open=(?P<open>[0-9,]*) tag=(?P<tag>\S*)$", re.M)

# The start of every batch script below: PROBE written where every node of the job reads it, as $P.
WITH_PROBE = "P=/shared/jobs/probe-$SLURM_JOB_ID.sh\ncat > $P <<'PROBE'\n" + PROBE.strip() + "\nPROBE\nchmod +x $P\n"

STEPS_JOB = """#!/bin/bash
#SBATCH --gres=gpu:4 -N1 -n3 -O
#MAPA topology=ring sensitive=yes
""" + WITH_PROBE + """$P batch
srun -O -n3 --gpus-per-task=1 $P per-task
srun -O -n2 --gpus=4 --gpu-bind=map_gpu:3,1 $P map-gpu
srun -O -n3 --ntasks-per-gpu=1 --gpus=3 $P ntasks-per-gpu
srun -O -n2 --gpus=2 --gpu-bind=single:1 $P single
srun -O -n2 --gpus=2 --gpu-bind=none $P bind-none
srun -O -n2 --tres-per-task=gres/gpu:1 $P tres-per-task
srun -O -n2 --gpus=4 --gpu-bind=mask_gpu:0x3,0xc $P mask-gpu
srun -O -n2 --gpus=2 --gpu-bind=closest $P closest
srun -O -n2 --gpus-per-task=1 --gpu-bind=per_task:1 $P per-task-1
srun -O -n1 --gres=gpu:0 $P no-gpus
srun -O -n1 --gres=gpu:4 $P holding 4 &
sleep 2
srun -O -n1 --overlap --gres=gpu:1 $P overlap
wait
"""


def _expand(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _ints(text: str) -> list[int]:
    return [int(g) for g in text.split(",") if g]


def _lines(out: str) -> list[dict]:
    return [match.groupdict() for match in LINE.finditer(out)]


def _pairing(job_slurm: list[int], job_mapa: list[int]) -> dict[int, int]:
    """Slurm's index -> MAPA's GPU: Slurm's ascending with MAPA's in core/order.py's order."""
    return dict(zip(sorted(job_slurm), prefix_order(DGX, job_mapa)))


def _check_task(line: dict, pairing: dict[int, int]) -> tuple[int, ...]:
    """The task's MAPA GPUs follow Slurm's by the pairing; it may open what the agent isolated it
    to, a set holding its own; CUDA is told their ranks among those. Its GPUs, sorted."""
    slurm, mine, opened = _expand(line["slurm"]), _ints(line["mine"]), _ints(line["open"])
    assert sorted(pairing[g] for g in slurm) == mine, line
    assert line["iso"] == "cgroup-v1", line
    assert opened == sorted(_ints(line["isogpus"])) and set(mine) <= set(opened), line
    assert sorted(_ints(line["cvd"])) == sorted(sorted(opened).index(g) for g in mine), line
    return tuple(mine)


def _decision(cluster, jobid: int, node: str):
    admin = cluster.wait_sacct(jobid, ("AdminComment",), AdminComment=lambda v: f" # {node}=" in v)["AdminComment"]
    return parse_decisions(admin)[node]


def test_each_step_and_task_gets_and_may_open_the_mapa_gpus_paired_with_slurms(cluster):
    jobid = cluster.sbatch(STEPS_JOB, "-w", "dgx1")
    cluster.wait_state(jobid, "COMPLETED", timeout=240)
    lines = _lines(cluster.output(jobid))
    decision = _decision(cluster, jobid, "dgx1")
    batch = next(line for line in lines if line["tag"] == "batch")
    job_mapa, job_slurm = _ints(batch["job_mapa"]), _ints(batch["job_slurm"])
    assert sorted(job_mapa) == sorted(decision.gpus) and job_slurm == sorted(decision.slurm_gpus), (batch, decision)
    # The premise of map_gpu/mask_gpu below (their values are node indices with ConstrainDevices=no):
    # on an idle dgx1 Slurm gives a 4-GPU job its GPUs 0-3.
    assert job_slurm == [0, 1, 2, 3], (batch, "dgx1 was not idle when the job started")
    pairing = _pairing(job_slurm, job_mapa)
    by_tag: dict[str, list[dict]] = {}
    for line in lines:
        by_tag.setdefault(line["tag"], []).append(line)
    assert set(by_tag) == {"batch", "per-task", "map-gpu", "ntasks-per-gpu", "single", "bind-none", "tres-per-task", "mask-gpu",
                           "closest", "per-task-1", "no-gpus", "holding", "overlap"}, cluster.output(jobid)
    # The batch step: the whole job, isolated to it.
    assert _ints(batch["open"]) == sorted(job_mapa) and sorted(_ints(batch["mine"])) == sorted(job_mapa)
    # --gpus-per-task=1: local rank r gets Slurm's r-th GPU's pair, each task its own; the tasks of
    # the step may all open the step's GPUs (CUDA/ROCm IPC between ranks).
    per_task = sorted(by_tag["per-task"], key=lambda line: int(line["rank"]))
    assert len(per_task) == 3
    own = [_check_task(line, pairing) for line in per_task]
    assert all(len(gpus) == 1 for gpus in own) and len(set(own)) == 3, per_task
    assert len({line["open"] for line in per_task}) == 1 and len(_ints(per_task[0]["open"])) == 3
    # Consecutive ranks are link neighbours where the job's GPUs allow (the pairing's order).
    order = prefix_order(DGX, job_mapa)
    assert [gpus[0] for gpus in own] == list(order[:3]), (own, order)
    for tag, count, each in (("map-gpu", 2, 1), ("ntasks-per-gpu", 3, 1), ("single", 2, 1), ("bind-none", 2, 2),
                             ("tres-per-task", 2, 1), ("mask-gpu", 2, 2), ("per-task-1", 2, 1)):
        tasks = by_tag[tag]
        assert len(tasks) == count, tasks
        gpus = [_check_task(line, pairing) for line in tasks]
        assert all(len(g) == each for g in gpus), tasks
    # closest: the GPUs near each task's CPUs (the mock node has one core per socket); each its pairs.
    assert all(_check_task(line, pairing) for line in by_tag["closest"])
    # mask_gpu:0x3,0xc: rank 0 Slurm's first two of the step, rank 1 the other two; apart.
    mask = sorted(by_tag["mask-gpu"], key=lambda line: int(line["rank"]))
    assert [_expand(line["slurm"]) for line in mask] == [job_slurm[:2], job_slurm[2:]], mask
    # map_gpu:3,1: the tasks get the pairs of Slurm's 3 and 1 in rank order.
    map_gpu = sorted(by_tag["map-gpu"], key=lambda line: int(line["rank"]))
    assert [_expand(line["slurm"]) for line in map_gpu] == [[job_slurm[3]], [job_slurm[1]]], map_gpu
    # A step of no GPUs sees none and can open none.
    none = by_tag["no-gpus"][0]
    assert (none["mine"], none["cvd"], none["open"]) == ("", "", ""), none
    # --overlap: a step on a GPU another running step holds gets that GPU's pair, as Slurm shares it.
    holding, overlap = by_tag["holding"][0], by_tag["overlap"][0]
    assert set(_check_task(overlap, pairing)) <= set(_check_task(holding, pairing)), (holding, overlap)



# Two CPUs (the mock node's all): Slurm 26.05 runs two `--exact` steps of one CPU each side by side
# only when the job has a CPU for each (24.11 let `-O` steps share the job's one CPU).
CONCURRENT_JOB = """#!/bin/bash
#SBATCH --gres=gpu:4 -N1 -n2
#MAPA topology=ring sensitive=yes
""" + WITH_PROBE + """$P batch
srun --exact -n1 --gres=gpu:2 $P concurrent-a 3 &
srun --exact -n1 --gres=gpu:2 $P concurrent-b 3 &
wait
"""


def test_two_concurrent_steps_kept_apart_by_slurm_are_apart_on_mapas_gpus(cluster):
    jobid = cluster.sbatch(CONCURRENT_JOB, "-w", "dgx1")
    cluster.wait_state(jobid, "COMPLETED", timeout=120)
    by_tag = {line["tag"]: line for line in _lines(cluster.output(jobid))}
    assert set(by_tag) == {"batch", "concurrent-a", "concurrent-b"}, cluster.output(jobid)
    batch = by_tag["batch"]
    pairing = _pairing(_ints(batch["job_slurm"]), _ints(batch["job_mapa"]))
    a, b = by_tag["concurrent-a"], by_tag["concurrent-b"]
    ga, gb = _check_task(a, pairing), _check_task(b, pairing)
    # Side by side (each ran while the other slept), so Slurm gave them different GPUs.
    assert a["step"] != b["step"] and not set(_expand(a["slurm"])) & set(_expand(b["slurm"])), (a, b)
    assert len(ga) == len(gb) == 2 and not set(ga) & set(gb), (a, b)
    assert not set(_ints(a["open"])) & set(_ints(b["open"])), (a, b)

ARRAY_JOB = """#!/bin/bash
#SBATCH --gres=gpu:1 -p dgx -n1 --array=0-3
#MAPA topology=ring sensitive=no
echo "task=$SLURM_ARRAY_TASK_ID node=$(hostname) gpus=$MAPA_GPUS"
sleep 3
"""


def test_every_array_task_carries_its_own_record(cluster):
    """`scontrol update job=N` on an array task whose id is the array's changes every task's
    AdminComment: each task's record must name the node and GPUs that task used."""
    jobid = cluster.sbatch(ARRAY_JOB, f"--output={cluster.job_dir}/array-%A_%a.out")
    seen: dict[str, tuple[str, list[int]]] = {}
    deadline = time.monotonic() + 180
    while len(seen) < 4 and time.monotonic() < deadline:
        for task in range(4):
            out = cluster.exec("slurmctld", ["cat", f"{cluster.job_dir}/array-{jobid}_{task}.out"], check=False).stdout
            match = re.search(r"^task=(\d+) node=(\S+) gpus=([0-9,]+)$", out, re.M)
            if match:
                seen[match.group(1)] = (match.group(2), _ints(match.group(3)))
        time.sleep(1)
    assert len(seen) == 4, seen
    for task, (node, gpus) in seen.items():
        decisions = parse_decisions(cluster.wait_sacct(f"{jobid}_{task}", ("AdminComment",),
                                                       AdminComment=lambda v: " # " in v, timeout=60)["AdminComment"])
        assert set(decisions) == {node} and list(decisions[node].gpus) == gpus, (task, decisions, node, gpus)


HET_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2 -w dgx1 -n1
#MAPA topology=ring sensitive=yes
#SBATCH hetjob
#SBATCH --gres=gpu:3 -w dgx2 -n1
""" + WITH_PROBE + """srun --het-group=0,1 $P het
"""


def test_each_het_component_is_isolated_and_recorded_by_its_own_job_id(cluster):
    jobid = cluster.sbatch(HET_JOB)
    cluster.wait_state(jobid, "COMPLETED", timeout=180)
    lines = {line["host"]: line for line in _lines(cluster.output(jobid))}
    assert set(lines) == {"dgx1", "dgx2"}, cluster.output(jobid)
    out = cluster.run("sacct", "-a", "-X", "-n", "-P", "-j", str(jobid), "-o", "JobID,NodeList,AdminComment")
    records = {fields[0]: (fields[1], fields[2]) for fields in (line.split("|", 2) for line in out.splitlines()) if len(fields) == 3}
    for offset, node, count in ((0, "dgx1", 2), (1, "dgx2", 3)):
        listed, admin = records[f"{jobid}+{offset}"]
        decisions = parse_decisions(admin)
        assert listed == node and set(decisions) == {node}, records  # its own record, not the leader's
        line = lines[node]
        pairing = _pairing(_ints(line["job_slurm"]), _ints(line["job_mapa"]))
        assert sorted(decisions[node].gpus) == sorted(_ints(line["job_mapa"])), (line, decisions)
        assert len(_check_task(line, pairing)) == count  # isolated by its own job id, not failed open


MULTI_NODE_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2 -p dgx -N2 --ntasks-per-node=2 -O
#MAPA topology=ring sensitive=yes
""" + WITH_PROBE + """srun -O --gpus-per-task=1 $P multi
"""


def test_each_node_of_a_multi_node_step_maps_its_own_part(cluster):
    jobid = cluster.sbatch(MULTI_NODE_JOB)
    cluster.wait_state(jobid, "COMPLETED", timeout=180)
    lines = _lines(cluster.output(jobid))
    admin = cluster.wait_sacct(jobid, ("AdminComment",), AdminComment=lambda v: v.count(" # ") == 2)["AdminComment"]
    decisions = parse_decisions(admin)
    assert {line["host"] for line in lines} == set(decisions) == {"dgx1", "dgx2"}, (lines, decisions)
    for node in decisions:
        tasks = [line for line in lines if line["host"] == node]
        assert len(tasks) == 2
        for line in tasks:
            # Slurm's job GPUs of *this* node, as its Prolog had them (the batch node's are in SLURM_JOB_GPUS).
            assert _ints(line["job_slurm"]) == sorted(decisions[node].slurm_gpus), (line, decisions[node])
            assert sorted(_ints(line["job_mapa"])) == sorted(decisions[node].gpus), line
        own = [_check_task(line, _pairing(_ints(tasks[0]["job_slurm"]), _ints(tasks[0]["job_mapa"]))) for line in tasks]
        assert len(set(own)) == 2


def test_salloc_and_srun_get_their_mapa_gpus(cluster):
    cluster.run("sh", "-c", f"cat > {cluster.job_dir}/probe-salloc.sh && chmod 755 {cluster.job_dir}/probe-salloc.sh",
                input=PROBE.strip() + "\n")
    proc = cluster.exec("slurmctld", ["salloc", "-w", "dgx1", "--gres=gpu:2", "-n2", "-O", "--comment=mapa:topology=ring sensitive=yes",
                                      "srun", "-O", "-n2", "--gpus-per-task=1", f"{cluster.job_dir}/probe-salloc.sh", "salloc"],
                        user="alice", timeout=150)
    lines = _lines(proc.stdout)
    assert len(lines) == 2, proc.stdout + proc.stderr
    pairing = _pairing(_ints(lines[0]["job_slurm"]), _ints(lines[0]["job_mapa"]))
    own = [_check_task(line, pairing) for line in lines]
    assert len(set(own)) == 2 and all(len(g) == 1 for g in own)
