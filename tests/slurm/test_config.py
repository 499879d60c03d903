"""Every admin command that takes --config refuses a config it cannot use: exit status 2 and one
line naming the file, what is wrong and what is accepted, never a traceback. The hooks themselves
still fall back on such a config (load_hook_config; a hook never fails: test_hardening.py).

The commands run in-process (``main([...])``), which is what the console scripts call."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slurm_mapa.cli import main as mapa_main
from slurm_mapa.errors import MapaError
from slurm_mapa.replay.cluster_spec import _load_config as load_replay_config
from slurm_mapa.replay.cli import main as replay_main
from slurm_mapa.slurm.config import HOOK_KEYS, HookConfig, config_from_text, load_admin_config, load_hook_config

# name -> (bytes of the file, or None for a directory / nothing, and what the error line says)
BAD = {
    "unknown key": (b'polcy = "preserve"\n', "unknown key 'polcy' (line 1: 'polcy = \"preserve\"') (did you mean 'policy'?) (accepted: admin_comment_rate, "),
    "wrong type": (b"policy = 3\n", "policy must be a string (in quotes), got 3"),
    "unknown policy": (b'policy = "presrve"\n', "unknown policy 'presrve' (accepted: baseline, "),
    "wrong table": (b'nodes = "dgx1-v100"\n', '[nodes] maps node-name globs to a preset or a topology file, e.g. "dgx*" = "dgx1-v100"; '
                                           'got "dgx1-v100"'),
    "out of range": (b"prolog_budget = 100\n", "prolog_budget must be seconds in [2, 20], got 100"),
    "NUL in a path": (b'ledger = "/var/lib/a\\u0000b"\n', "ledger contains a NUL character (\\u0000), which no path or name may hold"),
    "TOML syntax": (b'policy = "preserve\n', "not valid TOML: Illegal character '\\n' (at line 1, column 19)"),
    "not UTF-8": (b'policy = "preserve"\n# J\xe9r\xf4me\n', "byte 0xe9 at offset 23 is not UTF-8; accepted: UTF-8 text"),
    "random bytes": (bytes(range(256)) * 4, "byte 0x80 at offset 128 is not UTF-8; accepted: UTF-8 text"),
    "directory": (None, "is a directory; accepted: a UTF-8 TOML file of the keys in docs/admin.md, section 4"),
    "missing": (None, "no such file; accepted: a UTF-8 TOML file of the keys in docs/admin.md, section 4"),
}


def _bad_config(tmp_path: Path, case: str) -> Path:
    content, _ = BAD[case]
    path = tmp_path / "conf" / "mapa.toml"
    path.parent.mkdir(exist_ok=True)
    if case == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
        os.chmod(path, 0o644)
    return path


def _commands(tmp_path: Path, config: Path) -> dict[str, list[str]]:
    return {
        "hooks": ["hooks", str(tmp_path / "sbin"), "--config", str(config)],
        "job-submit-lua": ["job-submit-lua", str(tmp_path / "etc" / "job_submit.lua"), "--config", str(config)],
        "status": ["status", "n1", "--config", str(config)],
        "explain": ["explain", "12", "--config", str(config)],
    }


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", ["hooks", "job-submit-lua", "status", "explain"])
def test_admin_commands_refuse_a_bad_config_in_one_line(tmp_path, capsys, case, command):
    config = _bad_config(tmp_path, case)
    assert mapa_main(_commands(tmp_path, config)[command]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"mapa: error: --config {config}: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert BAD[case][1] in captured.err
    assert not (tmp_path / "sbin").exists() and not (tmp_path / "etc").exists()  # nothing written


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_hooks_still_fall_back_on_the_same_configs(tmp_path, case):
    config = _bad_config(tmp_path, case)
    # The Prolog's reading and the Epilog's (which needs only the paths, and checks no policy).
    for validate in (True,) if case == "unknown policy" else (True, False):
        loaded, problem = load_hook_config({"MAPA_CONFIG": str(config)}, validate=validate)
        assert loaded == HookConfig() and problem.startswith("bad-config: "), (case, problem)


@pytest.mark.parametrize("case", sorted(BAD))
def test_replay_refuses_a_bad_config_in_one_line(tmp_path, capsys, case):
    config = _bad_config(tmp_path, case)
    argv = ["run", "--generate", "paper:5", "--topology", "dgx1-v100", "--config", str(config), "--policies", "preserve"]
    assert replay_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mapa-replay: error: --config {config}: ") and err.count("\n") == 1 and "Traceback" not in err
    if case == "unknown key":
        assert "unknown key 'polcy' (line 1: 'polcy = \"preserve\"') (did you mean 'policy'?) (accepted: nodes, cluster, " in err
    elif case == "wrong table":
        assert '[nodes] must be a table of node-name globs to topologies, e.g. "gpu*" = "pcie-8"; got "dgx1-v100"' in err
    elif case not in ("directory", "missing"):
        assert BAD[case][1].split("; accepted")[0] in err


def test_an_empty_config_is_every_default(tmp_path, capsys):
    config = tmp_path / "mapa.toml"
    config.write_bytes(b"")
    os.chmod(config, 0o644)
    assert load_admin_config(config) == HookConfig() == load_hook_config({"MAPA_CONFIG": str(config)})[0]
    assert mapa_main(["job-submit-lua", str(tmp_path / "etc" / "job_submit.lua"), "--config", str(config)]) == 0
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config)]) == 0
    assert (tmp_path / "sbin" / "mapa-prolog-wrapper").stat().st_size > 0
    capsys.readouterr()


def test_hooks_and_job_submit_lua_also_refuse_what_the_hooks_would_not_trust(tmp_path, capsys):
    config = tmp_path / "mapa.toml"
    config.write_text('policy = "preserve"\n')
    os.chmod(config, 0o666)
    for command in ("hooks", "job-submit-lua"):
        assert mapa_main(_commands(tmp_path, config)[command]) == 2
        assert "the hooks would refuse it and fall back for every job: " in capsys.readouterr().err
    # mapa status only reads the config, as anyone may
    assert mapa_main(["status", "n1", "--config", str(config)]) == 2
    assert capsys.readouterr().err == "mapa: error: no [nodes] entry of the config matches node 'n1'\n"


# --- no input makes a traceback ------------------------------------------------------------------


def _run(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, err.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=200).map(str.encode)))
def test_arbitrary_bytes_as_the_config_never_make_a_traceback(raw):
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "mapa.toml"
        config.write_bytes(raw)
        os.chmod(config, 0o644)
        for argv in (["job-submit-lua", f"{scratch}/etc/job_submit.lua", "--config", str(config)],
                     ["status", "n1", "--config", str(config)]):
            code, err = _run(mapa_main, argv)
            assert code in (0, 2), (argv[0], code, err)
            assert "Traceback" not in err and (code == 0 or err.startswith("mapa: error: ")), err
        try:
            load_replay_config(str(config))
        except MapaError:
            pass


# TOML documents of the config's own keys with values of any type, and for each table values of
# its own keys: they get past the TOML parser, so they reach the checks of each key (random bytes
# mostly stop at UTF-8 or TOML).
_SCALARS = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=20),
                     st.sampled_from(["preserve", "preserve-ahead", "/abs/path", "dgx1-v100", "auto", "off", "step", "prefer",
                                      "topology=ring sensitive=yes", "n1:dgx1-v100", "^train-"]))
_WORDS = st.one_of(st.sampled_from(["sizes", "tolerance", "mode", "max_loss", "threshold", "fleet", "insensitive_jobs", "nodes",
                                    "topology", "sensitive", "name", "directive", "0", "1", "4", "65", "²", "dgx*"]),
                   st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WORDS, inner, max_size=3),
                       max_leaves=6)
_TABLE_KEYS = {
    "preserve_ahead": ["sizes", "tolerance"], "affinity": ["mode", "max_loss"], "nodes": ["dgx*", "n1", ""],
    "features": ["sizes", "threshold", "fleet", "insensitive_jobs"], "cluster": ["nodes"], "defaults": ["topology", "sensitive"],
}


def _value_for(key: str):
    if key == "rules":
        return st.lists(st.dictionaries(st.sampled_from(["name", "user", "directive", "x"]), _SCALARS, max_size=3), max_size=2)
    if key in _TABLE_KEYS:
        inner = _VALUES | st.dictionaries(_WORDS, _SCALARS, max_size=3) | st.lists(_SCALARS, max_size=3)
        return st.dictionaries(st.sampled_from(_TABLE_KEYS[key]), inner, max_size=3)
    return _VALUES


_ENTRIES = st.sampled_from(sorted(HOOK_KEYS | {"cluster", "defaults", "rules", "polcy"})).flatmap(
    lambda key: st.tuples(st.just(key), _value_for(key)))


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == float("inf") else "-inf" if value == float("-inf") else repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return "{" + ", ".join(f"{_toml(str(key))} = {_toml(item)}" for key, item in value.items()) + "}"


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(_ENTRIES, max_size=4, unique_by=lambda entry: entry[0]))
@example(entries=[("preserve_ahead", {"sizes": {"²": 1}})])  # "²".isdigit(), but int("²") fails
@example(entries=[("ledger", "/a\x00b")])  # TOML's \u0000: os calls raise ValueError on it
def test_any_value_of_any_key_is_taken_or_refused_in_words(entries):
    text = "".join(f"{key} = {_toml(value)}\n" for key, value in entries)
    try:
        config_from_text(text, source="--config x")
    except MapaError as error:
        assert str(error).startswith("--config x: "), str(error)
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "mapa.toml"
        config.write_text(text)
        os.chmod(config, 0o644)
        with contextlib.suppress(MapaError):
            load_admin_config(config, trusted=False)
        code, err = _run(mapa_main, ["status", "n1", "--config", str(config)])
        assert code in (0, 2) and "Traceback" not in err and (code == 0 or err.startswith("mapa: error: ")), err
        with contextlib.suppress(MapaError):
            load_replay_config(str(config))
        loaded, problem = load_hook_config({"MAPA_CONFIG": str(config)})
        assert problem == "" or loaded == HookConfig()


def test_a_misspelled_key_or_section_is_answered_with_the_closest_accepted_one(tmp_path):
    from slurm_mapa.errors import InputError
    from slurm_mapa.replay.config import parse_config
    from slurm_mapa.slurm.config import config_from_text

    for text, suggested in (('polcy = "preserve"\n', "'policy'"), ('isolaton = "off"\n', "'isolation'"),
                            ("[featurs]\nsizes = [2]\n", "'features'")):
        with pytest.raises(InputError, match=f"did you mean {suggested}"):
            config_from_text(text, "mapa.toml")
    with pytest.raises(InputError, match="did you mean 'cluster'"):
        parse_config("[clustr]\n", "replay.toml")
    with pytest.raises(InputError) as nothing_close:
        config_from_text('zzzzzz = 1\n', "mapa.toml")
    assert "did you mean" not in str(nothing_close.value)


def test_an_edit_of_mapa_toml_or_the_topology_file_applies_to_the_next_read_despite_the_parse_cache(tmp_path):
    """Issue 41: mapa-agent parses mapa.toml and the node's topology file once per text; an edit
    (same path, new text) is read and parsed afresh, and an error is never cached."""
    from slurm_mapa.hardware.load import load_topology_file
    from slurm_mapa.slurm.config import load_hook_config

    path = tmp_path / "mapa.toml"
    path.write_text('policy = "preserve"\n')
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o644)
    env = {"MAPA_CONFIG": str(path)}
    first, problem = load_hook_config(env)
    assert (first.policy, problem) == ("preserve", "")
    assert load_hook_config(env)[0] is first  # the same text: parsed once
    path.write_text('policy = "greedy"\n')
    assert load_hook_config(env)[0].policy == "greedy"
    path.write_text('policy = "gredy"\n')
    for _ in range(2):
        config, problem = load_hook_config(env)
        assert "unknown policy 'gredy'" in problem and config.policy == "preserve"  # the defaults, refused each time
    topology = tmp_path / "node.toml"
    topology.write_text('gpus = 2\n[links]\n"0-1" = "NV1"\n')
    assert load_topology_file(str(topology)).graph.size == 2
    topology.write_text('gpus = 3\n[links]\n"0-1" = "NV1"\n')
    assert load_topology_file(str(topology)).graph.size == 3


def test_a_features_key_error_names_the_key_its_line_and_the_closest_key():
    """Issue 39: [features] errors named no key, line or suggestion; top-level keys got all three."""
    from slurm_mapa.slurm.config import config_from_text

    with pytest.raises(MapaError) as raised:
        config_from_text('policy = "preserve"\n[features]\nsize = [2, 4]\n')
    assert "unknown key 'size' in [features] (line 3: 'size = [2, 4]') (did you mean 'sizes'?) (accepted: sizes" in str(raised.value)
    with pytest.raises(MapaError, match=r"\[features\] must be a table .*got 3"):
        config_from_text("features = 3\n")
