"""slurm-mapa in a real Slurm: the Lua plugin, the Prolog/TaskProlog/Epilog and the ledger on mock GPUs."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time

import pytest

from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.decision import parse_decisions

pytestmark = pytest.mark.cluster

# Prints what the job sees, then waits (bounded) until the test releases it.
HOLDING_JOB = """#!/bin/bash
#SBATCH --gres=gpu:{gpus}
#MAPA topology=ring sensitive={sensitive}
echo "cvd=$CUDA_VISIBLE_DEVICES"
echo "slurm=$SLURM_JOB_GPUS"
for _ in $(seq 1500); do [ -e /shared/jobs/release-$SLURM_JOB_ID ] && exit 0; sleep 0.2; done
exit 3
"""


def _cvd(cluster, jobid: int, timeout: float = 60) -> tuple[int, ...]:
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.exec("slurmctld", ["cat", f"{cluster.job_dir}/{jobid}.out"], check=False).stdout
        match = re.search(r"^cvd=([0-9,]*)$", out, re.M)
        if match:
            return tuple(int(g) for g in match.group(1).split(",") if g)
        if time.monotonic() > deadline:
            raise cluster.Error(f"job {jobid} printed no CUDA_VISIBLE_DEVICES: {out!r}")
        time.sleep(0.3)


def _release(cluster, jobid: int) -> None:
    cluster.run("touch", f"{cluster.job_dir}/release-{jobid}")
    cluster.wait_state(jobid, "COMPLETED", timeout=60)


def _admin_comment(cluster, jobid: int) -> str:
    job = cluster.job(jobid)
    return job.get("admin_comment", "") if job else cluster.sacct(jobid, ("AdminComment",))["AdminComment"]


def _ledger(cluster, node: str) -> dict:
    out = cluster.exec(node, ["cat", "/var/lib/slurm-mapa/ledger.json"], check=False).stdout
    return json.loads(out)["jobs"] if out.strip() else {}


def _run_job_sequence(cluster, policy: str, steps) -> tuple[dict[str, int], int]:
    """Submit ``steps`` to the mock DGX-1 (("A", gpus, sensitive) submits, ("release", "A") ends one);
    each job must get what ``select(policy, ..., running=...)`` gives for the jobs held at that moment,
    and record that free set and those running jobs. Returns the job ids and how many decisions the
    running jobs changed; every job is released at the end."""
    graph = preset("dgx1-v100")
    held: dict[str, tuple[int, ...]] = {}
    ids: dict[str, int] = {}
    running_mattered = 0
    for step in steps:
        if step[0] == "release":
            _release(cluster, ids[step[1]])
            del held[step[1]]
            continue
        name, gpus, sensitive = step
        free = [g for g in range(graph.size) if g not in {x for hold in held.values() for x in hold}]
        running = sorted(tuple(sorted(hold)) for hold in held.values())
        request = Request(make_pattern("ring", gpus), sensitive)
        expected = select(policy, graph, free, request, running=running)
        running_mattered += sorted(expected.gpus) != sorted(select(policy, graph, free, request).gpus)
        jobid = cluster.sbatch(HOLDING_JOB.format(gpus=gpus, sensitive="yes" if sensitive else "no"), "-w", "dgx1")
        ids[name] = jobid
        cluster.wait_state(jobid, "RUNNING", timeout=60)
        seen = _cvd(cluster, jobid)
        assert seen == expected.gpus, (name, free, running, seen, expected.gpus)
        decision = parse_decisions(_admin_comment(cluster, jobid))["dgx1"]
        assert decision.gpus == expected.gpus and decision.policy == policy
        assert decision.free == tuple(free) and decision.running == tuple(running)
        held[name] = seen
    for name in held:
        _release(cluster, ids[name])
    return ids, running_mattered


SACCT_FIELDS = "JobID,JobName,User,Account,Partition,Submit,Start,End,Elapsed,ElapsedRaw,State,ExitCode,NodeList,AllocTRES,Comment,AdminComment"


def _replayed_audit(cluster, ids, tmp_path, policies: str) -> tuple[dict, str]:
    """mapa-replay's audit of the jobs' sacct log (each decision re-made on its recorded state), and the log."""
    from slurm_mapa.replay.cli import main as replay_main

    log = cluster.run("sacct", "-a", "-P", "-o", SACCT_FIELDS, "-j", ",".join(map(str, ids)))
    path = tmp_path / "cluster-sacct.txt"
    path.write_text(log)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert replay_main(["run", str(path), "--cluster", "dgx1:dgx1-v100", "--policies", policies, "--json"]) == 0
    return json.loads(buffer.getvalue())["recorded_decisions"], log


def test_a_job_sequence_gets_exactly_what_mapa_select_gives(cluster):
    """Jobs of mixed sizes and sensitivities on the mock DGX-1, some ending in between."""
    _assert_ledger_empties(cluster, "dgx1", timeout=60)  # the expected choices assume an idle node
    steps = [("A", 2, True), ("B", 1, False), ("C", 3, True), ("release", "A"), ("D", 2, False),
             ("E", 2, True), ("release", "C"), ("F", 3, True), ("release", "B")]
    ids, _ = _run_job_sequence(cluster, "preserve", steps)
    for name, jobid in ids.items():
        rec = cluster.wait_sacct(jobid, ("AdminComment",), AdminComment=lambda v: " # dgx1=" in v)
        assert rec["AdminComment"].startswith("mapa:topology=ring sensitive=")
    _assert_ledger_empties(cluster, "dgx1")


def test_a_bad_directive_is_rejected_at_submit_time(cluster):
    bad = "#!/bin/bash\n#SBATCH --gres=gpu:1\n#MAPA topology=rnig\nhostname\n"
    with pytest.raises(cluster.Error) as rejected:
        cluster.sbatch(bad, "-w", "dgx1")
    assert "MAPA: line 3: unknown topology 'rnig' (accepted: ring, chain, tree" in str(rejected.value)
    proc = cluster.exec("slurmctld", ["srun", "-w", "dgx1", "--gres=gpu:1", "--comment=mapa:topology=rnig", "hostname"],
                        user="alice", check=False)
    assert proc.returncode != 0
    assert "MAPA: unknown topology 'rnig'" in proc.stderr


def test_srun_with_a_comment_directive_gets_mapa_gpus(cluster):
    proc = cluster.exec("slurmctld", ["srun", "-w", "dgx1", "--gres=gpu:2", "--comment=mapa:topology=ring sensitive=yes",
                                      "bash", "-c", "echo cvd=$CUDA_VISIBLE_DEVICES"], user="alice", timeout=90)
    gpus = tuple(int(g) for g in re.search(r"cvd=([0-9,]+)", proc.stdout).group(1).split(","))
    dgx = preset("dgx1-v100")
    assert dgx.link(*gpus).token == "NV2"  # a sensitive pair on an idle DGX-1 gets a double NVLink


CONCURRENT_JOB = """#!/bin/bash
#SBATCH --gres=gpu:{gpus}
#MAPA topology=ring sensitive={sensitive}
echo "start $(date +%s%N) $CUDA_VISIBLE_DEVICES"
sleep 1
echo "end $(date +%s%N)"
"""


def test_forty_jobs_at_once_never_share_a_gpu(cluster):
    jobids = [cluster.sbatch(CONCURRENT_JOB.format(gpus=1 + i % 2, sensitive="yes" if i % 3 else "no"), "-w", "dgx1")
              for i in range(40)]
    intervals = []
    for i, jobid in enumerate(jobids):
        cluster.wait_state(jobid, "COMPLETED", timeout=240)
        out = cluster.output(jobid)
        start = re.search(r"^start (\d+) ([0-9,]+)$", out, re.M)
        end = re.search(r"^end (\d+)$", out, re.M)
        assert start and end, out
        gpus = {int(g) for g in start.group(2).split(",")}
        assert len(gpus) == 1 + i % 2
        intervals.append((int(start.group(1)), int(end.group(1)), gpus, jobid))
    for a in range(len(intervals)):
        for b in range(a + 1, len(intervals)):
            s1, e1, g1, j1 = intervals[a]
            s2, e2, g2, j2 = intervals[b]
            if s1 < e2 and s2 < e1:
                assert not g1 & g2, f"jobs {j1} and {j2} ran at once on GPUs {g1 & g2}"
    _assert_ledger_empties(cluster, "dgx1", timeout=30)


def test_a_corrupt_ledger_is_rebuilt_without_double_assignment(cluster):
    first = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", "summit1")
    cluster.wait_state(first, "RUNNING")
    first_gpus = _cvd(cluster, first)
    cluster.exec("summit1", ["sh", "-c", "printf '{ torn' > /var/lib/slurm-mapa/ledger.json"])
    second = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", "summit1")
    cluster.wait_state(second, "RUNNING")
    second_gpus = _cvd(cluster, second)
    assert len(second_gpus) == 2 and not set(first_gpus) & set(second_gpus)
    log = cluster.exec("summit1", ["cat", "/var/log/slurm-mapa.log"]).stdout
    assert f"job {second}: ledger /var/lib/slurm-mapa/ledger.json is corrupt" in log
    _release(cluster, first)
    _release(cluster, second)
    _assert_ledger_empties(cluster, "summit1")


def test_a_node_without_topology_falls_back_to_slurms_gpus(cluster):
    node = "summit1"
    cluster.exec(node, ["sed", "-i", "/^\"summit1\"/d", "/etc/slurm/mapa.toml"])
    try:
        jobid = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", node)
        cluster.wait_state(jobid, "RUNNING")
        seen = _cvd(cluster, jobid)
        slurm = re.search(r"^slurm=([0-9,]+)$", cluster.output(jobid), re.M).group(1)
        assert seen == tuple(int(g) for g in slurm.split(","))
        decision = parse_decisions(_admin_comment(cluster, jobid))[node]
        assert decision.policy == "fallback" and decision.fallback == "no-topology"
        _release(cluster, jobid)
    finally:
        cluster.exec(node, ["install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml"])
    log = cluster.exec(node, ["cat", "/var/log/slurm-mapa.log"]).stdout
    assert f"job {jobid} on {node}: {node}=" in log and "FALLBACK because no-topology" in log


MULTI_NODE_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2
#MAPA topology=ring sensitive=yes
srun --ntasks-per-node=1 bash -c 'echo "node=$(hostname) cvd=$CUDA_VISIBLE_DEVICES"'
"""


def test_a_multi_node_job_gets_a_mapa_choice_on_each_node(cluster):
    jobid = cluster.sbatch(MULTI_NODE_JOB, "-N", "2", "-w", "dgx1,summit1")
    cluster.wait_state(jobid, "COMPLETED", timeout=90)
    seen = dict(re.findall(r"^node=(\S+) cvd=([0-9,]+)$", cluster.output(jobid), re.M))
    decisions = parse_decisions(cluster.wait_sacct(jobid, ("AdminComment",), AdminComment=lambda v: v.count(" # ") == 2)["AdminComment"])
    assert set(decisions) == {"dgx1", "summit1"}
    for node, decision in decisions.items():
        assert decision.policy == "preserve"
        assert seen[node] == ",".join(map(str, decision.gpus))
    assert preset("dgx1-v100").link(*decisions["dgx1"].gpus).token == "NV2"
    assert preset("summit").link(*decisions["summit1"].gpus).token == "NV2"


DISCOVER = ("import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; "
            "sys.exit(main(['topo', 'discover', '--source', 'nvidia-smi', '--json']))")


@pytest.mark.parametrize("node", ["dgx1", "torus1", "summit1"])
def test_discovery_on_each_mock_node_reproduces_its_preset(cluster, node):
    """`mapa topo discover` on the node reads its (mock) nvidia-smi and gets the node's server back."""
    name, _ = cluster.nodes[node]
    found = json.loads(cluster.exec(node, ["python3", "-I", "-c", DISCOVER]).stdout)
    expected = preset(name)
    assert found["gpus"] == expected.size
    assert found["links"] == expected.link_tokens()


def test_the_clusters_sacct_log_replays_and_preserve_matches_the_recorded_decisions(cluster, tmp_path):
    # No waiting for an idle node or for distinct seconds: the audit takes each decision's free set
    # from its record, not from sacct's whole-second times.
    ids = []
    for gpus, sensitive in [(2, True), (1, False), (3, True)]:
        ids.append(cluster.sbatch(HOLDING_JOB.format(gpus=gpus, sensitive="yes" if sensitive else "no"), "-w", "dgx1"))
        cluster.wait_state(ids[-1], "RUNNING")
        _cvd(cluster, ids[-1])
    _release(cluster, ids[1])
    ids.append(cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", "dgx1"))
    cluster.wait_state(ids[-1], "RUNNING")
    _cvd(cluster, ids[-1])
    for jobid in (ids[0], ids[2], ids[3]):
        _release(cluster, jobid)
    for jobid in ids:
        cluster.wait_sacct(jobid, ("AdminComment", "State"), State="COMPLETED", AdminComment=lambda v: " # dgx1=" in v)
    audit, log = _replayed_audit(cluster, ids, tmp_path, "preserve,baseline")
    # Each decision is compared on the free set its Prolog recorded, not one rebuilt from times.
    assert audit["compared"] == len(ids) and audit["free_sets"]["recorded"] == len(ids), (audit, log)
    assert audit["policies"]["preserve"]["same_set"] == len(ids), (audit, log)


def test_preserve_ahead_decides_with_the_running_jobs_and_its_log_replays_exactly(cluster, tmp_path):
    """policy = preserve-ahead on the mock DGX-1: each Prolog hands the policy the ledger's running
    jobs, records them (running=), and the replay's audit re-makes every decision from sacct."""
    _assert_ledger_empties(cluster, "dgx1", timeout=60)
    base = cluster.exec("dgx1", ["cat", "/etc/slurm-mapa/config/mapa.toml"]).stdout
    assert 'policy = "preserve"\n' in base
    cluster.exec("dgx1", ["sh", "-c", "cat > /etc/slurm/mapa.toml"], input=base.replace('policy = "preserve"\n', 'policy = "preserve-ahead"\n'))
    try:
        steps = [("A", 3, False), ("B", 2, False), ("C", 2, False), ("release", "A"), ("D", 2, True)]
        ids, running_mattered = _run_job_sequence(cluster, "preserve-ahead", steps)
        assert running_mattered >= 1  # the sequence would not tell a policy blind to running jobs apart
        for jobid in ids.values():
            cluster.wait_sacct(jobid, ("AdminComment", "State"), State="COMPLETED", AdminComment=lambda v: " # dgx1=" in v)
        audit, log = _replayed_audit(cluster, ids.values(), tmp_path, "preserve-ahead,preserve")
        assert audit["compared"] == len(ids) and audit["policies"]["preserve-ahead"]["same_set"] == len(ids), (audit, log)
    finally:
        _restore_node_config(cluster, "dgx1")
    _assert_ledger_empties(cluster, "dgx1")


def _set_node_config(cluster, node: str, extra: str) -> None:
    """The node's hook config with ``extra`` top-level keys put first."""
    base = cluster.exec(node, ["cat", "/etc/slurm-mapa/config/mapa.toml"]).stdout
    cluster.exec(node, ["sh", "-c", "cat > /etc/slurm/mapa.toml"], input=extra + "\n" + base)


def _restore_node_config(cluster, node: str) -> None:
    cluster.exec(node, ["install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml"])


AGENT = "slurm_mapa.slurm.agent import main"


def _wait_for(cluster, node: str, argv: list[str], what: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (found := cluster.exec(node, argv, check=False)).returncode != 0:
        if time.monotonic() > deadline:
            raise cluster.Error(what)
        time.sleep(0.1)
    return found.stdout


def test_a_prolog_killed_midway_loses_no_gpu(cluster):
    """Both Prolog paths are SIGKILLed while they wait for squeue: first mapa-agent (the wrapper
    then runs the Prolog in-process), then that in-process Prolog. The job runs on Slurm's GPUs,
    and the next Prolog (the restarted agent's) adopts them instead of handing them out again."""
    node = "summit1"
    cluster.exec(node, ["sh", "-c", "printf '#!/bin/sh\\nsleep 4\\nexec /usr/bin/squeue \"$@\"\\n' > /usr/local/bin/slow-squeue"
                                    " && chmod 755 /usr/local/bin/slow-squeue"])
    _set_node_config(cluster, node, 'squeue = "/usr/local/bin/slow-squeue"')  # within command_timeout (5 s)
    try:
        first = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", node)
        agent = _wait_for(cluster, node, ["pgrep", "-f", AGENT], "no mapa-agent runs").split()
        _wait_for(cluster, node, ["pgrep", "-P", ",".join(agent), "-f", "slow-squeue"], "the agent never reached squeue")
        cluster.exec(node, ["pkill", "-KILL", "-f", AGENT])
        in_process = _wait_for(cluster, node, ["pgrep", "-f", "prolog_main"], "the wrapper did not run the Prolog in-process").split()
        _wait_for(cluster, node, ["pgrep", "-P", ",".join(in_process), "-f", "slow-squeue"], "the in-process Prolog never reached squeue")
        cluster.exec(node, ["pkill", "-KILL", "-f", "prolog_main"])
    finally:
        _restore_node_config(cluster, node)
    cluster.wait_state(first, "RUNNING")
    first_gpus = _cvd(cluster, first)
    slurm = re.search(r"^slurm=([0-9,]+)$", cluster.output(first), re.M).group(1)
    assert first_gpus == tuple(int(g) for g in slurm.split(",")) and len(first_gpus) == 2
    assert cluster.node(node)["state"] != ["DRAIN"] and "DRAIN" not in cluster.node(node)["state"]
    _wait_for(cluster, node, ["test", "-S", "/run/slurm-mapa-agent/agent.sock"], "mapa-agent did not come back")
    second = cluster.sbatch(HOLDING_JOB.format(gpus=2, sensitive="yes"), "-w", node)
    cluster.wait_state(second, "RUNNING")
    second_gpus = _cvd(cluster, second)
    assert not set(first_gpus) & set(second_gpus)
    log = cluster.exec(node, ["cat", "/var/log/slurm-mapa.log"]).stdout
    assert f"adopted job {first} with Slurm's GPUs {','.join(map(str, first_gpus))}" in log
    _release(cluster, first)
    _release(cluster, second)
    _assert_ledger_empties(cluster, node)


def _assert_ledger_empties(cluster, node: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _ledger(cluster, node) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _ledger(cluster, node)
    log = cluster.exec(node, ["tail", "-n", "15", "/var/log/slurm-mapa.log"], check=False).stdout
    assert left == {}, f"ledger of {node} still holds {left}; log:\n{log}"


def test_slurmd_restarted_during_a_job(cluster):
    node = "torus1"
    first = cluster.sbatch(HOLDING_JOB.format(gpus=4, sensitive="yes"), "-w", node)
    cluster.wait_state(first, "RUNNING")
    first_gpus = _cvd(cluster, first)
    old_pid = cluster.exec(node, ["pgrep", "-x", "slurmd"]).stdout.split()
    cluster.exec(node, ["pkill", "-x", "slurmd"])
    deadline = time.monotonic() + 60
    while True:
        pid = cluster.exec(node, ["pgrep", "-x", "slurmd"], check=False).stdout.split()
        if pid and pid != old_pid:
            break
        if time.monotonic() > deadline:
            raise cluster.Error("slurmd did not come back")
        time.sleep(0.5)
    cluster.wait_node(node, lambda state: "NOT_RESPONDING" not in state and state & {"MIXED", "ALLOCATED"}, timeout=60,
                      what="responding with the job")
    assert cluster.state(first) == "RUNNING"
    second = cluster.sbatch(HOLDING_JOB.format(gpus=4, sensitive="yes"), "-w", node)
    cluster.wait_state(second, "RUNNING")
    second_gpus = _cvd(cluster, second)
    assert len(second_gpus) == 4 and not set(first_gpus) & set(second_gpus)
    _release(cluster, first)
    _release(cluster, second)
    _assert_ledger_empties(cluster, node)


STEP_JOB = """#!/bin/bash
#SBATCH --gres=gpu:4
#MAPA topology=ring sensitive=yes
echo "job=$MAPA_GPUS"
srun -n1 --gres=gpu:2 bash -c 'echo "step=$CUDA_VISIBLE_DEVICES"'
"""


def test_a_step_asking_for_fewer_gpus_gets_the_first_in_pattern_order(cluster):
    jobid = cluster.sbatch(STEP_JOB, "-w", "dgx1")
    cluster.wait_state(jobid, "COMPLETED", timeout=90)
    out = cluster.output(jobid)
    job = re.search(r"^job=([0-9,]+)$", out, re.M).group(1).split(",")
    step = re.search(r"^step=([0-9,]+)$", out, re.M).group(1).split(",")
    assert len(job) == 4 and step == job[:2], out
