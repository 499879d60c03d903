"""The isolation request's one deadline (issue #31): the SPANK plugin (spank_mapa_isolate.c, built
as the cluster image builds it and called through ctypes with the few Slurm functions it uses
stubbed) and the TaskProlog's client (agent_client.isolate) give up in time on an agent that is
hung, busy or silent, and give each case the same meaning: fail-open runs the task, fail-closed
fails it; an agent's explicit refusal fails it in both modes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from repo_paths import REPO

from slurm_mapa.slurm.agent import client as agent_client

SOURCE = REPO / "slurm_mapa" / "data" / "spank" / "spank_mapa_isolate.c"
FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]  # as containers/Dockerfile builds it
MARGIN_S = 5.0  # a noisy 2-core machine: a regression hangs for ever, a slow run is a second late

# What slurmstepd gives the plugin: spank_remote, spank_getenv (this process's environment),
# spank_setenv and the log functions, printed.
SHIM = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <slurm/spank.h>

int spank_remote(spank_t sp) { (void)sp; return 1; }

/* The step's environment: this process's own (the runner sets what a test wants). */
spank_err_t spank_getenv(spank_t sp, const char *var, char *buf, int len)
{
	const char *value = getenv(var);
	(void)sp;
	if (value == NULL)
		return ESPANK_ENV_NOEXIST;
	if ((int)strlen(value) >= len)
		return ESPANK_NOSPACE;
	strcpy(buf, value);
	return ESPANK_SUCCESS;
}

spank_err_t spank_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
	(void)sp;
	printf("setenv %s=%s %d\n", var, val, overwrite);
	fflush(stdout);
	return ESPANK_SUCCESS;
}

static void say(const char *level, const char *format, va_list args)
{
	printf("%s: ", level);
	vprintf(format, args);
	printf("\n");
	fflush(stdout);
}

void slurm_info(const char *format, ...) { va_list a; va_start(a, format); say("info", format, a); va_end(a); }
void slurm_error(const char *format, ...) { va_list a; va_start(a, format); say("error", format, a); va_end(a); }
"""

RUNNER = """
import ctypes, os, sys
ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_GLOBAL)
plugin = ctypes.CDLL(sys.argv[2], mode=os.RTLD_NOW)
args = [a.encode() for a in sys.argv[3:]]
argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
print("rc", plugin.slurm_spank_task_init_privileged(None, len(args), argv), flush=True)
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.fail("the Slurm headers are missing: apt-get install -y libslurm-dev (scripts/test does)")
    where = tmp_path_factory.mktemp("spank")
    (where / "shim.c").write_text(SHIM)
    built = []
    for source, name in ((SOURCE, "spank_mapa_isolate.so"), (where / "shim.c", "shim.so")):
        done = subprocess.run(["cc", *FLAGS, "-o", str(where / name), str(source)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        built.append(str(where / name))
    return built  # plugin, shim


def run_plugin(plugin, *args, within, env=None):
    """slurm_spank_task_init_privileged(args): (its return value, what it logged, seconds).
    ``env``: the step's environment as the plugin reads it (spank_getenv)."""
    so, shim = plugin
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, shim, so, *args], capture_output=True, text=True, timeout=within,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})})
    except subprocess.TimeoutExpired:
        pytest.fail(f"slurm_spank_task_init_privileged did not return within {within} s")
    elapsed = time.monotonic() - start
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("rc "), (done.stdout, done.stderr)
    return int(lines[-1].split()[1]), lines[:-1], elapsed


class Agent:
    """An AF_UNIX socket where an agent listens: nobody accepts until serve(), which answers each
    request with ``answer`` (None: never) after ``delay`` seconds."""

    def __init__(self, path: Path, backlog: int = 16):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(backlog)
        self.fillers: list[socket.socket] = []
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def fill(self):
        """Connect until the listen backlog is full (a non-blocking connect says EAGAIN)."""
        for _ in range(64):
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                filler.connect(self.path)
            except BlockingIOError:
                filler.close()
                break
            self.fillers.append(filler)
        else:
            pytest.fail("64 connections and the listen backlog is not full")
        assert self.fillers

    def serve(self, answer, delay=0.0, after=0.0):
        def accept():
            if self.stop.wait(after):
                return
            for filler in self.fillers:  # closed unread: accepted, they say EOF at once
                filler.close()
            self.sock.settimeout(0.1)
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                self._start(self._answer, conn, answer, delay)

        self._start(accept)

    def _start(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _answer(self, conn, answer, delay):
        with conn:
            conn.settimeout(10)
            try:
                line = conn.makefile("rb").readline()
                if not line:
                    return
                self.requests.append(line)
                if self.stop.wait(delay) or answer is None:
                    self.stop.wait(60)  # silent: holds the connection open
                    return
                conn.sendall(answer.encode() + b"\n")
            except OSError:
                return

    def close(self):
        self.stop.set()
        self.sock.close()
        for filler in self.fillers:
            filler.close()
        for thread in self.threads:
            thread.join(timeout=5)


@pytest.fixture
def agent(tmp_path):
    made = []

    def make(backlog=16):
        made.append(Agent(tmp_path / "agent.sock", backlog))
        return made[-1]

    yield make
    for one in made:
        one.close()


# --- the SPANK plugin ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode, rc", [("fail-open", 0), ("fail-closed", -1)])
def test_spank_plugin_gives_up_on_a_full_listen_backlog_by_its_deadline(plugin, agent, mode, rc):
    """A hung agent whose listen backlog is full: a blocking connect would wait for ever, and with
    it every task start on the node. The plugin asks again until its deadline, then its mode decides."""
    hung = agent(backlog=0)
    hung.fill()
    got, log, elapsed = run_plugin(plugin, mode, f"socket={hung.path}", "timeout_ms=1500", within=1.5 + MARGIN_S)
    assert got == rc
    level, then = ("info", "the task runs without GPU isolation (fail-open)") if rc == 0 else ("error", "the task does not start (fail-closed)")
    assert log == [f"{level}: mapa_isolate: busy until the deadline: mapa-agent ({hung.path}: its listen backlog is full); {then}"]
    assert elapsed >= 1.0  # it kept asking while the deadline allowed (the last pause is 250 ms at most)


def test_spank_plugin_gives_up_on_a_full_listen_backlog_by_its_default_deadline(plugin, agent):
    """The same without timeout_ms: the default deadline, 10 s."""
    hung = agent(backlog=0)
    hung.fill()
    got, log, _ = run_plugin(plugin, f"socket={hung.path}", within=10 + MARGIN_S)
    assert got == 0 and "its listen backlog is full" in log[0]


def test_spank_plugin_asks_again_when_the_backlog_drains(plugin, agent):
    slow = agent(backlog=0)
    slow.fill()
    slow.serve("done cgroup-v1 job 12 step 0 task pid 9: GPUs 4,5 in /x", after=0.5)
    got, log, _ = run_plugin(plugin, "fail-closed", f"socket={slow.path}", "timeout_ms=8000", within=8 + MARGIN_S)
    assert (got, log) == (0, ["setenv MAPA_SPANK_ISOLATION=cgroup-v1 1"])
    assert slow.requests == [b"MAPA1 isolate 15\n"]  # MAPA_STEP_ENV=1 follows the header


@pytest.mark.parametrize("mode, rc", [("fail-open", 0), ("fail-closed", -1)])
def test_spank_plugin_treats_an_agent_busy_until_the_deadline_as_unreachable(plugin, agent, mode, rc):
    """`error busy` every time: as for the TaskProlog, the plugin's mode decides, not the agent's."""
    busy = agent()
    busy.serve("error busy")
    got, log, _ = run_plugin(plugin, mode, f"socket={busy.path}", "timeout_ms=1000", within=1 + MARGIN_S)
    assert got == rc
    assert len(log) == 1 and log[0].startswith(("info" if rc == 0 else "error") + ": mapa_isolate: busy until the deadline: mapa-agent (error busy)")
    assert len(busy.requests) >= 2


@pytest.mark.parametrize(
    "answer, mode, rc, logged",
    [
        ("done cgroup-v1 job 12 step 0 task pid 9: GPUs 4,5 in /x", "fail-closed", 0, "setenv MAPA_SPANK_ISOLATION=cgroup-v1 1"),
        ("done failed-open cannot set up the devices cgroup", "fail-closed", 0, "setenv MAPA_SPANK_ISOLATION=failed-open 1"),
        ("done off", "fail-open", 0, "setenv MAPA_SPANK_ISOLATION=off 1"),
        # The agent's own mapa.toml says fail-closed: the task fails whatever the plugin's mode.
        ("error not isolated", "fail-open", -1, "error: mapa_isolate: GPU isolation failed, the task does not start: error not isolated"),
        ("error not isolated", "fail-closed", -1, "error: mapa_isolate: GPU isolation failed, the task does not start: error not isolated"),
        ("hello", "fail-open", -1, "error: mapa_isolate: GPU isolation failed, the task does not start: hello"),
        # Accepted, and never answered.
        (None, "fail-open", 0, "info: mapa_isolate: cannot ask mapa-agent (no answer from {path} within 1000 ms); the task runs without GPU isolation (fail-open)"),
        (None, "fail-closed", -1, "error: mapa_isolate: cannot ask mapa-agent (no answer from {path} within 1000 ms); the task does not start (fail-closed)"),
    ],
)
def test_spank_plugin_answers(plugin, agent, answer, mode, rc, logged):
    server = agent()
    server.serve(answer)
    got, log, _ = run_plugin(plugin, mode, f"socket={server.path}", "timeout_ms=1000", within=1 + MARGIN_S)
    assert (got, log) == (rc, [logged.replace("{path}", server.path)])


@pytest.mark.parametrize("mode, rc", [("fail-open", 0), ("fail-closed", -1)])
def test_spank_plugin_without_an_agent_follows_its_mode(plugin, tmp_path, mode, rc):
    got, log, _ = run_plugin(plugin, mode, f"socket={tmp_path}/none.sock", within=MARGIN_S)
    assert got == rc and f"cannot ask mapa-agent ({tmp_path}/none.sock: No such file or directory)" in log[0]


@pytest.mark.parametrize("value", ["", "0", "99", "60001", "100000", "0100", "+500", "-500", " 500", "500 ", "5e3", "1000ms", "99999999999999999999"])
def test_spank_plugin_refuses_a_malformed_timeout(plugin, tmp_path, value):
    got, log, _ = run_plugin(plugin, f"socket={tmp_path}/none.sock", f"timeout_ms={value}", within=MARGIN_S)
    assert got == -1
    assert log == [f"error: mapa_isolate: unknown argument 'timeout_ms={value}' (accepted: fail-open, fail-closed, "
                   "socket=/absolute/path, timeout_ms=100..60000)"]


@pytest.mark.parametrize("value", ["100", "2500", "60000"])
def test_spank_plugin_takes_a_timeout_in_range(plugin, tmp_path, value):
    got, log, _ = run_plugin(plugin, f"timeout_ms={value}", f"socket={tmp_path}/none.sock", within=MARGIN_S)
    assert got == 0 and "the task runs without GPU isolation (fail-open)" in log[0]


# --- the TaskProlog's client ----------------------------------------------------------------------
def bounded(call, within):
    """call() in a thread that must end within ``within`` s: (its result, seconds)."""
    result = []
    start = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        pytest.fail(f"it did not return within {within} s")
    return result[0], time.monotonic() - start


def test_isolate_client_gives_up_on_a_full_listen_backlog_by_its_deadline(agent, monkeypatch):
    monkeypatch.setattr(agent_client, "ISOLATE_TIMEOUT_S", 1.5)
    hung = agent(backlog=0)
    hung.fill()
    result, elapsed = bounded(lambda: agent_client.isolate(hung.path, {"SLURM_JOB_ID": "12"}), 1.5 + MARGIN_S)
    assert result == (agent_client.FALL_BACK, None)
    assert elapsed >= 1.0  # it kept asking while the deadline allowed
    # The Prolog's path (root, the slow path in-process behind it) still falls back at once.
    answer, _ = bounded(lambda: agent_client.ask_agent("prolog", {"SLURM_JOB_ID": "12"}, hung.path), MARGIN_S)
    assert answer is None


def test_isolate_client_asks_again_when_the_backlog_drains(agent, monkeypatch):
    monkeypatch.setattr(agent_client, "ISOLATE_TIMEOUT_S", 8.0)
    slow = agent(backlog=0)
    slow.fill()
    slow.serve("done cgroup-v1 job 12 step 0 task pid 9: GPUs 4,5 in /x", after=0.5)
    result, _ = bounded(lambda: agent_client.isolate(slow.path, {"SLURM_JOB_ID": "12"}), 8 + MARGIN_S)
    assert result == (0, "export MAPA_ISOLATION=cgroup-v1")


def test_isolate_client_keeps_one_deadline_for_all_its_asks(agent, monkeypatch):
    """An agent that says `error busy` late each time: asking again never takes the task past
    ISOLATE_TIMEOUT_S in all (it used to wait that long per ask, six times)."""
    monkeypatch.setattr(agent_client, "ISOLATE_TIMEOUT_S", 2.0)
    busy = agent()
    busy.serve("error busy", delay=1.2)
    result, _ = bounded(lambda: agent_client.isolate(busy.path, {"SLURM_JOB_ID": "12"}), 2 + MARGIN_S)
    assert result == (agent_client.FALL_BACK, None)
    assert len(busy.requests) >= 2  # asked again once the first said busy, with what time was left


def test_isolate_client_runs_under_python_isolated_mode(agent, tmp_path):
    """As the TaskProlog runs it (python -I -S, as the user): the standard library's built-ins only."""
    busy = agent()
    busy.serve("done off")
    client = Path(agent_client.__file__)
    done = subprocess.run([sys.executable, "-I", "-S", str(client), "isolate", busy.path], capture_output=True, text=True,
                          timeout=10 + MARGIN_S, env={"SLURM_JOB_ID": "12", "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert (done.returncode, done.stdout, done.stderr) == (0, "export MAPA_ISOLATION=off\n", "")


@pytest.mark.parametrize("step_gpus, payload", [
    ("0,2", b"MAPA_STEP_ENV=1\0SLURM_STEP_GPUS=0,2"),
    (None, b"MAPA_STEP_ENV=1"),  # a step of no GPUs: Slurm unset the variable
    ("0;rm -rf", b"MAPA_STEP_ENV=1"),  # not a list of indices: not sent
])
def test_spank_plugin_sends_the_steps_gpus_and_passes_on_what_the_task_may_open(plugin, tmp_path, step_gpus, payload):
    """The plugin reads the step's SLURM_STEP_GPUS (Slurm narrows it per task only after this hook)
    and sends it; the agent's answer names the GPUs the task may open, which the task gets in
    MAPA_SPANK_GPUS for its TaskProlog."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    received = []

    def answer():
        conn, _ = server.accept()
        with conn:
            reader = conn.makefile("rb")
            header = reader.readline()
            received.append((header, reader.read(int(header.split()[2]))))
            conn.sendall(b"done cgroup-v1 gpus=4,7 job 12 step 0 task pid 1: GPUs 4,7 in /x\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        got, log, _ = run_plugin(plugin, f"socket={path}", within=10 + MARGIN_S,
                                 env={} if step_gpus is None else {"SLURM_STEP_GPUS": step_gpus})
    finally:
        thread.join(timeout=10)
        server.close()
    assert got == 0
    assert received == [(b"MAPA1 isolate %d\n" % len(payload), payload)]
    assert log == ["setenv MAPA_SPANK_ISOLATION=cgroup-v1 1", "setenv MAPA_SPANK_GPUS=4,7 1"]
