"""Randomised interleavings of Prologs and Epilogs in threads: lock holders, Prologs without the
lock (claims), Epilogs that cannot lock, all with random delays inside file writes, scans and held
locks. The invariant: no GPU in two live jobs (Slurm never gives more GPUs than the node has, so
MAPA never has to share here).

Before the claim rule covered lock holders too, and before Epilogs left word that the job ended,
these seeds found double uses (a lock holder writing a GPU a Prolog without the lock had just
claimed) and forced sharing (ledger entries of ended jobs filling the node while squeue failed).
The process-level soak with kill -9 is tests/core/test_invariant.py and benchmarks/bench_soak.py.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

import pytest

from slurm_mapa.slurm.hooks import epilog
from slurm_mapa.slurm.hooks import prolog as hooks
from slurm_mapa.slurm.node_state import job_files as jobfiles
from slurm_mapa.slurm import trusted_files as paths
from slurm_mapa.slurm.hooks.budget import Budget
from slurm_mapa.slurm.text.commands import CommandFailed
from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.node_state.ledger import LedgerFile

SIZE = 8


class Node:
    """Slurm's side for one node: it never gives a GPU to two jobs it runs at once."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.mutex = threading.Lock()
        self.slurm_free = set(range(SIZE))
        self.allocated: set[str] = set()
        self.live: dict[str, tuple[int, ...]] = {}  # what each started job uses
        self.overlaps: list[str] = []
        self.log: list[str] = []

    def squeue_or_scontrol(self, argv) -> str:
        time.sleep(random.random() * 0.02)
        if "squeue" in argv[0] and random.random() < 0.7:
            with self.mutex:
                return "".join(f"{job}\n" for job in sorted(self.allocated))
        raise CommandFailed(f"{argv[0]} exited 1: slurm_load_jobs error: Socket timed out")

    def record(self, line: str) -> None:
        with self.mutex:
            self.log.append(line)

    def run_job(self, config: HookConfig, job: str, wanted: int) -> None:
        with self.mutex:
            if len(self.slurm_free) < wanted:
                return
            slurm_gpus = sorted(self.rng.sample(sorted(self.slurm_free), wanted))
            self.slurm_free.difference_update(slurm_gpus)
            self.allocated.add(job)
        env = {"SLURM_JOB_ID": job, "SLURMD_NODENAME": "dgx1", "SLURM_JOB_GPUS": ",".join(map(str, slurm_gpus))}
        hooks.run_prolog(env, config, self.squeue_or_scontrol, self.record, budget=Budget(random.choice([0.5, 1.5, 3.0])))
        try:
            uses = jobfiles.parse_job_file((config.jobs_dir / job).read_bytes())
        except FileNotFoundError:
            uses = tuple(slurm_gpus)  # the TaskProlog then leaves Slurm's binding
        with self.mutex:
            for other, gpus in self.live.items():
                if set(gpus) & set(uses):
                    self.overlaps.append(f"jobs {other} {gpus} and {job} {uses}")
            self.live[job] = uses
        time.sleep(random.random() * 0.2)
        with self.mutex:
            del self.live[job]
        epilog.run_epilog({"SLURM_JOB_ID": job}, config, self.record)
        with self.mutex:
            self.slurm_free.update(slurm_gpus)
            self.allocated.discard(job)


def slowed(function):
    """``function`` with random pauses before and after: a thread descheduled at the worst time."""

    def call(*args, **kwargs):
        if random.random() < 0.3:
            time.sleep(random.random() * 0.02)
        result = function(*args, **kwargs)
        if random.random() < 0.3:
            time.sleep(random.random() * 0.02)
        return result

    return call


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_no_gpu_in_two_jobs_under_random_interleavings(tmp_path: Path, monkeypatch, seed: int) -> None:
    random.seed(seed)
    node = Node(random.Random(seed))
    (tmp_path / "state").mkdir(mode=0o755)
    config = HookConfig(ledger=tmp_path / "state" / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                        nodes=(("dgx*", "dgx1-v100"),), command_timeout=0.5, prolog_budget=3.0, health="off")
    real_locked = LedgerFile.locked

    @contextlib.contextmanager
    def locked(self, timeout=10.0):
        # Short waits make Prologs take the path without the lock and Epilogs give up on it.
        with real_locked(self, timeout=min(timeout, random.choice([0.01, 0.05, 0.3, 2.0]))):
            if random.random() < 0.2:
                time.sleep(random.random() * 0.3)
            yield

    monkeypatch.setattr(LedgerFile, "locked", locked)
    monkeypatch.setattr(paths, "replace_file", slowed(paths.replace_file))
    monkeypatch.setattr(paths, "create_file", slowed(paths.create_file))
    monkeypatch.setattr(jobfiles, "scan", slowed(jobfiles.scan))

    threads: list[threading.Thread] = []
    for job in range(1000, 1250):
        thread = threading.Thread(target=node.run_job, args=(config, str(job), node.rng.choice([1, 1, 2, 2, 3, 4])), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(node.rng.random() * 0.03)
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    lock_timeouts = sum("LEDGER LOCK TIMEOUT (" in line for line in node.log)
    assert lock_timeouts > 0, "the test must exercise the path without the lock"
    assert node.overlaps == [], "\n".join(node.overlaps[:5])
    assert not [line for line in node.log if "internal error" in line or "Traceback" in line]
