"""Offline replay of sacct logs and generated workloads through every allocation policy.

Pure code: readers parse text given as strings or iterables of lines, the simulator is a function
over plain data, reports return strings and dicts. All file and terminal I/O is in the command's
modules: :mod:`.cli`, :mod:`.sources`, :mod:`.cluster_spec` and :mod:`.run`.
"""

from .jobs import Job, ReadStats

__all__ = ["Job", "ReadStats"]
