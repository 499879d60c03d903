"""Issue 49: ring-rate tables kept on disk (slurm/ring_rate_cache.py) for topology files whose
links match no preset: written once and reused, trusted only when root's and exactly the graph's
table, and never in the way of a decision when the disk is not."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from itertools import combinations

import pytest

from slurm_mapa.core import ring_packing
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.ring_packing import max_ring_rate, solve_ring_rate
from slurm_mapa.core.ring_rate_tables import fingerprint, table_from_bytes, use_store
from slurm_mapa.hardware.presets import preset
from slurm_mapa.hardware.topofile import graph_to_toml
from slurm_mapa.slurm.ring_rate_cache import prepare_table, use_directory, user_cache_dir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="ownership by another uid needs root (os.chown)")
OTHER_UID = 1000


def changed_dgx1():
    """A DGX-1 V100 with GPUs 0 and 1 joined by two NVLinks instead of one: no preset's links."""
    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"
    return build_graph("my-dgx1", 8, links)


def decide(graph, directory, lines):
    """One process's first ring rate of ``graph`` with its tables kept in ``directory``."""
    max_ring_rate.cache_clear()
    ring_packing._solved_once.cache_clear()
    use_store(None)
    use_directory(directory, lines.append)
    return max_ring_rate(graph, (0, 1, 2, 3))


def test_the_table_is_written_once_as_root_keeps_files_and_reused(fresh, tmp_path, monkeypatch):
    graph = changed_dgx1()
    directory = tmp_path / "state" / "ring-rates"
    lines: list[str] = []
    rate = decide(graph, directory, lines)
    path = directory / f"{fingerprint(graph)}.json"
    assert rate == solve_ring_rate(graph, (0, 1, 2, 3)) and lines == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and stat.S_IMODE(directory.stat().st_mode) == 0o755
    assert table_from_bytes(path.read_bytes(), graph) is not None
    written = path.stat().st_mtime_ns
    monkeypatch.setattr(ring_packing, "solve_ring_rate", lambda *_: pytest.fail("solved although the table is stored"))
    assert decide(graph, directory, lines) == rate and lines == [] and path.stat().st_mtime_ns == written


def test_the_stored_rates_are_the_programmes_on_every_set(fresh, tmp_path):
    graph = changed_dgx1()
    decide(graph, tmp_path / "ring-rates", [])
    table = table_from_bytes((tmp_path / "ring-rates" / f"{fingerprint(graph)}.json").read_bytes(), graph)
    for k in range(3, 9):
        for gpus in combinations(range(8), k):
            assert table[sum(1 << g for g in gpus)] == solve_ring_rate(graph, gpus), gpus


def _stored(graph, directory):
    decide(graph, directory, [])
    return directory / f"{fingerprint(graph)}.json"


def _forged(path, graph):
    """The table at ``path`` with another rate for 0,1,2,3, so a test sees whether it was trusted."""
    text = path.read_text()
    rate = solve_ring_rate(graph, (0, 1, 2, 3))
    forged = text.replace(f'"0,1,2,3": {rate}', '"0,1,2,3": 999.0')
    assert forged != text
    path.write_text(forged)


@needs_root
@pytest.mark.parametrize("spoil", ["file-owner", "file-group-writable", "dir-owner", "dir-other-writable"])
def test_as_root_a_table_others_could_change_is_ignored_and_rewritten(fresh, tmp_path, spoil):
    graph = changed_dgx1()
    directory = tmp_path / "ring-rates"
    path = _stored(graph, directory)
    _forged(path, graph)
    assert decide(graph, directory, []) == 999.0  # a root-owned table is trusted (the check below is the owner's)
    if spoil == "file-owner":
        os.chown(path, OTHER_UID, OTHER_UID)
    elif spoil == "file-group-writable":
        os.chmod(path, 0o664)
    elif spoil == "dir-owner":
        os.chown(directory, OTHER_UID, OTHER_UID)
    else:
        os.chmod(directory, 0o757)
    lines: list[str] = []
    assert decide(graph, directory, lines) == solve_ring_rate(graph, (0, 1, 2, 3))
    assert lines[0].startswith(f"ring rates: ignoring the stored table {path}")
    if spoil.startswith("file"):  # rewritten by root, in root's directory
        info = path.stat()
        assert len(lines) == 1 and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o644
        assert table_from_bytes(path.read_bytes(), graph) is not None
    else:  # nor written there
        assert len(lines) == 2 and lines[1].startswith(f"ring rates: cannot store a table in {directory}")


@needs_root
def test_as_root_a_table_below_a_directory_of_another_user_is_ignored(fresh, tmp_path):
    graph = changed_dgx1()
    above = tmp_path / "user"
    path = _stored(graph, above / "ring-rates")
    _forged(path, graph)
    os.chown(above, OTHER_UID, OTHER_UID)
    lines: list[str] = []
    assert decide(graph, above / "ring-rates", lines) == solve_ring_rate(graph, (0, 1, 2, 3))
    assert f"{above} belongs to uid 1000" in lines[0]


def test_a_symlinked_table_is_not_followed(fresh, tmp_path):
    graph = changed_dgx1()
    elsewhere = _stored(graph, tmp_path / "elsewhere")
    _forged(elsewhere, graph)
    directory = tmp_path / "ring-rates"
    directory.mkdir()
    (directory / elsewhere.name).symlink_to(elsewhere)
    assert decide(graph, directory, []) == solve_ring_rate(graph, (0, 1, 2, 3))


def test_a_corrupt_table_is_ignored_and_rewritten(fresh, tmp_path):
    graph = changed_dgx1()
    directory = tmp_path / "ring-rates"
    path = _stored(graph, directory)
    path.write_bytes(b'{"format": "ring-rates-1", "rates": {')
    lines: list[str] = []
    assert decide(graph, directory, lines) == solve_ring_rate(graph, (0, 1, 2, 3)) and lines == []
    assert table_from_bytes(path.read_bytes(), graph) is not None


def test_a_table_that_cannot_be_written_leaves_the_decision_to_solve_it_and_says_so_once(fresh, tmp_path):
    graph = changed_dgx1()
    (tmp_path / "state").write_text("a file where the directory would be")
    lines: list[str] = []
    assert decide(graph, tmp_path / "state" / "ring-rates", lines) == solve_ring_rate(graph, (0, 1, 2, 3))
    assert max_ring_rate(graph, (4, 5, 6)) == solve_ring_rate(graph, (4, 5, 6))
    assert len(lines) == 1 and lines[0].startswith(f"ring rates: cannot store a table in {tmp_path}/state/ring-rates (")
    assert lines[0].endswith("solving the ring rates in each process instead")


def test_prepare_table_computes_what_is_missing_and_says_so(fresh, tmp_path):
    directory = tmp_path / "ring-rates"
    graph = changed_dgx1()
    said = prepare_table(graph, directory)
    assert said == f"ring rates: computed the table of my-dgx1 (links match no preset) into {directory}/{fingerprint(graph)}.json"
    assert prepare_table(graph, directory) is None  # there already
    assert prepare_table(preset("dgx1-v100"), directory) is None  # shipped
    assert "no table for the 16 GPUs of torus2d-16" in prepare_table(preset("torus2d-16"), directory)
    assert os.listdir(directory) == [f"{fingerprint(graph)}.json"]
    (tmp_path / "file").write_text("")
    lines: list[str] = []
    said = prepare_table(graph, tmp_path / "file" / "ring-rates", lines.append)
    assert said.startswith("ring rates: computed the table of my-dgx1 but could not store it") and len(lines) == 1


def test_the_user_cache_follows_xdg():
    assert user_cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == user_cache_dir({"XDG_CACHE_HOME": "/x/cache/"})
    assert str(user_cache_dir({"XDG_CACHE_HOME": "/x/cache"})) == "/x/cache/slurm-mapa/ring-rates"
    home = os.path.expanduser("~")
    assert str(user_cache_dir({})) == f"{home}/.cache/slurm-mapa/ring-rates"
    assert str(user_cache_dir({"XDG_CACHE_HOME": "relative"})) == f"{home}/.cache/slurm-mapa/ring-rates"


@pytest.mark.parametrize("gpus", [4, 8])
def test_a_decision_in_a_fresh_process_reads_the_stored_table_without_numpy(tmp_path, gpus):
    """The in-process Prolog on a node whose topology file matches no preset: its table stored (by
    `mapa hooks` or the agent's start), a fresh interpreter decides with json alone."""
    graph = changed_dgx1()
    topology = tmp_path / "node.toml"
    topology.write_text(graph_to_toml(graph))
    directory = tmp_path / "ring-rates"
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from slurm_mapa.core.patterns import make_pattern\n"
            "from slurm_mapa.core.policies import Request, select\n"
            "from slurm_mapa.hardware.load import load_topology\n"
            "from slurm_mapa.slurm.ring_rate_cache import use_directory\n"
            f"use_directory(Path({str(directory)!r}))\n"
            f"graph = load_topology({str(topology)!r})\n"
            f"chosen = select('preserve', graph, tuple(range(8)), Request(make_pattern('ring', {gpus}), True))\n"
            "print(chosen.objective, chosen.placement.ring_rate, 'numpy' in sys.modules)\n")

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert done.stderr == ""
        return done.stdout.split()

    first = run()  # computes and stores the table: numpy
    assert first[0] == "effective-rings" and first[2] == "True" and (directory / f"{fingerprint(graph)}.json").is_file()
    assert run() == [*first[:2], "False"]  # the table read back: no numpy
