"""Issue 13's hardening, tested for real: umask, trusted config/interpreter/commands, the agent's
backlog, deadline and thread bound, the wrapper's retry after a SIGKILL, and the systemd unit.

These tests run as root (chown to another uid must work), as the hooks do.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_slurm import FAKE_SCONTROL, FakeSlurm, env_for

from slurm_mapa.errors import InputError
from slurm_mapa.slurm import config as config_module
from slurm_mapa.slurm.agent import client as agent_client
from slurm_mapa.slurm import trusted_files as paths
from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.agent.server import serve
from slurm_mapa.slurm.config import HookConfig, hook_logger, load_hook_config
from slurm_mapa.slurm.admin.install import PACKAGE_DIR, RETRY_WINDOW_S, check_config, check_interpreter, wrapper_text
from slurm_mapa.slurm.node_state.ledger import LedgerFile

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid and the hooks' checks need root")

OTHER_UID = 12345
UNIT = PACKAGE_DIR / "data" / "systemd" / "mapa-agent.service"
PYTHON = sys.executable


def _fake_slurm_commands(directory: Path) -> tuple[Path, Path]:
    """Root-owned 755 scontrol and squeue scripts, as a site would install its own."""
    directory.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("squeue", "#!/bin/sh\necho 7\necho 8\n")):
        (directory / name).write_text(text)
        os.chmod(directory / name, 0o755)
    return directory / "scontrol", directory / "squeue"


def _write_config(path: Path, base: Path, extra: str = "", topology: str = "dgx1-v100") -> Path:
    scontrol, squeue = _fake_slurm_commands(base / "bin")
    path.write_text(
        f'ledger = "{base}/state/mapa/ledger.json"\njobs_dir = "{base}/run/mapa/jobs"\nlog = "{base}/mapa.log"\n'
        f'health = "off"\nscontrol = "{scontrol}"\nsqueue = "{squeue}"\n{extra}[nodes]\n"dgx*" = "{topology}"\n'
    )
    os.chmod(path, 0o644)
    return path


def _write_hooks(tmp_path: Path, config: Path, *extra: str, python: str = PYTHON) -> dict[str, str]:
    from slurm_mapa.cli import main as mapa_main

    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--python", python, "--config", str(config), *extra]) == 0
    return {kind: str(tmp_path / "sbin" / f"mapa-{kind}-wrapper") for kind in ("prolog", "epilog")}


def _slurmd_env(job: str, gpus: str, tmp_path: Path) -> dict[str, str]:
    """What slurmd gives a Prolog: no PATH, a few SLURM_* variables (env -i), and here no agent."""
    return {**env_for(job, gpus), "MAPA_AGENT_SOCKET": str(tmp_path / "no-agent.sock")}


def _open_to_others(root: Path) -> list[str]:
    """Everything under ``root`` that others could write (a sticky directory does not count)."""
    found = []
    for entry in [root, *root.rglob("*")]:
        info = entry.lstat()
        if stat.S_IMODE(info.st_mode) & 0o022 and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX):
            found.append(f"{entry} {stat.S_IMODE(info.st_mode):o}")
    return found


# --- umask ----------------------------------------------------------------------------------------


def test_a_wrapper_under_umask_000_creates_nothing_others_can_write(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    pycache = tmp_path / "pycache"
    wrappers = _write_hooks(tmp_path, config, "--pycache-prefix", str(pycache))
    done = subprocess.run([wrappers["prolog"]], env=_slurmd_env("7", "0,1", tmp_path), umask=0, check=False)
    assert done.returncode == 0
    assert "7" in LedgerFile(tmp_path / "state" / "mapa" / "ledger.json", 8).read().holdings
    assert list(pycache.rglob("*.pyc")), "the in-process Prolog wrote no byte code: the test saw nothing"
    assert stat.S_IMODE((tmp_path / "mapa.log").stat().st_mode) in (0o640, 0o644)
    for created in (pycache, tmp_path / "state", tmp_path / "run"):
        assert _open_to_others(created) == []


def _listens(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_the_agent_sets_umask_022_whatever_started_it(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    sock = tmp_path / "agent" / "agent.sock"
    agent = subprocess.Popen(
        [PYTHON, "-c", "import sys; from slurm_mapa.slurm.agent.service import main; sys.exit(main(sys.argv[1:]))",
         "--config", str(config), "--socket", str(sock), "--node", "dgx1"],
        umask=0, cwd=str(PACKAGE_DIR.parent), stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _listens(sock):  # the path exists from bind(), a moment before listen()
            assert agent.poll() is None, agent.stderr.read()
            assert time.monotonic() < deadline, "the agent never listened"
            time.sleep(0.05)
        assert agent_client.ask_agent("prolog", env_for("7", "0,1"), str(sock)) == "done"
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
    assert (tmp_path / "run" / "mapa" / "jobs" / "7").exists()
    assert stat.S_IMODE((tmp_path / "mapa.log").stat().st_mode) in (0o640, 0o644)
    for created in (tmp_path / "state", tmp_path / "run"):
        assert _open_to_others(created) == []


# --- the config and the programs it names ---------------------------------------------------------


def _chown_other(path: Path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (_chown_other, f"belongs to uid {OTHER_UID}; accepted: owned by root"),
        (lambda path: os.chmod(path, 0o666), "writable by group or others \\(mode 666\\); accepted: not group/world-writable"),
        (lambda path: os.chmod(path, 0o664), "writable by group or others \\(mode 664\\)"),
        (lambda path: (path.rename(path.with_suffix(".real")), path.symlink_to(path.with_suffix(".real"))),
         "is not a regular file \\(a symlink or something else\\)"),
    ],
    ids=["other-owner", "mode-666", "mode-664", "symlink"],
)
def test_an_untrusted_config_is_refused_and_the_prolog_falls_back(tmp_path, monkeypatch, spoil, reason):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    assert load_hook_config({"MAPA_CONFIG": str(config)})[1] == ""
    spoil(config)
    loaded, problem = load_hook_config({"MAPA_CONFIG": str(config)})
    assert loaded == HookConfig()
    assert problem.startswith("bad-config: refused the config, as sshd's StrictModes would: ")
    assert re.search(reason, problem), problem
    assert load_hook_config({"MAPA_CONFIG": str(config)}, validate=False)[1] == problem  # the Epilog sees the same
    _prolog_falls_back_with(config, tmp_path, monkeypatch, "refused the config")


def _prolog_falls_back_with(config: Path, tmp_path: Path, monkeypatch, expected: str) -> None:
    """Run the in-process Prolog body with the config at ``config``. A refused config means the
    defaults (/var/lib, /run, /var/log of this machine), so they are pointed into tmp_path here."""
    from slurm_mapa.slurm.hooks.prolog import prolog_failing_open

    @dataclass(frozen=True)
    class Defaults(HookConfig):
        ledger: Path = tmp_path / "default" / "ledger.json"
        jobs_dir: Path = tmp_path / "default" / "jobs"
        log: Path = tmp_path / "default" / "log"

    monkeypatch.setattr(config_module, "HookConfig", Defaults)
    (tmp_path / "default").mkdir(exist_ok=True)  # as /var/log is there
    slurm = FakeSlurm()
    slurm.running = {"7"}
    prolog_failing_open(env_for("7", "2,3"), {"MAPA_CONFIG": str(config)}, lambda timeout: slurm)
    log = (tmp_path / "default" / "log").read_text()
    assert f"every job falls back: bad-config: {expected}" in log and f"FALLBACK because bad-config: {expected}" in log, log
    holding = LedgerFile(tmp_path / "default" / "ledger.json", 8).read().holdings["7"]
    assert holding.gpus == (2, 3) and holding.policy == "fallback"


def test_a_config_in_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    config = _write_config(shared / "mapa.toml", tmp_path)
    os.chmod(shared, 0o777)
    problem = load_hook_config({"MAPA_CONFIG": str(config)})[1]
    assert f"directory above {shared} is writable by group or others (mode 777)" in problem
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot replace root's file
    assert load_hook_config({"MAPA_CONFIG": str(config)})[1] == ""


@pytest.mark.parametrize("key", ["scontrol", "squeue"])
def test_a_config_naming_a_program_others_can_replace_is_refused(tmp_path, monkeypatch, key):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    program = tmp_path / "bin" / key
    _chown_other(program)
    problem = load_hook_config({"MAPA_CONFIG": str(config)})[1]
    assert problem.startswith(f"bad-config: refused {key} = '{program}' in {config}, as sshd's StrictModes would: ")
    assert f"belongs to uid {OTHER_UID}" in problem
    os.chown(program, 0, 0)
    os.chmod(program, 0o777)
    assert "writable by group or others (mode 777)" in load_hook_config({"MAPA_CONFIG": str(config)})[1]
    # Through a symlink in a directory others can write: the link could be re-pointed.
    os.chmod(program, 0o755)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    (open_dir / key).symlink_to(program)
    config.write_text(config.read_text().replace(f'{key} = "{program}"', f'{key} = "{open_dir / key}"'))
    assert f"directory above {open_dir} is writable" in load_hook_config({"MAPA_CONFIG": str(config)})[1]
    _prolog_falls_back_with(config, tmp_path, monkeypatch, f"refused {key}")


def test_programs_named_by_the_config_are_judged_where_they_resolve(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    link = tmp_path / "bin" / "scontrol-link"
    link.symlink_to("scontrol")  # relative, as /usr/bin/python3 -> python3.11
    config.write_text(config.read_text().replace(f'scontrol = "{tmp_path}/bin/scontrol"', f'scontrol = "{link}"'))
    assert load_hook_config({"MAPA_CONFIG": str(config)})[1] == ""
    # A program that does not exist is no trust problem: the call fails when made.
    config.write_text(config.read_text().replace(f'scontrol = "{link}"', f'scontrol = "{tmp_path}/nowhere/scontrol"'))
    assert load_hook_config({"MAPA_CONFIG": str(config)})[1] == ""
    # A bare name is what subprocess would run without PATH: /bin or /usr/bin.
    assert paths.command_path("sh") in (Path("/bin/sh"), Path("/usr/bin/sh"))
    assert paths.command_path("surely-no-such-program-mapa") is None


def test_a_config_that_is_not_utf8_or_too_large_is_refused_with_why(tmp_path):
    config = tmp_path / "mapa.toml"
    config.write_bytes(b'policy = "preserve"\n# Auteur: J\xe9r\xf4me\n')
    problem = load_hook_config({"MAPA_CONFIG": str(config)})[1]
    assert problem == f"bad-config: {config}: byte 0xe9 at offset 31 is not UTF-8; accepted: UTF-8 text"
    config.write_bytes(b"#" * (config_module.MAX_CONFIG_BYTES + 1))
    assert "is larger than 1048576 bytes; accepted: a config up to 1 MiB" in load_hook_config({"MAPA_CONFIG": str(config)})[1]
    assert load_hook_config({"MAPA_CONFIG": str(tmp_path / "none.toml")})[1] == f"bad-config: {tmp_path / 'none.toml'} does not exist"


# --- the log --------------------------------------------------------------------------------------


def test_the_log_never_follows_a_link_and_stays_closed_to_others(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log_path = tmp_path / "mapa.log"
    log_path.symlink_to(victim)
    hook_logger(log_path)("job 1: one")
    hook_logger(log_path)("job 1: two")
    assert victim.read_text() == "precious\n"
    err = capsys.readouterr().err
    assert "job 1: one" in err and "job 1: two" in err and f"cannot log to {log_path}" in err
    log_path.unlink()
    os.link(victim, log_path)  # a hard link to another file: refused too
    hook_logger(log_path)("job 2")
    assert victim.read_text() == "precious\n" and "not a regular file with one link" in capsys.readouterr().err
    log_path.unlink()
    os.mkfifo(log_path)  # a FIFO nobody reads would block the hook for ever
    hook_logger(log_path)("job 3")
    assert "job 3" in capsys.readouterr().err
    log_path.unlink()
    log_path.write_text("")
    os.chmod(log_path, 0o666)  # made by an older wrapper under umask 000
    hook_logger(log_path)("job 4")
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o644 and "job 4" in log_path.read_text()
    _chown_other(log_path)
    hook_logger(log_path)("job 5")
    assert "job 5" not in log_path.read_text() and f"belongs to uid {OTHER_UID}" in capsys.readouterr().err


# --- mapa hooks --python --------------------------------------------------------------------------


def _small_executable(directory: Path, name: str = "python") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    shutil.copy(shutil.which("true") or "/bin/true", target)
    os.chmod(target, 0o755)
    return target


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (_chown_other, f"belongs to uid {OTHER_UID}; accepted: owned by root"),
        (lambda path: os.chmod(path, 0o777), "is writable by group or others \\(mode 777\\)"),
        (lambda path: os.chmod(path.parent, 0o777), "directory above .* is writable by group or others \\(mode 777\\)"),
    ],
    ids=["other-owner", "mode-777", "open-directory"],
)
def test_mapa_hooks_refuses_an_interpreter_others_can_change(tmp_path, capsys, spoil, reason):
    from slurm_mapa.cli import main as mapa_main

    python = _small_executable(tmp_path / "bin")
    assert check_interpreter(str(python)) == python
    spoil(python)
    refused = f"--python {re.escape(str(python))}: root would run it for every job, refused: .*{reason}.* \\(symlinks such as"
    with pytest.raises(InputError, match=refused):
        check_interpreter(str(python))
    capsys.readouterr()
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--python", str(python), "--config", str(tmp_path / "mapa.toml")]) != 0
    assert "root would run it for every job, refused" in capsys.readouterr().err
    assert not (tmp_path / "sbin").exists()  # nothing written


def test_mapa_hooks_follows_interpreter_symlinks_and_judges_each(tmp_path):
    real = _small_executable(tmp_path / "usr" / "bin", "python3.11")
    link = tmp_path / "usr" / "bin" / "python3"
    link.symlink_to("python3.11")
    assert check_interpreter(str(link)) == real
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    (open_dir / "python").symlink_to(real)  # the link itself could be re-pointed by anyone
    with pytest.raises(InputError, match=f"directory above {open_dir} is writable"):
        check_interpreter(str(open_dir / "python"))
    with pytest.raises(InputError, match="is not an absolute path"):
        check_interpreter("python3")
    os.chmod(real, 0o644)
    with pytest.raises(InputError, match="is not executable"):
        check_interpreter(str(link))


def test_mapa_hooks_refuses_a_config_the_hooks_would_refuse(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    assert check_config(str(config)).jobs_dir == tmp_path / "run" / "mapa" / "jobs"
    os.chmod(config, 0o666)
    with pytest.raises(InputError, match="the hooks would refuse it and fall back for every job: .*mode 666"):
        check_config(str(config))
    # Without a config the hooks fall back for every job: written then, they would never use MAPA.
    with pytest.raises(InputError, match=f"--config {tmp_path / 'later.toml'}: no such file; accepted: "):
        check_config(str(tmp_path / "later.toml"))


def test_mapa_hooks_replaces_a_planted_symlink_instead_of_following_it(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    (tmp_path / "sbin").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "sbin" / "mapa-prolog-wrapper").symlink_to(victim)
    wrappers = _write_hooks(tmp_path, config)
    assert victim.read_text() == "precious\n"
    info = os.lstat(wrappers["prolog"])
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o755
    assert not [p for p in (tmp_path / "sbin").iterdir() if p.name.startswith(".")]  # no temporary left


# --- the wrapper runs a SIGKILLed hook once more --------------------------------------------------


def _stand_in_python(tmp_path: Path, first_in_process_run: str) -> Path:
    """A root-owned interpreter that does ``first_in_process_run`` (e.g. kill -9 itself, as the OOM
    killer would) the first time the wrapper runs the hook in-process, and the real Python after.
    It records each in-process attempt and the retry variable the wrapper set."""
    script = tmp_path / "bin" / "python"
    script.parent.mkdir(exist_ok=True)
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-I -c" ]; then\n'
        f'  echo "attempt retry=$MAPA_HOOK_RETRY_AFTER_SIGNAL" >> {tmp_path}/attempts\n'
        f'  if [ ! -e {tmp_path}/first-done ]; then : > {tmp_path}/first-done; {first_in_process_run}; fi\n'
        "fi\n"
        f'exec {PYTHON} "$@"\n'
    )
    os.chmod(script, 0o755)
    return script


@pytest.mark.parametrize(
    "first_run, attempts, recorded",
    [
        ("kill -9 $$", ["attempt retry=", "attempt retry=9"], True),  # SIGKILL: run again
        ("kill -15 $$", ["attempt retry=", "attempt retry=15"], True),  # any signal
        ("exit 1", ["attempt retry="], False),  # a plain failure would fail again: not retried
    ],
    ids=["sigkill", "sigterm", "exit-1"],
)
def test_a_wrapper_runs_a_hook_killed_by_a_signal_once_more(tmp_path, first_run, attempts, recorded):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    wrappers = _write_hooks(tmp_path, config, python=str(_stand_in_python(tmp_path, first_run)))
    done = subprocess.run([wrappers["prolog"]], env=_slurmd_env("7", "0,1", tmp_path), check=False)
    assert done.returncode == 0
    assert (tmp_path / "attempts").read_text().splitlines() == attempts
    assert ("7" in LedgerFile(tmp_path / "state" / "mapa" / "ledger.json", 8).read().holdings) == recorded


def test_no_retry_once_the_window_has_passed(tmp_path):
    # With a window of 0 s the retry could overrun PrologEpilogTimeout: the wrapper must not retry.
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    python = _stand_in_python(tmp_path, "kill -9 $$")
    wrapper = tmp_path / "prolog-wrapper"
    paths.replace_file(wrapper, wrapper_text("prolog", str(python), str(PACKAGE_DIR.parent), str(config), retry_window_s=0).encode(), 0o755)
    assert subprocess.run([str(wrapper)], env=_slurmd_env("7", "0,1", tmp_path), check=False).returncode == 0
    assert (tmp_path / "attempts").read_text().splitlines() == ["attempt retry="]


def test_the_wrapper_exports_its_start_in_seconds_since_boot(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    probe = tmp_path / "bin" / "python"
    probe.parent.mkdir(exist_ok=True)
    probe.write_text(f'#!/bin/sh\necho "$MAPA_WRAPPER_STARTED" > {tmp_path}/started\nexit 3\n')
    os.chmod(probe, 0o755)
    wrappers = _write_hooks(tmp_path, config, python=str(probe))
    assert subprocess.run([wrappers["prolog"]], env={}, check=False).returncode == 0
    started = float((tmp_path / "started").read_text())
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert 0 <= uptime - started < 30


def test_a_wrapper_runs_the_hook_once_when_it_works(tmp_path):
    config = _write_config(tmp_path / "mapa.toml", tmp_path)
    wrappers = _write_hooks(tmp_path, config, python=str(_stand_in_python(tmp_path, ":")))
    assert subprocess.run([wrappers["epilog"]], env={"SLURM_JOB_ID": "7", "MAPA_AGENT_SOCKET": str(tmp_path / "none")},
                          check=False).returncode == 0
    assert (tmp_path / "attempts").read_text().splitlines() == ["attempt retry="]


# --- the agent: bursts, trickling clients, a thread bound -----------------------------------------


@pytest.fixture
def agent_64(tmp_path):
    """An agent for a 64-GPU node with a fake Slurm, created but not yet serving."""
    topology = tmp_path / "pcie64.toml"
    topology.write_text('name = "pcie64"\ngpus = 64\ndefault_link = "PHB"\n')
    config = _write_config(tmp_path / "mapa.toml", tmp_path, topology=str(topology))
    slurm = FakeSlurm()
    errors: list[str] = []
    agent = Agent(str(config), errors.append, run=lambda timeout: slurm)
    servers = []

    def start(**options):
        server = serve(str(tmp_path / "agent" / "agent.sock"), agent, **options)
        servers.append(server)
        return server

    yield start, slurm, errors, tmp_path
    for server in servers:
        server.shutdown()
        server.server_close()


def _serve_in_background(server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


def test_a_burst_of_40_prologs_all_reach_the_agent(agent_64):
    start, slurm, errors, tmp_path = agent_64
    server = start()
    jobs = [str(1000 + i) for i in range(40)]
    slurm.running = set(jobs)
    answers: dict[str, str | None] = {}

    def ask(job: str) -> None:
        answers[job] = agent_client.ask_agent("prolog", env_for(job, str(int(job) - 1000)), server.server_address)  # one GPU each

    clients = [threading.Thread(target=ask, args=(job,)) for job in jobs]
    # All 40 connect while the agent is not accepting yet (slurmd starts the Prologs of jobs
    # allocated together at once): they must wait in the listen backlog, not be refused.
    for client in clients:
        client.start()
    time.sleep(0.5)
    _serve_in_background(server)
    for client in clients:
        client.join(60)
    assert answers == {job: "done" for job in jobs}
    held = [gpu for holding in LedgerFile(tmp_path / "state" / "mapa" / "ledger.json", 64).read().holdings.values() for gpu in holding.gpus]
    assert len(held) == 40 and len(set(held)) == 40
    assert errors == []


def test_a_trickling_client_is_cut_off_at_the_overall_deadline(agent_64):
    start, slurm, errors, tmp_path = agent_64
    server = start()
    server.request_read_timeout = 1.0
    _serve_in_background(server)
    request = agent_client.request_bytes("prolog", env_for("7", "0"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.server_address)
        began = time.monotonic()

        def trickle():  # one byte every 0.3 s: never a 1 s gap, so a timeout per recv never fires
            for byte in request:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.3)

        threading.Thread(target=trickle, daemon=True).start()
        sock.settimeout(30)
        answer = sock.recv(1024)
        elapsed = time.monotonic() - began
    assert answer == b"error request not complete within 1 s\n"
    assert 0.9 <= elapsed < 5.0, elapsed  # the whole request would have taken len(request) * 0.3 s
    assert len(request) * 0.3 > 10
    assert any("request not complete within 1 s" in line for line in errors)
    assert slurm.calls == []


def test_past_the_thread_bound_a_client_is_told_busy_and_falls_back(agent_64, monkeypatch):
    start, slurm, errors, tmp_path = agent_64
    server = start(max_handlers=1)
    server.request_read_timeout = 5.0
    _serve_in_background(server)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.connect(server.server_address)  # holds the only handler while it sends nothing
        time.sleep(0.2)
        assert agent_client.ask_agent("prolog", env_for("7", "0"), server.server_address) == "error busy"
        monkeypatch.setenv("MAPA_AGENT_SOCKET", server.server_address)
        assert agent_client.main(["prolog"]) == agent_client.FALL_BACK  # the wrapper then runs the hook in-process
    assert any("too many requests at once" in line for line in errors)
    # Once the handler is free again, requests are served.
    slurm.running = {"8"}
    deadline = time.monotonic() + 10
    while (answer := agent_client.ask_agent("prolog", env_for("8", "0"), server.server_address)) != "done":
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


def test_the_agent_wait_and_the_retry_fit_in_the_recommended_prolog_timeout():
    # Agent wait, then the in-process Prolog; or a retry started inside the window: each ends by 60 s.
    assert agent_client.ANSWER_TIMEOUT_S == 25.0
    assert agent_client.ANSWER_TIMEOUT_S + config_module.MAX_PROLOG_BUDGET_S <= 60.0
    assert RETRY_WINDOW_S + config_module.MAX_PROLOG_BUDGET_S <= 60.0


# --- the systemd unit -----------------------------------------------------------------------------


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_the_systemd_unit_is_hardened():
    service = _unit()["Service"]
    expected = {
        "UMask": "0022", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "read-only", "PrivateTmp": "yes",
        "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes", "ProtectHostname": "yes",
        "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "RestrictRealtime": "yes", "RestrictNamespaces": "yes",
        "SystemCallArchitectures": "native", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "StateDirectory": "slurm-mapa", "RuntimeDirectory": "slurm-mapa slurm-mapa-agent slurm-mapa-isolate", "RuntimeDirectoryMode": "0755",
        "RuntimeDirectoryPreserve": "yes", "ReadWritePaths": "/var/log",
    }
    assert {key: service.get(key) for key in expected} == expected
    # NVML needs /dev/nvidia*, device cgroups need /sys/fs/cgroup writable: these must stay off.
    for key in ("PrivateDevices", "ProtectControlGroups", "ProtectKernelTunables", "ProtectClock", "DevicePolicy", "DeviceAllow"):
        assert key not in service, key
    # The writable places are the config's defaults.
    defaults = HookConfig()
    assert defaults.ledger.parent == Path("/var/lib") / service["StateDirectory"]
    assert defaults.jobs_dir.parent == Path("/run") / service["RuntimeDirectory"].split()[0]
    assert str(defaults.log.parent) == service["ReadWritePaths"]
    assert Path(agent_client.DEFAULT_SOCKET).parent == Path("/run") / service["RuntimeDirectory"].split()[1]
    assert Path(agent_client.ISOLATE_SOCKET).parent == Path("/run") / service["RuntimeDirectory"].split()[2]


def test_systemd_analyze_verifies_the_unit(tmp_path):
    unit = tmp_path / "mapa-agent.service"
    agent_bin = tmp_path / "mapa-agent"
    agent_bin.write_text("#!/bin/sh\n")
    os.chmod(agent_bin, 0o755)
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/mapa-agent", str(agent_bin)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
