"""A fault-injection harness for the hooks: it plays slurmctld and slurmd for one node.

Black box: it runs the real wrappers `mapa hooks` writes (the agent client, then the in-process
hook), the real `mapa-agent` and the real TaskProlog, with Slurm's bare environment (no PATH, only
the SLURM_* variables slurmd sets). scontrol and squeue are tiny /bin/sh scripts answering from a
state directory this driver keeps (a Python start per call would be too slow for 10,000 jobs).

Slurm's side: Slurm picks each job's GPU indices itself (first fit, sometimes any free ones) from
its own bookkeeping, which never hands out more GPUs than the node has; a job is allocated (listed
by squeue) from before its Prolog until its Epilog has finished. A job is LIVE from the moment its
Prolog wrapper exits (slurmd then starts it) until its Epilog starts.

THE INVARIANT, checked at every job start: no GPU is used by two live jobs, where a live job uses
the GPUs its TaskProlog exported from its per-job file when it started (``jobs_dir/JOBID``), or
Slurm's indices when the TaskProlog printed nothing. It is also checked on the job files as they
are at that moment (the definition read literally). At the end, after every job has ended and one
more Prolog+Epilog round for a fresh job, the ledger and the jobs directory must be empty.

Faults, all drawn from one seed (timing still makes runs differ): kill -9 of the hooks' Python
processes at random points (agent client, in-process hook, its retry; sometimes every attempt),
kill -9 of the agent, runs with and without an agent, non-UTF-8 batch scripts and job names,
slow / failing / hanging / garbage-printing Slurm commands, bursts of 32+ simultaneous Prologs,
many CPU-only jobs, stale Prolog marks naming a live unrelated process, ledgers corrupted in every
field (and replaced by a symlink), 8- and 64-GPU nodes, an upgrade (jobs running from the start
with an earlier release's marks) and a local user flooding the agent's isolate socket and its
metrics port.

A job whose every Prolog attempt was killed and that left no job file runs on Slurm's indices; if
those collide with GPUs MAPA gave a job before, that is reported apart as
"shared-after-killed-prolog" (no hook can prevent it); every other overlap is a double use.

Used by tests/core/test_invariant.py (CI-sized) and benchmarks/bench_soak.py (10,000+ jobs).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY_64 = REPO / "tests" / "data" / "boards-64.toml"
NODE = "sim1"
TOPOLOGIES = {8: "dgx1-v100", 64: str(TOPOLOGY_64)}
WEATHERS = ("normal", "slow", "fail", "hang", "garbage", "random")
DIRECTIVES = ("topology=ring sensitive=yes", "topology=ring sensitive=no", "topology=all sensitive=yes",
              "topology=tree sensitive=yes", "topology=star sensitive=no")
# The ledger corruptions (see Simulation.corrupt_ledger).
CORRUPTIONS = ("not-json", "non-utf8", "deep-json", "since-null", "since-string", "since-nan", "since-future", "gpus-string",
               "gpus-negative", "gpus-huge", "gpus-bool", "gpus-float", "gpus-dup-in-job", "gpus-dup-across-jobs",
               "policy-object", "note-list", "missing-field", "extra-field", "job-id-newline", "job-id-text",
               "version-2", "jobs-list", "top-level-list", "empty", "truncated", "oversized", "stale-entries", "symlink")


def default_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@dataclass
class Scenario:
    """What one run does; every random choice comes from ``seed``."""

    seed: int = 1
    jobs: int = 150
    gpus: int = 8  # 8: the dgx1-v100 preset; 64: tests/data/boards-64.toml (8 boards of 8)
    mode: str = "mixed"  # agent | inprocess | mixed (the agent is sometimes down for a while)
    # The directory holding the slurm_mapa under test (e.g. an older version unpacked with git archive).
    package_root: str = field(default_factory=lambda: os.environ.get("FAULTSIM_PACKAGE_ROOT", str(REPO)))
    python: str = field(default_factory=default_python)
    command_timeout: float = 1.0
    prolog_budget: float = 4.0  # written to the config only where it accepts the key
    hook_timeout: float = 60.0  # slurmd's PrologEpilogTimeout: a hook past it drains the node
    deadline: float = 900.0  # wall seconds: no job is started after this (the run says it was cut)
    cpu_only: float = 0.4  # share of CPU-only jobs
    burst: float = 0.12  # share of arrival groups that are bursts (burst_size jobs, all started at once)
    burst_size: tuple[int, int] = (34, 44)
    group_size: tuple[int, int] = (1, 4)
    gap: tuple[float, float] = (0.0, 0.25)  # seconds between arrival groups
    run_time: tuple[float, float] = (0.02, 0.6)  # seconds a job runs
    max_live: int = 64  # jobs allocated at once (Slurm's other limits)
    sizes: tuple[tuple[int, float], ...] = ((1, 30), (2, 25), (3, 6), (4, 20), (5, 3), (6, 3), (7, 3), (8, 10))
    large_directive: str = ""  # if set: the directive of every job of 5+ GPUs (a fast search on 64 GPUs)
    kill_prolog: float = 0.25  # share of Prologs whose Python processes are killed
    kill_prolog_all: float = 0.35  # of those, share where every attempt is killed
    kill_epilog: float = 0.1
    kill_epilog_all: float = 0.3
    kill_agent: float = 0.08  # per 2.5 jobs
    stale_mark: float = 0.5  # of the jobs whose last Prolog attempt was killed: their mark then names a live pid
    orphan_mark: float = 0.02  # per 2.5 jobs: a mark naming a live pid for a job that has ended
    latin1_script: float = 0.12
    bad_name: float = 0.12
    corrupt_ledger: float = 0.05  # per 2.5 jobs
    weather_change: float = 0.1  # per 2.5 jobs (see make_plan): Slurm's commands change behaviour
    weather_weights: tuple[float, ...] = (0.5, 0.14, 0.1, 0.08, 0.08, 0.1)  # as WEATHERS
    slurm_random_pick: float = 0.2  # share of jobs Slurm gives random free GPUs instead of the first ones
    corruptions: tuple[str, ...] = CORRUPTIONS  # the ledger corruptions to use (to aim at one)
    # An upgrade: jobs already running when the run starts, marked by a Prolog of an earlier release
    # (a bare pid, its process gone, no job file): they run on Slurm's GPUs until they end.
    legacy_jobs: int = 0
    legacy_run_time: tuple[float, float] = (3.0, 15.0)
    # A local user with no job floods the agent's isolate socket (connections held open, junk sent).
    flood: bool = False
    # ... and its metrics port ([metrics] on): idle TCP connections held open, as many as it can.
    metrics_flood: bool = False

    def name(self) -> str:
        return f"{self.gpus}gpu-{self.mode}-seed{self.seed}"


# --- the plan: everything random, drawn up front from the seed ---------------------------------------


@dataclass
class KillPlan:
    kind: str = "none"  # none | once (whatever Python runs at `delay` after the wrapper started) |
    #                     inprocess (the in-process hook, `delay` after it started) | all (every attempt)
    delays: tuple[float, ...] = ()


@dataclass
class JobPlan:
    job_id: int
    group: int
    gpus: int
    directive: str  # where the directive is: none | script | admin | comment | srun
    directive_text: str
    latin1: bool
    bad_name: bool
    run_time: float
    random_pick: bool
    prolog_kill: KillPlan
    epilog_kill: KillPlan
    stale_mark: bool


@dataclass
class GroupPlan:
    index: int
    jobs: list[JobPlan]
    gap: float
    weather: tuple[str, str] | None = None  # (scontrol, squeue), from the group's first job start on
    corruptions: list[tuple[float, str]] = field(default_factory=list)  # (delay after that, variant)
    agent_kills: list[tuple[float, float]] = field(default_factory=list)  # (delay after that, seconds down)
    orphan_marks: int = 0
    fired: bool = False


def _kill_plan(rng: random.Random, p: float, p_all: float) -> KillPlan:
    if rng.random() >= p:
        return KillPlan()
    # Delays spread over a hook's life: an agent's client lives ~20-50 ms, an in-process hook ~70-300 ms.
    if rng.random() < p_all:
        return KillPlan("all", tuple(rng.choice((rng.uniform(0, 0.015), rng.uniform(0, 0.06), rng.uniform(0.02, 0.3)))
                                     for _ in range(6)))
    if rng.random() < 0.3:
        return KillPlan("inprocess", (rng.choice((rng.uniform(0, 0.03), rng.uniform(0, 0.12), rng.uniform(0.05, 0.4))),))
    return KillPlan("once", (rng.choice((rng.uniform(0, 0.01), rng.uniform(0, 0.05), rng.uniform(0.02, 0.15),
                                         rng.uniform(0.1, 0.6))),))


def make_plan(sc: Scenario) -> list[GroupPlan]:
    rng = random.Random(sc.seed)
    sizes, weights = zip(*sc.sizes)
    groups: list[GroupPlan] = []
    job_id = 1000 + rng.randrange(1000)
    made = 0
    corruptions: list[str] = []  # each variant once, in a seeded order, before any repeats
    while made < sc.jobs:
        burst = rng.random() < sc.burst
        count = rng.randint(*sc.burst_size) if burst else rng.randint(*sc.group_size)
        count = min(count, sc.jobs - made)
        jobs = []
        demand = 0
        for _ in range(count):
            gpus = 0 if rng.random() < sc.cpu_only else rng.choices(sizes, weights)[0]
            gpus = min(gpus, sc.gpus)
            if burst and demand + gpus > sc.gpus:  # a burst is one scheduling pass: what fits at once
                gpus = 0
            demand += gpus
            directive = rng.choices(("none", "script", "admin", "comment", "srun"), (35, 15, 30, 10, 10))[0]
            text = rng.choice(DIRECTIVES)
            if sc.large_directive and gpus >= 5:
                text = sc.large_directive
            job_id += rng.choice((1, 1, 1, 2, 7))
            jobs.append(JobPlan(
                job_id=job_id, group=len(groups), gpus=gpus, directive=directive, directive_text=text,
                latin1=rng.random() < sc.latin1_script, bad_name=rng.random() < sc.bad_name,
                run_time=rng.uniform(*sc.run_time), random_pick=rng.random() < sc.slurm_random_pick,
                prolog_kill=_kill_plan(rng, sc.kill_prolog, sc.kill_prolog_all),
                epilog_kill=_kill_plan(rng, sc.kill_epilog, sc.kill_epilog_all),
                stale_mark=rng.random() < sc.stale_mark,
            ))
        made += count
        group = GroupPlan(len(groups), jobs, rng.uniform(*sc.gap))
        # Node events: the rates are per 2.5 jobs (a small group), so a burst draws several.
        for _ in range(max(1, round(count / 2.5))):
            if rng.random() < sc.weather_change:
                if rng.random() < 0.4:
                    group.weather = ("normal", "normal")
                else:
                    group.weather = (rng.choices(WEATHERS, sc.weather_weights)[0], rng.choices(WEATHERS, sc.weather_weights)[0])
            if rng.random() < sc.corrupt_ledger:
                if not corruptions:
                    corruptions = rng.sample(sc.corruptions, len(sc.corruptions))
                group.corruptions.append((rng.uniform(0, 0.5), corruptions.pop()))
            if sc.mode != "inprocess" and rng.random() < sc.kill_agent:
                down = rng.uniform(0, 0.5) if sc.mode == "agent" else rng.choice((rng.uniform(0, 0.5), rng.uniform(1, 6)))
                group.agent_kills.append((rng.uniform(0, 0.6), down))
            group.orphan_marks += rng.random() < sc.orphan_mark
        groups.append(group)
    return groups


# --- the fake Slurm commands -------------------------------------------------------------------------

_SLURM_COMMON = r"""#!/bin/sh
# Fake {name} for the fault harness: answers from {state}; behaviour from weather.{name}.
S='{state}'
read -r mode rest < "$S/weather.{name}" || mode=normal
if [ "$mode" = random ]; then
  r=$(/usr/bin/od -An -N1 -tu1 /dev/urandom)
  r=$((r))
  if [ $r -lt 150 ]; then mode=normal; elif [ $r -lt 185 ]; then mode=slow; elif [ $r -lt 210 ]; then mode=fail
  elif [ $r -lt 230 ]; then mode=hang; else mode=garbage; fi
fi
echo "$mode" >> "$S/calls.{name}"
case "$mode" in
  slow) "$S/bin/sleep" {slow} ;;
  fail) echo "{name}: error: Unable to contact slurm controller (connect failure)" >&2; exit 1 ;;
  hang) exec "$S/bin/sleep" {hang} ;;
esac
"""

SQUEUE_BODY = r"""
if [ "$mode" = garbage ]; then
  r=$(/usr/bin/od -An -N1 -tu1 /dev/urandom); r=$((r % {n}))
  exec /bin/cat "$S/garbage/squeue.$r"
fi
[ "$1 $2 $3" = "--noheader --nodelist {node}" ] || {{ echo "squeue: unexpected arguments: $*" >&2; exit 2; }}
exec /bin/cat "$S/running"
"""

SCONTROL_BODY = r"""
if [ "$mode" = garbage ]; then
  r=$(/usr/bin/od -An -N1 -tu1 /dev/urandom); r=$((r % {n}))
  exec /bin/cat "$S/garbage/scontrol.$r"
fi
if [ "$1" = --json ] && [ "$2" = show ] && [ "$3" = job ]; then
  case "$4" in ''|*[!0-9]*) echo "scontrol: error: Invalid job id specified" >&2; exit 1 ;; esac
  [ -r "$S/jobs/$4.json" ] || {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}
  exec /bin/cat "$S/jobs/$4.json"
elif [ "$1" = write ] && [ "$2" = batch_script ] && [ "$4" = - ]; then
  case "$3" in ''|*[!0-9]*) echo "scontrol: error: Invalid job id specified" >&2; exit 1 ;; esac
  [ -r "$S/jobs/$3.sh" ] || {{ echo "scontrol: error: job $3 has no batch script" >&2; exit 1; }}
  exec /bin/cat "$S/jobs/$3.sh"
elif [ "$1" = update ]; then
  id=${{2#job=}}
  case "$id" in ''|*[!0-9]*) echo "scontrol: error: Invalid job id specified" >&2; exit 1 ;; esac
  printf '%s\n' "$3" > "$S/admin/$id"
  exit 0
fi
echo "scontrol: unexpected arguments: $*" >&2
exit 2
"""

GARBAGE_SCONTROL = (
    b"",
    b"scontrol: error: slurm_load_jobs error: Unexpected message received\n",
    b'{"jobs": [{"job_id": 1, "admin_comment": "mapa:topo',
    b'{"jobs": []}\n',
    b"\xff\xfe\x00garbage \x80\x81 not json\n",
    b'{"jobs": ' + b"[" * 50000 + b"]" * 50000 + b"}\n",
    b'{"jobs": [{"job_id": "x", "admin_comment": 5, "batch_flag": "yes", "job_state": 7, "gres_detail": "gpu:2"}]}\n',
    b'#!/bin/bash\n#MAPA topolo\xe9gy=ring\x00\n',
)
GARBAGE_SQUEUE = (
    b"squeue: error: Invalid user for SlurmUser slurm, ignored\n",
    b"\xff\xfe\n12\x80\n",
    b"1001 1002\n",
    b"7\n\n0x1f\n",
    b"JOBID\n1001\n",
)


# --- processes ---------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as handle:
            return [int(p) for p in handle.read().split()]
    except (OSError, ValueError):
        return []


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read(8192)
    except OSError:
        return b""


def start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read(4096)
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def processes_mentioning(needle: bytes) -> list[int]:
    """Processes whose command line or environment holds ``needle`` (this run's directory)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        try:
            if needle in cmdline(pid):
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read(1 << 16):
                    found.append(pid)
        except OSError:
            continue
    return found


class Killer(threading.Thread):
    """kill -9 of the Python processes a hook wrapper runs (never the wrapper), as ``plan`` says."""

    def __init__(self, wrapper_pid: int, plan: KillPlan, started: float) -> None:
        super().__init__(daemon=True)
        self.wrapper_pid = wrapper_pid
        self.plan = plan
        self.started = started
        self.stop = threading.Event()
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (client | inprocess, first seen)
        self.killed: list[tuple[str, float]] = []  # (kind, ms after that process started)
        self.killed_pids: set[int] = set()
        self.start_ticks: dict[int, int | None] = {}

    def run(self) -> None:
        done = False
        while not self.stop.is_set() and not done:
            now = time.monotonic()
            for pid in children_of(self.wrapper_pid):
                if pid not in self.seen or self.seen[pid][0] == "other":  # "other": maybe forked, not yet exec'd
                    line = cmdline(pid)
                    kind = "client" if b"/agent/client.py" in line else "inprocess" if b"python" in line else "other"
                    self.seen[pid] = (kind, now)
                    self.start_ticks[pid] = start_ticks(pid)
                kind, first = self.seen[pid]
                if kind == "other" or pid in self.killed_pids:
                    continue
                plan = self.plan
                if plan.kind == "once" and now - self.started >= plan.delays[0]:
                    done = self._kill(pid, kind, first, now)
                elif plan.kind == "inprocess" and kind == "inprocess" and now - first >= plan.delays[0]:
                    done = self._kill(pid, kind, first, now)
                elif plan.kind == "all" and now - first >= plan.delays[len(self.killed) % len(plan.delays)]:
                    self._kill(pid, kind, first, now)
            self.stop.wait(0.002)

    def _kill(self, pid: int, kind: str, first: float, now: float) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.killed_pids.add(pid)
        self.killed.append((kind, round((now - first) * 1000, 1)))
        return True

    def last_attempt_killed(self) -> bool:
        """Whether the last Python process the wrapper ran was killed by us."""
        python = [(first, pid) for pid, (kind, first) in self.seen.items() if kind != "other"]
        return bool(python) and max(python)[1] in self.killed_pids


# --- the run's state -------------------------------------------------------------------------------


@dataclass
class JobState:
    plan: JobPlan
    slurm_gpus: tuple[int, ...] = ()
    allocated_at: float = 0.0
    prolog_started: float = 0.0
    live_at: float | None = None
    ended_at: float | None = None
    binding: tuple[int, ...] = ()
    binding_source: str = ""  # file | slurm
    killed_all: bool = False
    faults: list[str] = field(default_factory=list)
    prolog_wall: float = 0.0
    epilog_wall: float = 0.0


@dataclass
class HookRun:
    rc: int | None
    wall: float
    timed_out: bool
    killer: Killer | None
    stderr: bytes


class Simulation:
    def __init__(self, scenario: Scenario, workdir: Path) -> None:
        self.sc = scenario
        self.dir = Path(workdir)
        self.plan = make_plan(scenario)
        self.cond = threading.Condition()
        self.slurm_free = set(range(scenario.gpus))
        self.allocated: dict[int, JobState] = {}
        self.live: dict[int, JobState] = {}
        self.queue: deque[JobState] = deque()
        self.threads: list[threading.Thread] = []
        self.counts: Counter = Counter()
        self.prolog_walls: list[float] = []
        self.gpu_prolog_walls: list[float] = []
        self.epilog_walls: list[float] = []
        self.violations: dict[tuple[int, int], dict[str, Any]] = {}
        self.anomalies: list[dict[str, Any]] = []
        self.events: list[tuple[float, str]] = []  # (time, what) for agent kills and corruptions
        self.shared_gpus: set[tuple[int, int]] = set()  # (killed job, gpu) of excused overlaps
        self.prologs_in_flight = 0
        self.agent: subprocess.Popen | None = None
        self.agent_lock = threading.Lock()
        self.decoy: subprocess.Popen | None = None
        self.weather = ("normal", "normal")
        self.ended_ids: list[int] = []
        self.started_at = 0.0
        self.truncated = False
        self.budget_supported = False
        self.final: dict[str, Any] = {}
        self.chaos_threads: list[threading.Thread] = []
        self.stderr_samples: list[str] = []
        self.count_lock = threading.Lock()
        self._seen_anomalies: set = set()

    # --- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)  # the hooks trust only directories no one else can change
        self.state = d / "state"
        for sub in ("state/bin", "state/jobs", "state/admin", "state/garbage", "lib", "agent"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "agent", 0o700)
        os.symlink("/bin/sleep", self.state / "bin" / "sleep")
        for i, data in enumerate(GARBAGE_SCONTROL):
            (self.state / "garbage" / f"scontrol.{i}").write_bytes(data)
        for i, data in enumerate(GARBAGE_SQUEUE):
            (self.state / "garbage" / f"squeue.{i}").write_bytes(data)
        slow = round(min(0.6 * self.sc.command_timeout, 1.5), 2)
        for name, body, n in (("scontrol", SCONTROL_BODY, len(GARBAGE_SCONTROL)), ("squeue", SQUEUE_BODY, len(GARBAGE_SQUEUE))):
            text = _SLURM_COMMON.format(name=name, state=self.state, slow=slow, hang=20) + body.format(n=n, node=NODE)
            path = self.state / "bin" / name
            path.write_text(text)
            os.chmod(path, 0o755)
        self.set_weather(("normal", "normal"))
        self.write_running()
        self.ledger = d / "lib" / "ledger.json"
        self.jobs_dir = d / "jobs"
        self.socket = d / "agent" / "agent.sock"
        self.victim = d / "victim.txt"
        self.victim_text = b"victim: root must never write through a symlink planted at the ledger\n"
        self.victim.write_bytes(self.victim_text)
        self.config = d / "mapa.toml"
        base = (f'ledger = "{self.ledger}"\njobs_dir = "{self.jobs_dir}"\nlog = "{d}/mapa.log"\nhealth = "off"\n'
                f'command_timeout = {self.sc.command_timeout}\n'
                f'scontrol = "{self.state}/bin/scontrol"\nsqueue = "{self.state}/bin/squeue"\n')
        nodes = f'[nodes]\n"sim*" = "{TOPOLOGIES[self.sc.gpus]}"\n'
        probe = ("import sys; sys.path.insert(0, sys.argv[1]); import slurm_mapa\n"
                 "from slurm_mapa.slurm.config import config_from_text\n"
                 "assert slurm_mapa.__file__.startswith(sys.argv[1]), slurm_mapa.__file__\n"
                 "try:\n    config_from_text(sys.argv[2]); print('yes')\nexcept Exception as e:\n    print('no', e)\n")
        if self.sc.metrics_flood:
            with socket.socket() as free:  # a port free a moment ago
                free.bind(("127.0.0.1", 0))
                self.metrics_port = free.getsockname()[1]
            nodes += f'[metrics]\nlisten = "127.0.0.1:{self.metrics_port}"\n'
        with_budget = base + f"prolog_budget = {self.sc.prolog_budget}\n"
        # The newest config first (a short reconcile interval: a segment lasts about a minute),
        # then what older package roots accept.
        for text in (with_budget + "reconcile_interval = 5\n" + nodes, with_budget + nodes, base + nodes):
            answer = subprocess.run([self.sc.python, "-c", probe, self.sc.package_root, text], capture_output=True, text=True,
                                    check=True).stdout
            if answer.startswith("yes"):
                break
        self.budget_supported = "prolog_budget" in text
        self.config.write_text(text)
        os.chmod(self.config, 0o644)
        hooks = ("import sys; sys.path.insert(0, sys.argv[1]); from slurm_mapa.cli import main; "
                 "sys.exit(main(['hooks', sys.argv[2], '--python', sys.argv[3], '--config', sys.argv[4]]))")
        subprocess.run([self.sc.python, "-c", hooks, self.sc.package_root, str(d / "sbin"), self.sc.python, str(self.config)],
                       check=True, capture_output=True)
        self.prolog = d / "sbin" / "mapa-prolog-wrapper"
        self.epilog = d / "sbin" / "mapa-epilog-wrapper"
        # The TaskProlog as written, reading this run's jobs directory.
        text = (d / "sbin" / "mapa-taskprolog").read_text()
        self.taskprolog = d / "sbin" / "taskprolog-here"
        # `mapa hooks` points the TaskProlog at the config's jobs_dir (older versions: the default).
        self.taskprolog_ok = f"JOBS_DIR={self.jobs_dir}\n" in text or "JOBS_DIR=/run/slurm-mapa/jobs\n" in text
        if not self.taskprolog_ok and self.sc.package_root == str(REPO):
            raise RuntimeError(f"the TaskProlog `mapa hooks` wrote reads no JOBS_DIR this harness knows:\n{text[:400]}")
        self.taskprolog.write_text(text.replace("JOBS_DIR=/run/slurm-mapa/jobs\n", f"JOBS_DIR={self.jobs_dir}\n"))
        os.chmod(self.taskprolog, 0o755)
        # A live process unrelated to any job, whose pid stale marks name (a reused pid).
        self.decoy = subprocess.Popen([str(self.state / "bin" / "sleep"), "100000"], start_new_session=True)
        self.isolate_dir = None
        if self.sc.flood:  # where the flooding user (another uid) can reach it: pytest's tmp_path is root's alone
            self.isolate_dir = Path(tempfile.mkdtemp(prefix="faultsim-isolate-"))
            os.chmod(self.isolate_dir, 0o755)
        self.plant_legacy_jobs()
        if self.sc.mode in ("agent", "mixed"):
            self.start_agent(wait=True)
        if self.sc.flood:
            self.start_flood()
        if self.sc.metrics_flood:
            self.start_metrics_flood()

    def plant_legacy_jobs(self) -> None:
        """The upgrade: jobs that a Prolog of an earlier release started (its mark a bare pid whose
        process is gone, no job file, no ledger entry) and that run on Slurm's GPUs until they end."""
        if not self.sc.legacy_jobs:
            return
        rng = random.Random(self.sc.seed * 7919)
        self.jobs_dir.mkdir(mode=0o755, exist_ok=True)
        gone = subprocess.Popen(["true"])
        gone.wait()
        for i in range(self.sc.legacy_jobs):
            plan = JobPlan(900000 + i, -1, rng.randint(1, 2), "none", "", False, False, rng.uniform(*self.sc.legacy_run_time),
                           False, KillPlan(), KillPlan(), False)
            js = JobState(plan)
            with self.cond:
                js.slurm_gpus = tuple(sorted(rng.sample(sorted(self.slurm_free), plan.gpus)))
                self.slurm_free -= set(js.slurm_gpus)
                self.allocated[plan.job_id] = js
                self.write_job_record(js, "RUNNING")
                self.write_running()
                js.binding, js.binding_source, js.live_at = js.slurm_gpus, "slurm", time.monotonic()
                js.faults.append("started-by-an-earlier-release")
                self.live[plan.job_id] = js
            _atomic_write(self.jobs_dir / f".prolog-{plan.job_id}", f"{gone.pid}\n".encode(), mode=0o600)
            self.bump("jobs running from an earlier release")
            thread = threading.Thread(target=self._guarded, args=(self.legacy_lifecycle, (js,)), daemon=True)
            self.threads.append(thread)
            thread.start()

    def legacy_lifecycle(self, js: JobState) -> None:
        time.sleep(js.plan.run_time)
        with self.cond:
            self.check_files_now()
            del self.live[js.plan.job_id]
            js.ended_at = time.monotonic()
        self.end_job(js)

    def start_flood(self) -> None:
        """A user with no job (uid 4242) holds 200 connections to the isolate socket open and keeps
        sending junk on 50 more every 0.2 s, until the run ends."""
        sock = self.isolate_dir / "isolate.sock"
        code = ("import os, socket, time\n"
                "os.setgid(4242); os.setuid(4242)\n"
                "held = []\n"
                "while True:\n"
                "    for i in range(250):\n"
                "        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(0.5)\n"
                "        try:\n"
                f"            s.connect({str(sock)!r})\n"
                "            if i < 50:\n"
                "                s.sendall(b'MAPA1 isolate 5\\nxx\\x00yy'); s.close()\n"
                "            else:\n"
                "                held.append(s)\n"
                "        except OSError:\n"
                "            s.close()\n"
                "    print(len(held), flush=True)\n"
                "    while len(held) > 200:\n"
                "        held.pop(0).close()\n"
                "    time.sleep(0.2)\n")
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.flooder = subprocess.Popen([self.sc.python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.bump("isolate socket floods")

    def start_metrics_flood(self) -> None:
        """A user with no job (uid 4242) opens idle TCP connections to the agent's metrics port,
        sending one byte and never the rest of a request, up to 900 held at once (under systemd's
        default 1,024 descriptors of the agent, had it kept them), reconnecting as they close."""
        code = ("import os, socket, time\n"
                "os.setgid(4242); os.setuid(4242)\n"
                "held = []\n"
                "while True:\n"
                "    held = [s for s in held if s.fileno() >= 0]\n"
                "    for i in range(100):\n"
                "        if len(held) >= 900: break\n"
                "        s = socket.socket(); s.settimeout(0.5)\n"
                "        try:\n"
                f"            s.connect(('127.0.0.1', {self.metrics_port})); s.send(b'G'); held.append(s)\n"
                "        except OSError:\n"
                "            s.close()\n"
                "    print(len(held), flush=True)\n"
                "    time.sleep(0.1)\n")
        self.metrics_flooder = subprocess.Popen([self.sc.python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                start_new_session=True)
        self.bump("metrics port floods")

    def scrape_metrics(self) -> bool:
        """Whether the agent's metrics endpoint answers a scrape (within a few tries)."""
        import urllib.request

        for _ in range(40):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as answer:
                    return b"mapa_" in answer.read()
            except OSError:
                time.sleep(0.25)
        return False

    def set_weather(self, weather: tuple[str, str]) -> None:
        self.weather = weather
        for name, mode in zip(("scontrol", "squeue"), weather):
            _atomic_write(self.state / f"weather.{name}", f"{mode}\n".encode())

    def write_running(self) -> None:
        _atomic_write(self.state / "running", "".join(f"{j}\n" for j in sorted(self.allocated)).encode())

    def write_job_record(self, js: JobState, state: str) -> None:
        p = js.plan
        admin = f"mapa:{p.directive_text}" if p.directive == "admin" else ""
        record = {"job_id": p.job_id, "admin_comment": admin, "batch_flag": p.directive != "srun", "job_state": [state],
                  "gres_detail": [f"gpu:{len(js.slurm_gpus)}(IDX:{','.join(map(str, js.slurm_gpus))})"] if js.slurm_gpus else [],
                  "name": "@NAME@", "nodes": NODE}
        name = b"r\xe9sultats-\xff\xfe" + str(p.job_id).encode() if p.bad_name else f"train-{p.job_id}".encode()
        data = json.dumps({"jobs": [record]}).encode().replace(b'"@NAME@"', b'"' + name + b'"')
        _atomic_write(self.state / "jobs" / f"{p.job_id}.json", data)

    def write_batch_script(self, js: JobState) -> None:
        p = js.plan
        if p.directive == "srun":
            return
        lines = [b"#!/bin/bash", f"#SBATCH --gres=gpu:{p.gpus}".encode() if p.gpus else b"#SBATCH -c 4"]
        if p.latin1:
            lines.append(b"# Auteur: J\xe9r\xf4me, r\xe9sultats du mod\xe8le")
        if p.directive in ("script", "admin"):
            lines.append(f"#MAPA {p.directive_text}".encode())
        lines.append(b"srun ./train")
        _atomic_write(self.state / "jobs" / f"{p.job_id}.sh", b"\n".join(lines) + b"\n")

    # --- the agent -------------------------------------------------------------------------------

    def start_agent(self, wait: bool = False) -> None:
        with self.agent_lock:
            if self.agent is not None and self.agent.poll() is None:
                return
            out = open(self.dir / "agent.out", "ab")
            isolate = ["--isolate-socket", str(self.isolate_dir / "isolate.sock")] if self.isolate_dir else []
            self.agent = subprocess.Popen(
                [self.sc.python, "-m", "slurm_mapa.slurm.agent.service", "--config", str(self.config), "--socket", str(self.socket),
                 "--node", NODE, *isolate],
                cwd=self.sc.package_root, env={"PYTHONPATH": self.sc.package_root, "PATH": "/usr/bin:/bin"},
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
            out.close()
            self.bump("agent starts")
        if wait:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(str(self.socket))
                    return
                except OSError:
                    time.sleep(0.05)
            raise RuntimeError(f"mapa-agent did not listen within 30 s; see {self.dir / 'agent.out'}")

    def kill_agent(self, down: float) -> None:
        with self.agent_lock:
            agent = self.agent
            if agent is None or agent.poll() is not None:
                return
            try:
                os.kill(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            agent.wait()
            self.bump("agent kills")
            self.events.append((time.monotonic(), "agent-killed"))
        time.sleep(down)
        if not self.stopping:
            self.start_agent()

    def agent_chaos(self, delay: float, down: float) -> None:
        time.sleep(delay)
        if not self.quiet and not self.stopping:
            self.kill_agent(down)

    # --- hooks -------------------------------------------------------------------------------------

    def hook_env(self, js: JobState, kind: str) -> dict[str, str]:
        p = js.plan
        env = {"SLURM_JOB_ID": str(p.job_id), "SLURMD_NODENAME": NODE, "SLURM_JOB_NUM_NODES": "1",
               "MAPA_AGENT_SOCKET": str(self.socket if self.sc.mode != "inprocess" else self.dir / "agent" / "none.sock")}
        if kind == "prolog":
            env["SLURM_JOB_GPUS"] = ",".join(map(str, js.slurm_gpus))
            env["SLURM_JOB_COMMENT"] = f"mapa:{p.directive_text}" if p.directive == "comment" else ""
        return env

    def run_hook(self, kind: str, js: JobState, plan: KillPlan) -> HookRun:
        wrapper = self.prolog if kind == "prolog" else self.epilog
        started = time.monotonic()
        proc = subprocess.Popen([str(wrapper)], env=self.hook_env(js, kind), cwd="/", stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        killer = None
        if plan.kind != "none":
            killer = Killer(proc.pid, plan, started)
            killer.start()
        timed_out = False
        try:
            _, err = proc.communicate(timeout=self.sc.hook_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # slurmd kills a hook past PrologEpilogTimeout
            except ProcessLookupError:
                pass
            _, err = proc.communicate()
        wall = time.monotonic() - started
        if killer is not None:
            killer.stop.set()
            killer.join()
        return HookRun(proc.returncode, wall, timed_out, killer, err or b"")

    def task_binding(self, js: JobState) -> tuple[tuple[int, ...] | None, str]:
        """What the TaskProlog exports for the job (None: nothing, Slurm's binding stays)."""
        if self.taskprolog_ok:
            out = subprocess.run([str(self.taskprolog)], env={"SLURM_JOB_ID": str(js.plan.job_id)}, capture_output=True,
                                 check=False).stdout.decode("ascii", "replace")
            match = re.search(r"^export CUDA_VISIBLE_DEVICES=([0-9,]+)$", out, re.M)
            return (tuple(int(g) for g in match.group(1).split(",")) if match else None), out
        gpus = read_job_file(self.jobs_dir / str(js.plan.job_id))
        return gpus, ""

    # --- a job's life ------------------------------------------------------------------------------

    def lifecycle(self, js: JobState) -> None:
        p = js.plan
        try:
            with self.cond:
                self.prologs_in_flight += 1
                with self.count_lock:
                    self.counts["max simultaneous Prologs"] = max(self.counts["max simultaneous Prologs"], self.prologs_in_flight)
                if self.weather != ("normal", "normal"):
                    js.faults.append(f"slurm:scontrol={self.weather[0]},squeue={self.weather[1]}")
            js.prolog_started = time.monotonic()
            run = self.run_hook("prolog", js, p.prolog_kill)
            with self.cond:
                self.prologs_in_flight -= 1
            js.prolog_wall = run.wall
            self.prolog_walls.append(run.wall)
            if self.budget_supported and run.wall > self.sc.prolog_budget + 1.0:
                self.anomalies.append({"kind": "Prolog over its budget + 1 s", "job": p.job_id, "wall_s": round(run.wall, 2),
                                       "gpus": p.gpus, "weather": list(self.weather),
                                       "kills": [f"{what}@{ms:g}ms" for what, ms in (run.killer.killed if run.killer else [])]})
            if p.gpus:
                self.gpu_prolog_walls.append(run.wall)
            self.note_kills(js, run, "prolog")
            self.note_stderr(run)
            failed = run.timed_out or run.rc != 0
            if failed:
                what = "timed out (slurmd drains the node)" if run.timed_out else f"exit status {run.rc}"
                self.bump("Prolog wrapper failures")
                self.anomalies.append({"kind": "prolog wrapper failed", "job": p.job_id, "what": what,
                                       "stderr": run.stderr[-500:].decode("utf-8", "replace")})
            else:
                gpus, _ = self.task_binding(js)
                file_now = read_job_file(self.jobs_dir / str(p.job_id))
                with self.cond:
                    js.live_at = time.monotonic()
                    if gpus is None:
                        js.binding, js.binding_source = js.slurm_gpus, "slurm"
                    else:
                        js.binding, js.binding_source = gpus, "file"
                    js.killed_all = js.binding_source == "slurm" and run.killer is not None and run.killer.last_attempt_killed()
                    if js.killed_all and p.gpus:
                        js.faults.append("every-prolog-attempt-killed")
                        self.bump("Prologs with every attempt killed")
                    for t, what in self.events:
                        if js.prolog_started <= t <= js.live_at:
                            js.faults.append(f"{what}-during-prolog")
                    self.check_job(js, file_now)
                    self.live[p.job_id] = js
                    self.check_files_now()
                if p.stale_mark and p.gpus and run.killer is not None and run.killer.last_attempt_killed():
                    self.plant_stale_mark(js, run.killer)  # its Prolog died, then its pid was reused
                time.sleep(p.run_time)
                with self.cond:
                    self.check_files_now()
                    del self.live[p.job_id]
                    js.ended_at = time.monotonic()
        except Exception as error:  # noqa: BLE001 - a harness error is reported, never hidden
            self.bump("harness errors")
            self.anomalies.append({"kind": "harness error", "job": p.job_id, "what": repr(error)})
        self.end_job(js)

    def end_job(self, js: JobState) -> None:
        """The job's Epilog, then Slurm frees its GPUs."""
        p = js.plan
        try:
            self.write_job_record(js, "COMPLETING")
            run = self.run_hook("epilog", js, p.epilog_kill)
            js.epilog_wall = run.wall
            self.epilog_walls.append(run.wall)
            self.note_kills(js, run, "epilog")
            self.note_stderr(run)
            if run.timed_out or run.rc != 0:
                self.bump("Epilog wrapper failures")
                self.anomalies.append({"kind": "epilog wrapper failed", "job": p.job_id,
                                       "what": "timed out" if run.timed_out else f"exit status {run.rc}"})
        except Exception as error:  # noqa: BLE001 - a harness error is reported, never hidden
            self.bump("harness errors")
            self.anomalies.append({"kind": "harness error", "job": p.job_id, "what": repr(error)})
        finally:
            with self.cond:
                self.live.pop(p.job_id, None)
                self.allocated.pop(p.job_id, None)
                self.slurm_free |= set(js.slurm_gpus)
                self.write_running()
                self.write_job_record(js, "COMPLETED")
                self.ended_ids.append(p.job_id)
                self.start_fitting()
                self.cond.notify_all()

    def bump(self, key: str, by: int = 1) -> None:
        with self.count_lock:
            self.counts[key] += by

    def note_stderr(self, run: HookRun) -> None:
        if not run.stderr:
            return
        self.bump("hook runs that wrote to stderr")
        text = run.stderr[-300:].decode("utf-8", "replace")
        if len(self.stderr_samples) < 5 and text not in self.stderr_samples:
            self.stderr_samples.append(text)

    def note_kills(self, js: JobState, run: HookRun, kind: str) -> None:
        k = run.killer
        if k is None:
            return
        self.bump(f"{kind} kill plans")
        if not k.killed:
            self.bump(f"{kind} kill plans that missed (hook done first)")
        for what, ms in k.killed:
            self.bump(f"kill -9 of {kind} {what}")
            js.faults.append(f"{kind}-kill:{what}@{ms:g}ms")

    def plant_stale_mark(self, js: JobState, killer: Killer | None) -> None:
        """The job's Prolog died; its pid now belongs to an unrelated live process (the decoy)."""
        path = self.jobs_dir / f".prolog-{js.plan.job_id}"
        decoy = self.decoy.pid
        try:
            old = path.read_bytes()
        except OSError:
            old = b""
        if re.fullmatch(rb"[0-9]+\n?", old):
            new = f"{decoy}\n".encode()
        elif re.search(rb"pid=[0-9]+", old):
            new = re.sub(rb"pid=[0-9]+", f"pid={decoy}".encode(), old, count=1)
        else:
            ticks = max((t for t in (killer.start_ticks.values() if killer else ()) if t), default=1)
            new = f"pid={decoy} start={ticks} slurm={','.join(map(str, js.slurm_gpus))}\n".encode()
        _atomic_write(path, new, mode=0o600)
        self.bump("stale marks planted (reused pid)")
        js.faults.append("stale-mark-with-live-pid")

    def plant_orphan_mark(self) -> None:
        with self.cond:
            candidates = [j for j in self.ended_ids[-50:] if j not in self.allocated]
        if not candidates or self.decoy is None:
            return
        job = candidates[-1]
        _atomic_write(self.jobs_dir / f".prolog-{job}", f"pid={self.decoy.pid} start=1 slurm=0\n".encode(), mode=0o600)
        self.bump("stale marks planted for ended jobs")

    # --- the invariant -----------------------------------------------------------------------------

    def check_job(self, js: JobState, file_now: tuple[int, ...] | None) -> None:
        """At ``js``'s start (under the lock): it shares no GPU with a live job."""
        p = js.plan
        if js.binding_source == "file":
            if p.gpus == 0:
                self.anomalies.append({"kind": "a CPU-only job got GPUs", "job": p.job_id, "gpus": js.binding})
            elif len(js.binding) != p.gpus:
                self.anomalies.append({"kind": "GPU count differs from Slurm's", "job": p.job_id, "gpus": js.binding,
                                       "slurm": js.slurm_gpus})
            if any(g >= self.sc.gpus for g in js.binding):
                self.anomalies.append({"kind": "job file names GPUs the node lacks", "job": p.job_id, "gpus": js.binding})
        elif file_now is not None or (self.jobs_dir / str(p.job_id)).exists():
            self.anomalies.append({"kind": "job file exists but the TaskProlog exported nothing", "job": p.job_id})
        elif p.gpus and not js.killed_all:
            # Not a violation by itself, but the issue wants a safe job file whatever failed.
            self.anomalies.append({"kind": "a GPU job started without a job file though its Prolog was not killed to the end",
                                   "job": p.job_id, "faults": list(js.faults)})
        if p.gpus:
            self.bump("GPU jobs started")
            self.bump(f"GPU jobs on {'MAPA' if js.binding_source == 'file' else 'Slurm'}'s GPUs")
        else:
            self.bump("CPU-only jobs started")
        for other in self.live.values():
            shared = set(js.binding) & set(other.binding)
            if shared:
                self.record_overlap(other, js, shared, "at-start")

    def check_files_now(self) -> None:
        """The definition read literally, now: job file if any, else Slurm's indices."""
        current = {}
        for job, js in self.live.items():
            gpus = read_job_file(self.jobs_dir / str(job))
            current[job] = gpus if gpus is not None else js.slurm_gpus
            if gpus is not None and js.binding_source == "file" and gpus != js.binding:
                self._anomaly_once("job file changed while the job ran", job, {"was": js.binding, "now": gpus})
            if gpus is None and js.binding_source == "file":
                self._anomaly_once("job file removed while the job ran", job, {"was": js.binding})
        jobs = sorted(current)
        for i, a in enumerate(jobs):
            for b in jobs[i + 1:]:
                shared = set(current[a]) & set(current[b])
                if shared and (a, b) not in self.violations:
                    self.record_overlap(self.live[a], self.live[b], shared, "job-files-now")

    def _anomaly_once(self, kind: str, job: int, extra: dict) -> None:
        key = (kind, job)
        if key in self._seen_anomalies:
            return
        self._seen_anomalies.add(key)
        self.anomalies.append({"kind": kind, "job": job, **extra})

    def record_overlap(self, older: JobState, newer: JobState, shared: set[int], view: str) -> None:
        a, b = sorted((older, newer), key=lambda j: j.live_at or 0)
        key = (a.plan.job_id, b.plan.job_id)
        if key in self.violations:
            return
        if a.binding_source == "slurm" and b.binding_source == "slurm":
            category = "harness-bug (Slurm gave one GPU twice)"
        elif b.binding_source == "slurm" and b.killed_all:
            category = "shared-after-killed-prolog"  # MAPA gave it to `a` first; Slurm then to `b`, whose Prolog died
        elif a.binding_source == "slurm" and a.killed_all and b.prolog_started < (a.live_at or 0):
            category = "shared-after-killed-prolog"  # concurrent Prologs: `a` died while `b` chose
        elif self._announced_sharing(a, b):
            category = "announced-sharing"  # the Prolog found too few free GPUs and said it SHARES (a documented limit)
        else:
            category = "double-use"
        detail = ""
        if category == "double-use":
            if any((j.plan.job_id, g) in self.shared_gpus for j in (a, b) for g in shared):
                detail = "third job on a GPU two jobs already shared"
            elif (a.binding_source == "slurm" and a.killed_all) or (b.binding_source == "slurm" and b.killed_all):
                detail = "a later Prolog gave away the Slurm GPUs of a job whose Prolog was killed"
            elif a.binding_source == "slurm" or b.binding_source == "slurm":
                detail = "a Prolog that was not killed left no job file"
            else:
                detail = "two MAPA choices"
        else:
            for j in (a, b):
                if j.binding_source == "slurm":
                    self.shared_gpus |= {(j.plan.job_id, g) for g in shared}
        self.violations[key] = {
            "category": category, "detail": detail, "view": view, "gpus": sorted(shared),
            "jobs": [self._job_summary(a), self._job_summary(b)],
            "at_s": round(time.monotonic() - self.started_at, 2),
            "ledger_corruptions_before": [what for t, what in self.events if what.startswith("ledger-")],
        }

    def _announced_sharing(self, *jobs: JobState) -> bool:
        """Whether one of the jobs' Prologs logged that it found too few free GPUs and shares."""
        try:
            text = (self.dir / "mapa.log").read_text(errors="replace")
        except OSError:
            return False
        return any(f"job {j.plan.job_id}: too few GPUs" in line and "SHARES" in line for line in text.splitlines() for j in jobs)

    def _job_summary(self, js: JobState) -> dict[str, Any]:
        p = js.plan
        return {"job": p.job_id, "gpus": list(js.binding), "source": js.binding_source, "slurm": list(js.slurm_gpus),
                "directive": p.directive, "latin1": p.latin1, "bad_name": p.bad_name, "faults": list(js.faults),
                "prolog_s": round(js.prolog_wall, 3)}

    # --- faults on the node ------------------------------------------------------------------------

    def corrupt_ledger(self, variant: str) -> None:
        """Replace the ledger by a corrupt one (under its lock when it can be had quickly)."""
        lock_fd = None
        try:
            lock_path = self.ledger.with_name(self.ledger.name + ".lock")
            if lock_path.exists():
                lock_fd = os.open(lock_path, os.O_RDWR)
                deadline = time.monotonic() + 0.5
                while True:
                    try:
                        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as error:
                        if error.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                            break
                        time.sleep(0.005)
            try:
                real = json.loads(self.ledger.read_bytes()) if not self.ledger.is_symlink() else None
            except (OSError, ValueError, RecursionError):
                real = None
            if (not isinstance(real, dict) or not isinstance(real.get("jobs"), dict) or not real["jobs"]
                    or not all(isinstance(e, dict) and isinstance(e.get("gpus"), list) and all(type(g) is int for g in e["gpus"])
                               for e in real["jobs"].values())):  # e.g. still the last corruption: start from a sound one
                real = {"version": 1, "jobs": {"999999901": {"gpus": [0], "policy": "preserve", "since": time.time() - 5, "note": ""}}}
            jobs = real["jobs"]
            first = sorted(jobs)[0]
            if variant == "symlink":
                tmp = self.ledger.with_name(".corrupt-link")
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                os.symlink(self.victim, tmp)
                os.replace(tmp, self.ledger)
            else:
                data = corrupt_bytes(variant, real, first, self.sc.gpus)
                _atomic_write(self.ledger, data)
            self.bump(f"ledger corruption: {variant}")
            self.bump("ledger corruptions")
            self.events.append((time.monotonic(), f"ledger-{variant}"))
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    # --- the scheduler -----------------------------------------------------------------------------

    def start_fitting(self) -> None:
        """Under the lock: start the queued jobs that fit, Slurm picking their GPUs. GPU jobs start in
        order; CPU-only jobs are backfilled past a GPU job that waits for GPUs (so a burst starts at once)."""
        if self.stopping:
            return
        waiting: deque[JobState] = deque()
        gpu_job_waits = False
        while self.queue:
            js = self.queue.popleft()
            if len(self.allocated) >= self.sc.max_live or (js.plan.gpus and (gpu_job_waits or js.plan.gpus > len(self.slurm_free))):
                gpu_job_waits = gpu_job_waits or bool(js.plan.gpus)
                waiting.append(js)
                continue
            self.start_job(js)
        self.queue = waiting

    def start_job(self, js: JobState) -> None:
        group = self.plan[js.plan.group] if js.plan.group >= 0 else None
        if group is not None and not group.fired:
            group.fired = True  # the group's node events happen as its first job starts
            self.fire_events(group)
        free = sorted(self.slurm_free)
        if js.plan.random_pick:
            gpus = tuple(sorted(random.Random(js.plan.job_id).sample(free, js.plan.gpus)))
        else:
            gpus = tuple(free[: js.plan.gpus])
        js.slurm_gpus = gpus
        self.slurm_free -= set(gpus)
        self.allocated[js.plan.job_id] = js
        js.allocated_at = time.monotonic()
        self.write_job_record(js, "CONFIGURING" if js.plan.gpus % 2 else "RUNNING")
        self.write_batch_script(js)
        self.write_running()
        thread = threading.Thread(target=self.lifecycle, args=(js,), daemon=True)
        self.threads.append(thread)
        thread.start()

    def fire_events(self, group: GroupPlan) -> None:
        """Slurm's weather, a ledger corruption, a stale mark, an agent kill: as a group's first job starts."""
        if group.weather is not None:
            self.set_weather(group.weather)
            self.bump(f"Slurm weather set: scontrol={group.weather[0]} squeue={group.weather[1]}")
        if len(group.jobs) >= 32:
            self.bump("bursts")
        actions = [(self.later, (delay, self.corrupt_ledger, variant)) for delay, variant in group.corruptions]
        actions += [(self.plant_orphan_mark, ())] * group.orphan_marks
        actions += [(self.agent_chaos, kill) for kill in group.agent_kills]
        for target, args in actions:
            thread = threading.Thread(target=self._guarded, args=(target, args), daemon=True)
            self.chaos_threads.append(thread)
            thread.start()

    def later(self, delay: float, action, *args) -> None:
        time.sleep(delay)
        if not self.quiet and not self.stopping:
            action(*args)

    def _guarded(self, target, args) -> None:
        try:
            target(*args)
        except Exception as error:  # noqa: BLE001 - reported, never hidden
            self.bump("harness errors")
            self.anomalies.append({"kind": "harness error", "job": None, "what": f"{target.__name__}: {error!r}"})

    stopping = False
    quiet = False

    def run(self) -> "Report":
        self.started_at = time.monotonic()
        try:
            self.setup()
            for group in self.plan:
                time.sleep(group.gap)
                if time.monotonic() - self.started_at > self.sc.deadline:
                    self.truncated = True
                    break
                with self.cond:
                    # Backpressure: arrivals wait while much is queued (the queue is Slurm's pending list).
                    while len(self.queue) > self.sc.max_live and time.monotonic() - self.started_at < self.sc.deadline:
                        self.cond.wait(0.5)
                    self.queue.extend(JobState(plan) for plan in group.jobs)
                    self.start_fitting()
            with self.cond:
                while self.queue or self.allocated:
                    if time.monotonic() - self.started_at > self.sc.deadline and self.queue:
                        self.truncated = True
                        self.queue.clear()
                    self.cond.wait(0.5)
            for thread in self.threads:
                thread.join()
            self.quiet = True
            for chaos in self.chaos_threads:
                chaos.join()
            self.final_round()
        finally:
            self.stopping = True
            self.cleanup()
        return self.report()

    def final_round(self) -> None:
        """One fresh job's Prolog and Epilog on a quiet node, then: has everything converged?"""
        time.sleep(0.2)
        self.set_weather(("normal", "normal"))
        if self.sc.mode in ("agent", "mixed"):
            self.start_agent(wait=True)
        last = max((g.jobs[-1].job_id for g in self.plan if g.jobs), default=1000)
        plan = JobPlan(last + 1000, -1, 1, "none", "", False, False, 0.0, False, KillPlan(), KillPlan(), False)
        js = JobState(plan)
        with self.cond:
            js.slurm_gpus = (min(self.slurm_free),)
            self.slurm_free -= set(js.slurm_gpus)
            self.allocated[plan.job_id] = js
            self.write_job_record(js, "RUNNING")
            self.write_batch_script(js)
            self.write_running()
        self.lifecycle(js)
        self.final = self.convergence()

    def convergence(self) -> dict[str, Any]:
        problems: list[str] = []
        entries: Any = None
        if os.path.islink(self.ledger):
            problems.append("the ledger is still a symlink")
        elif self.ledger.exists():
            try:
                data = json.loads(self.ledger.read_bytes())
                entries = data.get("jobs") if isinstance(data, dict) else None
                if not isinstance(entries, dict):
                    problems.append(f"the ledger has no jobs table: {str(data)[:80]}")
                elif entries:
                    problems.append(f"ledger entries left: {json.dumps(entries)[:300]}")
            except (OSError, ValueError, RecursionError) as error:
                problems.append(f"the ledger is unreadable: {str(error)[:200]}")
        now = time.time()
        recent_tmp = []
        for folder in (self.jobs_dir, self.ledger.parent):
            if not folder.exists():
                continue
            for entry in sorted(os.listdir(folder)):
                path = folder / entry
                if folder == self.ledger.parent and entry in (self.ledger.name, self.ledger.name + ".lock",
                                                              self.ledger.name + ".reconciled", "journal"):
                    continue  # the journal holds AdminComment records (counted below): not about GPUs
                if entry.endswith(".tmp"):
                    age = now - os.lstat(path).st_mtime
                    if age < 60:
                        recent_tmp.append(f"{path.name} ({age:.0f} s old)")
                        continue
                problems.append(f"left in {folder.name}/: {entry}")
        if self.victim.read_bytes() != self.victim_text:
            problems.append("the file a planted ledger symlink pointed to was written through")
        journal = self.ledger.parent / "journal"
        unwritten = sorted(os.listdir(journal)) if journal.is_dir() else []
        return {"converged": not problems, "problems": problems, "recent_temp_files": recent_tmp,
                "admin_comment_records_not_yet_written": len(unwritten)}

    def cleanup(self) -> None:
        metrics_flooder = getattr(self, "metrics_flooder", None)
        if metrics_flooder is not None:
            # Still under the flood: an agent (restarted if the schedule left it down) answers a scrape.
            try:
                self.start_agent(wait=True)
                self.counts["metrics scrapes answered under the flood"] = int(self.scrape_metrics())
            except RuntimeError:
                self.counts["metrics scrapes answered under the flood"] = 0
            metrics_flooder.kill()
            held = metrics_flooder.communicate()[0].split()
            self.counts["metrics connections opened by the flood"] = max(map(int, held)) if held else 0
        with self.agent_lock:
            if self.agent is not None and self.agent.poll() is None:
                self.agent.kill()
                self.agent.wait()
        flooder = getattr(self, "flooder", None)
        if flooder is not None:
            flooder.kill()
            held = flooder.communicate()[0].split()
            self.counts["isolate socket connections held by the flood"] = int(held[-1]) if held else 0
        if getattr(self, "isolate_dir", None) is not None:
            shutil.rmtree(self.isolate_dir, ignore_errors=True)
        if self.decoy is not None and self.decoy.poll() is None:
            self.decoy.kill()
            self.decoy.wait()
        needle = str(self.dir).encode()
        for _ in range(5):
            left = processes_mentioning(needle)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        with self.cond:
            self.cond.notify_all()

    # --- the result -----------------------------------------------------------------------------

    def report(self) -> "Report":
        calls = Counter()
        for name in ("scontrol", "squeue"):
            try:
                for line in (self.state / f"calls.{name}").read_text().split():
                    calls[f"{name} {line}"] += 1
            except OSError:
                pass
        violations = list(self.violations.values())
        by_category = Counter(v["category"] for v in violations)
        log_lines = {}
        try:
            log_text = (self.dir / "mapa.log").read_text(errors="replace").splitlines()
        except OSError:
            log_text = []
        for v in violations[:10]:
            for j in v["jobs"]:
                needle = f"job {j['job']}"
                log_lines[j["job"]] = [line for line in log_text if needle + ":" in line or needle + " " in line][:12]
        scheduled = sum(len(g.jobs) for g in self.plan)
        return Report(
            scenario=self.sc, budget_supported=self.budget_supported,
            jobs_planned=scheduled, jobs_run=len(self.prolog_walls) - 1 if self.final else len(self.prolog_walls),
            truncated=self.truncated, wall_s=time.monotonic() - self.started_at,
            double_uses=by_category.get("double-use", 0) + by_category.get("harness-bug (Slurm gave one GPU twice)", 0),
            shared_after_killed_prolog=by_category.get("shared-after-killed-prolog", 0),
            announced_sharing=by_category.get("announced-sharing", 0),
            violations=violations, counts=dict(self.counts), slurm_calls=dict(calls),
            prolog_walls=self.prolog_walls, gpu_prolog_walls=self.gpu_prolog_walls, epilog_walls=self.epilog_walls,
            anomalies=self.anomalies, final=self.final, log_lines=log_lines, stderr_samples=self.stderr_samples,
        )


@dataclass
class Report:
    scenario: Scenario
    budget_supported: bool
    jobs_planned: int
    jobs_run: int
    truncated: bool
    wall_s: float
    double_uses: int
    announced_sharing: int
    shared_after_killed_prolog: int
    violations: list[dict[str, Any]]
    counts: dict[str, int]
    slurm_calls: dict[str, int]
    prolog_walls: list[float]
    gpu_prolog_walls: list[float]
    epilog_walls: list[float]
    anomalies: list[dict[str, Any]]
    final: dict[str, Any]
    log_lines: dict[int, list[str]]
    stderr_samples: list[str] = field(default_factory=list)

    @property
    def wrapper_failures(self) -> int:
        return self.counts.get("Prolog wrapper failures", 0) + self.counts.get("Epilog wrapper failures", 0)

    @property
    def converged(self) -> bool:
        return bool(self.final.get("converged"))

    def ok(self) -> bool:
        return (self.double_uses == 0 and self.wrapper_failures == 0 and self.converged and not self.truncated
                and not self.counts.get("harness errors"))

    def faults(self) -> dict[str, int]:
        """Faults injected, by kind."""
        c = self.counts
        out = {
            "kill -9 of a Prolog's Python": sum(v for k, v in c.items() if k.startswith("kill -9 of prolog")),
            "GPU jobs whose every Prolog attempt was killed": c.get("Prologs with every attempt killed", 0),
            "kill -9 of an Epilog's Python": sum(v for k, v in c.items() if k.startswith("kill -9 of epilog")),
            "kill -9 of the agent": c.get("agent kills", 0),
            "ledger corruptions": c.get("ledger corruptions", 0),
            "stale marks with a live pid": c.get("stale marks planted (reused pid)", 0) + c.get("stale marks planted for ended jobs", 0),
            "Slurm calls slow": sum(v for k, v in self.slurm_calls.items() if k.endswith(" slow")),
            "Slurm calls failing": sum(v for k, v in self.slurm_calls.items() if k.endswith(" fail")),
            "Slurm calls hanging": sum(v for k, v in self.slurm_calls.items() if k.endswith(" hang")),
            "Slurm calls printing garbage": sum(v for k, v in self.slurm_calls.items() if k.endswith(" garbage")),
            "bursts of 32+ jobs": c.get("bursts", 0),
            "CPU-only jobs": c.get("CPU-only jobs started", 0),
            "jobs running from an earlier release": c.get("jobs running from an earlier release", 0),
            "isolate socket connections held by a flooding user": c.get("isolate socket connections held by the flood", 0),
            "metrics connections opened by a flooding user": c.get("metrics connections opened by the flood", 0),
            "metrics scrapes answered under the flood": c.get("metrics scrapes answered under the flood", 0),
        }
        return out

    def summary(self) -> dict[str, Any]:
        def stat(values: list[float], q: float) -> float:
            if not values:
                return 0.0
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))]

        return {
            "scenario": self.scenario.name(), "jobs": self.jobs_run, "truncated": self.truncated, "wall_s": round(self.wall_s, 1),
            "double_uses": self.double_uses, "shared_after_killed_prolog": self.shared_after_killed_prolog,
            "announced_sharing": self.announced_sharing,
            "wrapper_failures": self.wrapper_failures, "converged": self.converged,
            "prolog_median_s": round(statistics.median(self.prolog_walls), 3) if self.prolog_walls else 0.0,
            "prolog_p99_s": round(stat(self.prolog_walls, 0.99), 3),
            "prolog_max_s": round(max(self.prolog_walls, default=0.0), 3),
            "gpu_prolog_median_s": round(statistics.median(self.gpu_prolog_walls), 3) if self.gpu_prolog_walls else 0.0,
            "epilog_max_s": round(max(self.epilog_walls, default=0.0), 3),
            "prologs_over_budget": self.prologs_over_budget,
            "budget_in_config": self.budget_supported,
        }

    @property
    def prologs_over_budget(self) -> int:
        """Prolog wrappers that took longer than the configured budget plus a second (retries included)."""
        if not self.budget_supported:
            return 0
        return sum(1 for wall in self.prolog_walls if wall > self.scenario.prolog_budget + 1.0)

    def to_dict(self) -> dict[str, Any]:
        sc = {k: v for k, v in self.scenario.__dict__.items()}
        return {"summary": self.summary(), "faults": self.faults(), "counts": self.counts, "slurm_calls": self.slurm_calls,
                "violations": self.violations, "anomalies": self.anomalies[:200], "final": self.final, "scenario": sc,
                "log_lines": {str(k): v for k, v in self.log_lines.items()}}

    def text(self, details: int = 5) -> str:
        s = self.summary()
        lines = [f"== {s['scenario']}: {s['jobs']} jobs in {s['wall_s']} s"
                 + (" (CUT SHORT by the deadline)" if self.truncated else "")
                 + f"; package {self.scenario.package_root}; prolog_budget in config: {self.budget_supported}",
                 f"   double uses: {self.double_uses}   shared-after-killed-prolog: {self.shared_after_killed_prolog}   "
                 f"announced sharing (too few free): {self.announced_sharing}   "
                 f"wrapper failures: {self.wrapper_failures}   converged: {self.converged}",
                 f"   Prolog wall: median {s['prolog_median_s']} s, p99 {s['prolog_p99_s']} s, max {s['prolog_max_s']} s; "
                 f"Epilog max {s['epilog_max_s']} s; max simultaneous Prologs {self.counts.get('max simultaneous Prologs', 0)}"
                 + (f"; {self.prologs_over_budget} Prologs over budget + 1 s" if self.prologs_over_budget else ""),
                 "   faults: " + ", ".join(f"{k} {v}" for k, v in self.faults().items() if v)]
        if not self.converged:
            lines.append("   NOT CONVERGED: " + "; ".join(self.final.get("problems", ["no final round"]))[:1500])
        if self.final.get("recent_temp_files"):
            lines.append("   temporary files younger than 60 s: " + ", ".join(self.final["recent_temp_files"]))
        for sample in self.stderr_samples[:3]:
            lines.append(f"   a hook wrote to stderr: {sample.strip()[:300]!r}")
        kinds = Counter(a["kind"] for a in self.anomalies)
        if kinds:
            lines.append("   anomalies: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
        for v in self.violations[:details]:
            lines.append(f"   - {v['category']}" + (f" ({v['detail']})" if v["detail"] else "")
                         + f" on GPUs {v['gpus']} [{v['view']}] at {v['at_s']} s"
                         + (f" (ledger corruptions before it: {', '.join(v['ledger_corruptions_before'])})"
                            if v["ledger_corruptions_before"] else "") + ":")
            for j in v["jobs"]:
                lines.append(f"       job {j['job']}: {j['source']} GPUs {j['gpus']} (Slurm {j['slurm']}), directive {j['directive']}"
                             f"{', latin-1 script' if j['latin1'] else ''}{', non-UTF-8 name' if j['bad_name'] else ''}; "
                             f"Prolog {j['prolog_s']} s; faults: {', '.join(j['faults']) or 'none'}")
                for line in self.log_lines.get(j["job"], [])[:6]:
                    lines.append(f"           | {line[:220]}")
        if len(self.violations) > details:
            lines.append(f"   ... and {len(self.violations) - details} more overlaps")
        return "\n".join(lines)


# --- helpers ---------------------------------------------------------------------------------------


def read_job_file(path: Path) -> tuple[int, ...] | None:
    """The GPUs of a per-job file as the TaskProlog reads it (first line, MAPA_GPUS=strict list)."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(4096)
    except OSError:
        return None
    match = re.fullmatch(rb"MAPA_GPUS=([0-9]+(?:,[0-9]+)*)\n?", first)
    return tuple(int(g) for g in match.group(1).split(b",")) if match else None


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.faultsim-{threading.get_ident()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def corrupt_bytes(variant: str, real: dict, first: str, size: int) -> bytes:
    """The ledger ``real`` with one thing wrong, as bytes."""
    import copy

    data = copy.deepcopy(real)
    entry = data["jobs"][first]
    if variant == "not-json":
        return b"{ this is not JSON, the disk was full"
    if variant == "non-utf8":
        return json.dumps(data).encode().replace(b'"note": "', b'"note": "\xff\xfe', 1) + b"\xe9"
    if variant == "deep-json":
        return b'{"version": 1, "jobs": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    if variant == "empty":
        return b""
    if variant == "truncated":
        text = json.dumps(data).encode()
        return text[: len(text) // 2]
    if variant == "oversized":
        return json.dumps(data).encode() + b" " * (2 << 20)
    if variant == "version-2":
        data["version"] = 2
    elif variant == "jobs-list":
        data["jobs"] = list(data["jobs"].items())
    elif variant == "top-level-list":
        data = [data]
    elif variant == "since-null":
        entry["since"] = None
    elif variant == "since-string":
        entry["since"] = "yesterday"
    elif variant == "since-nan":
        return json.dumps(data).encode().replace(b'"since": ', b'"since": NaN, "x": ', 1)
    elif variant == "since-future":
        data["jobs"]["999999902"] = {"gpus": [size - 1], "policy": "preserve", "since": time.time() + 1e9, "note": "clock"}
        for other in data["jobs"].values():
            if other is not data["jobs"]["999999902"] and size - 1 in other.get("gpus", []):
                other["gpus"] = [g for g in other["gpus"] if g != size - 1]
    elif variant == "gpus-string":
        entry["gpus"] = "x"
    elif variant == "gpus-negative":
        entry["gpus"] = [-1] + list(entry.get("gpus", []))
    elif variant == "gpus-huge":
        entry["gpus"] = [10 ** 12, 2 ** 63]
    elif variant == "gpus-bool":
        entry["gpus"] = [True]
    elif variant == "gpus-float":
        entry["gpus"] = [float(g) for g in entry.get("gpus", [0])] or [0.0]
    elif variant == "gpus-dup-in-job":
        gpus = list(entry.get("gpus", [0])) or [0]
        entry["gpus"] = gpus + gpus[:1]
    elif variant == "gpus-dup-across-jobs":
        gpus = list(entry.get("gpus", [0])) or [0]
        data["jobs"]["999999903"] = {"gpus": gpus, "policy": "preserve", "since": time.time(), "note": ""}
    elif variant == "policy-object":
        entry["policy"] = {"name": "preserve"}
    elif variant == "note-list":
        entry["note"] = ["a"]
    elif variant == "missing-field":
        entry.pop("gpus", None)
    elif variant == "extra-field":
        entry["gpus_v2"] = [0]
    elif variant == "job-id-newline":
        data["jobs"][first + "\n"] = data["jobs"].pop(first)
    elif variant == "job-id-text":
        data["jobs"]["job" + first] = data["jobs"].pop(first)
    elif variant == "stale-entries":
        data["jobs"]["999999904"] = {"gpus": list(range(size)), "policy": "preserve", "since": time.time() - 100, "note": ""}
        for key in list(data["jobs"]):
            if key != "999999904":
                del data["jobs"][key]
    else:
        raise ValueError(f"unknown corruption {variant}")
    return json.dumps(data).encode()


def run_scenario(scenario: Scenario, workdir: Path | None = None) -> Report:
    """Run one scenario in ``workdir`` (a new temporary directory, removed afterwards, if None)."""
    own = workdir is None
    path = Path(tempfile.mkdtemp(prefix=f"faultsim-{scenario.name()}-")) if own else Path(workdir)
    sim = Simulation(scenario, path)
    try:
        report = sim.run()
    finally:
        if own and os.environ.get("FAULTSIM_KEEP") != "1":
            shutil.rmtree(path, ignore_errors=True)
    return report
