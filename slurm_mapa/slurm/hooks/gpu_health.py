"""Which GPUs a new job must not get on this node: those the driver's library reports unhealthy
(NVML, AMD SMI: ``health = "auto"``) and those held out of new jobs (``mapa gpu hold``, issue 50).

Neither ever stops a job: a probe that fails, or a held-GPUs file that cannot be read, leaves
every GPU usable and says so in the log. A held GPU is given to a new job only when too few
others are free (the fail-open fallback takes the unheld ones first, prolog.fallback_gpus); the
decision record then says ``held=GPUS`` and the log says why.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..config import HookConfig
from ..node_state import HeldCorrupt, NodeState
from ..text.commands import Log
from ..text.decision import Decision
from .budget import Budget, run_for_at_most
from .job_context import PrologContext


def held_gpus_check(ctx: PrologContext, state: NodeState, log: Log) -> frozenset[int]:
    """The GPUs held out of new jobs (none when the file cannot be read: then the log says so)."""
    try:
        holds = state.held_gpus()
    except (HeldCorrupt, OSError) as error:
        log(f"job {ctx.job_id}: cannot read the held GPUs ({state.held_path()}: {error}); no GPU is held out")
        return frozenset()
    if holds:
        log(f"job {ctx.job_id}: holding out GPUs {','.join(map(str, sorted(holds)))} (mapa gpu hold)")
    return frozenset(holds)


def note_held(ctx: PrologContext, decision: Decision, held: frozenset[int], log: Log) -> Decision:
    """The decision with the held GPUs it had to use (``held=`` in the record), logged."""
    used = tuple(sorted(set(decision.gpus) & held))
    if not used:
        return decision
    log(f"job {ctx.job_id}: too few unheld GPUs were free; it was given HELD GPUs {','.join(map(str, used))} "
        "(mapa gpu hold), after every free unheld one")
    return dataclasses.replace(decision, held=used)


def healthy_gpus_check(
    ctx: PrologContext, config: HookConfig, log: Log, unhealthy_gpus: Callable[[], dict[int, tuple[str, ...]]] | None,
    budget: Budget,
) -> frozenset[int]:
    """The GPUs the driver's library says to leave out (none when there is no probe or it fails)."""
    if unhealthy_gpus is None:
        return frozenset()
    try:
        problems = run_for_at_most(budget.for_step(config.command_timeout), unhealthy_gpus)
    except Exception as error:  # noqa: BLE001 - a health probe must never stop the job
        log(f"job {ctx.job_id}: GPU health check failed ({error}); using every GPU")
        return frozenset()
    for gpu, reasons in sorted(problems.items()):
        log(f"job {ctx.job_id}: leaving out GPU {gpu}: {'; '.join(reasons)}")
    return frozenset(problems)


def _pid_in_a_job(pid: int) -> bool:
    """Whether a process runs inside a Slurm job (its environment names one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return b"SLURM_JOB_ID=" in handle.read(1 << 16)
    except OSError:
        return True  # gone, or not ours to read: do not blame the GPU


def gpu_health_probe(config: HookConfig, kfd: Path = Path("/dev/kfd")) -> Callable[[], dict[int, tuple[str, ...]]] | None:
    """The GPUs to leave out as the driver's library sees them (NVML; AMD SMI on nodes with the
    amdgpu driver's /dev/kfd), when the config asks for it and the library is there."""
    if config.health == "off":
        return None
    if kfd.exists():
        from ...hardware.amd import health_probe

        return health_probe(_pid_in_a_job)
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return None

    def probe() -> dict[int, tuple[str, ...]]:
        from ...hardware.nvml import health, load_pynvml, nvml_session

        with nvml_session(load_pynvml()) as nvml:
            return health(nvml, job_pids=_pid_in_a_job).problems

    return probe
