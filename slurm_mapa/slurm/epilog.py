"""The Epilog: release the job's GPUs on this node. Idempotent, fails open, and imports little.

It runs at the end of every job, so it stays light: the ledger and the config, not the engine.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from . import jobfiles, paths
from .commands import is_job_id
from .config import HookConfig, hook_logger, load_hook_config
from .ledger import LedgerCorrupt, LedgerFile

LOCK_WAIT_S = 10.0  # the lock is held for milliseconds; past this a holder is stuck


def run_epilog(env: Mapping[str, str], config: HookConfig, log: Callable[[str], None]) -> None:
    """Remove the job's files and its ledger entry.

    First the job's .ended file (the wrapper writes it too, before Python starts), so that a
    Prolog drops the job's ledger entry and files whatever happens to this Epilog. Then under the
    lock, files first, the ledger entry, and the .ended file last. If the lock cannot be had, the
    files go and the .ended file stays: the next Prolog that holds the lock drops the entry.
    """
    job_id = env.get("SLURM_JOB_ID", "")
    if not is_job_id(job_id):
        raise ValueError(f"SLURM_JOB_ID {job_id[:40]!r} is not what slurmd sets")
    jobs_dir_there = os.path.lexists(config.jobs_dir)
    if jobs_dir_there:
        paths.check_trusted_dir(config.jobs_dir)  # never remove files through a directory others control
        jobfiles.write_ended(config.jobs_dir, job_id)
    ledger_file = LedgerFile(config.ledger, 1 << 10)
    try:
        with ledger_file.locked(timeout=min(LOCK_WAIT_S, config.prolog_budget)):
            jobfiles.remove_job(config.jobs_dir, job_id, keep_ended=True)
            try:
                ledger = ledger_file.read()
                if job_id in ledger.holdings:
                    ledger_file.write(ledger.without([job_id]))
                    log(f"job {job_id}: released GPUs {','.join(map(str, ledger.holdings[job_id].gpus))}")
            except LedgerCorrupt as error:
                log(f"job {job_id}: ledger corrupt ({error}); the next Prolog rebuilds it")
            paths.remove(jobfiles.ended_path(config.jobs_dir, job_id))
    except TimeoutError as error:
        jobfiles.remove_job(config.jobs_dir, job_id, keep_ended=jobs_dir_there)
        log(f"job {job_id}: {error}; removed its files; the next Prolog that gets the lock drops its ledger entry")
    release_isolation(job_id, log)


def release_isolation(job_id: str, log: Callable[[str], None]) -> None:
    """Remove the job's device cgroups (docs/isolation.md), whatever the config says now: it may
    have turned isolation off while the job ran. A cgroup still busy is logged and left."""
    from .isolation_cgroups import release_job

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
