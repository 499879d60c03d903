"""The wrappers' compiled client of mapa-agent (data/client/mapa_hook_client.c, built by `mapa
hooks`): byte for byte the Python client's request, and its exit statuses, against a fake agent.
scripts/test installs the C compiler (as for the SPANK plugin)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.slurm.admin import hook_client
from slurm_mapa.slurm.agent import client

SOCKET_NAME = "agent.sock"


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sbin")
    built, said = hook_client.build_into(directory, "cc")
    assert built is not None, said
    assert built == directory / "mapa-hook-client" and os.stat(built).st_mode & 0o777 == 0o755
    return built


class FakeAgent:
    """Answers each connection with ``answer`` (bytes; None: closes without one) after reading
    one whole request, which it keeps."""

    def __init__(self, path, answer):
        self.path, self.answer, self.requests = str(path), answer, []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\n" not in data:
                    data += conn.recv(65536)
                header, _, rest = data.partition(b"\n")
                length = int(header.split()[2])
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(header + b"\n" + rest)
                if self.answer is not None:
                    conn.sendall(self.answer)

    def close(self):
        # close() alone leaves accept() waiting (a thread left behind per test); shutdown wakes it
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(timeout=10)
        os.unlink(self.path)


def run(binary, argv, env):
    return subprocess.run([str(binary), *argv], env=env, capture_output=True, timeout=60)


def python_request(kind, env_bytes):
    """What client.py sends for the same environment (os.environ's decoding: surrogateescape)."""
    decoded = {key.decode("utf-8", "surrogateescape"): value.decode("utf-8", "surrogateescape") for key, value in env_bytes.items()}
    return client.request_bytes(kind, decoded)


JOB_ENV = {b"SLURM_JOB_ID": b"42", b"SLURMD_NODENAME": b"dgx1", b"SLURM_JOB_GPUS": b"0,1,2,3",
           b"SLURM_JOB_COMMENT": b"nightly [mapa:topology=ring sensitive=yes]", b"SLURM_JOB_NUM_NODES": b"1",
           b"SLURM_JOB_SLUID": b"s0123456789ABC", b"PATH": b"/usr/bin", b"HOME": b"/root"}


@pytest.mark.parametrize("kind", ["prolog", "epilog"])
def test_it_sends_what_the_python_client_sends_and_exits_0_on_done(binary, tmp_path, kind):
    agent = FakeAgent(tmp_path / SOCKET_NAME, b"done\n")
    try:
        env = {**JOB_ENV, b"MAPA_AGENT_SOCKET": agent.path.encode()}
        done = run(binary, [kind], env)
        assert done.returncode == 0 and done.stdout == b"" and done.stderr == b""
        assert agent.requests == [python_request(kind, env)]
        assert b"PATH=" not in agent.requests[0] and b"MAPA_AGENT_SOCKET" not in agent.requests[0]
    finally:
        agent.close()


@pytest.mark.parametrize("answer", [b"error busy\n", b"error no topology\n", b"done", b"done ping\n", b"", None, b"DONE\n"])
def test_anything_but_a_done_line_is_a_fall_back(binary, tmp_path, answer):
    agent = FakeAgent(tmp_path / SOCKET_NAME, answer)
    try:
        assert run(binary, ["prolog"], {**JOB_ENV, b"MAPA_AGENT_SOCKET": agent.path.encode()}).returncode == client.FALL_BACK
    finally:
        agent.close()


@pytest.mark.parametrize("argv", [[], ["isolate"], ["prolog", "extra"], ["PROLOG"]])
def test_no_agent_or_a_wrong_call_is_a_fall_back(binary, tmp_path, argv):
    env = {**JOB_ENV, b"MAPA_AGENT_SOCKET": str(tmp_path / "none.sock").encode()}
    assert run(binary, ["prolog"], env).returncode == client.FALL_BACK
    assert run(binary, argv, env).returncode == client.FALL_BACK
    # a socket path longer than sun_path allows
    assert run(binary, ["prolog"], {**JOB_ENV, b"MAPA_AGENT_SOCKET": b"/" + b"x" * 200}).returncode == client.FALL_BACK


values = st.binary(min_size=0, max_size=9000).filter(lambda b: b"\0" not in b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([key for key in JOB_ENV if key.startswith(b"SLURM")]), values))
def test_any_bytes_and_any_length_travel_as_the_python_client_sends_them(binary, tmp_path_factory, env):
    """User-set values (the job's comment) may hold any bytes but NUL, of any length: each is cut at
    MAX_VALUE_BYTES, as client.py cuts it."""
    agent = FakeAgent(tmp_path_factory.mktemp("agent") / SOCKET_NAME, b"done\n")
    try:
        env = {**env, b"MAPA_AGENT_SOCKET": agent.path.encode()}
        assert run(binary, ["epilog"], env).returncode == 0
        assert agent.requests == [python_request("epilog", env)]
    finally:
        agent.close()


def test_the_c_client_sends_the_keys_and_limits_client_py_names():
    """The two clients share the protocol's constants; a change to one must reach the other."""
    source = hook_client.SOURCE.read_text()
    keys = source.split("KEYS[] = {", 1)[1].split("};", 1)[0]
    assert [word.strip().strip('"') for word in keys.split(",")] == list(client.KEYS)
    assert f"#define MAX_VALUE_BYTES {client.MAX_VALUE_BYTES}\n" in source
    assert f"#define FALL_BACK {client.FALL_BACK}\n" in source
    assert f'#define DEFAULT_SOCKET "{client.DEFAULT_SOCKET}"\n' in source
    assert f"#define ANSWER_TIMEOUT_MS {int(client.ANSWER_TIMEOUT_S * 1000)}\n" in source
    assert f"#define CONNECT_TIMEOUT_MS {int(client.CONNECT_TIMEOUT_S * 1000)}\n" in source


def test_without_a_compiler_the_wrappers_keep_the_python_client(tmp_path):
    built, said = hook_client.build_into(tmp_path, "no-such-cc")
    assert built is None and not (tmp_path / "mapa-hook-client").exists()
    assert "no C compiler 'no-such-cc' (it is not on this node's PATH)" in said and "--cc names one" in said
    built, said = hook_client.build_into(tmp_path, "/bin/false")
    assert built is None and said.startswith("WARNING: /bin/false failed on ")


def test_a_client_built_elsewhere_is_used_only_if_root_alone_can_change_it(binary, tmp_path, capsys):
    """`mapa hooks --client PATH` (nodes without a compiler): the wrappers name it, nothing is
    compiled; a client others could change is refused, as --python is."""
    from slurm_mapa.cli import main as mapa_main
    from slurm_mapa.errors import InputError
    from slurm_mapa.slurm.admin.install import check_client

    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      '[nodes]\n"*" = "dgx1-v100"\n')
    sbin = tmp_path / "sbin"
    assert mapa_main(["hooks", str(sbin), "--config", str(config), "--client", str(binary), "--cc", "no-such-cc"]) == 0
    assert f"the wrappers ask mapa-agent through {binary}" in capsys.readouterr().err
    assert not (sbin / "mapa-hook-client").exists()
    assert f"\n{binary} prolog && exit 0\n" in (sbin / "mapa-prolog-wrapper").read_text()
    loose = tmp_path / "loose-client"
    loose.write_bytes(binary.read_bytes())
    os.chmod(loose, 0o777)
    with pytest.raises(InputError, match="root would run it for every job, refused"):
        check_client(str(loose))
    with pytest.raises(InputError, match="give an absolute path"):
        check_client("mapa-hook-client")
    os.chmod(loose, 0o644)
    with pytest.raises(InputError, match="is not executable"):
        check_client(str(loose))
