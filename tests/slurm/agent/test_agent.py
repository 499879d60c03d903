"""mapa-agent and its client: the strict protocol, and a live agent on a socket running the hooks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_slurm import FAKE_SCONTROL, FakeSlurm, env_for, eventually

from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.agent import client as agent_client
from slurm_mapa.slurm.agent.service import Agent
from slurm_mapa.slurm.agent.background import Background
from slurm_mapa.slurm.agent.server import parse_header, parse_payload, serve
from slurm_mapa.slurm.config import config_from_text
from slurm_mapa.slurm.hooks.prolog import run_prolog
from slurm_mapa.slurm.node_state.ledger import LedgerFile

CLIENT = Path(agent_client.__file__)


def _split(request: bytes) -> tuple[str, dict[str, str]]:
    header, _, payload = request.partition(b"\n")
    kind, length = parse_header(header + b"\n")
    assert length == len(payload)
    return kind, parse_payload(payload)


def test_request_round_trip_carries_only_the_hooks_variables():
    env = {**env_for("42", "0,1", "mapa:topology=ring # with spaces\nand a newline"), "LD_PRELOAD": "/tmp/evil.so", "PATH": "/x"}
    kind, parsed = _split(agent_client.request_bytes("prolog", env))
    assert kind == "prolog" and parsed == env_for("42", "0,1", "mapa:topology=ring # with spaces\nand a newline")
    assert _split(agent_client.request_bytes("epilog", {}))[1] == {}
    long = agent_client.request_bytes("prolog", {"SLURM_JOB_COMMENT": "x" * 100_000})
    assert len(_split(long)[1]["SLURM_JOB_COMMENT"]) == agent_client.MAX_VALUE_BYTES
    with pytest.raises(ValueError, match="prolog, epilog"):
        agent_client.request_bytes("taskprolog", {})


@pytest.mark.parametrize(
    "header, message",
    [
        (b"MAPA2 prolog 0\n", "is not 'MAPA1 <kind> <length>'"),
        (b"MAPA1 prolog\n", "is not 'MAPA1 <kind> <length>'"),
        (b"MAPA1 taskprolog 0\n", "unknown hook kind 'taskprolog' \\(accepted: prolog, epilog\\)"),
        (b"MAPA1 prolog -1\n", "is not a number up to"),
        (b"MAPA1 prolog 99999999\n", "is not a number up to"),
    ],
)
def test_bad_headers_are_refused_with_what_is_accepted(header, message):
    with pytest.raises(InputError, match=message):
        parse_header(header)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"PATH=/bin", "'PATH' is not accepted \\(accepted: SLURM_JOB_ID"),
        (b"SLURM_JOB_ID", "'SLURM_JOB_ID' is not accepted"),
        (b"SLURM_JOB_ID=1\0SLURM_JOB_ID=2", "given twice"),
        (b"SLURM_JOB_COMMENT=" + b"x" * (agent_client.MAX_VALUE_BYTES + 1), "longer than"),
    ],
)
def test_bad_payloads_are_refused(payload, message):
    with pytest.raises(InputError, match=message):
        parse_payload(payload)


def test_without_an_agent_the_client_says_fall_back(tmp_path):
    assert agent_client.ask_agent("prolog", env_for("1", "0"), str(tmp_path / "none.sock")) is None
    done = subprocess.run([sys.executable, "-I", "-S", str(CLIENT), "prolog"], env={"MAPA_AGENT_SOCKET": str(tmp_path / "none.sock")},
                          capture_output=True, check=False)
    assert done.returncode == agent_client.FALL_BACK
    usage = subprocess.run([sys.executable, "-I", "-S", str(CLIENT)], capture_output=True, text=True, check=False)
    assert usage.returncode == agent_client.FALL_BACK and "usage" in usage.stderr


def test_the_client_imports_nothing_but_built_in_modules():
    # Its speed is the point: no package module and no stdlib module read from disk except _socket.
    probe = ("import sys; before = set(sys.modules); "
             f"sys.path.insert(0, {str(CLIENT.parent)!r}); import {CLIENT.stem}; "
             f"print(sorted(name for name in set(sys.modules) - before - {{{CLIENT.stem!r}}} "
             "if getattr(sys.modules[name].__spec__, 'origin', None) not in ('built-in', 'frozen')))")
    added = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert set(eval(added)) <= {"_socket"}, added


@pytest.fixture
def live_agent(tmp_path):
    config_path = tmp_path / "mapa.toml"
    config_path.write_text(
        f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\nhealth = "off"\n'
        'job_submit_lua = true\n[nodes]\n"dgx*" = "dgx1-v100"\n'
    )
    slurm = FakeSlurm()
    errors: list[str] = []
    agent = Agent(str(config_path), errors.append, run=lambda timeout: slurm)
    agent.warm_up("dgx1")
    agent.background = Background(agent, "dgx1")
    agent.background.start()
    server = serve(str(tmp_path / "agent" / "agent.sock"), agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, slurm, config_from_text(config_path.read_text(), str(config_path)), errors
    agent.background.stop.set()
    server.shutdown()
    server.server_close()


def test_a_live_agent_runs_the_prolog_and_epilog_like_the_in_process_hooks(live_agent, tmp_path):
    server, slurm, config, errors = live_agent
    socket_path = server.server_address
    assert (os.stat(Path(socket_path).parent).st_mode & 0o777) == 0o700
    slurm.running = {"11"}
    assert agent_client.ask_agent("prolog", env_for("11", "0,1,2,3", "mapa:topology=ring sensitive=yes"), socket_path) == "done"
    expected = select("preserve", preset("dgx1-v100"), range(8), Request(make_pattern("ring", 4), True)).gpus
    assert LedgerFile(config.ledger, 8).read().holdings["11"].gpus == expected
    assert (config.jobs_dir / "11").read_text().splitlines()[0] == f"MAPA_GPUS={','.join(map(str, expected))}"
    # The AdminComment is written just after the answer (off the job's start).
    eventually(lambda: f"dgx1={','.join(map(str, expected))} policy=preserve" in slurm.admin.get("11", ""))
    # The real client, as the hook wrapper runs it.
    slurm.running.add("12")
    done = subprocess.run([sys.executable, "-I", "-S", str(CLIENT), "prolog"], check=False,
                          env={"MAPA_AGENT_SOCKET": socket_path, **env_for("12", "4", "mapa:topology=ring sensitive=no")})
    assert done.returncode == 0 and "12" in LedgerFile(config.ledger, 8).read().holdings
    assert agent_client.ask_agent("epilog", {"SLURM_JOB_ID": "11"}, socket_path) == "done"
    assert agent_client.ask_agent("epilog", {"SLURM_JOB_ID": "11"}, socket_path) == "done"  # idempotent
    assert set(LedgerFile(config.ledger, 8).read().holdings) == {"12"} and not (config.jobs_dir / "11").exists()
    assert errors == []


def test_concurrent_requests_to_the_agent_never_share_a_gpu(live_agent):
    server, slurm, config, errors = live_agent
    jobs = [str(100 + i) for i in range(8)]
    slurm.running = set(jobs)
    answers: list[str | None] = []
    threads = [threading.Thread(target=lambda j=j: answers.append(agent_client.ask_agent("prolog", env_for(j, str(int(j) - 100)),
                                                                                         server.server_address)))
               for j in jobs]  # Slurm gives each job its own GPU
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == ["done"] * 8
    held = [g for h in LedgerFile(config.ledger, 8).read().holdings.values() for g in h.gpus]
    assert sorted(held) == list(range(8))


def test_the_agent_refuses_bad_requests_and_writes_nothing(live_agent):
    server, slurm, config, errors = live_agent
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.server_address)
        sock.sendall(b"MAPA1 prolog 9\nPATH=/bin")
        answer = sock.recv(1024)
    assert answer.startswith(b"error request variable 'PATH' is not accepted")
    assert errors and "refused a request" in errors[0]
    assert not config.ledger.exists() and [c for c in slurm.calls if "squeue" not in c[0]] == []  # (squeue: the reconcile pass)


def test_a_prolog_whose_client_went_away_keeps_only_its_provisional_choice(tmp_path):
    config = config_from_text(f'ledger = "{tmp_path}/l.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n[nodes]\n"dgx*" = "dgx1-v100"\n', "t")
    slurm, logs = FakeSlurm(), []
    slurm.running = {"7"}
    slurm.admin["7"] = "mapa:topology=ring sensitive=yes"
    assert run_prolog(env_for("7", "0,1"), config, slurm, logs.append, still_wanted=lambda: False) is None
    # The search's choice is not written; the safe provisional one (Slurm's GPUs, free here) is.
    assert (config.jobs_dir / "7").read_text() == "MAPA_GPUS=0,1\nSLURM_GPUS=0,1\nPAIRED_GPUS=0,1\n"
    assert LedgerFile(config.ledger, 8).read().holdings["7"].gpus == (0, 1)
    assert any("went away" in line for line in logs)
    assert not any(call[1] == "update" for call in slurm.calls)  # nor is anything recorded in the AdminComment
    slurm.running.add("8")
    decision = run_prolog(env_for("8", "2,3"), config, slurm, logs.append)
    assert not {0, 1} & set(decision.gpus)


# --- a config the hooks cannot use: refused at the start, said while running (issue 52) ----------

from slurm_mapa.slurm.agent import service  # noqa: E402

UNUSABLE_CONFIGS = {  # name -> (the file's bytes, None for no file; what the error line says)
    "missing": (None, "no such file; accepted: a UTF-8 TOML file of the keys in docs/admin.md, section 4"),
    "not UTF-8": (b'policy = "preserve"\n\xff\xfe\x00garbage\n', "byte 0xff at offset 20 is not UTF-8; accepted: UTF-8 text"),
    "unknown key": (b'polcy = "preserve"\n', "unknown key 'polcy' (line 1: 'polcy = \"preserve\"') (did you mean 'policy'?) "
                                            "(accepted: admin_comment_rate, "),
    "TOML syntax": (b'policy = "preserve\n', "not valid TOML: Illegal character '\\n' (at line 1, column 19); accepted: a UTF-8 "
                                           "TOML file of the keys in docs/admin.md, section 4"),
}


def _unusable_config(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "conf" / "mapa.toml"
    path.parent.mkdir(exist_ok=True)
    content = UNUSABLE_CONFIGS[case][0]
    if content is not None:
        path.write_bytes(content)
        os.chmod(path, 0o644)
    return path


@pytest.mark.parametrize("case", sorted(UNUSABLE_CONFIGS))
def test_mapa_agent_refuses_to_start_on_a_config_the_hooks_cannot_use(tmp_path, capsys, monkeypatch, case):
    """Every job on the node would fall back to Slurm's GPUs: one line naming the file, what is
    wrong (the key, for a key) and what is accepted, exit status 2 (systemd shows the unit failed)."""
    config = _unusable_config(tmp_path, case)

    def must_not_listen(*args, **kwargs):
        raise AssertionError("mapa-agent started listening on an unusable config")

    monkeypatch.setattr(service, "serve", must_not_listen)
    argv = ["--config", str(config), "--socket", str(tmp_path / "a" / "agent.sock"),
            "--isolate-socket", str(tmp_path / "i" / "isolate.sock"), "--node", "dgx1"]
    assert service.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith(f"mapa-agent: error: --config {config}: ") and captured.err.count("\n") == 1, captured.err
    assert UNUSABLE_CONFIGS[case][1] in captured.err
    assert not (tmp_path / "a").exists() and not (tmp_path / "i").exists()


def test_a_config_gone_bad_under_a_running_agent_is_said_once_a_minute_and_the_hooks_fail_open(tmp_path):
    config = tmp_path / "mapa.toml"
    good = f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\nhealth = "off"\n'
    config.write_text(good)
    errors: list[str] = []
    now = [1000.0]
    agent = Agent(str(config), errors.append, run=lambda timeout: FakeSlurm())
    agent.config_log.clock = lambda: now[0]
    agent.run_hook("epilog", {"SLURM_JOB_ID": "5"}, lambda: True)
    assert errors == []
    config.write_text(good + 'polcy = "preserve"\n')  # an admin's typo, while the agent runs
    for _ in range(3):
        agent.run_hook("epilog", {"SLURM_JOB_ID": "6"}, lambda: True)  # each request still answered, failing open
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"mapa-agent: error: --config {config}: unknown key 'polcy' (line 5: 'polcy = \"preserve\"') "
                                "(did you mean 'policy'?) (accepted: admin_comment_rate, ")
    assert "every job on this node gets Slurm's GPUs until it is fixed (said at most once a minute)" in errors[0]
    now[0] += 59
    agent.run_hook("prolog", env_for("7", "0"), lambda: True)
    assert len(errors) == 1
    now[0] += 2
    agent.run_hook("epilog", {"SLURM_JOB_ID": "7"}, lambda: True)
    assert len(errors) == 2 and errors[1].endswith("(said at most once a minute; 3 more like it not logged)"), errors[1]
    config.write_text(good)  # mended: nothing more is said
    now[0] += 120
    agent.run_hook("epilog", {"SLURM_JOB_ID": "8"}, lambda: True)
    assert len(errors) == 2


# --- mapa hooks: the wrappers Slurm runs ---------------------------------------------------------

from slurm_mapa.slurm.admin.install import slurm_conf_lines, wrapper_text  # noqa: E402


def test_wrapper_text_literal():
    assert wrapper_text("epilog", "/usr/bin/python3", "/opt/site", "/etc/slurm/mapa.toml") == (
        "#!/bin/sh\n"
        "# slurm-mapa epilog wrapper, written by `mapa hooks`. Slurm gives hooks no PATH, and a hook that\n"
        "# fails drains the node: absolute paths only, no programs but ours and Python, and exit 0 whatever happens.\n"
        "# Whatever umask slurmd has: nothing root writes here (log, byte code) may be writable by others.\n"
        "umask 022\n"
        "read -r MAPA_WRAPPER_STARTED rest < /proc/uptime || MAPA_WRAPPER_STARTED=0\n"
        "MAPA_CONFIG=/etc/slurm/mapa.toml\n"
        "export MAPA_CONFIG MAPA_WRAPPER_STARTED\n"
        "# Fast path: the node's mapa-agent runs the hook; otherwise (no agent, killed, refused) in-process.\n"
        "/usr/bin/python3 -I -S /opt/site/slurm_mapa/slurm/agent/client.py epilog && exit 0\n"
        "/usr/bin/python3 -I -c 'import sys; sys.path.insert(0, \"/opt/site\"); from slurm_mapa.slurm.hooks.epilog import epilog_main; "
        "sys.exit(epilog_main())'\n"
        "# Killed by a signal (the OOM killer, say) early enough to stay inside Slurm's timeout: once more;\n"
        "# that run finds what the first one left and finishes it.\n"
        "status=$?\n"
        "read -r now rest < /proc/uptime || now=0\n"
        'if [ "$status" -gt 128 ] && [ $(( ${now%.*} - ${MAPA_WRAPPER_STARTED%.*} )) -lt 30 ]; then\n'
        "  MAPA_HOOK_RETRY_AFTER_SIGNAL=$((status - 128)) /usr/bin/python3 -I -c 'import sys; sys.path.insert(0, \"/opt/site\"); "
        "from slurm_mapa.slurm.hooks.epilog import epilog_main; sys.exit(epilog_main())'\n"
        "fi\n"
        "exit 0\n"
    )
    with_cache = wrapper_text("prolog", "/usr/bin/python3", "/opt/site", "/etc/slurm/mapa.toml", "/var/cache/mapa")
    assert "\n/usr/bin/python3 -I -X pycache_prefix=/var/cache/mapa -c 'import sys;" in with_cache
    assert "RETRY_AFTER_SIGNAL=$((status - 128)) /usr/bin/python3 -I -X pycache_prefix=/var/cache/mapa -c 'import sys;" in with_cache
    settings = [line.split("#")[0].strip() for line in slurm_conf_lines("/usr/local/sbin").splitlines()]
    assert settings == [
        "JobSubmitPlugins=lua", "PrologFlags=Alloc", "Prolog=/usr/local/sbin/mapa-prolog-wrapper",
        "Epilog=/usr/local/sbin/mapa-epilog-wrapper", "TaskProlog=/usr/local/sbin/mapa-taskprolog",
        "PrologEpilogTimeout=60", "AccountingStorageTRES=gres/gpu", "AccountingStoreFlags=job_comment",
    ]
    assert "PrologEpilogTimeout=75 " in slurm_conf_lines("/usr/local/sbin", 75)
    compiled = wrapper_text("epilog", "/usr/bin/python3", "/opt/site", "/etc/slurm/mapa.toml", client="/usr/local/sbin/mapa-hook-client")
    assert "\n/usr/local/sbin/mapa-hook-client epilog && exit 0\n/usr/bin/python3 -I -c 'import sys;" in compiled
    assert "client.py" not in compiled
    for bad in ("python3", "/usr/bin/py'thon", "/opt/$HOME"):
        with pytest.raises(InputError, match="must be absolute and free of quotes"):
            wrapper_text("prolog", bad, "/opt/site", "/etc/slurm/mapa.toml")


def test_written_wrappers_run_the_hooks_with_and_without_the_agent(tmp_path, capsys):
    from slurm_mapa.cli import main as mapa_main

    for name, text in (("scontrol", FAKE_SCONTROL), ("squeue", "#!/bin/sh\necho 7\necho 8\n")):
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o755)
    config_path = tmp_path / "mapa.toml"
    config_path.write_text(
        f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\nhealth = "off"\n'
        f'scontrol = "{tmp_path}/scontrol"\nsqueue = "{tmp_path}/squeue"\n[nodes]\n"dgx*" = "dgx1-v100"\n'
    )
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config_path)]) == 0
    assert "Prolog=" + str(tmp_path / "sbin" / "mapa-prolog-wrapper") in capsys.readouterr().out
    # The compiled client (scripts/test installs cc) asks the agent below; test_hook_client.py tests it alone.
    assert (tmp_path / "sbin" / "mapa-hook-client").exists()
    assert str(tmp_path / "sbin" / "mapa-hook-client") + " prolog && exit 0" in (tmp_path / "sbin" / "mapa-prolog-wrapper").read_text()
    prolog = str(tmp_path / "sbin" / "mapa-prolog-wrapper")
    expected = select("preserve", preset("dgx1-v100"), range(8), Request(make_pattern("ring", 2), True)).gpus
    # No agent: the wrapper runs the Prolog in-process (Slurm's bare environment: no PATH).
    env = {**env_for("7", "0,1"), "MAPA_AGENT_SOCKET": str(tmp_path / "no-agent.sock")}
    assert subprocess.run([prolog], env=env, check=False).returncode == 0
    assert LedgerFile(tmp_path / "ledger.json", 8).read().holdings["7"].gpus == expected
    # With an agent listening: the same result through it.
    slurm = FakeSlurm()
    slurm.running = {"7", "8"}
    agent = Agent(str(config_path), run=lambda timeout: slurm)
    server = serve(str(tmp_path / "agent" / "agent.sock"), agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**env_for("8", "2"), "MAPA_AGENT_SOCKET": server.server_address}
        assert subprocess.run([prolog], env=env, check=False).returncode == 0
        assert set(LedgerFile(tmp_path / "ledger.json", 8).read().holdings) == {"7", "8"}
        assert "mapa-agent" not in (tmp_path / "log").read_text()  # no internal error on either path
        epilog = str(tmp_path / "sbin" / "mapa-epilog-wrapper")
        assert subprocess.run([epilog], env={"SLURM_JOB_ID": "7", "MAPA_AGENT_SOCKET": server.server_address}, check=False).returncode == 0
        assert set(LedgerFile(tmp_path / "ledger.json", 8).read().holdings) == {"8"}
    finally:
        server.shutdown()
        server.server_close()


def test_a_ping_is_answered_and_neither_runs_nor_logs_anything(live_agent):
    """mapa doctor's probe: "done ping" from a live agent; a ping with a payload is refused, and
    nothing else ever reaches the log or the ledger."""
    import socket as socket_module

    from slurm_mapa.slurm.admin.doctor.gather_inputs import ask_agent

    server, slurm, config, errors = live_agent
    assert ask_agent(server.server_address) == "done ping"
    assert errors == [] and not Path(config.log).exists() and not Path(config.ledger).exists()
    with socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(server.server_address)
        payload = b"SLURM_JOB_ID=1\n"
        sock.sendall(b"MAPA1 ping %d\n" % len(payload) + payload)
        assert sock.recv(4096).startswith(b"error a ping request carries no variables")
    assert len(errors) == 1 and "ping" in errors[0]


def test_the_agent_start_stores_the_ring_rate_table_of_a_topology_file(tmp_path, capsys):
    """Issue 49: a node whose topology file matches no preset gets its ring-rate table computed at
    the agent's start, beside the ledger, so no Prolog solves it; a line says so (once)."""
    from slurm_mapa.core.hardware import build_graph
    from slurm_mapa.core.ring_rate_tables import fingerprint
    from slurm_mapa.hardware.topofile import graph_to_toml

    dgx = preset("dgx1-v100")
    links = {(a, b): dgx.link(a, b) for a, b in dgx.pairs()}
    links[(0, 1)] = "NV2"
    graph = build_graph("gpu-node", 8, links)
    (tmp_path / "gpu-node.toml").write_text(graph_to_toml(graph))
    config_path = tmp_path / "mapa.toml"
    config_path.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                           f'health = "off"\n[nodes]\n"gpu*" = "{tmp_path}/gpu-node.toml"\n')
    agent = Agent(str(config_path), [].append, run=lambda timeout: FakeSlurm())
    agent.warm_up("gpu7")
    table = tmp_path / "state" / "ring-rates" / f"{fingerprint(graph)}.json"
    assert table.is_file()
    assert capsys.readouterr().err == f"mapa-agent: ring rates: computed the table of gpu-node (links match no preset) into {table}\n"
    agent.warm_up("gpu7")
    assert capsys.readouterr().err == ""
