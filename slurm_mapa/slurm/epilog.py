"""The Epilog: release the job's GPUs on this node. Idempotent, fails open, and imports little.

It runs at the end of every job, so it stays light: the ledger and the config, not the engine.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from .commands import is_job_id
from .config import HookConfig, hook_logger, load_hook_config
from .ledger import LedgerCorrupt, LedgerFile, prolog_mark_path


def run_epilog(env: Mapping[str, str], config: HookConfig, log: Callable[[str], None]) -> None:
    job_id = env.get("SLURM_JOB_ID", "")
    if not is_job_id(job_id):
        raise ValueError(f"SLURM_JOB_ID {job_id!r} is not what slurmd sets")
    ledger_file = LedgerFile(config.ledger, 1 << 10)
    with ledger_file.locked(timeout=config.command_timeout * 2):
        try:
            ledger = ledger_file.read()
            if job_id in ledger.holdings:
                ledger_file.write(ledger.without([job_id]))
                log(f"job {job_id}: released GPUs {','.join(map(str, ledger.holdings[job_id].gpus))}")
        except LedgerCorrupt as error:
            log(f"job {job_id}: ledger corrupt ({error}); the next Prolog rebuilds it")
        for leftover in (config.jobs_dir / job_id, prolog_mark_path(config.jobs_dir, job_id)):  # a killed Prolog's mark too
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass


def epilog_main() -> int:
    config, _ = load_hook_config(os.environ, validate=False)  # the Epilog only needs the paths
    log = hook_logger(config.log)
    try:
        run_epilog(os.environ, config, log)
    except Exception:  # noqa: BLE001 - an Epilog error would drain the node
        import traceback

        log("epilog internal error:\n" + traceback.format_exc())
    return 0
