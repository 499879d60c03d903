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
