"""``mapa doctor``: check the live installation of slurm-mapa on this node, one line per check.

Run as root on a compute node or on the controller. Each check prints ``ok``, ``warn`` or ``FAIL``,
its name, what it found and, unless ok, what to do; the exit status is 1 if any check FAILs, else 0.
``--json`` prints the same as a list of ``{check, status, found, fix}``.

The design keeps the judgement pure: :func:`run_checks` takes an :class:`Inputs` record of plain
data (the texts of ``scontrol show config``, ``scontrol show node``, gres.conf, cgroup.conf,
mapa.toml and the hook files, the parsed topologies, path facts judged by the trust rules of
:mod:`slurm_mapa.slurm.trusted_files`, the agent's answer) and returns :class:`Check` records. The one I/O
edge, :func:`gather`, reads and asks with bounded timeouts (each Slurm command at most
``SLURM_TIMEOUT_S``, no shell; the agent ``AGENT_TIMEOUT_S``) and never raises: what it cannot
read becomes an error text in the record, and the check that needs it a FAIL or warn line naming it.

The role decides what is checked. A compute node (slurmd runs here, or slurmctld knows the node)
gets every check; a controller (slurmctld runs here, or slurm.conf's SlurmctldHost names this
host) skips the node-only checks (hook files, SPANK plugin, topology, gres.conf, discovery,
isolation, mapa-agent, node features) and says so on its ``role`` line; the job_submit.lua
comparison runs only on a controller. When neither is clear, every node check runs.

docs/admin.md, "Checking an installation", lists the checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ...config import DEFAULT_CONFIG_PATH
from .checks import exit_status, format_json, format_text, run_checks
from .gather_inputs import gather
from .records import FAIL, OK, WARN, Check, Inputs, PathFacts
from .slurm_text import parse_show_config, slurm_values

__all__ = ["FAIL", "OK", "WARN", "Check", "Inputs", "PathFacts", "add_commands", "cmd_doctor", "gather", "parse_show_config",
           "run_checks", "slurm_values"]


def cmd_doctor(args: argparse.Namespace) -> int:
    node = args.node or os.uname().nodename.split(".")[0]
    try:
        checks = run_checks(gather(args.config, node))
    except Exception as error:  # noqa: BLE001 - a bug here must still end in a line, not a traceback
        checks = [Check("doctor", FAIL, f"internal error of mapa doctor: {error!r}", "report it with this line")]
    sys.stdout.write(format_json(checks) if args.json else format_text(checks))
    return exit_status(checks)


def add_commands(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check this node's slurm-mapa installation (slurm.conf, hooks, SPANK plugin, gres.conf, topology, agent)",
        description="Check the live installation on this compute node or controller, one line per check (ok, warn, "
        "FAIL); exit status 1 if any check FAILs. Run it as root.",
    )
    doctor.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), help="the hooks' config (default %(default)s)")
    doctor.add_argument("--node", help="this node's Slurm name (default: the host's short name)")
    doctor.add_argument("--json", action="store_true", help="a JSON list of {check, status, found, fix}")
    doctor.set_defaults(handler=cmd_doctor)
