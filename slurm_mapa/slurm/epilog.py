"""The Epilog: release the job's GPUs on this node. Idempotent, fails open, and imports little.

It runs at the end of every job, so it stays light: the ledger and the config, not the engine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

from .commands import is_job_id
from .config import DEFAULT_CONFIG_PATH, HookConfig, config_from_text
from .ledger import LedgerCorrupt, LedgerFile


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
        try:
            (config.jobs_dir / job_id).unlink()
        except FileNotFoundError:
            pass


def epilog_main() -> int:
    path = Path(os.environ.get("MAPA_CONFIG", str(DEFAULT_CONFIG_PATH)))
    try:
        config = config_from_text(path.read_text(), source=str(path), validate=False)
    except Exception:  # noqa: BLE001 - the defaults still find the ledger
        config = HookConfig()

    def log(message: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} mapa[{os.getpid()}] {message}\n"
        try:
            with open(config.log, "a", encoding="utf-8") as handle:
                handle.write(line)
        except OSError:
            sys.stderr.write(line)

    try:
        run_epilog(os.environ, config, log)
    except Exception:  # noqa: BLE001 - an Epilog error would drain the node
        import traceback

        log("epilog internal error:\n" + traceback.format_exc())
    return 0
