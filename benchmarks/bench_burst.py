"""Job start under a burst, MAPA on and off side by side, in the mini cluster (scripts/cluster up first).

Usage: python benchmarks/bench_burst.py [--per-node 1,4,8,16] [--rounds 2] [--settings on,off,empty,on-nofeatures,on-python]

Each round submits, for each burst size N, N one-GPU jobs to each mock node at once (one shell
loop of sbatch as alice, round-robin over the nodes, each job pinned with -w; every job carries
`#MAPA topology=ring sensitive=no`) under each setting, the settings alternating round by round:

* on: the shipped configuration (Prolog, Epilog, TaskProlog wrappers, the SPANK plugin, mapa-agent);
* on-nofeatures: as on, with mapa.toml's [features] table left out (what publishing node features
  costs under a burst);
* on-python: as on, with wrappers that ask mapa-agent through the Python client (`mapa hooks --cc
  none` on a node without --client: what a node without the compiled client runs);
* off: MAPA disabled as docs/admin.md, "Disabling MAPA", says (the agents stopped, the three hook
  lines and the plugin's plugstack.conf line removed, `scontrol reconfigure`);
* empty: as off, but slurm.conf names a Prolog, Epilog and TaskProlog that only `exit 0` (what any
  hook costs in slurmd: the floor under MAPA's hooks).

After each switch of setting, one unmeasured burst of one job per node (``--warm-up``) and a pause
(``--settle``): a reconfigure restarts slurmd and the 'on' setting restarts mapa-agent, whose first
jobs would otherwise pay cold caches that a node in service has warm.

Per job: submit (the loop's clock just before its sbatch), allocation (slurmctld's "Allocate
JobId=" or backfill's "Started JobId=" log line, docker's timestamp), start (the job's first
command, `date +%s.%N`). Per burst: first submit to the moment every job has left squeue (its
Epilog done; polled inside the controller's container). Prints Markdown tables: medians and tails
of submit -> start and allocation -> start per setting and burst size, and on's ratios to off with
a 90% bootstrap interval (the bursts of each setting drawn again) and round by round: the machine's
noise moves a single burst's median by more than MAPA does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import statistics
import subprocess
import sys
import time

CLUSTER = "mapa"
NODES = ("dgx1", "torus1", "summit1", "mi250x1", "dgx2")
CONTROLLER = "slurmctld"
JOB_DIR = "/shared/jobs"
SHIPPED = "/etc/slurm-mapa/config"
JOB = "#!/bin/bash\n#SBATCH --gres=gpu:1\n#MAPA topology=ring sensitive=no\necho \"start $(date +%s.%N)\"\n"
EMPTY_HOOK = "/usr/local/sbin/bench-empty-hook"
HOOK_LINE = re.compile(r"^(Prolog|Epilog|TaskProlog)=", re.M)
AGENT = "^/usr/bin/python3 .*slurm_mapa.slurm.agent.service import main"

# Stops the agent and its restart loop (SIGSTOP); prints the loop's pid (scripts/mini-cluster-stop-agent).
STOP_AGENT = ["sh", "/opt/slurm-mapa/scripts/mini-cluster-stop-agent"]


def container(name: str) -> str:
    return f"{CLUSTER}-{name}"


def docker(name: str, *argv: str, input: str | None = None, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "exec", "-i", container(name), *argv], input=input, capture_output=True, text=True,
                          check=check, timeout=timeout)


def configure(setting: str) -> None:
    """slurm.conf and plugstack.conf for ``setting`` on every container, as local files in place
    of the links to the shipped ones (on: the links again)."""
    for name in ("slurmdbd", CONTROLLER, *NODES):
        if setting == "on":
            docker(name, "sh", "-c", f"ln -sfn {SHIPPED}/slurm.conf /etc/slurm/slurm.conf && "
                                     f"ln -sfn {SHIPPED}/plugstack.conf /etc/slurm/plugstack.conf")
            continue
        conf = HOOK_LINE.sub("#", docker(name, "cat", f"{SHIPPED}/slurm.conf").stdout)
        if setting == "empty":
            conf += "".join(f"{hook}={EMPTY_HOOK}\n" for hook in ("Prolog", "Epilog", "TaskProlog"))
            docker(name, "sh", "-c", f"printf '#!/bin/sh\\nexit 0\\n' > {EMPTY_HOOK} && chmod 755 {EMPTY_HOOK}")
        plugstack = "".join(line for line in docker(name, "cat", f"{SHIPPED}/plugstack.conf").stdout.splitlines(True)
                            if "spank_mapa" not in line)
        docker(name, "sh", "-c", "cat > /etc/slurm/slurm.conf.new && mv -f /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf", input=conf)
        docker(name, "sh", "-c", "cat > /etc/slurm/plugstack.conf.new && mv -f /etc/slurm/plugstack.conf.new /etc/slurm/plugstack.conf",
               input=plugstack)


def slurmd_starts() -> dict[str, int]:
    nodes = json.loads(docker(CONTROLLER, "scontrol", "--json", "show", "node").stdout)["nodes"]
    found = {}
    for node in nodes:
        started = node["slurmd_start_time"]
        if isinstance(started, dict):
            started = started.get("number", 0)
        found[node["name"]] = (int(started or 0), set(node["state"]))
    return found


def reconfigure(hooks_wanted: bool, timeout: float = 120) -> None:
    """`scontrol reconfigure`, then wait until slurmctld shows the hooks wanted and every slurmd has
    restarted and is in service (since Slurm 23.11 a reconfigure restarts the daemons in place)."""
    before = slurmd_starts()
    docker(CONTROLLER, "scontrol", "reconfigure")
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(1)
        shown = docker(CONTROLLER, "scontrol", "show", "config", check=False)
        if shown.returncode == 0 and bool(re.search(r"^Prolog\S*\s*=\s*/", shown.stdout, re.M)) == hooks_wanted:
            try:
                now = slurmd_starts()
            except (subprocess.CalledProcessError, ValueError, KeyError):
                now = None
            if now and all(now[n][0] > before[n][0] and now[n][1] & {"IDLE", "MIXED", "ALLOCATED"}
                           and not now[n][1] & {"NOT_RESPONDING", "DOWN", "DRAIN"} for n in NODES):
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"the reconfigure was not live after {timeout:g} s")


def set_agents(running: bool, loops: dict[str, str]) -> None:
    for node in NODES:
        if running:
            if node in loops:
                docker(node, "kill", "-CONT", loops.pop(node))
            continue
        proc = docker(node, *STOP_AGENT, AGENT, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"could not stop mapa-agent on {node}: {proc.stderr.strip()}")
        loops[node] = proc.stdout.strip()
    if running:
        deadline = time.monotonic() + 60
        while any(docker(n, "grep", "-q", "/run/slurm-mapa-agent/agent.sock", "/proc/net/unix", check=False).returncode for n in NODES):
            if time.monotonic() > deadline:
                raise SystemExit("mapa-agent did not come back on every node")
            time.sleep(0.3)


MAPA_HOOKS = ["/usr/bin/python3", "-I", "-X", "pycache_prefix=/var/cache/slurm-mapa/pycache", "-c",
              "import sys; sys.path.insert(0, '/opt/slurm-mapa'); from slurm_mapa.cli import main; sys.exit(main(sys.argv[1:]))",
              "hooks", "/usr/local/sbin", "--python", "/usr/bin/python3", "--config", "/etc/slurm/mapa.toml",
              "--pycache-prefix", "/var/cache/slurm-mapa/pycache"]
CLIENT = "/usr/local/lib/slurm-mapa/mapa-hook-client"  # the image's (containers/Dockerfile)


def write_hooks(compiled_client: bool) -> None:
    """The wrappers as the entrypoint writes them (the compiled client), or with the Python client."""
    for node in NODES:
        docker(node, *MAPA_HOOKS, *(["--client", CLIENT] if compiled_client else ["--cc", "none"]))


ON = ("on", "on-python", "on-nofeatures")


def without_table(text: str, table: str) -> str:
    """A TOML text without ``[table]`` and its keys (up to the next table header)."""
    kept, skipping = [], False
    for line in text.splitlines(True):
        if line.strip().startswith("["):
            skipping = line.strip() == f"[{table}]"
        if not skipping:
            kept.append(line)
    return "".join(kept)


def write_mapa_toml(with_features: bool) -> None:
    """Every node's mapa.toml: the shipped one, or the shipped one without [features] (no node
    features, hence no `scontrol show node` and `scontrol update` after starts and ends)."""
    for node in NODES:
        text = docker(node, "cat", f"{SHIPPED}/mapa.toml").stdout
        docker(node, "sh", "-c", "umask 022 && cat > /etc/slurm/mapa.toml.new && mv -f /etc/slurm/mapa.toml.new /etc/slurm/mapa.toml",
               input=text if with_features else without_table(text, "features"))


def switch(setting: str, current: str | None, loops: dict[str, str]) -> None:
    if setting == current:
        return
    if setting in ON:
        write_hooks(compiled_client=setting != "on-python")
        write_mapa_toml(with_features=setting != "on-nofeatures")
        if current in ON:
            return  # the same slurm.conf: only the wrappers changed
        configure("on")
        set_agents(True, loops)
        reconfigure(hooks_wanted=True)
    else:
        if current in (None, *ON):
            set_agents(False, loops)
        configure(setting)
        reconfigure(hooks_wanted=setting == "empty")


def allocations(since: str) -> dict[int, float]:
    """JobId -> when slurmctld logged its allocation (docker's timestamp, seconds since the epoch)."""
    proc = subprocess.run(["docker", "logs", "--timestamps", "--since", since, container(CONTROLLER)],
                          capture_output=True, text=True, timeout=120)
    found = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        match = re.match(r"(\S+) .*(?:sched: Allocate JobId=|backfill: Started JobId=)(\d+)", line)
        if match:
            stamp = match.group(1)
            whole, _, fraction = stamp.rstrip("Z").partition(".")
            seconds = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc).timestamp()
            found.setdefault(int(match.group(2)), seconds + float("0." + (fraction or "0")))
    return found


def cpu_seconds() -> dict[str, float]:
    """CPU time each container has used (its cgroup v1 cpuacct, where Docker puts it; the jobs'
    processes included), or nothing where that is not readable."""
    found = {}
    for name in (CONTROLLER, *NODES):
        ident = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", container(name)], capture_output=True, text=True).stdout.strip()
        try:
            with open(f"/sys/fs/cgroup/cpuacct/docker/{ident}/cpuacct.usage", encoding="ascii") as usage:
                found[name] = int(usage.read()) / 1e9
        except (OSError, ValueError):
            pass
    return found


def burst(per_node: int) -> dict:
    """Submit per_node jobs to each node at once; wait until all have left squeue."""
    cpu_before = cpu_seconds()
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    loop = (f"cd {JOB_DIR} && for i in $(seq {per_node}); do for node in {' '.join(NODES)}; do "
            f"t=$(date +%s.%N); id=$(sbatch --parsable -w $node --chdir={JOB_DIR} -o {JOB_DIR}/burst-%j.out < /tmp/burst-job.sh) "
            f"&& echo \"$id $t\"; done; done")
    docker(CONTROLLER, "sh", "-c", "cat > /tmp/burst-job.sh && chmod 644 /tmp/burst-job.sh", input=JOB)
    out = docker(CONTROLLER, "runuser", "-u", "alice", "--", "sh", "-c", loop).stdout
    submitted = {int(job.split(";")[0]): float(t) for job, t in (line.split() for line in out.splitlines())}
    ids = ",".join(map(str, submitted))
    # Waited for inside the controller's container: a `docker exec` per poll cost the host's two
    # cores more CPU than the jobs (dockerd, containerd and runc: about 0.1 s per job of a burst).
    # A squeue that fails (slurmctld busy) is asked again, not taken for an empty queue.
    waiting = (f"end=$(( $(date +%s) + 600 )); while :; do left=$(squeue -h -j {ids} -o %i) && [ -z \"$left\" ] && break; "
               f"[ $(date +%s) -gt $end ] && exit 1; sleep 0.2; done; date +%s.%N")
    proc = docker(CONTROLLER, "sh", "-c", waiting, check=False, timeout=660)
    if proc.returncode != 0:
        raise SystemExit(f"jobs {ids} were still queued or running 10 minutes after they were submitted")
    done = float(proc.stdout.split()[-1])
    cpu_after = cpu_seconds()
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after if name in cpu_before}
    starts = {}
    for job in submitted:
        text = docker(CONTROLLER, "cat", f"{JOB_DIR}/burst-{job}.out", check=False).stdout
        match = re.search(r"^start (\d+\.\d+)$", text, re.M)
        if match:
            starts[job] = float(match.group(1))
    allocated = allocations(since)
    docker(CONTROLLER, "sh", "-c", f"rm -f {JOB_DIR}/burst-*.out")
    return {"submitted": submitted, "allocated": allocated, "started": starts, "done": done, "cpu": cpu}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def waits(runs: list[dict]) -> list[float]:
    """Submit -> start of every job of ``runs`` (bursts) that started."""
    return [r["started"][j] - t for r in runs for j, t in r["submitted"].items() if j in r["started"]]


def ratio_interval(on: list[dict], off: list[dict], statistic, draws: int = 2000, seed: int = 1) -> tuple[float, float, float]:
    """``statistic`` of on's waits over off's, and its 90% bootstrap interval: the bursts of each
    setting drawn again with replacement (a burst is the unit that shares the machine's moment;
    the jobs of one burst are not independent of each other)."""
    rng = random.Random(seed)
    point = statistic(waits(on)) / statistic(waits(off))
    ratios = sorted(statistic(waits(rng.choices(on, k=len(on)))) / statistic(waits(rng.choices(off, k=len(off))))
                    for _ in range(draws))
    return point, ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-node", default="1,4,8,16", help="burst sizes: jobs per node at once (default 1,4,8,16)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default="on,off,empty")
    parser.add_argument("--json", help="also write every job's times to this file")
    parser.add_argument("--warm-up", type=int, default=1,
                        help="unmeasured one-job-per-node bursts after each switch of setting (default %(default)s)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds to wait after a switch and its warm-up, before the measured bursts (default %(default)s)")
    args = parser.parse_args()
    from needs import mini_cluster

    mini_cluster("bench_burst.py", f"{CLUSTER}-{CONTROLLER}")
    sizes = [int(n) for n in args.per_node.split(",")]
    settings = args.settings.split(",")
    loops: dict[str, str] = {}
    results: dict[tuple[str, int], list[dict]] = {}
    current = "on"
    started = time.monotonic()
    try:
        for round_ in range(args.rounds):
            order = settings if round_ % 2 == 0 else settings[::-1]
            for setting in order:
                if setting != current:
                    switch(setting, current, loops)
                    current = setting
                    # Unmeasured: after a switch the daemons (slurmd restarted by the reconfigure, a
                    # restarted mapa-agent) have cold caches that a production node's have not.
                    for _ in range(args.warm_up):
                        burst(1)
                    time.sleep(args.settle)
                for size in sizes:
                    results.setdefault((setting, size), []).append(burst(size))
                    print(f"round {round_ + 1}, {setting}, {size} per node: done", file=sys.stderr)
    finally:
        switch("on", current, loops)
    print(f"{len(NODES)} mock nodes ({', '.join(NODES)}), one-GPU jobs, {args.rounds} rounds, settings alternating; "
          f"{time.monotonic() - started:.0f} s in all\n")
    print("| jobs per node (all nodes) | setting | jobs started | submit->start median s | p90 s | max s "
          "| alloc->start median s | max s | first submit->all done s | CPU ms per job: nodes, slurmctld |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for setting in settings:
            runs = results[(setting, size)]
            wait = waits(runs)
            launch = [r["started"][j] - r["allocated"][j] for r in runs for j in r["submitted"] if j in r["started"] and j in r["allocated"]]
            span = [r["done"] - min(r["submitted"].values()) for r in runs]
            total = sum(len(r["submitted"]) for r in runs)
            node_cpu = 1000 * sum(r["cpu"].get(n, 0.0) for r in runs for n in NODES) / total
            ctld_cpu = 1000 * sum(r["cpu"].get(CONTROLLER, 0.0) for r in runs) / total
            print(f"| {size} ({size * len(NODES)}) | {setting} | {len(wait)}/{total} | {statistics.median(wait):.2f} | "
                  f"{quantile(wait, 0.9):.2f} | {max(wait):.2f} | {statistics.median(launch):.2f} | {max(launch):.2f} | "
                  + ", ".join(f"{s:.1f}" for s in span) + f" | {node_cpu:.0f}, {ctld_cpu:.0f} |")
    if "off" in settings and "on" in settings:
        print("\n| jobs per node | on/off median submit->start (90% interval) | on/off slowest (90% interval) "
              "| on/off median, round by round |")
        print("|---|---|---|---|")
        for size in sizes:
            on, off = results[("on", size)], results[("off", size)]
            median = ratio_interval(on, off, statistics.median)
            slowest = ratio_interval(on, off, max)
            paired = [statistics.median(waits([a])) / statistics.median(waits([b])) for a, b in zip(on, off)]
            print(f"| {size} | {median[0]:.2f}x ({median[1]:.2f}-{median[2]:.2f}) | {slowest[0]:.2f}x ({slowest[1]:.2f}-{slowest[2]:.2f}) | "
                  + ", ".join(f"{r:.2f}" for r in paired) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({f"{s}/{n}": runs for (s, n), runs in results.items()}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
