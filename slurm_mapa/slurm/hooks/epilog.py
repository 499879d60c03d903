"""The Epilog: release the job's GPUs on this node. Idempotent, fails open, and imports little.

It runs at the end of every job, so it stays light: the ledger and the config, not the engine.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from ..text.commands import is_job_id
from ..config import HookConfig, hook_logger, load_hook_config
from ..node_state import NodeState

LOCK_WAIT_S = 10.0  # the lock is held for milliseconds; past this a holder is stuck


def run_epilog(env: Mapping[str, str], config: HookConfig, log: Callable[[str], None]) -> None:
    """Remove the job's files and its ledger entry (NodeState.release), then its device cgroups."""
    job_id = env.get("SLURM_JOB_ID", "")
    if not is_job_id(job_id):
        raise ValueError(f"SLURM_JOB_ID {job_id[:40]!r} is not what slurmd sets")
    NodeState.of(config).release(job_id, log, lock_wait=min(LOCK_WAIT_S, config.prolog_budget))
    release_isolation(job_id, log)


def release_isolation(job_id: str, log: Callable[[str], None]) -> None:
    """Remove the job's device cgroups (docs/isolation.md), whatever the config says now: it may
    have turned isolation off while the job ran. A cgroup still busy is logged and left."""
    from ..isolation.cgroups import release_job

    for problem in release_job(job_id):
        log(f"job {job_id}: device isolation not cleaned up: {problem}")


def epilog_failing_open(env: Mapping[str, str], config_env: Mapping[str, str], where: str = "") -> None:
    """Load the config and run the Epilog; any error is logged, never raised (it would drain the
    node). The one body of the in-process Epilog and of mapa-agent's."""
    config, _ = load_hook_config(config_env, validate=False)  # the Epilog only needs the paths
    log = hook_logger(config.log)
    try:
        run_epilog(env, config, log)
    except Exception:  # noqa: BLE001 - an Epilog error would drain the node
        import traceback

        log(f"epilog internal error{where}:\n" + traceback.format_exc())


def epilog_main() -> int:
    epilog_failing_open(os.environ, os.environ)
    return 0
