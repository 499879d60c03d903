"""Every reader, fed damaged copies of every bundled example (issue 27): cut anywhere, a byte
changed, a line dropped. A reader either reads what is left (exit 0) or refuses it in one line
naming what it expected (exit 2); never a traceback, never another status.

tests/test_bad_input.py covers random bytes and named bad cases; these start from real files, so
the damage lands where parsers are deep in a table or a TOML document.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.cli import main as mapa_main
from slurm_mapa.replay.cli import main as replay_main

from test_bad_input import call

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
BUNDLED = ROOT / "slurm_mapa" / "data"
SMI_TEXTS = sorted((DATA / "nvidia-smi").glob("*.txt")) + sorted((DATA / "rocm-smi").glob("*.txt"))
MODELS = sorted((BUNDLED / "models").glob("*.toml"))
REPLAY_LOGS = sorted((DATA / "sacct").iterdir()) + [BUNDLED / "replay" / "sample-sacct.txt", BUNDLED / "replay" / "paper-dgx1-300.jobs"]
NCCL_OUTPUTS = sorted((DATA / "nccl-tests").glob("*.txt"))
DAMAGE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def damaged(draw, original: bytes) -> bytes:
    """``original`` cut at some point, with one byte changed or one line dropped (or both)."""
    data = original[: draw(st.integers(0, len(original)))]
    if data and draw(st.booleans()):
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    lines = data.split(b"\n")
    if len(lines) > 1 and draw(st.booleans()):
        del lines[draw(st.integers(0, len(lines) - 1))]
    return b"\n".join(lines)


def read_or_refuse(main, argv, capsys) -> None:
    code, out, err = call(main, argv, capsys)
    assert code in (0, 2), (code, err[-2000:])
    assert "Traceback" not in err + out
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], err[-2000:]


def each_damaged_copy(original: bytes, path: Path, capsys, *readers) -> None:
    """Damaged copies of ``original`` written to ``path`` in turn; each reader, a (main, argv) that
    reads ``path``, must read or refuse every copy."""

    @DAMAGE
    @given(data=damaged(original))
    def check(data):
        path.write_bytes(data)
        for main, argv in readers:
            read_or_refuse(main, argv, capsys)

    check()


def test_the_examples_are_there():
    """The parametrised tests below run once per example: none may silently run on zero files."""
    assert len(SMI_TEXTS) >= 20 and len(MODELS) >= 3 and len(REPLAY_LOGS) >= 5 and NCCL_OUTPUTS


@pytest.mark.parametrize("example", SMI_TEXTS, ids=lambda p: p.name)
def test_a_damaged_saved_smi_output(example, tmp_path, capsys):
    path = tmp_path / example.name
    each_damaged_copy(example.read_bytes(), path, capsys,
                      (mapa_main, ["topo", "discover", "--source", "file", "--file", str(path)]),
                      (mapa_main, ["topo", "show", str(path)]))


@pytest.fixture(scope="module")
def preset_files(tmp_path_factory) -> Path:
    """Every preset as the topology file `mapa gres-conf --write-presets` writes."""
    where = tmp_path_factory.mktemp("presets")
    assert mapa_main(["gres-conf", "--write-presets", str(where)]) == 0
    return where


@pytest.mark.parametrize("preset", ["dgx1-v100", "mi250x", "torus2d-16"])
def test_a_damaged_topology_file(preset, preset_files, tmp_path, capsys):
    path = tmp_path / "damaged.toml"
    each_damaged_copy((preset_files / f"{preset}.toml").read_bytes(), path, capsys,
                      (mapa_main, ["topo", "show", str(path)]),
                      (mapa_main, ["select", "--topology", str(path), "--gpus", "2"]))


@pytest.mark.parametrize("example", MODELS, ids=lambda p: p.name)
def test_a_damaged_model_file(example, tmp_path, capsys):
    path = tmp_path / example.name
    each_damaged_copy(example.read_bytes(), path, capsys,
                      (mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "3", "--model", str(path)]))


@pytest.mark.parametrize("example", REPLAY_LOGS, ids=lambda p: p.name)
def test_a_damaged_replay_log(example, tmp_path, capsys):
    path = tmp_path / example.name
    each_damaged_copy(example.read_bytes(), path, capsys,
                      (replay_main, ["run", str(path), "--nodes", "2", "--policies", "preserve", "--json"]))


def test_a_damaged_replay_config(tmp_path, capsys):
    path = tmp_path / "demo.toml"
    each_damaged_copy((BUNDLED / "replay" / "demo.toml").read_bytes(), path, capsys,
                      (replay_main, ["run", str(BUNDLED / "replay" / "sample-sacct.txt"), "--config", str(path),
                                     "--policies", "preserve", "--json"]))


@pytest.mark.parametrize("example", NCCL_OUTPUTS, ids=lambda p: p.name)
def test_a_damaged_nccl_tests_output(example, tmp_path, capsys):
    code, _, err = call(mapa_main, ["calibrate", "plan", "--topology", "dgx1-v100", "--max-gpus", "2", "--output-dir",
                                    str(tmp_path / "plan")], capsys)
    assert code == 0, err
    plan = tmp_path / "plan" / "plan.json"
    assert plan.is_file(), sorted(p.name for p in (tmp_path / "plan").iterdir())

    path = tmp_path / example.name
    each_damaged_copy(example.read_bytes(), path, capsys,
                      (mapa_main, ["calibrate", "fit", "--plan", str(plan), str(path)]))


def test_damage_is_not_a_no_op():
    """The strategy does damage: most draws differ from the original."""
    original = (DATA / "nvidia-smi" / "dgx1-v100.txt").read_bytes()
    seen: list[bool] = []

    @settings(max_examples=50, deadline=None)
    @given(data=damaged(original))
    def collect(data):
        seen.append(data != original)

    collect()
    assert sum(seen) > len(seen) // 2
