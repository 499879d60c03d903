"""How to install what an optional feature needs (an extra of pyproject.toml), as a command that works.

slurm-mapa is not on a package index, so a pip install of its name with an extra (``[plot]``)
fails: pip looks the name up on PyPI. What works wherever slurm-mapa came from (a wheel, an sdist, a checkout) is to
install the extra's own requirement into the Python that runs slurm-mapa, or, for that Python
when it is the system's, the distribution's package; :func:`install_hint` says both. (With the
wheel at hand, ``pip install 'slurm_mapa-<version>-py3-none-any.whl[plot]'`` does the same, and
in a checkout ``pip install -e '.[plot]'``; docs/admin.md, section 1.)

Imports nothing of the project: any package may use it.
"""

from __future__ import annotations

import shlex
import sys
from typing import NamedTuple


class Extra(NamedTuple):
    requirement: str  # as pyproject.toml's [project.optional-dependencies] has it (tests/test_packaging.py checks)
    debian: str | None  # Debian's package of it, for the system's Python, or None
    note: str = ""  # "{pip}" in it: the pip of the Python the hint is for


EXTRAS: dict[str, Extra] = {
    "nvml": Extra("nvidia-ml-py>=12", None),
    "amd": Extra("amdsmi>=6.1", None, "it must match the node's ROCm; ROCm's own copy: {pip} install /opt/rocm/share/amd_smi"),
    "plot": Extra("matplotlib>=3.6", "python3-matplotlib"),
    "metrics": Extra("prometheus-client>=0.17", "python3-prometheus-client"),
}


def in_virtual_environment() -> bool:
    return sys.prefix != sys.base_prefix


def install_hint(extra: str, python: str | None = None, system_python: bool | None = None) -> str:
    """``/opt/slurm-mapa/0.1.0/bin/python -m pip install 'matplotlib>=3.6'`` (and, for the
    system's Python, ``or Debian: apt install python3-matplotlib``): what installs ``extra``'s
    requirement into ``python`` (default: this one)."""
    wanted = EXTRAS[extra]
    python = python or sys.executable or "python3"
    system_python = (not in_virtual_environment()) if system_python is None else system_python
    pip = f"{shlex.quote(python)} -m pip"
    hint = f"{pip} install {shlex.quote(wanted.requirement)}"
    if wanted.debian and system_python:
        hint += f", or on Debian: apt install {wanted.debian}"
    if wanted.note:
        hint += f" ({wanted.note.format(pip=pip)})"
    return hint
