"""mapa-agent's Prometheus metrics (slurm/metrics.py): the pure parts, the node-state gauges against
a brute force, a live agent's counters against what its jobs got, the endpoint, the [metrics]
config key, and the Grafana dashboard's and alert rules' metric names."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from repo_paths import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from fake_slurm import FakeSlurm, env_for, eventually
from fake_node import node  # noqa: F401 - the fixture: a node with a fake /proc and cgroupfs

from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import all_policies
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset
from slurm_mapa.slurm.agent import client as agent_client
from slurm_mapa.slurm.agent.service import Agent, start_metrics
from slurm_mapa.slurm.agent.background import Background
from slurm_mapa.slurm.agent.server import serve
from slurm_mapa.slurm.text.commands import CommandFailed
from slurm_mapa.slurm.config import config_from_text
from slurm_mapa.slurm.hooks.reconcile import reconcile_node
from slurm_mapa.slurm.node_state.job_files import write_mark, Mark
from slurm_mapa.slurm.node_state.ledger import Holding, Ledger, LedgerFile
from slurm_mapa.slurm.agent.metrics import (DECISION_OUTCOMES, ISOLATION_OUTCOMES, REPAIR_KINDS, AgentMetrics, command_name,
                                      decision_outcome, isolation_outcome, node_gauges, read_node_gauges, repairs_in, ring_sizes)

ROOT = REPO
DASHBOARD = ROOT / "slurm_mapa" / "data" / "contrib" / "grafana" / "mapa-dashboard.json"
ALERTS = ROOT / "slurm_mapa" / "data" / "contrib" / "prometheus" / "mapa-alerts.yml"


def samples(metrics: AgentMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a scrape."""
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found, name, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


# --- the pure parts ------------------------------------------------------------------------------


def test_decision_outcomes_from_the_ledgers_policy_field():
    policies = all_policies()
    assert all(decision_outcome(policy, policies) == "mapa" for policy in policies)
    assert decision_outcome("fallback", policies) == "fallback"
    for safe in ("provisional", "recovered", "slurm", "claimed"):
        assert decision_outcome(safe, policies) == "provisional"


@pytest.mark.parametrize("answer, outcome", [
    ("done cgroup-v1 gpus=4,5 job 12 step batch", "isolated"),
    ("done cgroup-v2 gpus=0 job 1 step 0", "isolated"),
    ("done failed-open no topology", "failed-open"),
    ("error the task's cgroup is gone", "refused"),
    ("done off", None),
    ("done off isolation is off", None),
])
def test_isolation_outcomes_from_the_answer(answer, outcome):
    assert isolation_outcome(answer) == outcome


def test_ring_sizes_cover_two_to_eight_and_the_node():
    assert ring_sizes(8) == (2, 3, 4, 5, 6, 7, 8)
    assert ring_sizes(6) == (2, 3, 4, 5, 6)
    assert ring_sizes(16) == (2, 3, 4, 5, 6, 7, 8, 16)
    assert ring_sizes(1) == ()


def test_command_names():
    assert [command_name(a) for a in (["/usr/bin/scontrol", "show"], ["squeue"], ["/bin/sh"], [], None)] == \
        ["scontrol", "squeue", "other", "other", "other"]


def test_repairs_are_read_from_the_reconcile_passes_own_lines(tmp_path):
    """The texts repairs_in reads are hooks.py's: a real pass that reaps and adopts is counted."""
    config = config_from_text(f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                              'health = "off"\n[nodes]\n"dgx*" = "dgx1-v100"\n')
    (tmp_path / "jobs").mkdir(mode=0o755)
    slurm = FakeSlurm()
    # Job 5 ended without a clean Epilog (Slurm no longer lists it); job 6 runs without a mark.
    write_mark(config.jobs_dir, "5", Mark(0, 0, (0, 1)))
    LedgerFile(config.ledger, 8).write(Ledger({"5": Holding((0, 1), "preserve", 1.0, "")}))
    slurm.running = {"6"}
    slurm.gres["6"] = ["gpu:2(IDX:2-3)"]
    metrics = AgentMetrics("dgx1")
    lines: list[str] = []
    reconcile_node(config, "dgx1", slurm, metrics.repair_log(lines.append))
    found = samples(metrics)
    assert value(found, "mapa_ledger_repairs_total", node="dgx1", kind="reaped") == 1, lines
    assert value(found, "mapa_ledger_repairs_total", node="dgx1", kind="adopted") == 1, lines
    (tmp_path / "ledger.json").write_text("{not json")
    reconcile_node(config, "dgx1", slurm, metrics.repair_log(lines.append))
    assert value(samples(metrics), "mapa_ledger_repairs_total", node="dgx1", kind="rebuilt") == 1, lines
    assert repairs_in("reconcile pass: job 7's Prolog died before choosing; it runs on Slurm's GPUs 0,1, now held") == \
        [("prolog-died", 1)]
    assert repairs_in("job 9: reaped the ledger entries and files of jobs that ended: 3,4,8") == [("reaped", 3)]
    assert repairs_in("job 9 on dgx1: dgx1=0,1 policy=preserve") == []


# --- the node state against a brute force -------------------------------------------------------


def brute_best_ring(graph, free, k, model):
    """The best predicted effective bandwidth of any k-GPU ring on ``free``: every ordered choice."""
    ring = make_pattern("ring", k)
    best = 0.0
    for gpus in itertools.permutations(sorted(free), k):
        counts = [0] * len(model.class_names)
        for a, b in ring.edges:
            counts[model.classify(graph.links[gpus[a]][gpus[b]])] += 1
        best = max(best, model.predict(tuple(counts)))
    return best


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["dgx1-v100", "summit", "mi250x"]), seed=st.integers(0, 10**6))
def test_node_state_matches_the_ledger_and_a_brute_force(name, seed):
    graph, model = preset(name), paper_model()
    rng = random.Random(seed)
    gpus = list(range(graph.size))
    rng.shuffle(gpus)
    holdings, start = {}, 0
    for job in range(rng.randint(0, 3)):
        take = rng.randint(1, 3)
        holdings[str(job + 1)] = Holding(tuple(gpus[start:start + take]), rng.choice(["preserve", "fallback", "provisional"]), 1.0)
        start += take
    if holdings and rng.random() < 0.3:  # a GPU two jobs really use
        holdings["99"] = Holding((next(iter(holdings.values())).gpus[0],), "slurm", 1.0)
    state = node_gauges(graph, holdings, model, all_policies())
    owners = [g for h in holdings.values() for g in h.gpus]
    free = [g for g in range(graph.size) if g not in owners]
    assert state.size == graph.size and state.jobs == len(holdings)
    assert sum(state.held.values()) == len(owners)
    assert state.held["fallback"] == sum(len(h.gpus) for h in holdings.values() if h.policy == "fallback")
    assert state.shared == len({g for g in owners if owners.count(g) > 1})
    assert state.free_preserved == pytest.approx(sum(graph.bandwidth(a, b) for a, b in itertools.combinations(free, 2)))
    assert sorted(state.free_ring) == list(ring_sizes(graph.size))
    for k in state.free_ring:
        if k <= 5:  # the brute force is factorial
            assert state.free_ring[k] == pytest.approx(brute_best_ring(graph, free, k, model) if len(free) >= k else 0.0)
            assert state.idle_ring[k] == pytest.approx(brute_best_ring(graph, range(graph.size), k, model))
        assert state.free_ring[k] <= state.idle_ring[k] + 1e-9


# --- a live agent ---------------------------------------------------------------------------------


@pytest.fixture
def metered_agent(tmp_path):
    config_path = tmp_path / "mapa.toml"

    def configure(extra=""):
        config_path.write_text(
            f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\nhealth = "off"\n'
            f'job_submit_lua = true\n{extra}[nodes]\n"dgx*" = "dgx1-v100"\n')
        os.chmod(config_path, 0o644)

    configure()
    slurm = FakeSlurm()
    metrics = AgentMetrics("dgx1", state=lambda: read_node_gauges(config_from_text(config_path.read_text()), "dgx1"))
    agent = Agent(str(config_path), lambda text: None, run=lambda timeout: slurm, node="dgx1", metrics=metrics)
    agent.background = Background(agent, "dgx1")
    server = serve(str(tmp_path / "agent" / "agent.sock"), agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield agent, metrics, server.server_address, slurm, configure
    server.shutdown()
    server.server_close()


def test_a_live_agent_counts_what_its_jobs_got(metered_agent, tmp_path):
    agent, metrics, socket_path, slurm, configure = metered_agent
    slurm.running = {"21", "22"}
    for job, gpus in (("21", "0,1"), ("22", "2,3,4,5")):
        assert agent_client.ask_agent("prolog", env_for(job, gpus, "mapa:topology=ring sensitive=yes"), socket_path) == "done"
    assert agent_client.ask_agent("prolog", env_for("23", ""), socket_path) == "done"  # CPU-only: no decision
    ledger = LedgerFile(tmp_path / "ledger.json", 8).read()
    # Counted after the answer went back (off the start path): a moment later.
    eventually(lambda: value(samples(metrics), "mapa_prolog_duration_seconds_count", node="dgx1") == 2)
    found = samples(metrics)
    assert value(found, "mapa_decisions_total", node="dgx1", outcome="mapa", policy="preserve") == 2
    for outcome in ("provisional", "fallback", "refused"):
        assert value(found, "mapa_decisions_total", node="dgx1", outcome=outcome, policy="preserve") == 0
    assert value(found, "mapa_prolog_duration_seconds_count", node="dgx1") == 2
    assert value(found, "mapa_decision_duration_seconds_count", node="dgx1") == 2
    assert value(found, "mapa_prolog_budget_overruns_total", node="dgx1") == 0
    assert value(found, "mapa_gpus_held", node="dgx1", choice="mapa") == 6 == len(ledger.held())
    assert value(found, "mapa_gpus_shared", node="dgx1") == 0
    assert value(found, "mapa_gpus", node="dgx1") == 8 and value(found, "mapa_node_state_ok", node="dgx1") == 1
    free = ledger.free(8)
    assert value(found, "mapa_free_ring_effective_bandwidth_gbps", node="dgx1", k="2") == \
        pytest.approx(brute_best_ring(preset("dgx1-v100"), free, 2, paper_model()))
    assert value(found, "mapa_free_ring_effective_bandwidth_gbps", node="dgx1", k="3") == 0  # two GPUs are free
    assert value(found, "mapa_free_preserved_bandwidth_gbps", node="dgx1") == \
        pytest.approx(preset("dgx1-v100").bandwidth(*free))
    # Every series carries the node.
    assert all(dict(labels).get("node") == "dgx1" for _, labels in found)
    # The reconcile pass's squeue call is counted (the Prologs asked Slurm nothing).
    assert value(found, "mapa_controller_calls_total", node="dgx1", command="squeue") == 0
    agent.background.reconcile_once()
    after = samples(metrics)
    assert value(after, "mapa_controller_calls_total", node="dgx1", command="squeue") == 1
    assert value(after, "mapa_controller_call_duration_seconds_count", node="dgx1", command="squeue") == 1
    slurm.broken.add("squeue")
    agent.background.reconcile_once()
    assert value(samples(metrics), "mapa_controller_call_failures_total", node="dgx1", command="squeue") == 1


def test_a_fallback_and_a_provisional_choice_are_counted_as_such(metered_agent, tmp_path):
    agent, metrics, socket_path, slurm, configure = metered_agent
    env = {**env_for("31", "0,1"), "SLURMD_NODENAME": "nomatch1"}  # no [nodes] entry: the Prolog falls back
    assert agent_client.ask_agent("prolog", env, socket_path) == "done"
    eventually(lambda: value(samples(metrics), "mapa_prolog_duration_seconds_count", node="dgx1") == 1)
    # A Prolog whose client went away keeps its provisional choice (test_agent's case, here counted).
    agent.run_hook("prolog", env_for("32", "2,3"), lambda: False)
    agent.note_prolog(env_for("32", "2,3"), 0.0, 0.0)
    found = samples(metrics)
    assert value(found, "mapa_decisions_total", node="dgx1", outcome="fallback", policy="preserve") == 1
    assert value(found, "mapa_decisions_total", node="dgx1", outcome="provisional", policy="preserve") == 1
    assert value(found, "mapa_gpus_held", node="dgx1", choice="fallback") == 2
    assert value(found, "mapa_gpus_held", node="dgx1", choice="provisional") == 2
    assert value(found, "mapa_prolog_budget_overruns_total", node="dgx1") == 1  # "took" since time 0


def test_a_prolog_turned_away_as_busy_is_counted_refused(tmp_path):
    metrics = AgentMetrics("dgx1")
    agent = Agent(str(tmp_path / "mapa.toml"), lambda text: None, node="dgx1", metrics=metrics)
    server = serve(str(tmp_path / "agent" / "agent.sock"), agent, max_handlers=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        assert agent_client.ask_agent("prolog", env_for("41", "0"), server.server_address) == "error busy"  # it falls back
        assert agent_client.ask_agent("epilog", env_for("41", "0"), server.server_address) == "error busy"
        eventually(lambda: value(samples(metrics), "mapa_decisions_total", node="dgx1", outcome="refused",
                                  policy="preserve") == 1 and not server.refused)
    finally:
        server.shutdown()
        server.server_close()
    assert value(samples(metrics), "mapa_decisions_total", node="dgx1", outcome="refused", policy="preserve") == 1


def test_isolation_answers_are_counted(node):  # noqa: F811 - test_isolation's fixture
    agent, proc, *_, configure, tmp_path = node
    agent.metrics = AgentMetrics("dgx1")
    assert agent.isolate(os.getpid(), 1000, {"SLURM_JOB_ID": "12"}).startswith("done cgroup-v1")
    proc.add(4000, "slurmstepd", 1, 0, "", exe="/usr/bin/python3")  # no slurmstepd: not isolable
    assert agent.isolate(os.getpid(), 1000, {"SLURM_JOB_ID": "12"}).startswith("done failed-open")
    configure("fail-closed")
    assert agent.isolate(os.getpid(), 1000, {"SLURM_JOB_ID": "12"}).startswith("error")
    assert agent.isolation_failed("bad request: x", 1, 1000).startswith("error")
    configure("off")
    assert agent.isolate(os.getpid(), 1000, {"SLURM_JOB_ID": "12"}) == "done off"
    found = samples(agent.metrics)
    assert [value(found, "mapa_isolation_requests_total", node="dgx1", outcome=o) for o in ISOLATION_OUTCOMES] == [1, 1, 2]


def test_features_written_and_active_are_shown(metered_agent):
    agent, metrics, *_ = metered_agent
    metrics.features = lambda: agent.background.features.published  # as service.main wires it
    assert value(samples(metrics), "mapa_feature_publications_total", node="dgx1") == 0
    assert not any(name == "mapa_node_feature_active" for name, _ in samples(metrics))  # nothing published yet
    publisher = agent.background.features

    def publish(config, run, log, force=False):  # as Publisher.publish after a write slurmctld took
        publisher.last = (("mapa_ring2", "mapa_noring4"), "mapa_ring2=48.1/58.93@0,mapa_ring4=-/53.6@-", 97)  # with an outlook and a weight
        return True

    publisher.publish = publish
    assert agent.background.publish_features() is True
    found = samples(metrics)
    assert value(found, "mapa_feature_publications_total", node="dgx1") == 1
    assert value(found, "mapa_node_feature_active", node="dgx1", feature="mapa_noring4") == 1


def test_an_unreadable_ledger_is_said_and_the_scrape_still_answers(metered_agent, tmp_path):
    agent, metrics, *_ = metered_agent
    (tmp_path / "ledger.json").write_text("{torn")
    found = samples(metrics)
    assert value(found, "mapa_node_state_ok", node="dgx1") == 0
    assert not any(name == "mapa_gpus_held" for name, _ in found)
    assert "not JSON" in metrics.state_problem


def test_a_failing_slurm_command_is_counted_and_raises_unchanged():
    metrics = AgentMetrics("n1")

    def run(argv, timeout=None):
        if argv[0].endswith("squeue"):
            raise CommandFailed("squeue timed out after 5 s")
        return f"ran {argv[1]} within {timeout}"

    call = metrics.instrument(lambda timeout: run)(5.0)
    assert call(["/usr/bin/scontrol", "show"], timeout=2.0) == "ran show within 2.0"
    with pytest.raises(CommandFailed, match="timed out"):
        call(["squeue", "-h"])
    found = samples(metrics)
    assert value(found, "mapa_controller_calls_total", node="n1", command="scontrol") == 1
    assert value(found, "mapa_controller_call_failures_total", node="n1", command="scontrol") == 0
    assert value(found, "mapa_controller_call_failures_total", node="n1", command="squeue") == 1


# --- the endpoint and the config key ------------------------------------------------------------


def test_the_endpoint_serves_the_text_format(tmp_path):
    metrics = AgentMetrics("n1")
    server = metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
            assert answer.headers["Content-Type"].startswith("text/plain")
    finally:
        server.shutdown()
        server.server_close()
    assert 'mapa_decisions_total{node="n1",outcome="mapa",policy="preserve"} 0.0' in text
    assert "process_cpu_seconds_total" not in text  # no series without a node label


def test_start_metrics_reads_the_config_and_says_why_not(tmp_path, capsys, monkeypatch):
    config = tmp_path / "mapa.toml"
    config.write_text("")
    os.chmod(config, 0o644)
    assert start_metrics(str(config), "n1") is None  # off by default
    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config.write_text(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    metrics = start_metrics(str(config), "n1")
    try:
        assert metrics is not None and f"metrics on http://127.0.0.1:{port}/metrics" in capsys.readouterr().err
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert b'mapa_node_state_ok{node="n1"} 0.0' in answer.read()  # no [nodes] entry for n1
        assert start_metrics(str(config), "n1") is None  # the port is taken now
        assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        metrics.server.shutdown()
        metrics.server.server_close()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    assert start_metrics(str(config), "n1") is None
    assert "python3-prometheus-client" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ("", None),
    ('[metrics]\nlisten = ""', None),
    ('[metrics]\nlisten = "127.0.0.1:9786"', ("127.0.0.1", 9786)),
    ('[metrics]\nlisten = "0.0.0.0:9786"', ("0.0.0.0", 9786)),
    ('[metrics]\nlisten = "[::1]:9786"', ("::1", 9786)),
    ('[metrics]\nlisten = "dgx1.example.org:80"', ("dgx1.example.org", 80)),
    ('[metrics]\nlisten = "9786"', ("127.0.0.1", 9786)),  # a bare port: loopback
])
def test_the_metrics_key(text, expected):
    assert config_from_text(text).metrics_listen == expected


@pytest.mark.parametrize("text, message", [
    ('[metrics]\nlisten = ":9786"', "is not HOST:PORT"),
    ('[metrics]\nlisten = "0"', "is not HOST:PORT or PORT"),
    ('[metrics]\nlisten = "65536"', "is not HOST:PORT or PORT"),
    ('[metrics]\nlisten = "９７８６"', "is not HOST:PORT or PORT"),
    ('[metrics]\nlisten = "port"', "is not HOST:PORT or PORT"),
    ('[metrics]\nlisten = "host:0"', "is not HOST:PORT"),
    ('[metrics]\nlisten = "host:65536"', "is not HOST:PORT"),
    ('[metrics]\nlisten = "a host:80"', "is not HOST:PORT"),
    ('[metrics]\nlisten = 9786', "listen must be a string"),
    ('[metrics]\nport = 9786', r"\[metrics\] takes a table with one key, listen"),
    ('metrics = "127.0.0.1:9786"', r"\[metrics\] takes a table"),
])
def test_a_bad_metrics_key_is_refused_in_one_line(text, message):
    with pytest.raises(InputError, match=message) as error:
        config_from_text(text, source="mapa.toml")
    assert str(error.value).startswith("mapa.toml: ") and "\n" not in str(error.value)


# --- the dashboard and the alert rules name only series the agent serves ------------------------


def served_names() -> set[str]:
    metrics = AgentMetrics("n1", state=lambda: node_gauges(preset("dgx1-v100"), {}, paper_model(), all_policies()),
                           features=lambda: ("mapa_ring2",), health=lambda: {0: True})
    return {name for name, _ in samples(metrics)}


def mapa_names(text: str) -> set[str]:
    return set(re.findall(r"\bmapa_[a-z0-9_]+\b", text)) - {"mapa_ring2"}


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v.get("query"), dict) else v["query"]
              for v in board.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs


def test_the_dashboard_queries_only_served_series():
    exprs = dashboard_expressions()
    assert len(exprs) >= 10
    used = set().union(*(mapa_names(expr) for expr in exprs))
    assert used and used <= served_names(), used - served_names()
    for name in ("mapa_decisions_total", "mapa_gpus_shared", "mapa_free_ring_effective_bandwidth_gbps",
                 "mapa_isolation_requests_total", "mapa_controller_calls_total", "mapa_ledger_repairs_total",
                 "mapa_prolog_duration_seconds_bucket", "mapa_decision_duration_seconds_bucket", "mapa_feature_publications_total"):
        assert name in used, name


def test_the_alert_rules_name_only_served_series():
    used = mapa_names(ALERTS.read_text())
    assert {"mapa_gpus_shared", "mapa_decisions_total", "mapa_isolation_requests_total"} <= used
    assert used <= served_names(), used - served_names()


def test_every_outcome_and_kind_is_a_series_from_the_start():
    found = samples(AgentMetrics("n1"))
    assert {dict(l)["outcome"] for n, l in found if n == "mapa_decisions_total"} == set(DECISION_OUTCOMES)
    assert {dict(l)["kind"] for n, l in found if n == "mapa_ledger_repairs_total"} == set(REPAIR_KINDS)


def test_idle_connections_cannot_exhaust_the_agent_and_a_scrape_still_answers():
    """Issue 36: any local user could open idle TCP connections to the metrics port, one thread
    and one descriptor each, until the agent stopped answering its Prologs. Now at most a few are
    open at once, each closed at its deadline, and the rest closed on arrival."""
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n", max_connections=4, deadline=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(300):
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
            connection.send(b"G")  # a request that never ends
            idle.append(connection)
        time.sleep(0.3)
        assert threading.active_count() - threads_before <= 4
        assert len(server.open) <= 4
        # The idle ones are closed at their deadline: a scrape gets through within a few seconds.
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as answer:
                    assert answer.read() == b"up 1\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape answered while idle connections were open"
                time.sleep(0.2)
        # Every idle connection was closed by the server (a read sees the end, not a hang).
        for connection in idle[:20]:
            connection.settimeout(5)
            try:
                assert connection.recv(100) == b""
            except ConnectionResetError:
                pass
        assert server.turned_away >= 200  # (a few were admitted as earlier ones reached their deadline)
    finally:
        for connection in idle:
            connection.close()
        server.shutdown()
        server.server_close()


def test_the_metrics_endpoint_answers_only_get_of_metrics():
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            connection.sendall(b"G" * 5000 + b"\r\n\r\n")  # a request line no scrape sends
            assert b"200" not in connection.recv(1000)
    finally:
        server.shutdown()
        server.server_close()


# --- one peer cannot keep the others' scrapes out ---------------------------------------------------

# /proc/net/tcp and tcp6 as the kernel writes them on a little-endian host: a listening socket, a
# loopback connection's two ends (uid 1000's client 127.0.0.1:51234 -> 127.0.0.1:9810, root's
# accepted end), a TIME_WAIT leftover of the same pair, and in tcp6 a dual-stack client
# (::ffff:127.0.0.1:40000, uid 1001) and an IPv6 one ([::1]:40001, uid 1002) of a server on [::]:9810.
PROC_NET_TCP_TEXT = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:2652 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0
   1: 0100007F:C822 0100007F:2652 06 00000000:00000000 03:00000F9E 00000000     0        0 0 3 0000000000000000
   2: 0100007F:C822 0100007F:2652 01 00000000:00000000 00:00000000 00000000  1000        0 23456 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:2652 0100007F:C822 01 00000000:00000000 00:00000000 00000000     0        0 23457 1 0000000000000000 20 4 31 10 -1
"""
PROC_NET_TCP6_TEXT = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:2652 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 34567 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:9C40 0000000000000000FFFF00000100007F:2652 01 00000000:00000000 00:00000000 00000000  1001        0 34568 1 0000000000000000 20 4 30 10 -1
   2: 00000000000000000000000001000000:9C41 00000000000000000000000001000000:2652 01 00000000:00000000 00:00000000 00000000  1002        0 34569 1 0000000000000000 20 4 30 10 -1
"""


def test_proc_net_tcp_addresses_are_read_in_the_hosts_byte_order():
    from ipaddress import ip_address
    from slurm_mapa.slurm.agent.peer_owner import proc_net_address, proc_net_tcp_line

    assert proc_net_address("0100007F:2652", "little") == (ip_address("127.0.0.1"), 9810)
    assert proc_net_address("7F000001:2652", "big") == (ip_address("127.0.0.1"), 9810)
    assert proc_net_address("0500000A:0050", "little") == (ip_address("10.0.0.5"), 80)
    assert proc_net_address("00000000000000000000000001000000:2652", "little") == (ip_address("::1"), 9810)
    assert proc_net_address("000080FE00000000FF0A5A5A3412DBFE:0016", "little") == (ip_address("fe80::5a5a:aff:fedb:1234"), 22)
    assert proc_net_address("0000000000000000FFFF00000100007F:9C40", "little") == (ip_address("127.0.0.1"), 40000)  # mapped
    for bad in ("0100007F", "0100007F:2652:1", "100007F:2652", "0100007G:2652", "0100007F:10000", ""):
        with pytest.raises(ValueError):
            proc_net_address(bad, "little")
    header, listening, *_ = PROC_NET_TCP_TEXT.splitlines()
    assert proc_net_tcp_line(header, "little") is None
    entry = proc_net_tcp_line(listening, "little")
    assert entry is not None and entry.local == (ip_address("127.0.0.1"), 9810) and entry.state == 0x0A and entry.uid == 0
    for junk in ("", "   0:", "   0: 0100007F:2652 00000000:0000 0A 0:0 0:0 0 notauid 0 1", "\x00" * 200,
                 "   0: zz:zz 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0"):
        assert proc_net_tcp_line(junk, "little") is None


def test_the_socket_owner_is_the_line_of_the_peers_address_and_ours():
    from ipaddress import ip_address
    from slurm_mapa.slurm.agent.peer_owner import socket_owner_uid

    loopback, v6 = ip_address("127.0.0.1"), ip_address("::1")
    tcp, tcp6 = PROC_NET_TCP_TEXT.splitlines(), PROC_NET_TCP6_TEXT.splitlines()
    # The client end (not the TIME_WAIT leftover of the same pair, nor our accepted end).
    assert socket_owner_uid(tcp, (loopback, 51234), (loopback, 9810), "little") == 1000
    assert socket_owner_uid(tcp, (loopback, 9810), (loopback, 51234), "little") == 0  # our own end
    assert socket_owner_uid(tcp, (loopback, 51234), (loopback, 9811), "little") is None  # another server's peer
    assert socket_owner_uid(tcp, (loopback, 51235), (loopback, 9810), "little") is None
    # A dual-stack client shows as ::ffff:127.0.0.1, in tcp6.
    assert socket_owner_uid(tcp6, (loopback, 40000), (loopback, 9810), "little") == 1001
    assert socket_owner_uid(tcp6, (ip_address("::ffff:127.0.0.1"), 40000), (loopback, 9810), "little") == 1001
    assert socket_owner_uid(tcp6, (v6, 40001), (v6, 9810), "little") == 1002
    assert socket_owner_uid([], (loopback, 51234), (loopback, 9810), "little") is None
    # Read as a big-endian host would, the same text names other addresses: no match.
    assert socket_owner_uid(tcp, (loopback, 51234), (loopback, 9810), "big") is None


# The kernel's answer to an exact sock_diag lookup (little-endian host): the nlmsghdr (72+16 bytes,
# SOCK_DIAG_BY_FAMILY, sequence 1), then inet_diag_msg: AF_INET, ESTABLISHED, timer, retrans, the
# socket id (127.0.0.1:51234 -> 127.0.0.1:9810, interface, cookie), expires, rqueue, wqueue, uid
# 1000, inode 23456.
SOCK_DIAG_REPLY = bytes.fromhex(
    "58000000" "1400" "0200" "01000000" "39300000"
    "02" "01" "00" "00"
    "c822" "2652" "7f000001" + "00" * 12 + "7f000001" + "00" * 12 + "00000000" "a0b1c2d3" "e4f50617"
    "00000000" "00000000" "00000000" "e8030000" "a05b0000")
SOCK_DIAG_ENOENT = bytes.fromhex("24000000" "0200" "0000" "01000000" "39300000" "feffffff") + bytes(16)


@pytest.mark.skipif(sys.byteorder != "little", reason="the literal messages are a little-endian host's")
def test_the_sock_diag_lookup_asks_for_one_socket_and_reads_its_owner():
    from ipaddress import ip_address
    from slurm_mapa.slurm.agent.peer_owner import sock_diag_request, sock_diag_uid

    loopback = ip_address("127.0.0.1")
    assert sock_diag_request((loopback, 51234), (loopback, 9810)) == bytes.fromhex(
        "48000000" "1400" "0100" "01000000" "00000000"  # 72 bytes, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST (no dump)
        "02" "06" "00" "00" "ffffffff"  # AF_INET, TCP, no extensions, every state
        "c822" "2652" "7f000001" + "00" * 12 + "7f000001" + "00" * 12 + "00000000" "ffffffff" "ffffffff")
    mapped = sock_diag_request((ip_address("::ffff:127.0.0.1"), 51234), (ip_address("::ffff:127.0.0.1"), 9810))
    assert mapped == sock_diag_request((loopback, 51234), (loopback, 9810))  # asked as IPv4: dual-stack sockets are found too
    v6 = sock_diag_request((ip_address("::1"), 40001), (ip_address("::1"), 9810), sequence=7)
    assert v6[4:6] == bytes.fromhex("1400") and v6[8:12] == bytes.fromhex("07000000") and v6[16] == socket.AF_INET6
    assert v6[28:44] == ip_address("::1").packed and v6[44:60] == ip_address("::1").packed
    assert sock_diag_uid(SOCK_DIAG_REPLY) == 1000
    assert sock_diag_uid(SOCK_DIAG_REPLY, sequence=2) is None  # not the answer to our question
    assert sock_diag_uid(SOCK_DIAG_REPLY[:17] + b"\x06" + SOCK_DIAG_REPLY[18:]) is None  # TIME_WAIT: no owner
    assert sock_diag_uid(SOCK_DIAG_ENOENT) is None
    for junk in (b"", SOCK_DIAG_REPLY[:80], bytes(200), b"\xff" * 200):
        assert sock_diag_uid(junk) is None


def test_the_owner_of_a_real_loopback_connection_is_found():
    """Both lookups (the kernel's, and /proc/net/tcp(6) where it cannot be used) find the uid of
    a loopback connection made here, over IPv4, IPv6 and a dual-stack server."""
    from slurm_mapa.slurm.agent.peer_owner import ip_of, peer_of_connection, socket_owner_by_sock_diag, socket_owner_in_proc

    def connected_pair(family, host, connect_to=None):
        listener = socket.socket(family)
        listener.bind((host, 0))
        listener.listen(1)
        client = socket.create_connection((connect_to or host, listener.getsockname()[1]), timeout=5)
        accepted, client_address = listener.accept()
        listener.close()
        return client, accepted, client_address

    pairs = [connected_pair(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        try:
            pairs.append(connected_pair(socket.AF_INET6, "::1"))
            pairs.append(connected_pair(socket.AF_INET6, "::", "127.0.0.1"))  # dual stack: ::ffff:127.0.0.1
        except OSError:
            pass  # no IPv6 loopback here
    try:
        for client, accepted, client_address in pairs:
            peer = (ip_of(client_address[0]), client_address[1])
            ours = (ip_of(accepted.getsockname()[0]), accepted.getsockname()[1])
            assert peer_of_connection(client_address, accepted.getsockname()) == ("uid", os.getuid()), client_address
            assert socket_owner_in_proc(peer, ours) == os.getuid(), client_address
            try:
                assert socket_owner_by_sock_diag(peer, ours) == os.getuid(), client_address
                assert socket_owner_by_sock_diag(peer, (ours[0], ours[1] ^ 1)) is None  # no such connection
            except OSError:
                pass  # no sock_diag here: /proc is read
            # Not found within the read's bound, or no table to read: no owner, so the peer is its address.
            assert socket_owner_in_proc(peer, ours, max_bytes=0) is None
            assert socket_owner_in_proc(peer, ours, tables=("/nonexistent/tcp", "/nonexistent/tcp6")) is None
            assert peer_of_connection(client_address, accepted.getsockname(), owner=lambda local, remote: None) == \
                ("address", str(peer[0]))
    finally:
        for client, accepted, _ in pairs:
            client.close()
            accepted.close()
    asked = []
    assert peer_of_connection(("10.0.0.5", 40000), ("10.0.0.1", 9786), owner=lambda *a: asked.append(a)) == \
        ("address", "10.0.0.5")  # not loopback: no lookup
    assert peer_of_connection(("::ffff:10.0.0.5", 40000, 0, 0), ("::ffff:10.0.0.1", 9786, 0, 0)) == ("address", "10.0.0.5")
    assert asked == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_the_owner_of_another_users_connection_is_that_user():
    """The uid found is the connecting socket's owner, not ours (the test runs as root)."""
    import subprocess
    from slurm_mapa.slurm.agent.peer_owner import ip_of, peer_of_connection, socket_owner_by_sock_diag, socket_owner_in_proc

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        code = ("import encodings.idna, os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
                f"s = socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=5)\n"
                "print('connected', flush=True); sys.stdin.readline()\n")
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "connected"
            accepted, client_address = listener.accept()
            with accepted:
                assert peer_of_connection(client_address, accepted.getsockname()) == ("uid", 65534)
                peer, ours = (ip_of(client_address[0]), client_address[1]), (ip_of("127.0.0.1"), accepted.getsockname()[1])
                assert socket_owner_in_proc(peer, ours) == 65534
                assert socket_owner_by_sock_diag(peer, ours) == 65534
        finally:
            child.stdin.close()
            child.wait(timeout=10)


def scrape_status(port: int, timeout: float = 10.0) -> tuple[int, bytes] | str:
    """A scrape's (status, body), or why it failed."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as answer:
            return answer.status, answer.read()
    except OSError as error:
        return repr(error)


def test_one_peer_holding_idle_connections_cannot_keep_another_peers_scrapes_out():
    """The security report: a local user holding the metrics port's connections open (reconnecting
    as they are closed) blinded monitoring. Now that user (here the connections made from the ports
    the attacker bound) holds at most its share, and every scrape from another peer is answered."""
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    attacker_ports: set[int] = set()
    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n", max_connections=8, max_per_peer=2,
                           request_line_deadline=1.0, deadline=5.0,
                           peer_of=lambda client, local: "attacker" if client[1] in attacker_ports else ("address", client[0]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def connect_as_attacker() -> socket.socket:
        connection = socket.socket()
        connection.bind(("127.0.0.1", 0))
        attacker_ports.add(connection.getsockname()[1])  # labelled before the server can see it
        connection.settimeout(5)
        connection.connect(("127.0.0.1", port))
        connection.send(b"G")  # a request that never ends
        return connection

    def attack() -> None:  # keeps opening idle connections, replacing those the server closes
        while not stop.is_set() and len(held) < 400:
            try:
                held.append(connect_as_attacker())
            except OSError:
                pass
            time.sleep(0.005)

    try:
        first = [connect_as_attacker() for _ in range(30)]
        held.extend(first)
        # Beyond its share the attacker's connections are closed at once, not at the idle deadline.
        started = time.monotonic()
        for connection in first[2:]:
            try:
                assert connection.recv(10) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < 0.9
        with server.open_lock:
            assert [c.peer for c in server.open.values()] == ["attacker", "attacker"]
        assert server.turned_away == 28
        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        answers = []
        for _ in range(15):  # spread over more than one idle deadline, while the attacker reconnects
            answers.append(scrape_status(port))
            with server.open_lock:
                assert sum(1 for c in server.open.values() if c.peer == "attacker") <= 2
            time.sleep(0.2)
        assert answers == [(200, b"up 1\n")] * 15, answers
        stop.set()
        attacker.join(timeout=10)
        assert server.turned_away > 100  # the attacker really was refused beyond its share all along
    finally:
        stop.set()
        for connection in held:
            connection.close()
        server.shutdown()
        server.server_close()


def test_a_connection_without_its_request_line_is_closed_soon_and_a_slow_scrape_is_not():
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n", request_line_deadline=0.5, deadline=3.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            started = time.monotonic()
            idle.send(b"GET /metr")  # a request line that does not end
            slow.sendall(b"GET /metrics HTTP/1.0\r\n")  # the line, then the headers' end later
            assert idle.recv(100) == b""
            assert 0.4 < time.monotonic() - started < 2.0
            slow.settimeout(1.0)
            with pytest.raises(socket.timeout):  # still open past the request line's deadline
                slow.recv(100)
            slow.sendall(b"\r\n")
            slow.settimeout(5)
            answer = b""
            while chunk := slow.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"up 1\n")
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_peer_lookup_keys_the_connection_by_its_address():
    """Bad input never raises out of the server thread: a peer that cannot be told is its address."""
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    def broken(client, local):
        raise ValueError("a table the lookup cannot read")

    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n", peer_of=broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert scrape_status(server.server_address[1]) == (200, b"up 1\n")
        assert server.peer(socket.socket(), ("127.0.0.1", 1)) == ("address", "127.0.0.1")
        assert server.peer(socket.socket(), None) == ("address", "None")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_another_users_idle_connections_leave_scrapes_answered_with_the_real_lookup():
    """The report's case end to end, with the default peer lookup (/proc/net/tcp): uid 65534 keeps
    40 idle connections open, reconnecting as they close; every scrape from this uid is answered."""
    import subprocess
    from slurm_mapa.slurm.agent.metrics import MetricsServer

    server = MetricsServer(("127.0.0.1", 0), lambda: b"up 1\n", request_line_deadline=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = ("import encodings.idna, os, socket, sys, time\nos.setgid(65534); os.setuid(65534)\nheld = []\n"
            "while True:\n"
            "    held = [s for s in held if s.fileno() >= 0][-200:]\n"
            "    for _ in range(40):\n"
            "        s = socket.socket(); s.settimeout(1)\n"
            "        try:\n"
            f"            s.connect(('127.0.0.1', {server.server_address[1]})); s.send(b'G'); held.append(s)\n"
            "        except OSError:\n"
            "            s.close()\n"
            "    print(len(held), flush=True); time.sleep(0.1)\n")
    flood = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert int(flood.stdout.readline()) >= 30
        answers = []
        for _ in range(10):  # over more than one idle deadline
            answers.append(scrape_status(server.server_address[1]))
            with server.open_lock:
                assert sum(1 for c in server.open.values() if c.peer == ("uid", 65534)) <= 2
            time.sleep(0.2)
        assert answers == [(200, b"up 1\n")] * 10, answers
        assert server.turned_away >= 38
    finally:
        flood.kill()
        flood.wait(timeout=10)
        server.shutdown()
        server.server_close()
