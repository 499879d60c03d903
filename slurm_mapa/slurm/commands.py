"""Thin adapters over scontrol and squeue: pure parsers of their output, one runner with a timeout.

The hooks have no PATH (Slurm runs them with an empty environment), so the binaries are named by
absolute path from the config. No shell is ever involved.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import Sequence

MAX_OUTPUT_BYTES = 4 << 20
_JOB_ID = re.compile(r"^[0-9]{1,12}$")


class CommandFailed(RuntimeError):
    """A Slurm command failed, timed out or printed something unreadable."""


@dataclass(frozen=True)
class Runner:
    """Runs a command without a shell, bounded in time and output."""

    timeout: float = 5.0

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> str:
        try:
            done = subprocess.run(
                list(argv), input=stdin, capture_output=True, text=True, timeout=self.timeout, check=False, env={"LC_ALL": "C"}
            )
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"{argv[0]} timed out after {self.timeout:g} s") from None
        except OSError as error:
            raise CommandFailed(f"cannot run {argv[0]}: {error.strerror}") from None
        if done.returncode != 0:
            raise CommandFailed(f"{' '.join(argv[:3])} exited {done.returncode}: {done.stderr.strip()[:300]}")
        if len(done.stdout) > MAX_OUTPUT_BYTES:
            raise CommandFailed(f"{argv[0]} printed more than {MAX_OUTPUT_BYTES} bytes")
        return done.stdout


def is_job_id(text: str) -> bool:
    return bool(_JOB_ID.match(text))


def parse_job_json(text: str) -> dict:
    """The first job of `scontrol --json show job ID`."""
    try:
        data = json.loads(text)
        jobs = data["jobs"]
        if not isinstance(jobs, list) or not jobs or not isinstance(jobs[0], dict):
            raise KeyError("jobs")
        return jobs[0]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CommandFailed("scontrol --json show job printed no job") from None


def parse_job_ids(text: str) -> set[str]:
    """`squeue -h -o %A` output: one job id per line."""
    ids = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not is_job_id(line):
            raise CommandFailed(f"squeue printed {line[:40]!r} where a job id was expected")
        ids.add(line)
    return ids


def parse_gpu_indices(text: str) -> tuple[int, ...]:
    """Slurm's GPU index lists as the hooks see them: `0,1,4` (also ranges `0-3`)."""
    gpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"not a GPU index list: {text[:60]!r}")
        gpus.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    return tuple(gpus)


def show_job_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "--json", "show", "job", job_id]


def batch_script_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "write", "batch_script", job_id, "-"]


def running_jobs_argv(squeue: str, node: str) -> list[str]:
    return [squeue, "--noheader", "--nodelist", node, "--states", "RUNNING,CONFIGURING,COMPLETING,SUSPENDED", "--format", "%A"]


def admin_comment_argv(scontrol: str, job_id: str, text: str) -> list[str]:
    return [scontrol, "update", f"job={job_id}", f"AdminComment={text}"]


_GRES_IDX = re.compile(r"^gpu(?::[^:(]+)?:[0-9]+\(IDX:([0-9,\-]*)\)$")


def slurm_gpus_on_only_node(job: dict) -> tuple[int, ...] | None:
    """The GPU indices Slurm gave a one-node job, from `gres_detail` (e.g. ``gpu:2(IDX:0-1)``).

    None when the job spans several nodes (its per-node list would need the host list expanded)
    or the record has no readable detail; an empty tuple for a job without GPUs.
    """
    detail = job.get("gres_detail")
    if not isinstance(detail, list) or len(detail) > 1:
        return None
    if not detail:
        return ()
    gpus: list[int] = []
    for part in re.split(r",(?=gpu)", str(detail[0])):
        match = _GRES_IDX.match(part.strip())
        if match is None:
            return None
        gpus.extend(parse_gpu_indices(match.group(1)))
    return tuple(sorted(set(gpus)))
