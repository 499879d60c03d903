"""The benchmarks' worker processes (benchmarks/revisions.py, issue 37): an old revision runs from
its own tree only, and no worker outlives an interrupted or killed benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
if not (BENCHMARKS / "revisions.py").is_file():
    pytest.skip("benchmarks/ is not here (an unpacked sdist carries tests/ only)", allow_module_level=True)
sys.path.insert(0, str(BENCHMARKS))

import revisions  # noqa: E402

# A benchmark in miniature: one worker (which starts a child of its own, as a worker's tools may),
# both pids printed, then it waits as a long measurement would.
DRIVER = textwrap.dedent("""
    import subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from revisions import Workers, stop_on_signals
    stop_on_signals()
    child = ("import os, subprocess, time; p = subprocess.Popen(['sleep', '60']); "
             "print(os.getpid(), p.pid, flush=True); time.sleep(60)")
    with Workers() as workers:
        worker = workers.start([sys.executable, "-c", child], sys.argv[2], stdout=subprocess.PIPE, text=True)
        print(worker.stdout.readline().strip(), flush=True)
        worker.wait()
""")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # ended; left for init to reap


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not _gone(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_no_worker_outlives_its_benchmark(signum, tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(BENCHMARKS), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2, "the driver did not start its worker"
        worker, grandchild = pids
        assert not _gone(worker) and not _gone(grandchild), "the worker ended by itself"
        os.kill(driver.pid, signum)
        driver.wait(timeout=10)
        if signum == signal.SIGKILL:
            # Nothing of the driver runs: the kernel's parent-death signal ends the worker; its own
            # child is orphaned (the benchmarks' workers start none).
            assert not _wait_gone([worker]), "the worker outlived a SIGKILLed benchmark"
        else:
            assert driver.returncode != 0
            assert not _wait_gone([worker, grandchild]), "a worker outlived the interrupted benchmark"
    finally:
        for pid in [*pids, driver.pid]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        driver.wait()


def test_a_worker_imports_the_package_of_its_tree_only(tmp_path, monkeypatch):
    fake = tmp_path / "slurm_mapa"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    code = ("import slurm_mapa, sys; sys.path.insert(0, sys.argv[1]); import revisions; revisions.assert_one_tree(); "
            "print(slurm_mapa.__file__)")
    with revisions.Workers() as workers:
        done = workers.run([sys.executable, "-c", code, str(BENCHMARKS)], str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(fake / "__init__.py")  # not the checkout's, nor the installed one
    # and a module of another tree is caught
    monkeypatch.setenv(revisions.TREE_ENV, str(tmp_path))
    import slurm_mapa  # noqa: F401 - this process's: the checkout's

    with pytest.raises(RuntimeError, match="modules from outside"):
        revisions.assert_one_tree()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_a_revision_is_checked_out_whole(tmp_path):
    tree = revisions.checkout("HEAD", str(tmp_path))
    assert (Path(tree) / "slurm_mapa" / "core" / "search.py").is_file()
    assert (Path(tree) / "pyproject.toml").is_file()
    with pytest.raises(SystemExit, match="not a commit"):
        revisions.checkout("no-such-revision-37", str(tmp_path))


@pytest.mark.parametrize("script", ["bench_burst.py", "bench_noring.py"])
def test_the_cluster_benchmarks_say_what_they_need_without_the_mini_cluster(script, tmp_path):
    """Issue 52: without the mini cluster they ended in a traceback from their first docker exec.
    Here docker is a stub that finds no container (the check runs before anything touches one)."""
    stub = tmp_path / "docker"
    stub.write_text("#!/bin/sh\necho 'Error: No such object' >&2\nexit 1\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script)], capture_output=True, text=True, env=env,
                          cwd=BENCHMARKS, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"{script}: error: needs the mini cluster: scripts/cluster up (container mapa-slurmctld is not running)"]
