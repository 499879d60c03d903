"""Every command with --json prints exactly one JSON document on stdout, and nothing else there
(issue 27): scripts read it with one json.loads. Commands of a node run here against a config in
a temporary directory (status) or with Slurm absent (doctor: its checks say so, in JSON)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest

from slurm_mapa.cli import build_parser as mapa_parser
from slurm_mapa.cli import main as mapa_main
from slurm_mapa.replay.cli import build_parser as replay_parser
from slurm_mapa.replay.cli import main as replay_main

DATA = Path(__file__).parent / "data"


def _commands_with_json() -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()

    def walk(parser: argparse.ArgumentParser, chain: tuple[str, ...]) -> None:
        if any("--json" in action.option_strings for action in parser._actions):
            found.add(chain)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, chain + (name,))

    walk(mapa_parser(), ("mapa",))
    walk(replay_parser(), ("mapa-replay",))
    return found


def _status_config(tmp: Path) -> str:
    (tmp / "state").mkdir(mode=0o755)
    (tmp / "jobs").mkdir(mode=0o755)
    config = tmp / "mapa.toml"
    config.write_text(f'ledger = "{tmp}/state/ledger.json"\njobs_dir = "{tmp}/jobs"\nlog = "{tmp}/log"\n[nodes]\n"*" = "dgx1-v100"\n')
    return str(config)


CASES = {
    ("mapa", "topo", "discover"): lambda tmp: ["topo", "discover", "--source", "file", "--file", str(DATA / "nvidia-smi" / "dgx1-v100.txt")],
    ("mapa", "topo", "show"): lambda tmp: ["topo", "show", "mi250x"],
    ("mapa", "select"): lambda tmp: ["select", "--topology", "dgx-a100", "--gpus", "8", "--directive", "sensitive=yes"],
    ("mapa", "status"): lambda tmp: ["status", "node1", "--config", _status_config(tmp)],
    ("mapa", "gpu", "list"): lambda tmp: ["gpu", "list", "--node", "node1", "--config", _status_config(tmp)],
    ("mapa", "doctor"): lambda tmp: ["doctor", "--config", str(tmp / "missing.toml"), "--node", "node1"],
    ("mapa", "calibrate", "plan"): lambda tmp: ["calibrate", "plan", "--topology", "dgx1-v100", "--max-gpus", "3", "--output-dir",
                                               str(tmp / "plan")],
    ("mapa-replay", "demo"): lambda tmp: ["demo"],
    ("mapa-replay", "run"): lambda tmp: ["run", "--generate", "paper:40", "--topology", "hgx-h100"],
    ("mapa-replay", "generate"): lambda tmp: ["generate", "paper", "--jobs", "5"],
    ("mapa-replay", "policies"): lambda tmp: ["policies"],
}
# Asked of slurmctld or fed measurements: their JSON is checked where they run (tests/slurm/hooks/test_hooks.py's
# fake scontrol for explain, tests/calibrate/test_calibrate.py's nccl-tests outputs for fit).
ELSEWHERE = {("mapa", "explain"), ("mapa", "calibrate", "fit")}


def test_every_command_with_json_is_tried_here_or_elsewhere():
    assert _commands_with_json() == set(CASES) | ELSEWHERE


@pytest.mark.parametrize("chain", sorted(CASES), ids=" ".join)
def test_json_is_one_document(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = mapa_main if chain[0] == "mapa" else replay_main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(CASES[chain](tmp_path) + ["--json"])
    assert code in (0, 1), err.getvalue()[-2000:]  # doctor exits 1 when a check FAILs
    json.loads(out.getvalue())  # one document: anything before or after it fails here
