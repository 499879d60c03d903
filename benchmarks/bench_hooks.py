"""What the hooks add to a job's start, measured in the mini cluster (scripts/cluster up first).

Usage: python benchmarks/bench_hooks.py [--runs N] [--jobs N]

On the mock DGX-1 node, with a real job running (so scontrol and squeue answer for real), it times
side by side in one loop, each started as slurmd starts them (the wrappers `mapa hooks` wrote): an empty hook (/bin/true, what a job
pays with hooks off), the Prolog and Epilog wrappers with the node's mapa-agent (the normal path),
the same wrappers with the agent out of reach (they run the hooks in-process), and the TaskProlog.
Runs are a quarter second apart (untimed), so each measures one job's start on a quiet node.
Every Prolog run decides for the job afresh (a re-run Prolog replaces its own entry), so each
pays the full path: the directive from SLURM_JOB_COMMENT (as job_submit.lua leaves it; the mini
cluster sets job_submit_lua = true), the decision, the ledger, the journal; with the agent the
AdminComment is written after the answer, in-process before the hook exits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess

RUNNER = r"""
import json, os, subprocess, sys, time
job, gpus, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = {"SLURM_JOB_ID": job, "SLURMD_NODENAME": "dgx1", "SLURM_JOB_GPUS": gpus, "SLURM_JOB_COMMENT": "mapa:topology=ring sensitive=yes"}
no_agent = {**env, "MAPA_AGENT_SOCKET": "/nonexistent/agent.sock"}
task_env = {"SLURM_JOB_ID": job, "PATH": "/usr/bin:/bin"}
hooks = {
    "no hook (/bin/true)": (["/bin/true"], env),
    "prolog, agent": (["/usr/local/sbin/mapa-prolog-wrapper"], env),
    "prolog, in-process": (["/usr/local/sbin/mapa-prolog-wrapper"], no_agent),
    "epilog, agent": (["/usr/local/sbin/mapa-epilog-wrapper"], env),
    "epilog, in-process": (["/usr/local/sbin/mapa-epilog-wrapper"], no_agent),
    "taskprolog": (["/usr/local/sbin/mapa-taskprolog"], task_env),
}
times = {name: [] for name in hooks}
for _ in range(runs):
    for name, (argv, e) in hooks.items():
        # Untimed: let the previous hook's trailing work (the agent's AdminComment write) finish,
        # as it does between real job starts; this measures one job's start, not a storm.
        time.sleep(0.25)
        start = time.perf_counter()
        subprocess.run(argv, env=e, check=True, stdout=subprocess.DEVNULL)
        times[name].append((time.perf_counter() - start) * 1000)
print(json.dumps(times))
"""


SUBMIT = r"""
import subprocess, sys, time
t0 = time.time()
job = subprocess.run(
    ["runuser", "-u", "alice", "--", "sbatch", "--parsable", "--wait", "-w", "dgx1", "--gres=gpu:2", "--chdir=/shared/jobs",
     "-o", "/shared/jobs/bench-e2e-%j.out"],
    input="#!/bin/bash\n#MAPA topology=ring sensitive=yes\ndate +%s.%N\n", capture_output=True, text=True, check=True,
).stdout.strip()
with open(f"/shared/jobs/bench-e2e-{job}.out") as handle:
    print((float(handle.read().split()[0]) - t0) * 1000)
"""
HOOK_FILES = ("mapa-prolog-wrapper", "mapa-epilog-wrapper", "mapa-taskprolog")


def set_hooks(on: bool) -> None:
    """Put the node's real hooks back, or replace them with empty ones (atomically, as slurmd may run them)."""
    script = "; ".join(
        f"cp /tmp/bench-real-{name} /usr/local/sbin/.{name}.tmp && mv /usr/local/sbin/.{name}.tmp /usr/local/sbin/{name}"
        if on else
        f"printf '#!/bin/sh\\nexit 0\\n' > /usr/local/sbin/.{name}.tmp && chmod 755 /usr/local/sbin/.{name}.tmp && mv /usr/local/sbin/.{name}.tmp /usr/local/sbin/{name}"
        for name in HOOK_FILES
    )
    docker("mapa-dgx1", "sh", "-c", script)


def end_to_end(pairs: int) -> None:
    docker("mapa-dgx1", "sh", "-c", "; ".join(f"cp -p /usr/local/sbin/{n} /tmp/bench-real-{n}" for n in HOOK_FILES))
    times: dict[str, list[float]] = {"hooks on": [], "hooks off": []}
    try:
        for i in range(pairs):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                set_hooks(on)
                times["hooks on" if on else "hooks off"].append(float(docker("mapa-slurmctld", "python3", "-c", SUBMIT)))
    finally:
        set_hooks(True)
    print(f"\n{pairs} one-job submissions each, hooks on and off alternating, mock DGX-1 node\n")
    print("| hooks | median ms (submit to the job's first command) | p10 ms | p90 ms |")
    print("|---|---|---|---|")
    for name, values in times.items():
        values.sort()
        q = lambda f: values[int(f * (len(values) - 1))]  # noqa: E731
        print(f"| {name} | {statistics.median(values):.0f} | {q(0.1):.0f} | {q(0.9):.0f} |")
    # Slurm's own start-up delay varies by seconds, so say how sure the difference is: a bootstrap
    # 95% interval of the difference of the medians.
    rng = random.Random(1)
    on, off = times["hooks on"], times["hooks off"]
    diffs = sorted(
        statistics.median(rng.choices(on, k=len(on))) - statistics.median(rng.choices(off, k=len(off))) for _ in range(2000)
    )
    print(f"\nmedian added by the hooks: {statistics.median(on) - statistics.median(off):.0f} ms "
          f"(95% bootstrap interval {diffs[50]:.0f} to {diffs[1949]:.0f} ms)")


def docker(*argv: str, input: str | None = None) -> str:
    return subprocess.run(["docker", "exec", "-i", *argv], input=input, capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=0, help="also time N whole job starts with hooks on and N with hooks off")
    args = parser.parse_args()
    job = docker("mapa-slurmctld", "runuser", "-u", "alice", "--", "sbatch", "--parsable", "-w", "dgx1", "--gres=gpu:2",
                 "--chdir=/shared/jobs", "--wrap", "sleep 600").strip()
    try:
        for _ in range(100):
            state = json.loads(docker("mapa-slurmctld", "scontrol", "--json", "show", "job", job))["jobs"][0]["job_state"]
            if "RUNNING" in state:
                break
            subprocess.run(["sleep", "0.2"], check=True)
        times = json.loads(docker("mapa-dgx1", "python3", "-c", RUNNER, job, "0,1", str(args.runs)))  # its Slurm GPUs on an idle node
    finally:
        docker("mapa-slurmctld", "scancel", job)
    print(f"{args.runs} runs each, interleaved, on the mock DGX-1 node (container on this machine)\n")
    print("| hook | median ms | p90 ms |")
    print("|---|---|---|")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {statistics.median(values):.1f} | {values[int(0.9 * (len(values) - 1))]:.1f} |")
    empty = statistics.median(times["no hook (/bin/true)"])
    for path in ("agent", "in-process"):
        start = statistics.median(times[f"prolog, {path}"]) - empty
        end = statistics.median(times[f"epilog, {path}"]) - empty
        print(f"\n{path}: added to a job's start (Prolog over an empty hook) {start:.1f} ms; at its end (Epilog) {end:.1f} ms")
    if args.jobs:
        end_to_end(args.jobs)


if __name__ == "__main__":
    main()
