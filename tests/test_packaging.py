"""What a site installs: the sdist and the wheel `python -m build` makes, installed into a fresh
virtual environment outside the checkout, and the commands an admin runs from it (docs/admin.md,
"1. Install"), `mapa contrib` among them (the Grafana dashboard, the Prometheus rules and the
gres.conf files the docs name); the sdist's own tests, run from the unpacked sdist; the licence,
NOTICE and the metadata; `--version` and the Slurm releases it names; install hints that work.

The archives are built without build isolation (``--no-isolation``, the backend of the test
environment: pyproject's test extra has build and setuptools>=77): an isolated build installs
setuptools into a new environment every time, which needs the network or pip's cache (and took
4.3 s against 1.8 s on the development machine, with a warm cache). ``python -m build`` with
neither --sdist nor --wheel makes the sdist and then the wheel *from the sdist*, so a file the
sdist lacks is missing from the wheel too and is found here.

The wheel is installed offline (``--no-deps --no-index``) into a venv made without pip (``pip
--python`` installs into it). Its two dependencies, numpy and networkx, which METADATA is checked
to declare, come from the test environment through a .pth file naming a directory that holds only
them: no download, and the package itself can only come from the wheel (the checkout's editable
install is not on that path, and the commands run outside the checkout with PYTHONPATH unset).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from slurm_mapa import TESTED_SLURM_RELEASES, __version__
from slurm_mapa.cli import main as mapa_main
from slurm_mapa.extras import EXTRAS, install_hint
from slurm_mapa.hardware.presets import PRESETS
from slurm_mapa.replay.cli import main as replay_main

ROOT = Path(__file__).resolve().parents[1]
# What the sdist is built from: the files MANIFEST.in and pyproject.toml name (a copy, because the
# build writes an egg-info directory into its source tree).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "NOTICE", "MANIFEST.in", "slurm_mapa", "docs", "tests", "scripts",
           "containers")
NAME = f"slurm_mapa-{__version__}"
COPYRIGHT_HOLDER = "The slurm-mapa developers"
# The package data the docs send admins to (docs/admin.md, Metrics; docs/hardware.md), relative
# to slurm_mapa/data/: named here, so that moving them out of the package fails the tests below
# instead of shrinking _data_files().
ADMIN_FILES = ("contrib/grafana/mapa-dashboard.json", "contrib/prometheus/mapa-alerts.yml",
               *(f"gres_conf/{name}{suffix}" for name in PRESETS for suffix in (".gres.conf", ".toml")))
# What the sdist's tests read besides the package (tests/data, their helpers, the cluster suite's
# conftest, the mock tools, the mini cluster's files).
TEST_INPUTS = ("tests/data/rocm-smi/mi300x-showtopo.txt", "tests/data/nvidia-smi/dgx1-v100.txt",
               "tests/data/directives/corpus.tsv", "tests/fake_nvml.py", "tests/fake_amdsmi.py", "tests/bruteforce.py",
               "tests/lua/run_cases.lua", "tests/cluster/conftest.py", "scripts/mock-nvidia-smi", "scripts/mock-rocm-smi",
               "containers/config/slurm.conf", "containers/entrypoint.sh")


def _files_under(*names: str) -> list[str]:
    """Every file of these checkout directories, relative to the checkout (byte code aside)."""
    return sorted(str(path.relative_to(ROOT)) for name in names for path in (ROOT / name).rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc")


def _data_files() -> list[str]:
    """Every file of slurm_mapa/data in the checkout, relative to slurm_mapa/ (byte code aside)."""
    base = ROOT / "slurm_mapa"
    return sorted(str(path.relative_to(base)) for path in (base / "data").rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc")


# --- licence and version ----------------------------------------------------------------------


def test_the_licence_is_apache_2_0_everywhere_it_is_stated():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE", "NOTICE"]
    assert any(req.startswith("setuptools>=77") for req in project["build-system"]["requires"])  # PEP 639 metadata
    assert "BSD" not in (ROOT / "pyproject.toml").read_text()


def test_the_copyright_holder_is_named_in_notice_and_metadata():
    notice = (ROOT / "NOTICE").read_text()
    assert notice.startswith("slurm-mapa\n") and re.search(rf"^Copyright 20\d\d {COPYRIGHT_HOLDER}$", notice, re.M)
    assert "Apache License, Version 2.0" in notice and "LICENSE" in notice
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["authors"] == project["maintainers"] == [{"name": COPYRIGHT_HOLDER}]
    classifiers = project["classifiers"]
    assert "Intended Audience :: System Administrators" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
    # PEP 639: the licence is the License-Expression; a licence classifier beside it is refused by setuptools.
    assert not [c for c in classifiers if c.startswith("License ::")]
    # Python versions named are ones requires-python allows.
    assert all(tuple(map(int, c.rsplit(" ", 1)[1].split("."))) >= (3, 11)
               for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    # No project URL: the project has no public address; one added later must be real (not a placeholder).
    for url in project.get("urls", {}).values():
        assert url.startswith("https://") and "example" not in url, url


# --- install hints ------------------------------------------------------------------------------

_PACKAGE_WITH_EXTRA = re.compile(r"(?<![\w./-])slurm[-_]mapa\[")


def test_every_install_hint_says_a_command_that_works():
    """slurm-mapa is on no index: `pip install 'slurm-mapa[plot]'` fails in a fresh environment.
    The code and the docs name the wheel with the extra, the checkout (`.[plot]`), the extra's own
    requirement or Debian's package instead."""
    places = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
              *sorted((ROOT / "slurm_mapa").rglob("*.py")), *sorted((ROOT / "scripts").iterdir()),
              *sorted(p for p in (ROOT / "containers").rglob("*") if p.is_file())]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in places if path.is_file() and "__pycache__" not in path.parts
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if _PACKAGE_WITH_EXTRA.search(line)]
    assert not found, "\n".join(found)


def test_the_hints_install_what_the_extras_install():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) == set(extras) - {"test"}
    for name, extra in EXTRAS.items():
        assert extras[name] == [extra.requirement], name
        hint = install_hint(name, "/opt/slurm-mapa/0.1.0/bin/python", system_python=False)
        assert hint.startswith(f"/opt/slurm-mapa/0.1.0/bin/python -m pip install '{extra.requirement}'"), hint
        assert "apt install" not in hint  # a virtual environment does not see Debian's packages
    assert install_hint("metrics", "/usr/bin/python3", system_python=True).endswith(
        ", or on Debian: apt install python3-prometheus-client")
    assert install_hint("plot", "/usr/bin/python3", system_python=True).endswith(", or on Debian: apt install python3-matplotlib")


def test_the_commands_give_the_hint_when_an_extra_is_missing(monkeypatch, tmp_path):
    from slurm_mapa.errors import InputError
    from slurm_mapa.hardware.amd import load_amdsmi
    from slurm_mapa.hardware.nvml import load_pynvml
    from slurm_mapa.replay import run

    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    with pytest.raises(InputError, match=re.escape(install_hint("nvml"))):
        load_pynvml()
    with pytest.raises(InputError, match=re.escape(install_hint("amd"))):
        load_amdsmi()
    monkeypatch.setattr(run, "have_matplotlib", lambda: False)
    notes: list[str] = []
    run._plots(type("Args", (), {"plot": str(tmp_path)})(), "label", [], {}, notes)
    assert notes == [f"plots skipped: matplotlib is not installed ({install_hint('plot')})"]


def test_version_names_the_package_and_the_tested_slurm_releases(capsys):
    for main, prog in ((mapa_main, "mapa"), (replay_main, "mapa-replay")):
        with pytest.raises(SystemExit) as exit_:
            main(["--version"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out == f"{prog} {__version__} (tested with Slurm {', '.join(TESTED_SLURM_RELEASES)})\n"
    assert __version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_tested_releases_are_the_mini_clusters_releases():
    """TESTED_SLURM_RELEASES is what tests/cluster runs: RELEASE_CLUSTERS and the default of
    MAPA_SLURM_RELEASES, read from conftest's text (importing it would pull in the cluster harness)."""
    text = (ROOT / "tests" / "cluster" / "conftest.py").read_text()
    block = re.search(r"^RELEASE_CLUSTERS\b[^=]*=\s*\{(.*?)^\}", text, re.M | re.S)
    assert block, "tests/cluster/conftest.py has no RELEASE_CLUSTERS = {...}"
    assert tuple(re.findall(r'^\s*"([0-9]+\.[0-9]+)"\s*:', block.group(1), re.M)) == TESTED_SLURM_RELEASES
    default = re.search(r'os\.environ\.get\("MAPA_SLURM_RELEASES",\s*"([^"]*)"\)', text)
    assert default and tuple(default.group(1).split(",")) == TESTED_SLURM_RELEASES


# --- the archives -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) of a copy of the checkout."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the build package is missing: install the test extra (pip install -e '.[test]')")
    base = tmp_path_factory.mktemp("packaging")
    source = base / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = base / "dist"
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=300, cwd=base)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert [p.name for p in sdists] == [f"{NAME}.tar.gz"] and [p.name for p in wheels] == [f"{NAME}-py3-none-any.whl"]
    return sdists[0], wheels[0]


def test_the_sdist_carries_every_data_file_the_licence_readme_and_docs(built):
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        for rel in _data_files():
            member = archive.extractfile(f"{NAME}/slurm_mapa/{rel}")
            assert member is not None and member.read() == (ROOT / "slurm_mapa" / rel).read_bytes(), rel
    wanted = {"LICENSE", "NOTICE", "README.md", "pyproject.toml", "slurm_mapa/py.typed", "slurm_mapa/cli.py",
              *(f"docs/{path.relative_to(ROOT / 'docs')}" for path in (ROOT / "docs").rglob("*") if path.is_file())}
    assert {f"{NAME}/{name}" for name in wanted} <= names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    missing = [rel for rel in ADMIN_FILES if f"{NAME}/slurm_mapa/data/{rel}" not in names]
    assert not missing, f"the sdist lacks the admin files the docs name: {missing}"


def test_the_sdist_carries_the_tests_with_their_data(built):
    """Every file of tests/ (tests/data, the helpers, the cluster suite) and of scripts/ and
    containers/, which the tests read, byte for byte: the unpacked sdist runs its tests."""
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        missing = [rel for rel in TEST_INPUTS if f"{NAME}/{rel}" not in names]
        assert not missing, f"the sdist lacks what its tests read: {missing}"
        for rel in _files_under("tests", "scripts", "containers"):
            member = archive.extractfile(f"{NAME}/{rel}")
            assert member is not None and member.read() == (ROOT / rel).read_bytes(), rel
    assert any(name.startswith(f"{NAME}/tests/data/rocm-smi/") for name in names)


def test_the_unpacked_sdists_tests_run(built, tmp_path):
    """A few test files that read tests/data, the gres_conf files, scripts/ and containers/, run
    from the unpacked sdist against its own package (not the checkout's)."""
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    source = tmp_path / NAME
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAPA_CONFIG")}
    where = subprocess.run([sys.executable, "-c", "import slurm_mapa; print(slurm_mapa.__file__)"],
                           capture_output=True, text=True, cwd=source, env=env, timeout=60)
    assert Path(where.stdout.strip()) == source / "slurm_mapa" / "__init__.py", where.stdout + where.stderr
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/hardware/test_topofile.py", "tests/hardware/test_gres.py", "tests/hardware/test_amd.py",
                           "tests/test_bad_input.py", "-k", "not fuzz and not any_bytes"],
                          capture_output=True, text=True, cwd=source, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"^\d+ passed", done.stdout.splitlines()[-1]), done.stdout[-500:]


def test_the_wheel_carries_every_data_file_the_licence_and_its_dependencies(built):
    _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for rel in _data_files():
            assert archive.read(f"slurm_mapa/{rel}") == (ROOT / "slurm_mapa" / rel).read_bytes(), rel
        assert "slurm_mapa/py.typed" in names
        assert archive.read(f"{NAME}.dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert archive.read(f"{NAME}.dist-info/licenses/NOTICE") == (ROOT / "NOTICE").read_bytes()
        missing = [rel for rel in ADMIN_FILES if f"slurm_mapa/data/{rel}" not in names]
        assert not missing, f"the wheel lacks the admin files the docs name: {missing}"
        metadata = archive.read(f"{NAME}.dist-info/METADATA").decode()
        entry_points = archive.read(f"{NAME}.dist-info/entry_points.txt").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert {f"Author: {COPYRIGHT_HOLDER}", f"Maintainer: {COPYRIGHT_HOLDER}",
            "Classifier: Intended Audience :: System Administrators"} <= set(metadata.splitlines())
    assert {"Requires-Dist: numpy>=1.24", "Requires-Dist: networkx>=3.0"} <= set(metadata.splitlines())
    for script in ("mapa", "mapa-replay", "mapa-prolog", "mapa-epilog", "mapa-agent"):
        assert re.search(rf"^{script} = ", entry_points, re.M), script
    # Every module of the checkout's package is in the wheel.
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "slurm_mapa").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names


# --- installed outside the checkout -----------------------------------------------------------


class Installed:
    def __init__(self, base: Path, venv: Path, site: Path):
        self.base, self.venv, self.site = base, venv, site
        self.python = venv / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV", "MAPA_CONFIG")}

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        program = argv[0] if argv[0].startswith("/") else str(self.venv / "bin" / argv[0])
        return subprocess.run([program, *argv[1:]], capture_output=True, text=True, timeout=timeout, cwd=self.base, env=self.env)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Installed:
    _, wheel = built
    base = tmp_path_factory.mktemp("site")
    assert not base.resolve().is_relative_to(ROOT)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                           "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, cwd=base).stdout.strip())
    deps = base / "deps"
    deps.mkdir()
    for module in ("numpy", "networkx"):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.submodule_search_locations, module
        package = Path(next(iter(spec.submodule_search_locations)))
        for entry in package.parent.iterdir():  # numpy, numpy.libs (its bundled BLAS), networkx
            if entry.name == module or entry.name == f"{module}.libs":
                (deps / entry.name).symlink_to(entry)
    (site / "_slurm_mapa_test_dependencies.pth").write_text(f"{deps}\n")
    return Installed(base, venv, site)


def test_the_installed_package_comes_from_the_wheel(installed):
    done = installed.run(str(installed.python), "-c", "import importlib.metadata as m, slurm_mapa, sys; "
                                                      "print(slurm_mapa.__file__); print(m.version('slurm-mapa')); print(sys.path)")
    assert done.returncode == 0, done.stderr
    where, version, path = done.stdout.splitlines()
    assert Path(where) == installed.site / "slurm_mapa" / "__init__.py" and version == __version__
    assert str(ROOT) not in path
    done = installed.run("mapa", "--version")
    assert (done.returncode, done.stdout) == (0, f"mapa {__version__} (tested with Slurm {', '.join(TESTED_SLURM_RELEASES)})\n")
    assert installed.run("mapa-replay", "--version").stdout.startswith(f"mapa-replay {__version__} (tested with Slurm ")


def test_the_installed_commands_write_the_hooks_and_the_job_submit_plugin(installed):
    etc = installed.base / "etc"
    etc.mkdir()
    config = etc / "mapa.toml"
    config.write_text(f'policy = "preserve"\njob_submit_lua = true\nledger = "{installed.base}/state/ledger.json"\n'
                      f'jobs_dir = "{installed.base}/run/jobs"\nlog = "{installed.base}/mapa.log"\n'
                      '[features]\nsizes = [2, 4]\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    os.chmod(config, 0o644)
    sbin = installed.base / "sbin"
    done = installed.run("mapa", "hooks", str(sbin), "--python", str(installed.python), "--config", str(config), "--node", "dgx1")
    assert done.returncode == 0, done.stderr
    assert "Prolog=" + str(sbin / "mapa-prolog-wrapper") in done.stdout and "Features=mapa_ring2" in done.stdout
    for name in ("mapa-prolog-wrapper", "mapa-epilog-wrapper", "mapa-taskprolog"):
        text = (sbin / name).read_text()
        assert text.startswith("#!/bin/sh\n") and (sbin / name).stat().st_mode & 0o777 == 0o755, name
        assert str(ROOT) not in text, name
    prolog = (sbin / "mapa-prolog-wrapper").read_text()
    assert f'sys.path.insert(0, "{installed.site}")' in prolog and str(installed.python) in prolog
    assert f"JOBS_DIR={installed.base}/run/jobs\n" in (sbin / "mapa-taskprolog").read_text()

    lua = etc / "job_submit.lua"
    done = installed.run("mapa", "job-submit-lua", str(lua), "--config", str(config))
    assert done.returncode == 0, done.stderr
    shipped = (ROOT / "slurm_mapa" / "data" / "slurm" / "job_submit.lua").read_text()
    assert lua.read_text() == shipped.replace("local _NODE_FEATURE_SIZES = {}\n", "local _NODE_FEATURE_SIZES = { 2, 4 }\n")
    assert done.stdout.startswith("JobSubmitPlugins=lua\n")

    done = installed.run("mapa", "hooks", str(sbin), "--python", str(installed.python), "--config", str(etc / "nope.toml"))
    assert done.returncode == 2 and done.stderr.startswith(f"mapa: error: --config {etc / 'nope.toml'}: no such file")


def test_the_installed_contrib_command_writes_the_files_the_docs_name(installed):
    """docs/admin.md, section 1: `mapa contrib write DIR` from the installed wheel writes the
    Grafana dashboard, the Prometheus rules and every preset's gres.conf and topology file."""
    done = installed.run("mapa", "contrib", "list")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == sorted(ADMIN_FILES)
    share = installed.base / "share" / "slurm-mapa"
    done = installed.run("mapa", "contrib", "write", str(share))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"wrote {share / rel}" for rel in sorted(ADMIN_FILES)]
    for rel in ADMIN_FILES:
        assert (share / rel).read_bytes() == (ROOT / "slurm_mapa" / "data" / rel).read_bytes(), rel
        assert (share / rel).stat().st_mode & 0o777 == 0o644, rel
    done = installed.run("mapa", "contrib", "write", str(share), "contrib")
    assert done.returncode == 2 and done.stderr.startswith(f"mapa: error: {share / ADMIN_FILES[0]} and 1 more file(s) exist")
    done = installed.run("mapa", "contrib", "write", str(share), "contrib/prometheus/mapa-alerts.yml", "--force")
    assert (done.returncode, done.stdout) == (0, f"wrote {share / 'contrib/prometheus/mapa-alerts.yml'}\n")
    done = installed.run("mapa", "contrib", "show", "gres_conf/dgx1-v100.gres.conf")
    assert done.stdout == (ROOT / "slurm_mapa" / "data" / "gres_conf" / "dgx1-v100.gres.conf").read_text()


def test_the_installed_replay_runs_on_its_bundled_data(installed):
    done = installed.run("mapa-replay")
    assert done.returncode == 0, done.stderr
    assert "bundled paper workload (300 jobs" in done.stdout and "bundled sacct log (sample-sacct.txt)" in done.stdout
    assert re.search(r"^preserve \(MAPA\)\s+\d+", done.stdout, re.M)  # a table row of MAPA's policy
    assert done.stdout.startswith("What MAPA gained, bundled paper workload")


@pytest.mark.skipif(shutil.which("cc") is None or not Path("/usr/include/slurm/spank.h").exists(),
                    reason="needs a C compiler and the Slurm headers (libslurm-dev; scripts/test installs them)")
def test_the_installed_spank_plugin_command_builds_the_bundled_source(installed):
    target = installed.base / "lib" / "spank_mapa_isolate.so"
    done = installed.run("mapa", "spank-plugin", str(target), timeout=180)
    assert done.returncode == 0, done.stderr
    assert target.read_bytes()[:4] == b"\x7fELF" and target.stat().st_size > 1000
    assert f"optional {target} fail-open" in done.stdout
    assert "built for Slurm" in done.stderr
