"""The suite's root. Its tests mirror the package (core/, hardware/, calibrate/, slurm/<part>/,
replay/, and cluster/ for the mini Slurm cluster); the tests at this level cover the whole
product (its commands, docs, packaging and layout).

pytest puts this directory on sys.path (it holds no __init__.py), so every test imports the shared
helpers beside this file by name: fake_slurm, fake_node, fake_nvml, fake_amdsmi, bruteforce,
faultsim, line_mutations, repo_paths.
"""

import pytest

from slurm_mapa.core import ring_packing
from slurm_mapa.core.ring_rate_tables import use_store


@pytest.fixture(autouse=True)
def ring_rate_tables_kept_apart(tmp_path_factory, monkeypatch):
    """Commands run here keep the ring-rate tables of topology files in the user's cache
    (slurm/ring_rate_cache.py): this run's own directory, never the user's, and no test inherits
    the table store another one installed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    yield
    use_store(None)


@pytest.fixture
def fresh():
    """As a fresh process finds the ring rates: none kept in memory, no table store."""
    ring_packing.max_ring_rate.cache_clear()
    ring_packing._solved_once.cache_clear()
    yield
    use_store(None)
    ring_packing.max_ring_rate.cache_clear()
    ring_packing._solved_once.cache_clear()

