"""What MAPA asks of slurmctld per job start, counted by slurmctld itself (sdiag), in the mini cluster.

Usage (scripts/cluster up first): python benchmarks/bench_ctld.py [--jobs 20]

It first counts, over an idle --idle seconds, what the agents' reconcile passes send. Then for
each setting it resets sdiag's counters, submits --jobs one-GPU jobs to every mock node (as
alice; the harness then waits on the jobs' output files, not on slurmctld), waits for mapa-agent
to write the AdminComment records, and reads the RPC counts by message type that MAPA's calls
make, less the reconcile passes' share of that time:
REQUEST_JOB_INFO_SINGLE (`scontrol show job`), REQUEST_JOB_INFO (`squeue`), REQUEST_UPDATE_JOB
(`scontrol update`), REQUEST_BATCH_SCRIPT (`scontrol write batch_script`). Settings:

* plugin: job_submit_lua = true, jobs with a `#MAPA` line (the directive reaches the Prolog in the
  job comment);
* no plugin: job_submit_lua = false, jobs without a directive in their comment (the Prolog reads
  the batch script: the one call left on the start path).

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

NODES = ("dgx1", "torus1", "summit1", "mi250x1")
TYPES = ("REQUEST_JOB_INFO_SINGLE", "REQUEST_JOB_INFO", "REQUEST_UPDATE_JOB", "REQUEST_BATCH_SCRIPT")
JOB = "#!/bin/bash\n#SBATCH --gres=gpu:1\n{directive}\ntrue\n"


def docker(container: str, *argv: str, input: str | None = None) -> str:
    return subprocess.run(["docker", "exec", "-i", container, *argv], input=input, capture_output=True, text=True, check=True).stdout


def counts() -> dict[str, int]:
    text = docker("mapa-slurmctld", "sdiag")
    section = text.split("by message type", 1)[1].split("Remote Procedure Call statistics by user", 1)[0]
    found = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)", section, re.M)}
    return {t: found.get(t, 0) for t in TYPES}


def set_config(job_submit_lua: bool) -> None:
    for node in NODES:
        base = docker(f"mapa-{node}", "cat", "/etc/slurm-mapa/config/mapa.toml")
        text = re.sub(r"^job_submit_lua = .*$", f"job_submit_lua = {'true' if job_submit_lua else 'false'}", base, flags=re.M)
        docker(f"mapa-{node}", "sh", "-c", "cat > /etc/slurm/mapa.toml", input=text)


def run_jobs(jobs: int, directive: str) -> None:
    """Submit (one RPC each, as alice) and wait on the jobs' output files, not on slurmctld."""
    script = JOB.format(directive=directive).replace("true\n", "echo done\n")
    ids = [docker("mapa-slurmctld", "runuser", "-u", "alice", "--", "sbatch", "--parsable", "-w", node, "--chdir=/shared/jobs",
                  "-o", "/shared/jobs/ctld-%j.out", input=script).strip()
           for _ in range(jobs) for node in NODES]
    check = " && ".join(f"grep -qs done /shared/jobs/ctld-{job}.out" for job in ids)
    deadline = time.monotonic() + 600
    while subprocess.run(["docker", "exec", "mapa-slurmctld", "sh", "-c", check]).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit("the jobs did not finish within 10 minutes")
        time.sleep(1)


def measure(jobs: int, job_submit_lua: bool, directive: str, idle_rate: dict[str, float]) -> dict[str, float]:
    """RPCs per job start, less what the reconcile passes send in the same time (``idle_rate``, per second)."""
    set_config(job_submit_lua)
    docker("mapa-slurmctld", "sdiag", "-r")
    started = time.monotonic()
    run_jobs(jobs, directive)
    time.sleep(3)  # the agents' AdminComment records, written just after each start
    elapsed = time.monotonic() - started
    total = counts()
    return {t: (total[t] - idle_rate[t] * elapsed) / (jobs * len(NODES)) for t in TYPES} | {"seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="jobs per node per setting")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of an idle cluster to count the reconcile passes")
    args = parser.parse_args()
    try:
        set_config(True)
        docker("mapa-slurmctld", "sdiag", "-r")
        time.sleep(args.idle)
        idle = counts()
        idle_rate = {t: idle[t] / args.idle for t in TYPES}
        rows = {
            "plugin (job_submit_lua = true, #MAPA jobs)": measure(args.jobs, True, "#MAPA topology=ring sensitive=yes", idle_rate),
            "no plugin (job_submit_lua = false, jobs without a directive)": measure(args.jobs, False, "# no directive", idle_rate),
        }
    finally:
        set_config(True)
    print(f"{args.jobs} one-GPU jobs on each of {len(NODES)} mock nodes per setting; RPCs per job start as sdiag counts them\n")
    print("| setting | " + " | ".join(TYPES) + " |")
    print("|---|" + "---|" * len(TYPES))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[t]:.2f}" for t in TYPES) + " |")
    interval = docker("mapa-dgx1", "sh", "-c", "grep '^reconcile_interval' /etc/slurm/mapa.toml || echo 'reconcile_interval = 60'")
    print(f"\nidle cluster, {args.idle:.0f} s, {len(NODES)} nodes ({interval.strip()}): "
          + ", ".join(f"{t} {idle[t]}" for t in TYPES))


if __name__ == "__main__":
    main()
