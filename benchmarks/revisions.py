"""Old revisions for the benchmarks that compare with one, and the worker processes that run them.

A benchmark that compares with revision REV runs REV whole: ``checkout(REV, tmp)`` extracts REV's
tree (``git archive``) into a temporary directory, and every measurement of that side runs in a
worker process with PYTHONPATH set to that tree (the working tree's side: to the checkout), so no
module of one tree is imported next to the other's. ``assert_one_tree()``, called by the worker,
fails if any ``slurm_mapa`` module came from elsewhere.

Workers do not outlive the benchmark: ``Workers`` starts each in a session (process group) of its
own and kills every group it started when its ``with`` block ends, also on an exception, on Ctrl-C
(KeyboardInterrupt) and, after ``stop_on_signals()``, on SIGTERM and SIGHUP (they become
SystemExit, so the ``finally`` runs). On Linux each worker also gets PR_SET_PDEATHSIG: the kernel
kills it when the benchmark dies, even of SIGKILL (its own children, if any, then lose their parent;
the benchmarks' workers start none). tests/test_bench_workers.py checks both.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE_ENV = "MAPA_BENCH_TREE"  # set in a worker: the tree its slurm_mapa must come from

_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - no libc to ask
    _LIBC = None


def commit_of(rev: str) -> str:
    """The full hash of ``rev`` in this checkout; SystemExit with the reason if git does not know it."""
    done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"revision {rev!r} is not a commit of this checkout ({ROOT}); "
                         f"a shallow clone may lack it: git fetch --unshallow")
    return done.stdout.strip()


def checkout(rev: str, into: str) -> str:
    """Extract the whole tree of ``rev`` into a new directory under ``into``; returns its path (the
    PYTHONPATH entry of that side's workers)."""
    commit = commit_of(rev)
    tree = os.path.join(into, f"rev-{commit[:12]}")
    os.makedirs(tree)
    data = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(tree, filter="data")
    return tree


def worker_env(tree: str) -> dict[str, str]:
    """The environment of a worker that must import slurm_mapa from ``tree`` and nothing else."""
    env = dict(os.environ)
    env["PYTHONPATH"] = tree  # replaces the caller's: nothing of another tree comes before it
    env[TREE_ENV] = tree
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ left in the checkout by an old revision's worker
    return env


def assert_one_tree() -> None:
    """In a worker: every slurm_mapa module imported so far comes from the tree it was started for."""
    tree = os.environ.get(TREE_ENV)
    if not tree:
        return
    base = os.path.realpath(tree) + os.sep
    strays = sorted(name for name, module in list(sys.modules.items())
                    if (name == "slurm_mapa" or name.startswith("slurm_mapa."))
                    and getattr(module, "__file__", None)
                    and not os.path.realpath(module.__file__).startswith(base))
    if strays:
        raise RuntimeError(f"modules from outside {tree}: {', '.join(strays[:10])}")


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the benchmark through its ``finally`` blocks (as Ctrl-C does), so that
    ``Workers`` kills its workers instead of leaving them to run on."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_exit)


def _in_child() -> None:
    """Run in the worker between fork and exec: die with the parent (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Workers:
    """The worker processes of one benchmark run; ``with Workers() as workers:`` kills what is left."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen] = []

    def start(self, argv: list[str], tree: str, **popen) -> subprocess.Popen:
        parent = os.getpid()

        def in_child() -> None:
            _in_child()
            if os.getppid() != parent:  # the parent died before the death signal was armed
                os._exit(1)

        popen.setdefault("cwd", tree)  # `python -c` puts its directory first on sys.path: the tree's, no other
        process = subprocess.Popen(argv, env=worker_env(tree), start_new_session=True, preexec_fn=in_child, **popen)
        self._running.append(process)
        return process

    def run(self, argv: list[str], tree: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run a worker to its end (``subprocess.run`` with capture_output and text); killed on any way out."""
        process = self.start(argv, tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            self.kill(process)
        return subprocess.CompletedProcess(argv, process.returncode, out, err)

    def kill(self, process: subprocess.Popen) -> None:
        """Kill the worker's process group (no-op once it has ended and was waited for)."""
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()
        if process in self._running:
            self._running.remove(process)

    def close(self) -> None:
        while self._running:
            self.kill(self._running[-1])

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
