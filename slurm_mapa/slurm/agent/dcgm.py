"""DCGM's HPC job-mapping files: which job uses each GPU, for sites monitoring with dcgm-exporter.

dcgm-exporter run with ``--hpc-job-mapping-dir DIR`` (or ``DCGM_HPC_JOB_MAPPING_DIR``) labels
each GPU's metrics with the jobs named in ``DIR/<gpu>``. Slurm's own scripts for it write the
indices Slurm gave the job; on a MAPA node the job runs on the GPUs MAPA chose, so this module
writes those instead. Format, as read by NVIDIA/dcgm-exporter (HEAD d5e5f510),
``internal/pkg/transformation/hpc.go``:

* ``getGPUFiles``: the directory is listed again on every scrape (``hpcMapper.Process``); only
  names matching ``^\\d+(\\.\\d+)?$`` are read (``<gpu>`` or ``<gpu>.<GPU instance>`` for MIG),
  directories and everything else are skipped. Our temporary files (``.3.xxxx.tmp``) never match.
* ``Process`` looks a file up by the metric's ``gpu`` label, the DCGM GPU id
  (``fmt.Sprintf("%d", DeviceInfo.GPU)``, ``internal/pkg/collector``). DCGM numbers GPUs in
  NVML order, which is the topology index MAPA uses (docs/hardware.md) on a node where DCGM sees
  every GPU; the source does not promise it, so check the ``gpu`` and ``pci_bus_id`` labels once.
* ``readFile``: one job per line, ``bufio.Scanner`` lines taken verbatim (no trimming; a blank
  line would become an empty job), a final newline is optional. Each job makes its own copy of
  the GPU's metrics with the label ``hpc_job="<job>"`` (``hpcJobAttribute``, const.go), so a GPU
  two jobs share is reported once per job. An empty file, like a missing one, leaves the
  metrics unlabelled (``exists && len(jobs) != 0``).
* A file that cannot be opened or read makes ``Process`` return an error, and the exporter
  then fails the whole scrape (``MetricsServer.render``, internal/pkg/server/server.go). Hence
  files are replaced atomically, never removed while their GPU exists, and readable by the
  exporter's user (mode 644).

:func:`mapping_files` is pure; :func:`write_mapping` brings the directory to it. mapa-agent does
that every second, through a :class:`MappingWriter`, which says which problems are new so that a
lasting one (a directory it must not write into, a directory named like a GPU file) is logged
once, not every second. One GPU's bad entry does not keep the other GPUs' files from being written.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ...errors import MapaError
from .. import trusted_files as trusted
from ..text.commands import is_job_id

FILE_MODE = 0o644  # dcgm-exporter runs as another user
MAX_FILE_BYTES = 1 << 16  # an existing file larger than this is rewritten without being compared
_GPU_NAME = re.compile(r"0|[1-9][0-9]*")  # the names mapping_files makes, and only these


def mapping_files(holdings: Mapping[str, Sequence[int]], gpu_count: int) -> dict[str, str]:
    """File name -> content for GPUs 0..gpu_count-1: the ids of the jobs holding the GPU, one per
    line, in numeric order. Job ids that are not plain Slurm job ids and GPUs out of range are
    left out.

    A GPU no job holds gets an empty file rather than none: dcgm-exporter treats both alike, and
    a file that is only ever replaced, never removed, cannot vanish between the exporter's
    directory listing and its open, which would fail the scrape (module docstring).
    """
    jobs_of: dict[int, set[str]] = {gpu: set() for gpu in range(gpu_count)}
    for job, gpus in holdings.items():
        if not is_job_id(job):
            continue
        for gpu in gpus:
            if gpu in jobs_of:
                jobs_of[gpu].add(job)
    return {str(gpu): "".join(f"{job}\n" for job in sorted(jobs, key=_numeric)) for gpu, jobs in jobs_of.items()}


def _numeric(job: str) -> tuple[int, str]:
    return int(job), job  # "07" and "7" are both valid ids; the string breaks the tie


def _unchanged(path: Path, data: bytes) -> bool:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or stat.S_IMODE(info.st_mode) != FILE_MODE:
            return False
        return trusted.read_bytes(path, MAX_FILE_BYTES) == data
    except OSError:
        return False


class MappingError(MapaError):
    """Some GPUs' files could not be written or removed (the others were); the message says which."""


@dataclass(frozen=True)
class MappingResult:
    """What one write of the mapping directory did, and what kept it from matching the jobs."""

    changed: tuple[str, ...] = ()  # the GPU files written or removed, in GPU order
    problems: tuple[str, ...] = ()  # each thing that could not be done, one line each, the same text while it lasts
    refused: bool = False  # the directory itself was refused (problems[0] says why): nothing was written
    new: tuple[str, ...] = ()  # the problems the previous write did not have (MappingWriter); all of them otherwise
    solved: tuple[str, ...] = ()  # the previous write's problems that are gone (MappingWriter)

    def log_lines(self) -> list[str]:
        """What a caller that writes every second should log now: what went wrong since the last
        write, and what was put right."""
        return [*self.new, *(f"solved: {problem}" for problem in self.solved)]


def write_mapping(directory: Path, files: dict[str, str]) -> list[str]:
    """Make ``directory`` hold exactly ``files`` (from mapping_files): changed files replaced
    atomically with mode 644, GPU files not in ``files`` removed, anything else left alone.

    The directory is created if missing and must be root's and writable by nobody else (raises
    trusted.UnsafePath, and nothing is written). A GPU whose file cannot be written (a directory
    of that name is left alone) does not stop the others: they are written, then MappingError
    says which GPUs were not. Returns the names written or removed, in GPU order.
    """
    result = _write(directory, files)
    if result.problems:
        raise MappingError("; ".join(result.problems))
    return list(result.changed)


def update_mapping(directory: Path, files: dict[str, str]) -> MappingResult:
    """write_mapping that reports instead of raising: the directory's refusal and each GPU's
    problem are in the result's ``problems`` (ValueError still for a name that is not a GPU's)."""
    try:
        return _write(directory, files)
    except trusted.UnsafePath as error:
        problem = f"{error}; no GPU file written"
        return MappingResult(problems=(problem,), refused=True, new=(problem,))


class MappingWriter:
    """update_mapping for a caller that runs it again and again (mapa-agent, every second): each
    result's ``new`` holds only the problems the previous call did not have, and ``solved`` those
    it had that are gone, so that logging :meth:`MappingResult.log_lines` reports a lasting problem
    once and a changed one (another mode, another owner, another GPU) again."""

    def __init__(self) -> None:
        self._reported: tuple[str, ...] = ()

    def write(self, directory: Path, files: dict[str, str]) -> MappingResult:
        result = update_mapping(directory, files)
        new = tuple(problem for problem in result.problems if problem not in self._reported)
        solved = tuple(problem for problem in self._reported if problem not in result.problems)
        self._reported = result.problems
        return MappingResult(result.changed, result.problems, result.refused, new, solved)

    def forget(self) -> None:
        """Report every problem again at the next write (the mapping was turned off, say)."""
        self._reported = ()


def _write(directory: Path, files: dict[str, str]) -> MappingResult:
    """write_mapping's work: raises trusted.UnsafePath for the directory, returns the GPUs' problems."""
    for name in files:
        if not _GPU_NAME.fullmatch(name):
            raise ValueError(f"not a GPU file name: {name!r}; accepted: a GPU index such as '0' or '7'")
    directory = Path(directory)
    trusted.ensure_trusted_dir(directory)
    changed, problems = [], []
    for name, text in sorted(files.items(), key=lambda item: int(item[0])):
        data, path = text.encode("ascii"), directory / name
        if _unchanged(path, data):
            continue
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):  # a file cannot be renamed over it; root's, so an admin's: kept
                problems.append(
                    f"GPU {name}: {path} is a directory, so dcgm-exporter shows the GPU without its jobs; "
                    f"left alone (remove it and the GPU's file is written)"
                )
                continue
        except FileNotFoundError:
            pass
        except OSError as error:
            problems.append(f"GPU {name}: cannot inspect {path}: {error.strerror or error}")
            continue
        try:
            trusted.replace_file(path, data, FILE_MODE)
        except OSError as error:  # strerror only: the temporary file's name changes at each try
            problems.append(f"GPU {name}: cannot write {path}: {error.strerror or error}")
            continue
        changed.append(name)
    try:
        with os.scandir(directory) as entries:
            stale = [e.name for e in entries if _GPU_NAME.fullmatch(e.name) and e.name not in files and not e.is_dir(follow_symlinks=False)]
    except OSError as error:
        problems.append(f"cannot list {directory} for GPU files to remove: {error.strerror or error}")
        stale = []
    for name in sorted(stale, key=int):
        try:
            trusted.remove(directory / name)
        except OSError as error:
            problems.append(f"GPU {name}: cannot remove {directory / name} (no such GPU now): {error.strerror or error}")
            continue
        changed.append(name)
    return MappingResult(tuple(sorted(changed, key=int)), tuple(problems), new=tuple(problems))
