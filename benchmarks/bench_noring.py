"""What `insensitive_jobs = "noring"` costs Slurm's scheduler under a busy queue (issue 40), in the
mini cluster (scripts/cluster up first).

Usage: python benchmarks/bench_noring.py [--jobs 60] [--rounds 2] [--sleep 5]

Each round submits ``--jobs`` two-GPU insensitive jobs (`#MAPA topology=ring sensitive=no`, each
sleeping ``--sleep`` seconds) at once to the default partition, unpinned, more than the five mock
nodes hold at once (46 GPUs: 23 such jobs), under two job_submit.lua settings alternating round
by round:

* none: the shipped plugin (insensitive jobs get no preference);
* noring: the plugin written from the same mapa.toml with `insensitive_jobs = "noring"` in
  `[features]` (`mapa job-submit-lua`), so each job gets `--prefer=mapa_noring2`: on an idle
  cluster no node has that feature active (every node has a good 2-ring free), and Slurm's main
  scheduler first finds no node for the preference before it places the job without it.

Per job: submit (the loop's clock just before its sbatch) and start (its first command); per
burst: first submit to last end. Prints a Markdown table per setting. (slurmctld says it found no
node for a preference only at debug level, so its log is not counted here.)
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time

CLUSTER = "mapa"
CONTROLLER = "slurmctld"
JOB_DIR = "/shared/jobs"
SHIPPED_TOML = "/etc/slurm/mapa.toml"
NORING_TOML = "/tmp/bench-noring-mapa.toml"
LUA = "/etc/slurm/job_submit.lua"
JOB = ("#!/bin/bash\n#SBATCH --gres=gpu:2\n#MAPA topology=ring sensitive=no\necho \"start $(date +%s.%N)\"\n"
       "sleep {sleep}\necho \"end $(date +%s.%N)\"\n")


def docker(*argv: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "exec", "-i", f"{CLUSTER}-{CONTROLLER}", *argv], input=input, capture_output=True,
                          text=True, check=check, timeout=300)


def switch(setting: str) -> None:
    """job_submit.lua for ``setting`` (slurmctld reads the script again when it changes)."""
    toml = SHIPPED_TOML
    if setting == "noring":
        shipped = docker("cat", SHIPPED_TOML).stdout
        assert "[features]\n" in shipped and "insensitive_jobs" not in shipped, "the shipped mapa.toml changed"
        docker("sh", "-c", f"cat > {NORING_TOML}", input=shipped.replace("[features]\n", "[features]\ninsensitive_jobs = \"noring\"\n", 1))
        toml = NORING_TOML
    docker("mapa", "job-submit-lua", LUA, "--config", toml)
    docker("scontrol", "reconfigure")
    # The preference a held probe gets says the plugin in force.
    deadline = time.monotonic() + 60
    while True:
        probe = docker("runuser", "-u", "alice", "--", "sbatch", "--parsable", "--hold", f"--chdir={JOB_DIR}", "-o", "/dev/null",
                       input=JOB.format(sleep=0), check=False).stdout.strip().split(";")[0]
        shown = docker("scontrol", "--oneliner", "show", "job", probe, check=False).stdout
        docker("scancel", probe, check=False)
        prefer = re.search(r"(?:^|\s)Prefer=(\S*)", shown)
        if (prefer.group(1) if prefer else "(null)") == ("mapa_noring2" if setting == "noring" else "(null)"):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"job_submit.lua did not take the {setting} setting: {shown[:300]}")
        time.sleep(1)


def burst(jobs: int, sleep: float) -> dict:
    docker("sh", "-c", "cat > /tmp/noring-job.sh && chmod 644 /tmp/noring-job.sh", input=JOB.format(sleep=sleep))
    loop = (f"cd {JOB_DIR} && for i in $(seq {jobs}); do t=$(date +%s.%N); "
            f"id=$(sbatch --parsable --chdir={JOB_DIR} -o {JOB_DIR}/noring-%j.out < /tmp/noring-job.sh) && echo \"$id $t\"; done")
    out = docker("runuser", "-u", "alice", "--", "sh", "-c", loop).stdout
    submitted = {int(job.split(";")[0]): float(t) for job, t in (line.split() for line in out.splitlines())}
    ids = ",".join(map(str, submitted))
    deadline = time.monotonic() + 900
    while docker("squeue", "-h", "-j", ids, "-o", "%i", check=False).stdout.strip():
        if time.monotonic() > deadline:
            raise SystemExit(f"jobs {ids} were still queued or running 15 minutes after they were submitted")
        time.sleep(0.5)
    starts, ends = {}, {}
    for job in submitted:
        text = docker("cat", f"{JOB_DIR}/noring-{job}.out", check=False).stdout
        if (match := re.search(r"^start (\d+\.\d+)$", text, re.M)):
            starts[job] = float(match.group(1))
        if (match := re.search(r"^end (\d+\.\d+)$", text, re.M)):
            ends[job] = float(match.group(1))
    docker("sh", "-c", f"rm -f {JOB_DIR}/noring-*.out")
    return {"submitted": submitted, "started": starts, "ended": ends}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=5.0)
    args = parser.parse_args()
    from needs import mini_cluster

    mini_cluster("bench_noring.py", f"{CLUSTER}-{CONTROLLER}")
    results: dict[str, list[dict]] = {"none": [], "noring": []}
    began = time.monotonic()
    try:
        for round_ in range(args.rounds):
            for setting in (("none", "noring") if round_ % 2 == 0 else ("noring", "none")):
                switch(setting)
                results[setting].append(burst(args.jobs, args.sleep))
                print(f"round {round_ + 1}, {setting}: done", flush=True)
    finally:
        switch("none")
    print(f"\n{args.jobs} two-GPU insensitive jobs per burst, {args.sleep:g} s each, {args.rounds} rounds; "
          f"{time.monotonic() - began:.0f} s in all\n")
    print("| setting | jobs started | submit->start median s | p90 s | max s | first submit->last end s (per round) |")
    print("|---|---|---|---|---|---|")
    for setting, bursts in results.items():
        waits = [b["started"][j] - t for b in bursts for j, t in b["submitted"].items() if j in b["started"]]
        total = sum(len(b["submitted"]) for b in bursts)
        spans = [max(b["ended"].values()) - min(b["submitted"].values()) for b in bursts if b["ended"]]
        ordered = sorted(waits)
        print(f"| {setting} | {len(waits)}/{total} | {statistics.median(waits):.2f} | {ordered[int(0.9 * (len(ordered) - 1))]:.2f} | "
              f"{ordered[-1]:.2f} | {', '.join(f'{s:.1f}' for s in spans)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
