"""The job as slurmd describes it to the Prolog: its environment, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..node_state import is_sluid
from ..text.commands import is_job_id, parse_gpu_indices


@dataclass
class PrologContext:
    job_id: str
    node: str
    slurm_gpus: tuple[int, ...]
    env_comment: str
    nodes_in_job: int = 1
    job_cpus: frozenset[int] | None = None  # from the job's cpuset cgroup when the Prolog runs in it (job_cpus.py)
    sluid: str = ""  # SLURM_JOB_SLUID (Slurm 25.11+): names the job's cgroup v2 directory from 26.05


def context_from_env(env: Mapping[str, str]) -> PrologContext:
    """The job as slurmd describes it; ValueError if the variables are not what slurmd sets."""
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME", "")
    if not is_job_id(job_id) or not node or len(node) > 255 or any(c in node for c in "/\0\n \t"):
        raise ValueError(f"SLURM_JOB_ID {job_id[:40]!r} / SLURMD_NODENAME {node[:40]!r} are not what slurmd sets")
    gpus = parse_gpu_indices(env.get("SLURM_JOB_GPUS", ""))
    nodes = env.get("SLURM_JOB_NUM_NODES", "1")
    return PrologContext(
        job_id=job_id,
        node=node,
        slurm_gpus=gpus,
        env_comment=env.get("SLURM_JOB_COMMENT", "")[:8192],
        nodes_in_job=int(nodes) if nodes.isdigit() and len(nodes) < 7 else 2,
        sluid=env.get("SLURM_JOB_SLUID", "") if is_sluid(env.get("SLURM_JOB_SLUID", "")) else "",
    )


