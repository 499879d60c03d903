"""`mapa contrib`: the bundled admin files (Grafana dashboard, Prometheus rules, gres.conf and
topology file per preset) listed, printed and written, in-process; the installed wheel's run is
in tests/test_packaging.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.cli import main
from slurm_mapa.hardware.presets import PRESETS
from slurm_mapa.slurm.admin import contrib

DATA = REPO / "slurm_mapa" / "data"
EVERY = sorted(["contrib/grafana/mapa-dashboard.json", "contrib/prometheus/mapa-alerts.yml",
                *(f"gres_conf/{name}{suffix}" for name in PRESETS for suffix in (".gres.conf", ".toml"))])


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_names_every_bundled_file_and_what_it_is(capsys):
    code, out, _ = run(capsys, "contrib", "list")
    assert code == 0
    rows = [line.split(None, 1) for line in out.splitlines()]
    assert [name for name, _ in rows] == EVERY
    what = dict(rows)
    assert what["contrib/grafana/mapa-dashboard.json"].startswith("Grafana dashboard")
    assert what["contrib/prometheus/mapa-alerts.yml"].startswith("Prometheus alert rules")
    assert what["gres_conf/mi300x.gres.conf"].startswith("gres.conf of the preset mi300x")
    assert what["gres_conf/mi300x.toml"].startswith("topology file of the preset mi300x")
    code, out, _ = run(capsys, "contrib", "list", "contrib/")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == EVERY[:2]


def test_the_bundled_files_are_the_package_data_and_nothing_else():
    files = contrib.bundled_files()
    assert list(files) == EVERY
    assert all(path == DATA / name for name, path in files.items())


def test_show_prints_one_file_byte_for_byte(capsysbinary):
    assert main(["contrib", "show", "contrib/prometheus/mapa-alerts.yml"]) == 0
    assert capsysbinary.readouterr().out == (DATA / "contrib" / "prometheus" / "mapa-alerts.yml").read_bytes()


@pytest.mark.parametrize("name, error", [
    ("contrib", "'contrib' is a directory; name one file"),
    ("gres_conf/dgx9.toml", "no bundled file or directory 'gres_conf/dgx9.toml'; accepted: contrib, gres_conf"),
    ("models/link-bound.toml", "no bundled file or directory 'models/link-bound.toml'"),  # package data, not an admin's
    ("", "no bundled file or directory ''"),
])
def test_show_refuses_what_is_not_one_bundled_file(name, error, capsys):
    code, out, err = run(capsys, "contrib", "show", name)
    assert (code, out) == (2, "") and err.startswith(f"mapa: error: {error}"), err


def test_write_copies_everything_under_the_directory_with_the_listed_paths(tmp_path, capsys):
    target = tmp_path / "share" / "slurm-mapa"  # made, parents too
    code, out, err = run(capsys, "contrib", "write", target)
    assert code == 0, err
    assert out.splitlines() == [f"wrote {target / name}" for name in EVERY]
    for name in EVERY:
        assert (target / name).read_bytes() == (DATA / name).read_bytes(), name
        assert (target / name).stat().st_mode & 0o777 == 0o644, name
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == EVERY  # no temporary left


def test_write_takes_files_and_directories(tmp_path, capsys):
    code, out, _ = run(capsys, "contrib", "write", tmp_path, "contrib/grafana", "gres_conf/dgx1-v100.gres.conf",
                       "contrib/grafana/mapa-dashboard.json")
    assert code == 0
    assert out.splitlines() == [f"wrote {tmp_path / 'contrib/grafana/mapa-dashboard.json'}",
                                f"wrote {tmp_path / 'gres_conf/dgx1-v100.gres.conf'}"]
    code, _, err = run(capsys, "contrib", "write", tmp_path, "grafana")
    assert code == 2 and "no bundled file or directory 'grafana'" in err


def test_write_refuses_to_overwrite_and_writes_nothing_unless_forced(tmp_path, capsys):
    alerts = tmp_path / "contrib" / "prometheus" / "mapa-alerts.yml"
    alerts.parent.mkdir(parents=True)
    alerts.write_text("site's own rules\n")
    code, out, err = run(capsys, "contrib", "write", tmp_path, "contrib")
    assert (code, out) == (2, "")
    assert err == f"mapa: error: {alerts} exists already; nothing written (--force replaces it)\n"
    assert alerts.read_text() == "site's own rules\n" and not (tmp_path / "contrib" / "grafana").exists()
    code, out, _ = run(capsys, "contrib", "write", tmp_path, "contrib", "--force")
    assert code == 0 and len(out.splitlines()) == 2
    assert alerts.read_bytes() == (DATA / "contrib" / "prometheus" / "mapa-alerts.yml").read_bytes()
    code, _, err = run(capsys, "contrib", "write", tmp_path)
    assert code == 2 and err.startswith(f"mapa: error: {tmp_path / EVERY[0]} and 1 more file(s) exist already")


def test_forced_write_replaces_a_symlink_instead_of_writing_through_it(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere.yml"
    elsewhere.write_text("not to be touched\n")
    alerts = tmp_path / "out" / "contrib" / "prometheus" / "mapa-alerts.yml"
    alerts.parent.mkdir(parents=True)
    alerts.symlink_to(elsewhere)
    assert run(capsys, "contrib", "write", tmp_path / "out", "contrib/prometheus")[0] == 2  # a symlink counts as there
    assert run(capsys, "contrib", "write", tmp_path / "out", "contrib/prometheus", "--force")[0] == 0
    assert not alerts.is_symlink() and elsewhere.read_text() == "not to be touched\n"


def test_write_refuses_a_file_where_a_directory_belongs(tmp_path, capsys):
    plain = tmp_path / "file"
    plain.write_text("x")
    code, _, err = run(capsys, "contrib", "write", plain)
    assert code == 2 and err == f"mapa: error: {plain} is not a directory; give the directory to write the files into\n"
    (tmp_path / "gres_conf").write_text("x")
    code, _, err = run(capsys, "contrib", "write", tmp_path, "gres_conf", "--force")
    assert code == 2 and f"{tmp_path / 'gres_conf'} is not a directory" in err
    (tmp_path / "d" / "contrib" / "prometheus" / "mapa-alerts.yml").mkdir(parents=True)
    code, _, err = run(capsys, "contrib", "write", tmp_path / "d", "--force")
    assert code == 2 and "mapa-alerts.yml: it is a directory" in err


def test_a_write_the_system_refuses_is_one_error_line(tmp_path, capsys, monkeypatch):
    real = contrib._replace

    def refuse_the_second(target, data):
        if target.name == "mapa-alerts.yml":
            raise PermissionError(13, "Permission denied")
        real(target, data)

    monkeypatch.setattr(contrib, "_replace", refuse_the_second)
    code, out, err = run(capsys, "contrib", "write", tmp_path, "contrib")
    assert code == 2 and out == ""  # the error says what was written before it
    assert err == (f"mapa: error: cannot write {tmp_path / 'contrib/prometheus/mapa-alerts.yml'}: Permission denied "
                   "(written before it: 1 file(s))\n")


def test_an_installation_without_the_files_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "contrib").mkdir()
    monkeypatch.setattr(contrib, "DATA_DIR", tmp_path)
    code, _, err = run(capsys, "contrib", "list")
    assert code == 2 and f"{tmp_path / 'gres_conf'} is missing: this installation of slurm-mapa is incomplete" in err
