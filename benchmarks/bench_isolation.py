"""What device isolation adds to a task's start, measured in the running mini cluster.

    scripts/cluster up
    .venv/bin/python benchmarks/bench_isolation.py --rounds 10 --steps 10

In each round, node dgx1's mapa.toml is set to ``isolation = "off"`` and then ``"fail-open"``
(`mapa hooks` is run again each time, as an admin must), and ``--steps`` one-GPU ``srun`` steps run
one after another inside one allocation of the node (``salloc``), each timed from srun's start to
its end inside the controller's container. The two settings alternate round by round, so both see
the same machine noise; the report gives the median and 90th percentile of each and the
difference of the medians. Everything else in a step (srun, slurmd, slurmstepd, the TaskProlog
without isolation) is the same in both, so the difference is what isolation adds: the Python
client's start, one request to mapa-agent, and the cgroup writes (on the first task of a job).
The shipped config is put back at the end.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

NODE = "dgx1"
HOOKS = ("import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; "
         "sys.exit(main(sys.argv[1:]))")
STEPS = """
for i in $(seq {steps}); do
  start=$(date +%s%N)
  srun -n1 --gres=gpu:1 true
  echo "step $(( ($(date +%s%N) - start) / 1000 ))"
done
"""


def docker(container: str, *argv: str, input: str | None = None) -> str:
    done = subprocess.run(["docker", "exec", "-i", f"mapa-{container}", *argv], input=input, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} on {container} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def set_isolation(mode: str) -> None:
    base = docker(NODE, "cat", "/etc/slurm-mapa/config/mapa.toml")
    if 'isolation = "auto"\n' not in base:
        raise SystemExit("the shipped mapa.toml has no line isolation = \"auto\"")
    docker(NODE, "sh", "-c", "cat > /etc/slurm/mapa.toml", input=base.replace('isolation = "auto"\n', f'isolation = "{mode}"\n'))
    docker(NODE, "/usr/bin/python3", "-I", "-X", "pycache_prefix=/var/cache/slurm-mapa/pycache", "-c", HOOKS, "hooks",
           "/usr/local/sbin", "--python", "/usr/bin/python3", "--config", "/etc/slurm/mapa.toml",
           "--pycache-prefix", "/var/cache/slurm-mapa/pycache")


def steps_ms(steps: int) -> list[float]:
    out = docker("slurmctld", "runuser", "-u", "alice", "--", "salloc", "-w", NODE, "--gres=gpu:1", "--chdir=/tmp",
                 "bash", "-c", STEPS.format(steps=steps))
    return [int(line.split()[1]) / 1000 for line in out.splitlines() if line.startswith("step ")]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "fail-open": []}
    started = time.monotonic()
    try:
        for _ in range(args.rounds):
            for mode in times:
                set_isolation(mode)
                times[mode] += steps_ms(args.steps)[1:]  # the first step of an allocation also waits for the Prolog
    finally:
        docker(NODE, "install", "-m", "644", "/etc/slurm-mapa/config/mapa.toml", "/etc/slurm/mapa.toml")
        set_isolation("off")
    print(f"machine: {platform.platform()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} CPUs; "
          f"{args.rounds} rounds x {args.steps - 1} timed steps per setting; {time.monotonic() - started:.0f} s")
    for mode, values in times.items():
        print(f"isolation={mode:9s}  steps={len(values):4d}  median={statistics.median(values):7.1f} ms  p90={quantile(values, 0.9):7.1f} ms")
    added = statistics.median(times["fail-open"]) - statistics.median(times["off"])
    print(f"isolation adds {added:.1f} ms to the median one-task srun step")


if __name__ == "__main__":
    main()
