"""The ``held`` and ``health`` checks of ``mapa doctor``: GPUs held out of new jobs on this node
(``mapa gpu hold``, health sources; issue 50)."""

from __future__ import annotations

from .records import FAIL, OK, WARN, Check, Inputs


def check_held(inputs: Inputs) -> Check:
    """warn for each held GPU (a GPU should not stay held: repair or replace it, then release it);
    FAIL when the held-GPUs file cannot be read (the hooks then hold no GPU out)."""
    if inputs.held_error:
        return Check("held", FAIL, f"the held GPUs cannot be read ({inputs.held_error}): the hooks hold no GPU out of new jobs",
                     "remove the file as root and hold the GPUs again with `mapa gpu hold GPU --reason TEXT`")
    if not inputs.held_gpus:
        return Check("held", OK, "no GPU is held out of new jobs")
    size = inputs.topology.graph.size if inputs.topology is not None else None
    found = []
    for held in inputs.held_gpus:
        text = (f"GPU {held['gpu']} held out of new jobs since {held['since_text']} ({held['source']}): "
                f"{held['reason'] or '(no reason given)'}")
        if held["jobs"]:
            text += f", still used by running job(s) {','.join(held['jobs'])}"
        if size is not None and held["gpu"] >= size:
            text += f" (not a GPU of the topology's {size}: no effect)"
        found.append(text)
    gpus = " ".join(str(held["gpu"]) for held in inputs.held_gpus)
    return Check("held", WARN, "; ".join(found) + ". Slurm still counts it: a job that needs it is given it (held= in its "
                 "AdminComment record)", f"repair or replace it, then `mapa gpu release GPU` for each of {gpus}")


def check_health(inputs: Inputs) -> Check:
    """Say per health source whether mapa-agent reads it (``nvml read (8 GPUs), dcgm not installed,
    amd-smi not used (no /dev/kfd)``); warn when none can be read although ``health = "auto"``."""
    if inputs.health_error or inputs.health_sources is None:
        return Check("health", WARN, f"the GPU health sources could not be probed ({inputs.health_error or 'not gathered'})",
                     "see mapa-agent's log (`GPU health:` lines)")
    text = f"health: {inputs.health_sources}"
    if " read (" not in text and not text.startswith("health: off"):
        return Check("health", WARN, text + "; no GPU fault holds a GPU out automatically (`mapa gpu hold` still does)",
                     "install nvidia-ml-py (the nvml extra) or amdsmi where the driver is, or set health = \"off\"")
    return Check("health", OK, text)
