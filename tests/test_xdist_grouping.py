"""The full run (scripts/test with no arguments) relies on pytest-xdist putting all cluster tests of
one Slurm release in one worker: each worker starts its own cluster, and a release's tests spread
over several workers would wait on each other's cluster lock. This checks that grouping with the
cluster conftest's own hook, in a throwaway project, under the installed pytest and pytest-xdist
(pytest 9 silently broke it: xdist 3 marks a group by rewriting a private attribute)."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

CLUSTER_CONFTEST = Path(__file__).resolve().parent / "cluster" / "conftest.py"

CONFTEST = f'''
import importlib.util
import pytest

_spec = importlib.util.spec_from_file_location("mapa_cluster_conftest", {str(CLUSTER_CONFTEST)!r})
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
pytest_collection_modifyitems = _real.pytest_collection_modifyitems


@pytest.fixture(scope="session", params=["26.05", "24.11"])
def cluster(request):
    return request.param
'''

CLUSTER_TESTS = '''
import os
from pathlib import Path

def _note(release):
    with open(Path(__file__).parent.parent.parent / "ran.txt", "a") as out:
        out.write(f"{release} {os.environ['PYTEST_XDIST_WORKER']}\\n")
''' + "".join(f"\ndef test_{i}(cluster):\n    _note(cluster)\n" for i in range(8))

OTHER_TESTS = "import pytest\n\n@pytest.mark.parametrize('i', range(30))\ndef test_other(i):\n    pass\n"


def test_each_releases_cluster_tests_run_in_one_worker_of_their_own(tmp_path):
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    (tmp_path / "tests" / "cluster" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "tests" / "cluster" / "test_on_cluster.py").write_text(CLUSTER_TESTS)
    (tmp_path / "tests" / "test_other.py").write_text(OTHER_TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup", "tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        release, worker = line.split()
        workers[release].add(worker)
    assert set(workers) == {"26.05", "24.11"}, workers
    assert all(len(ran_in) == 1 for ran_in in workers.values()), workers
    assert workers["26.05"] != workers["24.11"], workers
